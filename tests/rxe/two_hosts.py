"""Helpers of the two-host tests (``test_two_hosts.py``): processes on host 2, and the proof
that traffic crossed the wire.

Host 2 is reached through its command agent (:class:`harness.remote.RemoteProcess`);
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
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from harness.host_agent import PORT as AGENT_PORT
from harness.remote import RemoteProcess

from ..bounds import STEP

PEER = str(Path(__file__).with_name("peer_process.py"))
AIORDMA = str(Path(sys.executable).with_name("aiordma"))
#: Open MPI's launch agent to host 2 (mpirun runs it from its own directory: the tests run from
#: the repository's root, where ``python -m harness`` is found).
RSH_AGENT = f"{sys.executable} -m harness rsh"
#: Payload bytes an rxe packet carries at most here (the active MTU on a 1500-byte link).
RXE_MTU = 1024
#: Starting a Python process with aiordma imported on host 2 takes 5-10 s under emulation on
#: a busy machine; this is a hang guard.
START = 4 * STEP

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


@dataclass
class NetemCounts:
    """What netem on host 2 counted while its block ran (filled when the block ends): packets
    it dropped, and packets it requeued, which for netem is its count of packets sent ahead
    of the delayed ones (``reorder``; the kernel's generic requeue of a packet the card
    refused adds to it, which virtio-net does not do)."""

    dropped: int = -1
    requeues: int = -1


@contextlib.contextmanager
def netem_on_host2(*spec: str) -> Iterator[NetemCounts]:
    """``tc qdisc add dev eth0 root netem SPEC`` on host 2 (what leaves host 2 is disturbed)
    for the block; yields a :class:`NetemCounts` that gets netem's counts when it ends."""
    counts = NetemCounts()
    with RemoteProcess(["tc", "qdisc", "add", "dev", "eth0", "root", "netem", *spec]) as tc:
        assert tc.wait(START) == 0, f"tc failed: {tc.stderr}"
    try:
        yield counts
        with RemoteProcess(["tc", "-s", "qdisc", "show", "dev", "eth0"]) as show:
            assert show.wait(START) == 0, show.stderr
        m = re.search(r"dropped (\d+), overlimits \d+ requeues (\d+)", show.stdout)
        assert m, show.stdout
        counts.dropped, counts.requeues = int(m.group(1)), int(m.group(2))
    finally:
        with RemoteProcess(["tc", "qdisc", "del", "dev", "eth0", "root"]) as tc:
            tc.wait(START)


#: A partition on host 1's link: RoCE v2 (UDP to port 4791) and every TCP segment are dropped,
#: both ways, but for the agent's connections (port :data:`harness.host_agent.PORT`): they
#: are the harness, not what is tested, and a test that lost them could not tell host 2 to do
#: anything. The guests have no nft or iptables (the host's root file system has neither);
#: ``tc`` does the same:
#:
#: * leaving host 1: a ``prio`` root qdisc whose third band is ``netem``, and ``u32`` filters
#:   that send the partitioned packets there; the cut sets its loss to 100 %. Not a filter that
#:   drops (``action drop`` on egress): rxe in kernel 6.1 takes the failed transmission for a
#:   full queue and tries again at once, without end (``send_err`` counted 58,124 in 2.6 s for
#:   one queue pair, and a test with a dozen got no further in 10 minutes: likely its one vCPU
#:   spent in that loop); netem reports the packet sent, so rxe's ACK timeout and retries
#:   apply, as on a wire;
#: * arriving: ``clsact`` ingress filters; the agent's packets pass first, and the cut adds the
#:   ones that drop.
#:
#: :class:`Partition` prepares all that once and then cuts and heals with a ``tc -batch``
#: process kept running, so that each is a few netlink requests (a ``tc`` started under
#: emulation on a busy machine took 1-2.5 s, most of it before the cut took effect).
_AGENT = [f"ip protocol 6 0xff match ip sport {AGENT_PORT} 0xffff",
          f"ip protocol 6 0xff match ip dport {AGENT_PORT} 0xffff"]
