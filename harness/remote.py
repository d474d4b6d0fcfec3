"""Processes on host 2 of a two-VM run (``python -m harness run --hosts 2``), started from
host 1.

Host 1's command finds the pair in its environment: ``AIORDMA_HOST1`` and ``AIORDMA_HOST2``
(the link addresses, e.g. ``10.77.0.1`` and ``10.77.0.2``) and ``AIORDMA_AGENT``
(``10.77.0.2:7790``), the command agent of host 2 (:mod:`.host_agent`). Through it:

* :class:`RemoteProcess`: start a process there, read its stdout line by line, wait for it,
  kill it (closing the connection kills its process group);
* ``python -m harness exec 2 -- CMD`` (:func:`exec_on_host2`): run CMD there, its output and
  exit status passed through;
* ``python -m harness rsh 10.77.0.2 CMD...`` (:func:`rsh_on_host2`): the same, as ``rsh``
  takes it, for launchers (Open MPI's ``mpirun --mca plm_rsh_agent``);
* :func:`kill_host2` (``python -m harness kill 2``): the harness SIGKILLs host 2's QEMU
  process, a host that vanishes without a FIN or an RST; :func:`boot_host2` (``python -m
  harness boot 2``): a new host 2 boots, and this returns once its agent answers. Both go
  through a virtio serial port of host 1 (:data:`CONTROL_PORT`) to the harness on the machine
  that runs the VMs.

Every wait is bounded: connecting takes at most ``connect_timeout`` seconds; the agent sends a
heartbeat each second while the process runs, and silence for ``lost_after`` seconds (the VM
died, or the link is down) raises :class:`HostLostError` instead of hanging; each error says
what was waited for and for how long.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

from aiordma import AiordmaError, BrokenResourceError, OperationTimeout

from . import host_agent as _wire

__all__ = ["CONTROL_PORT", "LOST_AFTER", "HostLostError", "NotTwoHostsError", "RemoteProcess",
           "agent_address", "boot_host2", "control_request", "exec_on_host2", "host2_running",
           "host_addresses", "kill_host2", "rsh_on_host2",
           "stop_agent", "wait_for_agent"]

#: Seconds without any frame (heartbeats come each second) after which host 2 counts as gone.
#: Generous: a VM under software emulation on a busy machine can stall for seconds.
LOST_AFTER = 20.0
#: The name of host 1's virtio serial port to the harness (:mod:`.pair`).
CONTROL_PORT = "aiordma.pair"


class NotTwoHostsError(AiordmaError):
    """This process does not run on host 1 of a two-VM run (no ``AIORDMA_AGENT``)."""


class HostLostError(BrokenResourceError):
    """Host 2's agent stopped answering (no heartbeat within the bound) or the connection to
    it broke: its VM is gone or the link is down."""


class RemoteStartError(AiordmaError):
    """The agent could not start the command (e.g. no such file)."""


def agent_address() -> tuple[str, int]:
    """Host 2's agent, from ``AIORDMA_AGENT``.

    Raises:
        NotTwoHostsError: the variable is not set (not a two-VM run).
    """
    value = os.environ.get("AIORDMA_AGENT")
    if not value:
        raise NotTwoHostsError("not on host 1 of a two-VM run (AIORDMA_AGENT is not set): "
                               "start it with `python -m harness run --hosts 2 -- CMD`")
    host, _, port = value.rpartition(":")
    return host, int(port)


def host_addresses() -> tuple[str, str]:
    """The link addresses of host 1 and host 2 (``AIORDMA_HOST1``, ``AIORDMA_HOST2``).

    Raises:
        NotTwoHostsError: not a two-VM run.
    """
    h1, h2 = os.environ.get("AIORDMA_HOST1"), os.environ.get("AIORDMA_HOST2")
    if not h1 or not h2:
        raise NotTwoHostsError("not in a two-VM run (AIORDMA_HOST1/AIORDMA_HOST2 are not set)")
    return h1, h2


def _request(req: dict[str, Any], *, connect_timeout: float, lost_after: float,
             address: tuple[str, int] | None = None) -> socket.socket:
    addr = address or agent_address()
    try:
        sock = socket.create_connection(addr, timeout=connect_timeout)
    except OSError as exc:
        raise HostLostError(f"host 2's agent at {addr[0]}:{addr[1]} is not reachable: "
                            f"{exc}") from exc
    sock.settimeout(lost_after)
    try:
        sock.sendall(json.dumps(req).encode() + b"\n")
    except OSError as exc:
        sock.close()
        raise HostLostError(f"sending to host 2's agent failed: {exc}") from exc
    return sock


def _frames(sock: socket.socket, lost_after: float) -> Any:
    """The agent's frames (heartbeats included), raising :class:`HostLostError` on silence or
    a broken connection; the end of the stream before an exit status is one too."""
    while True:
        try:
            frame = _wire.read_frame(sock)
        except TimeoutError as exc:
            raise HostLostError(f"host 2 sent nothing for {lost_after:.0f} s (heartbeats "
                                f"come each {_wire.HEARTBEAT_S:.0f} s): its VM is gone or "
                                "the link is down") from exc
        except OSError as exc:
            raise HostLostError(f"the connection to host 2's agent broke: {exc}") from exc
        if frame is None:
            raise HostLostError("host 2's agent closed the connection before the exit status")
        yield frame


class RemoteProcess:
    """A process on host 2, started through its agent.

    Its stdout is read by line (:meth:`readline`, :meth:`expect`); its stderr is copied to
    this process's stderr, each line prefixed with ``[host2]``, and kept in :attr:`stderr`.
    Leaving the ``with`` block (or :meth:`kill`) kills it and everything in its process group.

    Args:
        argv: the command (paths as on host 1: both VMs see the same files).
        cwd: its directory (default: this process's).
        env: variables set over the agent's environment (which is host 1's, but for the
            ``AIORDMA_HOST*`` ones, which are the same on both).

    Raises:
        NotTwoHostsError: not a two-VM run.
        HostLostError: the agent is not reachable.
    """

    def __init__(self, argv: Sequence[str], *, cwd: str | None = None,
                 env: dict[str, str] | None = None, connect_timeout: float = 30.0,
                 lost_after: float = LOST_AFTER) -> None:
        self.argv = list(argv)
        self.returncode: int | None = None
        self.stdout = ""
        self.stderr = ""
        self._lines: queue.Queue[str | BaseException | None] = queue.Queue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lost_after = lost_after
        self._sock = _request({"argv": self.argv, "cwd": cwd or os.getcwd(), "env": env or {}},
                              connect_timeout=connect_timeout, lost_after=lost_after)
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"host2:{self.argv[0]}")
        self._reader.start()

    def _read(self) -> None:
        partial = b""
        err_partial = b""
        try:
            for kind, payload in _frames(self._sock, self._lost_after):
                if kind == _wire.STDOUT:
                    self.stdout += payload.decode(errors="replace")
                    partial += payload
                    *lines, partial = partial.split(b"\n")
                    for line in lines:
                        self._lines.put(line.decode(errors="replace") + "\n")
                elif kind == _wire.STDERR:
                    self.stderr += payload.decode(errors="replace")
                    err_partial += payload
                    *lines, err_partial = err_partial.split(b"\n")
                    for line in lines:
                        print(f"[host2] {line.decode(errors='replace')}", file=sys.stderr,
                              flush=True)
                elif kind == _wire.EXIT:
                    self.returncode = int(payload)
                    break
                elif kind == _wire.FAILED:
                    raise RemoteStartError(f"host 2 could not start {self.argv!r}: "
                                           f"{payload.decode(errors='replace')}")
        except BaseException as exc:  # noqa: BLE001 (handed to the reader of the lines)
            self._error = exc
        finally:
            if partial:
                self._lines.put(partial.decode(errors="replace"))
            self._lines.put(None if self._error is None else self._error)
            self._done.set()

    def readline(self, timeout: float = 60.0) -> str:
        """The next line of its stdout (with its newline), or ``""`` once it has exited.

        Raises:
            OperationTimeout: no line within ``timeout`` seconds (it runs, but said nothing).
            HostLostError: host 2 is gone.
            RemoteStartError: the command could not be started.
        """
        try:
            item = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise OperationTimeout(f"{self.argv!r} on host 2 printed no line within "
                                   f"{timeout} s") from None
        if item is None or isinstance(item, BaseException):
            self._lines.put(item)  # every later call sees the end too
            if isinstance(item, BaseException):
                raise item
            return ""
        return item

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """Read lines until one starts with ``prefix``; return it.

        Raises:
            AiordmaError: it exited first (its stderr in the message); or as :meth:`readline`.
        """
        deadline = time.monotonic() + timeout
        while True:
            line = self.readline(max(0.01, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line
            if line == "":
                self._done.wait(5)
                raise AiordmaError(f"{self.argv!r} on host 2 exited (status {self.returncode})"
                                   f" before printing {prefix!r}; its stderr: "
                                   f"{self.stderr[-2000:]!r}")

    def poll(self) -> int | None:
        """Its exit status if it has exited, else None (as ``Popen.poll``; also None when
        host 2 was lost: :meth:`wait` raises that)."""
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float = 60.0) -> int:
        """Its exit status (negative: killed by that signal).

        Raises:
            OperationTimeout: still running after ``timeout`` seconds.
            HostLostError: host 2 is gone.
        """
        if not self._done.wait(timeout):
            raise OperationTimeout(f"{self.argv!r} on host 2 still runs after {timeout} s")
        if self._error is not None:
            raise self._error
        if self.returncode is None:  # (the reader ends with an exit status or an error)
            raise HostLostError(f"{self.argv!r} on host 2 ended without an exit status")
        return self.returncode

    def kill(self) -> None:
        """Kill it and its process group (the agent does, when the connection closes)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(self._lost_after + 5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def exec_on_host2(argv: Sequence[str], *, timeout: float | None = None,
                  lost_after: float = LOST_AFTER) -> int:
    """``python -m harness exec 2 -- CMD``: run ``argv`` on host 2, its stdout and stderr copied to
    ours as they come; return its exit status (128 + N if signal N ended it).

    Raises:
        NotTwoHostsError, HostLostError, RemoteStartError; OperationTimeout after ``timeout``
        seconds (the process is killed).
    """
    sock = _request({"argv": list(argv), "cwd": os.getcwd(), "env": {}},
                    connect_timeout=30.0, lost_after=lost_after)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for kind, payload in _frames(sock, lost_after):
            if kind == _wire.STDOUT:
                sys.stdout.buffer.write(payload)
                sys.stdout.flush()
            elif kind == _wire.STDERR:
                sys.stderr.buffer.write(payload)
                sys.stderr.flush()
            elif kind == _wire.EXIT:
                rc = int(payload)
                return 128 - rc if rc < 0 else rc
            elif kind == _wire.FAILED:
                raise RemoteStartError(f"host 2 could not start {list(argv)!r}: "
                                       f"{payload.decode(errors='replace')}")
            if deadline is not None and time.monotonic() > deadline:
                raise OperationTimeout(f"{list(argv)!r} on host 2 still ran after {timeout} s"
                                       " (killed)")
        raise HostLostError("host 2's agent ended the stream")  # (_frames raises first)
    finally:
        sock.close()


#: The names host 2 answers to, besides its address: its host name, and ``2``.
HOST2_NAMES = ("2", "aiordma-host2")


def rsh_on_host2(host: str, words: Sequence[str]) -> int:
    """``python -m harness rsh HOST CMD...``: what ``rsh HOST CMD...`` does, to host 2: the
    words joined by spaces are run by ``sh -c`` there (so a launcher's ``VAR=x; export VAR;
    orted ...`` works), output and exit status passed through. It is the launch agent Open
    MPI's ``mpirun`` gets (``--mca plm_rsh_agent '.venv/bin/python -m harness rsh'``, mpirun
    started in the repository's root) to start its daemon on host 2.

    Raises:
        NotTwoHostsError: ``host`` is not host 2 (the only other host there is).
        HostLostError, RemoteStartError: as :func:`exec_on_host2`.
    """
    if host not in (*HOST2_NAMES, host_addresses()[1]):
        raise NotTwoHostsError(f"rsh: {host!r} is not host 2 ({host_addresses()[1]}, "
                               f"{', '.join(HOST2_NAMES)})")
    if not words:
        raise RemoteStartError("rsh: no command (a login shell is not offered)")
    return exec_on_host2(["sh", "-c", " ".join(words)])


def stop_agent(*, timeout: float = 10.0) -> None:
    """Ask host 2's agent to sync its file systems and stop (host 2 then powers off).

    Raises:
        NotTwoHostsError, HostLostError.
    """
    sock = _request({"stop": True}, connect_timeout=timeout, lost_after=timeout)
    try:
        for kind, _payload in _frames(sock, timeout):
            if kind == _wire.EXIT:
                return
    finally:
        sock.close()


def wait_for_agent(timeout: float) -> None:
    """Until host 2's agent answers a ping (host 1's start-up waits here).

    Raises:
        NotTwoHostsError; HostLostError: no answer within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    tries = 0
    while True:
        tries += 1
        try:
            sock = _request({"ping": True}, connect_timeout=5.0, lost_after=10.0)
            try:
                for kind, _payload in _frames(sock, 10.0):
                    if kind == _wire.EXIT:
                        return
            finally:
                sock.close()
        except HostLostError as exc:
            if time.monotonic() > deadline:
                host, port = agent_address()
                raise HostLostError(f"host 2's agent at {host}:{port} did not answer within "
                                    f"{timeout:g} s ({tries} tries across the link); the last "
                                    f"try: {exc}") from exc
            time.sleep(0.2)


def _control_port() -> str:
    """The /dev node of host 1's port to the harness.

    Raises:
        NotTwoHostsError: there is none (not host 1 of a two-VM run).
    """
    base = "/sys/class/virtio-ports"
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in names:
        try:
            with open(os.path.join(base, name, "name")) as f:
                if f.read().strip() == CONTROL_PORT:
                    return f"/dev/{name}"
        except OSError:
            continue
    raise NotTwoHostsError(f"no virtio serial port named {CONTROL_PORT!r} here: not host 1 of "
                           "a two-VM run (`python -m harness run --hosts 2 -- CMD`)")


def control_request(line: str, *, timeout: float = 30.0) -> str:
    """Send one request to the harness over host 1's control port; return its answer (the
    text after ``ok``).

    Raises:
        NotTwoHostsError: no control port here.
        OperationTimeout: no answer within ``timeout`` seconds (or the port stayed busy).
        AiordmaError: the harness refused (its ``err`` line).
    """
    path = _control_port()
    deadline = time.monotonic() + timeout
    while True:  # the port admits one opener at a time
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise OperationTimeout(f"host 1's control port {path}: {exc}") from exc
            time.sleep(0.05)
    try:
        os.write(fd, line.encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise OperationTimeout(f"the harness did not answer {line!r} within "
                                       f"{timeout} s")
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                continue
            if not chunk:  # the harness's end is not connected: nothing will come
                time.sleep(0.05)
            answer += chunk
    finally:
        os.close(fd)
    text = answer.decode(errors="replace").strip()
    if not text.startswith("ok"):
        raise AiordmaError(f"the harness refused {line!r}: {text}")
    return text[2:].strip()


def kill_host2() -> float:
    """Make host 2 vanish: the harness SIGKILLs its QEMU process (no FIN, no RST, no
    link-down: its guest just stops). Returns ``time.monotonic()`` just before the request
    was sent; the kill follows within the answer's delay (the harness kills, then answers).

    Raises:
        NotTwoHostsError, OperationTimeout; AiordmaError: host 2 was not running.
    """
    t = time.monotonic()
    control_request("kill 2")
    return t


def boot_host2(*, timeout: float = 300.0) -> float:
    """Boot host 2 again (after :func:`kill_host2`) and wait until its agent answers; return
    the seconds that took.

    Raises:
        NotTwoHostsError, OperationTimeout; AiordmaError: host 2 is running;
        HostLostError: its agent did not answer within ``timeout`` seconds.
    """
    t = time.monotonic()
    control_request("boot 2")
    wait_for_agent(timeout)
    return time.monotonic() - t


def host2_running() -> bool:
    """Whether host 2's QEMU process runs (the harness's view: not whether it answers)."""
    return control_request("status 2") == "running"


def _host2_may_run() -> bool:
    """False only when the harness says host 2's QEMU process is not running."""
    try:
        return host2_running()
    except AiordmaError:  # (no control port here, or no answer: try the agent anyway)
        return True


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.remote --wait S | --stop``: host 1's start-up and end."""
    import argparse

    p = argparse.ArgumentParser(description="host 1's side of a two-VM run")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--wait", type=float, metavar="S", help="until host 2's agent answers")
    g.add_argument("--stop", action="store_true", help="stop host 2's agent (host 2 powers off)")
    a = p.parse_args(argv)
    try:
        if a.stop:
            if not _host2_may_run():
                return 0  # killed by a test (kill_host2) and not booted again: nothing to stop
            stop_agent()
        else:
            wait_for_agent(a.wait)
    except AiordmaError as exc:
        print(f"[rxe] {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
