"""Helpers of the two-host tests (``test_two_hosts.py``): processes on host 2, and the proof
that traffic crossed the wire.

Host 2 is reached through its command agent (:class:`aiordma.tools.remote.RemoteProcess`);
its processes see the same files, so they are started by the same paths as on host 1.

The wire check reads, on both hosts, the link's byte counters
(``/sys/class/net/eth0/statistics/{tx,rx}_bytes``) and rxe0's packet counters
(``/sys/class/infiniband/rxe0/ports/1/hw_counters/{sent,rcvd}_pkts``). Bytes moved between
the hosts must show in both: on one rxe device (the one-host VM) rxe loops its own traffic
back inside the driver, and neither counter of eth0 moves.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aiordma.tools.remote import RemoteProcess, boot_host2, host2_running

from ..bounds import STEP

PEER = str(Path(__file__).with_name("peer_process.py"))
AIORDMA = str(Path(sys.executable).with_name("aiordma"))
#: Payload bytes an rxe packet carries at most here (the active MTU on a 1500-byte link).
RXE_MTU = 1024
#: Starting a Python process with aiordma imported on host 2 takes 5-10 s under emulation on
#: a busy machine; this is a hang guard.
START = 4 * STEP
#: A boot of host 2 took 12-30 s; this is a hang guard.
BOOT = 5 * STEP

_NET = "/sys/class/net/eth0/statistics/"
_RXE = "/sys/class/infiniband/rxe0/ports/1/hw_counters/"
FILES = (_NET + "tx_bytes", _NET + "rx_bytes", _RXE + "sent_pkts", _RXE + "rcvd_pkts")


@dataclass(frozen=True)
class Wire:
    """A host's link and rxe counters at one moment."""

    tx_bytes: int
    rx_bytes: int
    sent_pkts: int
    rcvd_pkts: int

    def __sub__(self, other: Wire) -> Wire:
        return Wire(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                    self.sent_pkts - other.sent_pkts, self.rcvd_pkts - other.rcvd_pkts)


def wire_here() -> Wire:
    return Wire(*(int(Path(f).read_text()) for f in FILES))


def rxe_counters() -> dict[str, int]:
    """All of host 1's rxe0 counters (retransmissions and sequence errors among them)."""
    return {p.name: int(p.read_text()) for p in sorted(Path(_RXE).iterdir())}


def wire_there() -> Wire:
    """Host 2's counters (``cat`` through its agent)."""
    with RemoteProcess(["cat", *FILES]) as proc:
        assert proc.wait(STEP) == 0, proc.stderr
        return Wire(*(int(v) for v in proc.stdout.split()))


@dataclass(frozen=True)
class Snapshot:
    here: Wire
    there: Wire


def snapshot() -> Snapshot:
    return Snapshot(wire_here(), wire_there())


def assert_crossed(before: Snapshot, *, sent: int, received: int) -> Wire:
    """Assert that at least ``sent`` payload bytes went from host 1 to host 2 and
    ``received`` back, on the link (eth0's byte counters on both hosts) and as RoCE packets
    (rxe0's counters on host 1, at most :data:`RXE_MTU` payload bytes each). Returns host 1's
    differences (for the test's report)."""
    now = snapshot()
    here, there = now.here - before.here, now.there - before.there
    assert here.tx_bytes >= sent and there.rx_bytes >= sent, (
        f"{sent} B sent, but eth0 counted {here.tx_bytes} B out of host 1 and "
        f"{there.rx_bytes} B into host 2")
    assert here.rx_bytes >= received and there.tx_bytes >= received, (
        f"{received} B received, but eth0 counted {here.rx_bytes} B into host 1 and "
        f"{there.tx_bytes} B out of host 2")
    packets = -(-(sent + received) // RXE_MTU)
    assert here.sent_pkts + here.rcvd_pkts >= packets, (
        f"{sent + received} B moved by RDMA need at least {packets} RoCE packets; host 1's rxe0 "
        f"counted {here.sent_pkts} sent and {here.rcvd_pkts} received")
    return here


@contextlib.contextmanager
def on_host2(argv: list[str], prefix: str) -> Iterator[str]:
    """Run ``argv`` on host 2; yield its first stdout line that starts with ``prefix`` (a
    server's port); kill it (and its process group) after."""
    with RemoteProcess(argv) as proc:
        yield proc.expect(prefix, START)


@contextlib.contextmanager
def netem_on_host2(*spec: str) -> Iterator[list[int]]:
    """``tc qdisc add dev eth0 root netem SPEC`` on host 2 (what leaves host 2 is disturbed)
    for the block; yields a list that gets netem's count of dropped packets when it ends."""
    dropped: list[int] = []
    with RemoteProcess(["tc", "qdisc", "add", "dev", "eth0", "root", "netem", *spec]) as tc:
        assert tc.wait(START) == 0, f"tc failed: {tc.stderr}"
    try:
        yield dropped
        with RemoteProcess(["tc", "-s", "qdisc", "show", "dev", "eth0"]) as show:
            assert show.wait(START) == 0, show.stderr
        m = re.search(r"dropped (\d+)", show.stdout)
        assert m, show.stdout
        dropped.append(int(m.group(1)))
    finally:
        with RemoteProcess(["tc", "qdisc", "del", "dev", "eth0", "root"]) as tc:
            tc.wait(START)


@contextlib.contextmanager
def host2_may_vanish() -> Iterator[None]:
    """For a test that kills host 2 (:func:`aiordma.tools.remote.kill_host2`): afterwards host
    2 is booted again and its agent answers, so the tests after it find the pair whole. The
    boot's time is printed."""
    try:
        yield
    finally:
        if not host2_running():
            took = boot_host2(timeout=BOOT)
            print(f"host 2 booted again: its agent answered after {took:.1f} s", file=sys.stderr)
