"""``python -m harness bench``: the wire between host 1 (the clients) and host 2 (the servers)
of a two-VM run (``python -m harness run --hosts 2``), and the proof that a row crossed it.

On one rxe device, rxe loops the traffic between its own queue pairs back inside the driver:
no frame leaves the network interface. So each row across the wire is bracketed by two
snapshots of both hosts' counters (:class:`Counters`): the link's byte counters
(``/sys/class/net/<netdev>/statistics/{tx,rx}_bytes``) and the RDMA port's packet counters
(``/sys/class/infiniband/<dev>/ports/<port>/hw_counters/{sent,rcvd}_pkts``), on host 1 and on
host 2. :func:`check_crossed` then requires that at least the row's payload went out of host
1's interface and into host 2's (and the other way for what host 1 received), and, for RDMA
rows, that each host's RDMA port counted at least one RoCE packet per MTU of payload: a row
that was looped back on one device fails with :class:`NotCrossed` (its figures are not an
across-the-wire figure). Host 2's packet count is the strong part: the link's byte counters
also count the harness's own traffic (the agent's heartbeats, these snapshots), a few hundred
bytes a second, but host 2's RDMA port counts only RoCE packets that reached it. Every payload byte
delivered crossed the wire at least once, so the check holds under loss too (a frame netem
drops is counted by neither interface, and is sent again).

Each end (:class:`LinkEnd`: device, port, GID index, network interface) is found from sysfs
by its link address (:func:`find_end`), on host 2 through its command agent. ``--loss P``
(:meth:`Wire.lossy`) puts ``netem loss P%`` on both hosts' interfaces: each frame, either
way, is dropped with probability P; netem's count of what it dropped goes with each row.

The parsers and the check are pure (unit-tested); :class:`Wire` reads and changes the hosts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from aiordma import AiordmaError
from aiordma.bench.link import NotCrossed, Payload

from ..remote import RemoteProcess, host_addresses

__all__ = ["LISTING", "Counters", "LinkEnd", "NotCrossed", "Payload", "Wire", "check_crossed",
           "counter_command", "find_end", "parse_counters"]

#: A shell command listing every RDMA port's valid GIDs, their types and network interfaces
#: (``path:value`` lines; the unused GIDs, all zero, are left out). One process: rxe has
#: 1024 entries per port, too many to read one by one under emulation.
LISTING = ("grep -H . /sys/class/infiniband/*/ports/*/gids/* "
           "/sys/class/infiniband/*/ports/*/gid_attrs/types/* "
           "/sys/class/infiniband/*/ports/*/gid_attrs/ndevs/* 2>/dev/null "
           "| grep -v ':0000:0000:0000:0000:0000:0000:0000:0000$'")

#: Seconds for one command on host 2 (a ``cat`` or ``tc``): a hang guard.
REMOTE_STEP = 60.0


@dataclass(frozen=True, slots=True)
class LinkEnd:
    """One host's end of the wire: the RDMA port and GID carrying ``address``, and the
    network interface under it."""

    address: str
    device: str
    port: int
    gid_index: int
    netdev: str

    def counter_files(self) -> list[str]:
        """The four counters of :class:`Counters`, in its order."""
        net = f"/sys/class/net/{self.netdev}/statistics/"
        hw = f"/sys/class/infiniband/{self.device}/ports/{self.port}/hw_counters/"
        return [net + "tx_bytes", net + "rx_bytes", hw + "sent_pkts", hw + "rcvd_pkts"]


_LINE = re.compile(r"^/sys/class/infiniband/([^/]+)/ports/(\d+)/(gids|gid_attrs/types|"
                   r"gid_attrs/ndevs)/(\d+):(.*)$")


def _ipv4_of(gid: str) -> str | None:
    try:
        ip = ipaddress.IPv6Address(gid)
    except ValueError:
        return None
    return str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else None


def find_end(listing: str, address: str) -> LinkEnd:
    """The RoCE v2 GID that carries the IPv4 ``address``, in :data:`LISTING`'s output.

    Raises:
        AiordmaError: no RoCE v2 GID carries it (or its network interface is unknown).
    """
    gids: dict[tuple[str, int, int], dict[str, str]] = {}
    for line in listing.splitlines():
        m = _LINE.match(line.strip())
        if m:
            dev, port, what, index, value = m.groups()
            gids.setdefault((dev, int(port), int(index)), {})[what] = value.strip()
    for (dev, port, index), attrs in sorted(gids.items()):
        if _ipv4_of(attrs.get("gids", "")) == address and attrs.get("gid_attrs/types") \
                == "RoCE v2" and attrs.get("gid_attrs/ndevs"):
            return LinkEnd(address=address, device=dev, port=port, gid_index=index,
                           netdev=attrs["gid_attrs/ndevs"])
    raise AiordmaError(f"no RoCE v2 GID carries {address} (GIDs found: "
                       f"{sorted(a.get('gids', '?') for a in gids.values())})")


@dataclass(frozen=True, slots=True)
class Counters:
    """A host's counters at one moment: its link's bytes, its RDMA port's packets, and the
    frames netem dropped leaving it (0 without netem)."""

    tx_bytes: int
    rx_bytes: int
    sent_pkts: int
    rcvd_pkts: int
    dropped: int = 0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                        self.sent_pkts - other.sent_pkts, self.rcvd_pkts - other.rcvd_pkts,
                        self.dropped - other.dropped)


def counter_command(end: LinkEnd, *, netem: bool) -> list[str]:
    """The command that prints ``end``'s counters (and, with ``netem``, ``tc -s``'s report
    of its interface's qdisc), for :func:`parse_counters`."""
    cat = "cat " + " ".join(end.counter_files())
    return ["sh", "-c", cat + (f" && tc -s qdisc show dev {end.netdev}" if netem else "")]


