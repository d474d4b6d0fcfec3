"""A small local launcher: ``python -m aiordma.services.collectives.launch -n 4 -- CMD ARGS...``.

Starts ``n`` copies of ``CMD`` on this host with the variables torchrun sets (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so a script using :meth:`aiordma.services.collectives.Group.from_env` runs the same
way under this launcher, torchrun or srun. Like torchrun, when one rank fails the others are
terminated (SIGTERM, then SIGKILL after ``--grace`` seconds); the exit status is the first
failing rank's (128 + signal number for a signal), else 0. SIGINT/SIGTERM to the launcher are
passed on to the ranks.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from aiordma.protocols.errors import LocalProtocolError

__all__ = ["free_port", "main", "rank_environment", "run"]


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
        environ: Mapping[str, str] | None = None) -> int:
    """Run ``n`` ranks of ``cmd``; the exit status (see the module docstring)."""
    if n < 1:
        raise LocalProtocolError("n must be at least 1")
    port = master_port or free_port(master_addr)
    base = os.environ if environ is None else environ
    procs = [subprocess.Popen(list(cmd), env=rank_environment(base, r, n, master_addr, port))
             for r in range(n)]
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
                    time.sleep(0.05)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            if all(c is not None for c in (p.poll() for p in procs)):
                break
            time.sleep(0.05)
        for p in procs:
            p.wait()
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
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no command given (put it after --)")
    if a.nproc < 1:
        p.error("-n must be at least 1")
    return run(cmd, a.nproc, master_addr=a.master_addr, master_port=a.master_port or None,
               grace=a.grace)


if __name__ == "__main__":
    sys.exit(main())