_CUT = ["ip protocol 17 0xff match ip dport 4791 0xffff", "ip protocol 6 0xff"]
PREPARE = [
    "qdisc add dev eth0 root handle 1: prio bands 3 priomap " + " ".join(["1"] * 16),
    "qdisc add dev eth0 parent 1:3 handle 30: netem loss 0%",
    *(f"filter add dev eth0 parent 1: prio 1 protocol ip u32 match {m} flowid 1:2"
      for m in _AGENT),
    *(f"filter add dev eth0 parent 1: prio 2 protocol ip u32 match {m} flowid 1:3" for m in _CUT),
    "qdisc add dev eth0 clsact",
    *(f"filter add dev eth0 ingress prio 1 protocol ip u32 match {m} action pass"
      for m in _AGENT),
]
CUT = ["qdisc change dev eth0 parent 1:3 handle 30: netem loss 100%",
       *(f"filter add dev eth0 ingress prio 2 protocol ip u32 match {m} action drop"
         for m in _CUT)]
HEAL = ["qdisc change dev eth0 parent 1:3 handle 30: netem loss 0%",
        "filter del dev eth0 ingress prio 2"]
REMOVE = ["qdisc del dev eth0 root", "qdisc del dev eth0 clsact"]
_MODULES = ["sch_prio", "sch_netem", "sch_ingress", "cls_u32", "act_gact"]


class Partition:
    """Host 1's partition (:data:`PREPARE`, :data:`CUT`, :data:`HEAL`); removed on close."""

    def __init__(self) -> None:
        subprocess.run(["modprobe", "-a", *_MODULES], capture_output=True, timeout=STEP,
                       check=False)
        self._batch(REMOVE)  # what an interrupted run may have left
        done = subprocess.run(["tc", "-batch", "-"], input="\n".join(PREPARE) + "\n",
                              text=True, capture_output=True, timeout=STEP, check=False)
        assert done.returncode == 0, f"tc -batch failed: {done.stderr}"
        # (stdbuf: tc's answer to the "show" after each switch comes at once, not when its
        # buffer is full)
        self._tc = subprocess.Popen(["stdbuf", "-oL", "tc", "-force", "-batch", "-"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    bufsize=1)

    def _switch(self, lines: list[str]) -> float:
        """Run ``lines`` in the kept ``tc``; return ``time.monotonic()`` once they are done
        (a ``qdisc show dev lo`` after them prints one line when they are)."""
        assert self._tc.stdin is not None and self._tc.stdout is not None
        self._tc.stdin.write("\n".join([*lines, "qdisc show dev lo"]) + "\n")
        self._tc.stdin.flush()
        line = self._tc.stdout.readline()
        assert line.startswith("qdisc"), f"tc said {line!r}"
        return time.monotonic()

    def cut(self) -> float:
        """Cut host 1 off; return ``time.monotonic()`` once the cut is in place (it was not
        yet in place at most a few milliseconds before)."""
        return self._switch(CUT)

    def dropped(self) -> int:
        """Packets the cuts dropped leaving host 1 so far (netem's count since the
        preparation; the ingress filters' counts go with each heal)."""
        out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True,
                             text=True, timeout=STEP, check=False).stdout
        m = re.search(r"qdisc netem 30:.*?dropped (\d+)", out, re.DOTALL)
        assert m, out
        return int(m.group(1))

    def heal(self) -> float:
        """End the cut; return ``time.monotonic()`` once it is over."""
        return self._switch(HEAL)

    def close(self) -> None:
        if self._tc.stdin is not None:
            self._tc.stdin.close()
        self._tc.wait(STEP)
        if self._tc.stdout is not None:
            self._tc.stdout.close()
        self._batch(REMOVE)

    @staticmethod
    def _batch(lines: list[str]) -> None:
        subprocess.run(["tc", "-force", "-batch", "-"], input="\n".join(lines) + "\n",
                       text=True, capture_output=True, timeout=STEP, check=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
