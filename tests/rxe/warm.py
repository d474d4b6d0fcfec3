"""Warm starts for the device tests' Python peer processes.

In the VM (software emulation) a new Python process costs seconds before it runs a line of its
own: 1.5 s for ``python -c pass``, 3.4 s to import msgpack and uvloop, 4.4 s for numpy (min of
5, 2026-11-26). The device tests start a few hundred such peers. So a test process keeps one
*warm* process (this file, run as a script): it has imported aiordma, its RPC layer, msgpack,
uvloop and numpy, opened no device and started no loop, and it forks a child per peer, which
then runs the peer's script or module as ``python`` would (``sys.argv``, ``sys.path[0]``,
``__main__``, the environment, the working directory, the session, its own stdio). Each child
is a real process with its own device context: what the tests check is unchanged; only the
interpreter's start and the imports are skipped.

:func:`popen` is :class:`subprocess.Popen` for ``[sys.executable, script_or_-m, ...]`` with
the few keyword arguments the tests use; anything else (another program, ``-c``, an option of
the interpreter, an environment whose ``PYTHON*``/``AIORDMA_*``/thread-count variables differ
from the warm process's, which read them at import) starts as a plain ``subprocess.Popen``, and
so does everything when ``AIORDMA_TEST_WARM=0``. The object it returns has what the tests use
of ``Popen``: ``pid``, ``stdin``/``stdout``/``stderr``, ``poll()``, ``wait(timeout)``,
``send_signal()``, ``terminate()``, ``kill()``, ``returncode``.

The wire between a test process and its warm process (a Unix socket per child): the test sends
one JSON request (``argv``, ``env``, ``cwd``, ``session``) with the child's three stdio fds;
the warm process answers ``{"pid": N}`` when it forked, and ``{"status": S}`` (the exit code,
or minus the signal, as ``Popen.returncode``) when the child ended; then closes.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

#: What the warm process imports before it forks (what the peers import).
PRELOAD = ("aiordma", "aiordma.rpc", "aiordma.services.collectives", "msgpack", "uvloop",
           "numpy")
#: Variables read at import time (by Python, aiordma or numpy's thread pools): a child whose
#: environment differs from the warm process's in one of these starts cold.
_IMPORT_TIME = ("PYTHON", "AIORDMA_", "OPENBLAS_", "OMP_", "MKL_")
_MAX_REQUEST = 1 << 20


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME)}


# -- the test process's side --------------------------------------------------------------------


class WarmProcess:
    """A child of the warm process, seen from the test process (see the module's docstring)."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int,
                 stdin: IO[Any] | None, stdout: IO[Any] | None, stderr: IO[Any] | None) -> None:
        self.args = args
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._conn = conn
        self._buf = b""

    def _read_status(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._conn.settimeout(timeout)
        while b"\n" not in self._buf:
            try:
                data = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return
            if not data:  # the warm process went away: the child's fate is unknown
                self.returncode = -9
                self._conn.close()
                return
            self._buf += data
        self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["status"])
        self._conn.close()

    def poll(self) -> int | None:
        self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class _Warm:
    """This test process's warm process: started on first use, stopped at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._path = ""
        self._env: dict[str, str] = {}

    def address(self) -> str | None:
        with self._lock:
            if self._proc is None:
                self._path = f"\0aiordma-warm-{os.getpid()}-{time.monotonic_ns()}"
                self._env = _import_time_env(dict(os.environ))
                self._proc = subprocess.Popen(
                    [sys.executable, __file__, self._path.lstrip("\0"), str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
                assert self._proc.stdout is not None
                ready = self._proc.stdout.readline()  # "" if it failed: then cold starts
                # No fd of ours outlives the start (the leak checks count this process's fds).
                self._proc.stdout.close()
                if ready != b"WARM\n":
                    self._proc.kill()
                    self._proc.wait()
                    print(f"warm: the warm process did not start ({ready!r}): cold starts",
                          file=sys.stderr)
                atexit.register(self.stop)
            return self._path if self._proc.poll() is None else None

    def matches(self, env: dict[str, str]) -> bool:
        return _import_time_env(env) == self._env

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


_WARM = _Warm()


def _pipe(mode: str, bufsize: int, text: bool) -> tuple[IO[Any], int]:
    """Our end of a new pipe as a file object (as ``Popen`` makes it) and the child's fd."""
    r, w = os.pipe()
    ours, theirs = (w, r) if mode == "w" else (r, w)
    f: IO[Any] = open(ours, mode + "b", bufsize)  # noqa: SIM115 (the caller's, as Popen's)
    if text:
        f = io.TextIOWrapper(f, write_through=True) if mode == "w" else io.TextIOWrapper(f)
    return f, theirs