def parse_counters(text: str) -> Counters:
    """:func:`counter_command`'s output.

    Raises:
        AiordmaError: it is not four numbers (and a qdisc report).
    """
    lines = text.split("\n", 4)
    try:
        tx, rx, sent, rcvd = (int(x) for x in lines[:4])
    except ValueError:
        raise AiordmaError(f"unreadable counters: {text[:300]!r}") from None
    m = re.search(r"qdisc netem .*?dropped (\d+)", lines[4] if len(lines) > 4 else "",
                  re.DOTALL)
    return Counters(tx, rx, sent, rcvd, int(m.group(1)) if m else 0)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 10_000 else f"{n} B"


def check_crossed(here: Counters, there: Counters, *, sent: int, received: int, roce: bool,
                  mtu: int) -> str:
    """Whether a row that moved ``sent`` payload bytes from host 1 to host 2 and ``received``
    back crossed the wire, from the differences of both hosts' counters over the row; the
    proof in words.

    Args:
        here, there: host 1's and host 2's counters after the row minus before.
        roce: an RDMA row (each host's RDMA port must count a packet per ``mtu`` bytes);
            False for the TCP baseline.

    Raises:
        NotCrossed: a counter moved less than the payload needs.
    """
    problems = []
    if here.tx_bytes < sent or there.rx_bytes < sent:
        problems.append(f"{_mb(sent)} sent, but the link counted {_mb(here.tx_bytes)} out of "
                        f"host 1 and {_mb(there.rx_bytes)} into host 2")
    if here.rx_bytes < received or there.tx_bytes < received:
        problems.append(f"{_mb(received)} received, but the link counted "
                        f"{_mb(there.tx_bytes)} out of host 2 and {_mb(here.rx_bytes)} into "
                        f"host 1")
    packets = -(-(sent + received) // mtu)
    for n, c in ((1, here), (2, there)):
        if roce and c.sent_pkts + c.rcvd_pkts < packets:
            problems.append(f"{_mb(sent + received)} moved need at least {packets} RoCE "
                            f"packets; host {n}'s port counted {c.sent_pkts} sent and "
                            f"{c.rcvd_pkts} received")
    if problems:
        raise NotCrossed("did not cross the wire: " + "; ".join(problems))
    proof = (f"crossed the wire: host 1 out {_mb(here.tx_bytes)}, in {_mb(here.rx_bytes)}; "
             f"host 2 in {_mb(there.rx_bytes)}, out {_mb(there.tx_bytes)} (payload "
             f"{_mb(sent)} out, {_mb(received)} in)")
    if roce:
        proof += (f"; RoCE packets on host 1: {here.sent_pkts} sent, {here.rcvd_pkts} received;"
                  f" on host 2: {there.sent_pkts} sent, {there.rcvd_pkts} received")
    if here.dropped or there.dropped:
        proof += (f"; netem dropped {here.dropped} leaving host 1, {there.dropped} leaving "
                  "host 2")
    return proof


class Wire:
    """Host 1 (here) and host 2 (through its agent) of a two-VM run: the
    :class:`aiordma.bench.link.Link` the bench runs its rows across.

    Raises (on construction):
        NotTwoHostsError: not on host 1 of a two-VM run.
        AiordmaError: an end has no RoCE v2 GID for its address.
        HostLostError: host 2's agent does not answer.
    """

    def __init__(self) -> None:
        h1, h2 = host_addresses()
        here = subprocess.run(["sh", "-c", LISTING], capture_output=True, text=True,
                              timeout=REMOTE_STEP, check=False).stdout
        self.here = find_end(here, h1)
        self.there = find_end(self._on_host2(["sh", "-c", LISTING], check=False), h2)
        self.loss = 0.0

    def start(self, argv: list[str]) -> RemoteProcess:
        """Start ``argv`` on host 2, through its agent."""
        return RemoteProcess(argv)

    @staticmethod
    def _on_host2(argv: list[str], *, check: bool = True) -> str:
        with RemoteProcess(argv) as proc:
            rc = proc.wait(REMOTE_STEP)
            if check and rc != 0:
                raise AiordmaError(f"{argv!r} on host 2 failed (status {rc}): "
                                   f"{proc.stderr[-500:]}")
            return proc.stdout

    def snapshot(self) -> tuple[Counters, Counters]:
        """Host 1's and host 2's counters now."""
        netem = self.loss > 0
        here = subprocess.run(counter_command(self.here, netem=netem), capture_output=True,
                              text=True, timeout=REMOTE_STEP, check=True).stdout
        there = self._on_host2(counter_command(self.there, netem=netem))
        return parse_counters(here), parse_counters(there)

    def crossed(self, before: tuple[Counters, Counters], payload: Payload, *, mtu: int) -> str:
        """:func:`check_crossed` over the row since ``before`` (a :meth:`snapshot`).

        Raises:
            NotCrossed: it did not cross.
        """
        after = self.snapshot()
        return check_crossed(after[0] - before[0], after[1] - before[1], sent=payload.sent,
                             received=payload.received, roce=payload.roce, mtu=mtu)

    @contextlib.contextmanager
    def lossy(self, percent: float) -> Iterator[None]:
        """``netem loss <percent>%`` on both hosts' interfaces for the block (nothing when
        ``percent`` is 0); removed after, also when the block fails."""
        if percent <= 0:
            yield
            return
        spec = ["qdisc", "add", "dev", "{dev}", "root", "netem", "loss", f"{percent:g}%"]
        done = subprocess.run(["tc", *(s.format(dev=self.here.netdev) for s in spec)],
                              capture_output=True, text=True, timeout=REMOTE_STEP, check=False)
        if done.returncode != 0:
            raise AiordmaError(f"tc on host 1 failed: {done.stderr.strip()}")
        try:
            self._on_host2(["tc", *(s.format(dev=self.there.netdev) for s in spec)])
            self.loss = percent
            yield
        finally:
            self.loss = 0.0
            subprocess.run(["tc", "qdisc", "del", "dev", self.here.netdev, "root"],
                           capture_output=True, timeout=REMOTE_STEP, check=False)
            with contextlib.suppress(AiordmaError):
                self._on_host2(["tc", "qdisc", "del", "dev", self.there.netdev, "root"],
                               check=False)

    def describe(self) -> str:
        """Both ends in words (the report's header)."""
        return (f"host 1 {self.here.address} ({self.here.device} port {self.here.port} GID "
                f"{self.here.gid_index} on {self.here.netdev}: the clients), host 2 "
                f"{self.there.address} ({self.there.device} port {self.there.port} GID "
                f"{self.there.gid_index} on {self.there.netdev}: the servers)")
