"""A small local launcher: ``python -m aiordma.services.collectives.launch -n 4 -- CMD ARGS...``.

Starts ``n`` copies of ``CMD`` on this host with the variables torchrun sets (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so a script using :meth:`aiordma.services.collectives.Group.from_env` runs the same
way under this launcher, torchrun or srun. Like torchrun, when one rank fails the others are
terminated (SIGTERM, then SIGKILL after ``--grace`` seconds); the exit status is the first
failing rank's (128 + signal number for a signal), else 0. SIGINT/SIGTERM to the launcher are
passed on to the ranks.

Output: the launcher reads each rank's stdout and stderr through a pipe and writes them to its
own, a whole line at a time, each line prefixed with the rank as torchrun's are
(``[rank0]:...``; ``--no-prefix`` leaves the lines as they are, still whole), so lines of
different ranks never join mid-line. A rank's last line without a newline gets one; a line
longer than 1 MiB is cut there (each part a line of its own).
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from aiordma.protocols.errors import LocalProtocolError

__all__ = ["RankLines", "free_port", "main", "rank_environment", "run"]

_LINE_LIMIT = 1 << 20  # bytes: a longer line is cut (a rank that never writes a newline)
_DRAIN = 2.0  # seconds the launcher keeps reading after the last rank exited (a rank's
# children may still hold its pipes)


class RankLines:
    """One rank's output as whole lines, each prefixed (see the module's "Output")."""

    def __init__(self, rank: int, *, prefix: bool = True, limit: int = _LINE_LIMIT) -> None:
        self.head = f"[rank{rank}]:".encode() if prefix else b""
        self.limit = limit
        self._partial = bytearray()

    def feed(self, data: bytes) -> bytes:
        """The complete lines in what has arrived so far, prefixed (``b""`` if none)."""
        self._partial += data
        lines = []
        while True:
            end = self._partial.find(b"\n")
            if end < 0 and len(self._partial) >= self.limit:
                end = self.limit - 1  # cut: the part becomes a line of its own
                lines.append(self.head + bytes(self._partial[:end + 1]) + b"\n")
            elif end < 0:
                break
            else:
                lines.append(self.head + bytes(self._partial[:end + 1]))
            del self._partial[:end + 1]
        return b"".join(lines)

    def close(self) -> bytes:
        """What is left at the end of the rank's output, as a line (``b""`` if nothing)."""
        if not self._partial:
            return b""
        rest = self.head + bytes(self._partial) + b"\n"
        self._partial.clear()
        return rest


class _TextSink:
    """A text stream (one without ``.buffer``, e.g. a test's) taking the ranks' bytes."""

    def __init__(self, stream: object) -> None:
        self._stream = stream

    def write(self, data: bytes) -> None:
        self._stream.write(data.decode(errors="replace"))  # type: ignore[attr-defined]

    def flush(self) -> None:
        self._stream.flush()  # type: ignore[attr-defined]


def _binary(stream: object) -> BinaryIO:
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextSink(stream)  # type: ignore[return-value]


class _Output:
    """The ranks' pipes, read as they fill and written out a whole line at a time."""

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]], prefix: bool,
                 stdout: BinaryIO, stderr: BinaryIO) -> None:
        self._sel = selectors.DefaultSelector()
        for rank, p in enumerate(procs):
            for pipe, sink in ((p.stdout, stdout), (p.stderr, stderr)):
                assert pipe is not None, "the ranks are started with stdout and stderr piped"
                os.set_blocking(pipe.fileno(), False)
                self._sel.register(pipe, selectors.EVENT_READ,
                                   (RankLines(rank, prefix=prefix), sink, pipe))

    def pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for output, and pass on the whole lines."""
        for key, _ in self._sel.select(timeout):
            lines, sink, pipe = key.data
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if data:
                out = lines.feed(data)
            else:  # the rank (and whatever it started) closed it
                out = lines.close()
                self._sel.unregister(pipe)
                pipe.close()
            if out:
                sink.write(out)
                sink.flush()

    def drain(self, bound: float) -> None:
        """Pass on what is left, for at most ``bound`` seconds; then close the pipes."""
        deadline = time.monotonic() + bound
        while self._sel.get_map() and time.monotonic() < deadline:
            self.pump(min(0.05, max(0.0, deadline - time.monotonic())))
        for key in list(self._sel.get_map().values()):
            lines, sink, pipe = key.data
            out = lines.close()
            if out:
                sink.write(out)
                sink.flush()
            self._sel.unregister(pipe)
            pipe.close()
        self._sel.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_environment(base: Mapping[str, str], rank: int, world: int, master_addr: str,
                     master_port: int) -> dict[str, str]:
    """``base`` plus the torchrun variables for ``rank`` of ``world`` on one host."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR=master_addr,
               MASTER_PORT=str(master_port))
    return env


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # Popen reports a signal as -signum


def run(cmd: Sequence[str], n: int, *, master_addr: str = "127.0.0.1",
        master_port: int | None = None, grace: float = 5.0,
        environ: Mapping[str, str] | None = None, prefix: bool = True,
        stdout: BinaryIO | None = None, stderr: BinaryIO | None = None) -> int:
    """Run ``n`` ranks of ``cmd``; the exit status (see the module docstring). Their output
    goes to ``stdout``/``stderr`` (default: this process's), whole lines prefixed with the
    rank (``prefix``)."""
    if n < 1:
        raise LocalProtocolError("n must be at least 1")
    port = master_port or free_port(master_addr)
    base = os.environ if environ is None else environ
    procs = [subprocess.Popen(list(cmd), env=rank_environment(base, r, n, master_addr, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(n)]
    output = _Output(procs, prefix, stdout or _binary(sys.stdout), stderr or _binary(sys.stderr))
    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed: int | None = None
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad and failed is None:
                failed = _status(bad[0])
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                deadline = time.monotonic() + grace
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    output.pump(0.05)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            if all(c is not None for c in (p.poll() for p in procs)):
                break
            output.pump(0.05)
        for p in procs:
            p.wait()
        output.drain(_DRAIN)
        if failed is not None:
            return failed
        return 128 + forwarded[0] if forwarded else 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.services.collectives.launch",
                                description="Run N ranks of a command on this host with "
                                            "torchrun's environment variables.")
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (default "
                   "127.0.0.1)")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a "
                   "free one)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and "
                   "SIGKILL for the other ranks when one fails")
    p.add_argument("--no-prefix", action="store_true", help="pass the ranks' lines on "
                   "without the [rankN]: prefix (still a whole line at a time)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no command given (put it after --)")
    if a.nproc < 1:
        p.error("-n must be at least 1")
    return run(cmd, a.nproc, master_addr=a.master_addr, master_port=a.master_port or None,
               grace=a.grace, prefix=not a.no_prefix)


if __name__ == "__main__":
    sys.exit(main())