def popen(args: list[str], *, stdin: Any = None, stdout: Any = None, stderr: Any = None,
          env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
          text: bool = False, bufsize: int = -1,
          start_new_session: bool = False) -> WarmProcess | subprocess.Popen[Any]:
    """``subprocess.Popen(args, ...)``, forked from the warm process when it can be."""
    kw: dict[str, Any] = {"stdin": stdin, "stdout": stdout, "stderr": stderr, "env": env,
                          "cwd": cwd, "text": text, "bufsize": bufsize,
                          "start_new_session": start_new_session}
    full_env = dict(os.environ if env is None else env)
    if (os.environ.get("AIORDMA_TEST_WARM") == "0" or len(args) < 2
            or args[0] != sys.executable or (args[1].startswith("-") and args[1] != "-m")
            or any(s not in (None, subprocess.PIPE, subprocess.DEVNULL)
                   for s in (stdin, stdout)) or stderr not in (None, subprocess.DEVNULL)):
        return subprocess.Popen(args, **kw)
    address = _WARM.address()
    if address is None or not _WARM.matches(full_env):
        return subprocess.Popen(args, **kw)
    ours: list[IO[Any] | None] = [None, None, None]
    theirs: list[int] = []
    closing: list[int] = []
    for i, (spec, mode) in enumerate(((stdin, "w"), (stdout, "r"))):
        if spec == subprocess.PIPE:
            ours[i], fd = _pipe(mode, bufsize, text)
            closing.append(fd)
        elif spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            closing.append(fd)
        else:
            fd = i  # ours, inherited
        theirs.append(fd)
    theirs.append(2 if stderr is None else os.open(os.devnull, os.O_RDWR))
    if stderr is not None:
        closing.append(theirs[2])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(60.0)  # the request, the fork and its answer: the warm process is ours
    try:
        conn.connect(address)
        request = json.dumps({"argv": list(args), "env": full_env,
                              "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                              "session": start_new_session}).encode()
        socket.send_fds(conn, [request + b"\n"], theirs)
        buf = b""
        while b"\n" not in buf:
            data = conn.recv(4096)
            if not data:
                raise OSError("the warm process closed the request")
            buf += data
    except OSError as exc:
        conn.close()
        for f in ours:
            if f is not None:
                f.close()
        for fd in closing:
            os.close(fd)
        print(f"warm: {exc}: a cold start", file=sys.stderr)
        return subprocess.Popen(args, **kw)
    for fd in closing:
        os.close(fd)
    line, rest = buf.split(b"\n", 1)
    proc = WarmProcess(list(args), conn, int(json.loads(line)["pid"]), ours[0], ours[1], None)
    proc._buf = rest
    return proc


# -- the warm process ---------------------------------------------------------------------------


def _child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the requested ``python`` and run it; never returns."""
    code = 0
    try:
        if request["session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"][1:]
        import runpy
        import signal

        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = request["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (a child reports as python would, then exits)
        import traceback

        traceback.print_exc()
        code = 1
    try:
        import threading as _threading  # the interpreter's exit: atexit, then stdio

        _threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _serve(path: str, parent: int) -> None:
    """The warm process: import :data:`PRELOAD`, say ``WARM``, then fork a child per request
    until the test process that started it is gone."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    import signal

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    ended_r, ended_w = os.pipe()  # a child ended: SIGCHLD's wake-up byte
    os.set_blocking(ended_r, False)
    os.set_blocking(ended_w, False)
    signal.set_wakeup_fd(ended_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(ended_r, selectors.EVENT_READ)
    sys.stdout.write("WARM\n")
    sys.stdout.flush()
    while os.getppid() == parent:
        for key, _ in sel.select(0.5):
            if key.fileobj == ended_r:
                while True:
                    try:
                        if not os.read(ended_r, 4096):
                            break
                    except BlockingIOError:
                        break
                continue
            conn, _addr = listener.accept()
            try:
                conn.settimeout(10.0)
                msg, fds, _flags, _a = socket.recv_fds(conn, _MAX_REQUEST, 3)
                while not msg.endswith(b"\n"):
                    more = conn.recv(_MAX_REQUEST)
                    if not more:
                        raise OSError("the request was cut short")
                    msg += more
                request = json.loads(msg)
            except (OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (ended_r, ended_w):
                    os.close(fd)
                listener.close()
                conn.close()
                for c in children.values():
                    c.close()
                _child(request, list(fds))
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            except OSError:
                pass
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    code = os.waitstatus_to_exitcode(status)
                    conn.sendall(json.dumps({"status": code}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _serve(sys.argv[1], int(sys.argv[2]))
