"""Across two hosts: a collectives group of 4 ranks, 2 on each host, started by Open MPI's
``mpirun`` as a user would start it, and a host killed under it.

Run only on host 1 of ``python -m harness run --hosts 2`` (``scripts/two-host-tests.sh``). mpirun
starts its daemon on host 2 through its rsh launch agent, here ``python -m harness rsh`` (host 2's
command agent, in place of ssh: ``--mca plm_rsh_agent``); the ranks (``mpi_rank.py``) form the
group from ``OMPI_COMM_WORLD_RANK``/``_SIZE`` and the ``MASTER_ADDR``/``MASTER_PORT`` passed on
with ``-x``, and every link between the hosts crosses the wire. It kills host 2, so it runs
last in the stage (its file's name sorts last).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from harness.remote import host_addresses, kill_host2

from ..bounds import STEP
from .two_hosts import RSH_AGENT

pytestmark = [pytest.mark.two_hosts, pytest.mark.usefixtures("host2_up"),
              pytest.mark.skipif(shutil.which("mpirun") is None,
                                 reason="Open MPI's mpirun is not installed (scripts/setup.sh "
                                 "installs it)")]

RANK = str(Path(__file__).with_name("mpi_rank.py"))
#: The ranks' keepalive: idle 10 s, then 10 probes 1 s apart (about 20 s). The default (3 s)
#: broke a healthy link once between two loaded 1-vCPU hosts (docs/two-hosts.md); with this, a
#: vanished host is noticed by the retries of what is in flight to it (about 3.8 s), or, when
#: at the kill every WRITE to host 2 had been acknowledged and host 1's ranks were waiting for
#: host 2's data, by the control channel's keepalive (the idle time already run counts).
KEEPALIVE = 10
KEEPALIVE_BOUND = KEEPALIVE + KEEPALIVE * 1
RETRY_BOUND = 7 * 0.54
#: What a loaded machine adds to a bound, and what a group's abort adds to pass the news from
#: the rank that noticed to the others on host 1.
SLACK = 4.0


def mpirun(h1: str, h2: str, port: int, *args: str) -> list[str]:
    """``mpirun`` for 4 ranks, 2 per host, ranks 0-1 on host 1 (rank 0 serves the
    rendezvous there)."""
    return ["mpirun", "--allow-run-as-root", "-np", "4", "--host", f"{h1}:2,{h2}:2",
            "--map-by", "slot",
            "--mca", "plm_rsh_agent", RSH_AGENT,
            # mpirun's own connections to its daemon: over the link only
            "--mca", "oob_tcp_if_include", "eth0",
            "-x", f"MASTER_ADDR={h1}", "-x", f"MASTER_PORT={port}", "-x", "PATH",
            sys.executable, RANK, "--keepalive", str(KEEPALIVE), *args]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def test_a_group_of_four_across_two_hosts_under_mpirun_then_a_host_killed(
        rdma_device: Any) -> None:
    """Four ranks under mpirun, two on each host: every collective is checked on both sides
    of its thresholds (each rank says on which host it ran); then, while they run 256 KiB
    allreduces back to back, host 2 (ranks 2 and 3) vanishes: the ranks on host 1 fail
    ``BrokenResourceError`` within the retries' bound (a rank that notices aborts, and its
    neighbours on host 1 notice that at once), or, if nothing was in flight to host 2, within
    the keepalive's, and mpirun ends. (One launch for both: starting
    four ranks under emulation takes a minute.)"""
    h1, h2 = host_addresses()
    t0 = time.monotonic()
    proc = subprocess.Popen(mpirun(h1, h2, free_port(), "--until-broken"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        checked = sorted(out.wait_for("CHECKED", 4, 5 * STEP))
        formed = time.monotonic() - t0
        assert [line.split()[:3] for line in checked] == [["CHECKED", str(r), "4"]
                                                         for r in range(4)], checked
        hosts = {line.split()[1]: line.split()[3] for line in checked}
        # two ranks on each host: every collective crossed the wire
        assert sorted(hosts.values()) == ["aiordma-host1"] * 2 + ["aiordma-host2"] * 2, hosts
        print(f"\nmpirun: 4 ranks ({hosts}) started, formed and checked every collective in "
              f"{formed:.1f} s")
        out.wait_for("STARTED", 4, STEP)  # every rank is into the allreduces
        time.sleep(0.5)  # well into later ones
        killed_at = kill_host2()
        try:
            proc.wait(3 * STEP)
        except subprocess.TimeoutExpired:
            pass
        ended = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(STEP)
    out.done.wait(STEP)
    err.done.wait(STEP)
    broken = [line.split(maxsplit=5) for line in out.lines if line.startswith("BROKEN")]
    report = [f"rank {b[1]}: {b[2]} after {float(b[4]) - killed_at:.2f} s ({b[5]})"
              for b in broken]
    print("host 2 killed mid-allreduce; on host 1: " + "; ".join(report)
          + f"; mpirun ended {ended:.1f} s after the kill, status {proc.returncode}")
    assert sorted(b[1] for b in broken) == ["0", "1"], out.lines + err.lines[-30:]
    host1 = {rank for rank, host in hosts.items() if host == "aiordma-host1"}
    for b in broken:
        assert b[3] == "True", report  # a BrokenResourceError (or subclass)
        # what noticed: the retries of a WRITE in flight, else the keepalive of a link that had
        # nothing in flight; or the abort of the other rank on host 1, which noticed first
        # (by either), so after it: within its time + the slack
        bound = KEEPALIVE_BOUND if "control channel" in b[5] else RETRY_BOUND
        link = re.search(r"the link with rank (\d+) broke", b[5])
        if link and link.group(1) in host1:
            other = min(float(o[4]) for o in broken if o is not b) - killed_at
            bound = max(bound, other)
        assert float(b[4]) - killed_at < bound + SLACK, report  # catalogue


class Lines:
    """A pipe's lines, read by a thread (so that a wait for them is bounded and no line waits
    in a buffer that a select does not see)."""

    def __init__(self, pipe: IO[str] | None) -> None:
        assert pipe is not None
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.done = threading.Event()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.done.set()
            self._changed.notify_all()

    def wait_for(self, prefix: str, n: int, timeout: float) -> list[str]:
        """The first ``n`` lines that start with ``prefix``, once there are that many.

        Raises:
            AssertionError: not within ``timeout`` seconds, or the pipe ended first.
        """
        def found() -> list[str]:
            return [line for line in self.lines if line.startswith(prefix)][:n]

        with self._changed:
            if not self._changed.wait_for(lambda: len(found()) == n or self.done.is_set(),
                                          timeout):
                raise AssertionError(f"{len(found())} of {n} {prefix!r} lines within "
                                     f"{timeout} s: {self.lines[-20:]}")
            if len(found()) < n:
                raise AssertionError(f"mpirun ended with {len(found())} of {n} {prefix!r} "
                                     f"lines: {self.lines[-20:]}")
            return found()
