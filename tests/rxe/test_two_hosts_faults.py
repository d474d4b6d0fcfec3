"""Across two hosts, the faults one host cannot show: a partition that heals, a host that
vanishes.

Run only on host 1 of ``python -m harness run --hosts 2`` (``scripts/two-host-tests.sh``). The
partition is made on host 1's link (``two_hosts.Partition``). Host 2 is killed by the harness on
this host's request (:func:`harness.remote.kill_host2`: its QEMU process gets SIGKILL, so
its kernel sends no FIN, no RST, and the link does not go down), and booted again by the next
test that needs it (the ``host2_up`` fixture), so the kills come last in the stage.

What notices a vanished host on host 1 is one of two things (docs/faults.md):

* the liveness channel's TCP keepalive (``Config.keepalive_*``): idle, then probes; an endpoint
  is broken ``idle + interval x probes`` seconds after the last packet from the peer at most
  (3 s by default), whatever it is doing;
* the queue pair's retry exhaustion: an operation whose packets go unacknowledged is retried
  ``retry_cnt`` (6) times, 0.54 s apart (``aiordma/_endpoint/qp.py``), then fails
  ``PeerUnreachableError``, about 3.8 s after the last answer; an endpoint with nothing in
  flight never gets there.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

import aiordma
from aiordma import BrokenResourceError, Config, PeerUnreachableError, RemoteBuffer
from aiordma.rpc import connect as rpc_connect
from harness.remote import RemoteProcess, host_addresses, kill_host2

from ..bounds import STEP
from .peers import LOOPS, run_on, wait_until
from .two_hosts import (
    PEER,
    START,
    Partition,
)

pytestmark = [pytest.mark.two_hosts, pytest.mark.usefixtures("host2_up")]

EAGER_MAX = Config().eager_max
BIG = 16 << 20  # a READ of this size takes seconds across the link: killed mid-way
DEFAULT = Config()
#: Keepalive long enough that retry exhaustion (about 3.8 s) fires first on an endpoint with
#: an operation in flight: idle 5 s, 5 probes 1 s apart.
SLOW_KEEPALIVE = Config(keepalive_idle=5, keepalive_interval=1, keepalive_probes=5)
RETRY_BOUND = 7 * 0.54  # 6 retries after the first try, 0.54 s each (aiordma/_endpoint/qp.py)
#: What a loaded machine adds to a bound: the emulated CPUs stall for seconds under load (the
#: machine has two cores, shared with other VMs), and the kernel's timers and the loop's
#: wake-ups run late by as much.
SLACK = 3.0


def keepalive_bound(config: Config) -> float:
    return config.keepalive_idle + config.keepalive_interval * config.keepalive_probes


# -- a partition that heals --------------------------------------------------------------------

#: A keepalive past every partition below: idle 10 s, then 10 probes 1 s apart (about 20 s).
LONG_KEEPALIVE = Config(keepalive_idle=10, keepalive_interval=1, keepalive_probes=10)


class Traffic:
    """Three loops over one connection to host 2's peer process, until stopped or failed:
    messages echoed (eager and rendezvous sizes, each compared), one-sided READs of host 2's
    region, RPC calls. Each operation's start and end are kept; the first error ends a loop."""

    def __init__(self, name: str, ep: aiordma.Endpoint, desc: RemoteBuffer,
                 rpc: aiordma.rpc.RpcClient) -> None:
        self.name = name
        self.ep, self.desc, self.rpc = ep, desc, rpc
        self.spans: list[tuple[float, float]] = []
        self.errors: list[tuple[float, BaseException]] = []
        self.stop = asyncio.Event()
        self.tasks = [asyncio.ensure_future(f()) for f in (self._messages, self._reads,
                                                           self._calls)]

    async def _loop(self, op: Any) -> None:
        i = 0
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                await asyncio.wait_for(op(i), STEP)
            except BrokenResourceError as exc:
                self.errors.append((time.monotonic(), exc))
                return
            self.spans.append((t, time.monotonic()))
            i += 1

    async def _messages(self) -> None:
        sizes = [1, 1000, EAGER_MAX, EAGER_MAX + 1, 100_000]

        async def op(i: int) -> None:
            data = b"\x00" + i.to_bytes(4, "little") * (sizes[i % len(sizes)] // 4)
            sender = asyncio.ensure_future(self.ep.send(data))
            got = await self.ep.recv()
            await sender
            assert got == data, f"{self.name}: message {i} came back different"
        await self._loop(op)

    async def _reads(self) -> None:
        mine = self.ep.register(bytearray(4096))

        async def op(i: int) -> None:
            await self.ep.read(mine[0:4096], self.desc[0:4096])
        await self._loop(op)

    async def _calls(self) -> None:
        async def op(i: int) -> None:
            assert await self.rpc.add(i, 1) == i + 1
        await self._loop(op)

    async def count(self, n: int) -> None:
        """Until ``n`` more operations completed (traffic is flowing)."""
        want = len(self.spans) + n
        await wait_until(lambda: len(self.spans) >= want or self.errors,
                         f"{self.name}: {n} operations")
        assert not self.errors, self.errors

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), STEP)

    def longest_across(self, t0: float, t1: float) -> float:
        """The longest operation that was under way while the partition was in place."""
        return max((end - start for start, end in self.spans if start < t1 and end > t0),
                   default=0.0)


async def _connect(h2: str, port: int, rpc_port: int, config: Config, name: str) -> Traffic:
    ep = await aiordma.connect(h2, port, timeout=STEP, config=config)
    desc = RemoteBuffer.from_wire(msgpack.unpackb(await asyncio.wait_for(ep.recv(), STEP)))
    rpc = await rpc_connect(h2, rpc_port, timeout=STEP, config=config)
    return Traffic(name, ep, desc, rpc)


async def _close(*traffic: Traffic) -> None:
    for t in traffic:
        await asyncio.wait_for(t.ep.aclose(), STEP)
        await asyncio.wait_for(t.rpc.aclose(), STEP)


def _by_retries(exc: BaseException) -> bool:
    """Whether retries running out on this side ended the operation: it was the work request
    that exhausted them (``PeerUnreachableError``), or it was pending on the endpoint they broke
    (``BrokenResourceError`` caused by one: seen when the exhausted request was one of the
    endpoint's own message transfers, on every user operation of that endpoint)."""
    return isinstance(exc, PeerUnreachableError) or isinstance(exc.__cause__,
                                                               PeerUnreachableError)


#: Partitions: one the retries outlast, one past every bound but a long keepalive's.
SHORT_CUT, LONG_CUT = 1.0, 8.0


@pytest.mark.timer_bound
@pytest.mark.parametrize("loop", ["uvloop"])  # (what notices: as in the vanish test, both loops)
def test_a_partition_that_heals(rdma_device: Any, loop: str) -> None:
    """Host 1 cut off from host 2 (RoCE and TCP dropped both ways, ``two_hosts.PARTITION``)
    under traffic. For 1 s, on endpoints with a long keepalive (20 s), every operation waits
    through it and completes, intact: the retries (3.8 s) outlast it. For 8 s: endpoints with
    the default keepalive fail ``BrokenResourceError`` within its bound; those with the long
    keepalive and operations in flight fail too, by retry exhaustion (this side's:
    ``PeerUnreachableError``; or host 2's, learnt once the partition healed), while an idle
    one outlives the partition and carries messages after it; new connections work."""
    _, h2 = host_addresses()
    argv = [sys.executable, PEER, "--host", h2, "--loop", loop, "--rpc",
            "--keepalive", str(LONG_KEEPALIVE.keepalive_idle)]
    with RemoteProcess(argv) as peer:
        port = int(peer.expect("PORT ", START).split()[1])
        rpc_port = int(peer.expect("RPC ", START).split()[1])

        async def partition(cut: Partition, seconds: float) -> tuple[float, float, str]:
            """Cut, wait, heal: ``(on, off, what happened)``."""
            before = await asyncio.to_thread(cut.dropped)
            on = await asyncio.to_thread(cut.cut)
            await asyncio.sleep(seconds)
            off = await asyncio.to_thread(cut.heal)
            dropped = await asyncio.to_thread(cut.dropped) - before
            assert dropped > 0, "the partition dropped nothing leaving host 1"
            return on, off, (f"partition of {off - on:.2f} s ({dropped} packets leaving host 1 "
                             "dropped)")

        async def main() -> None:
            report: list[str] = []

            def note(*lines: str) -> None:
                report.extend(lines)
                print("\n".join(lines))

            long = await _connect(h2, port, rpc_port, LONG_KEEPALIVE, "long keepalive")
            quiet = await aiordma.connect(h2, port, timeout=STEP, config=LONG_KEEPALIVE)
            await asyncio.wait_for(quiet.recv(), STEP)  # its region's descriptor
            short: Traffic | None = None
            cut = await asyncio.to_thread(Partition)
            try:
                # below the bounds: everything completes, intact (each echo is compared)
                await long.count(5)
                on, off, what = await partition(cut, SHORT_CUT)
                note(what)
                await long.count(5)
                longest = long.longest_across(on, off)
                note(f"  every operation completed; the longest under way then took "
                     f"{longest:.2f} s")
                # the partition held traffic up: some operation waited through it
                assert longest > 0.8 * SHORT_CUT, report
                # past the bounds: default-keepalive endpoints too, the long ones still busy
                short = await _connect(h2, port, rpc_port, DEFAULT, "default keepalive")
                await short.count(5)
                await long.count(5)
                quiet_recv = asyncio.ensure_future(quiet.recv())  # nothing in flight
                on, off, what = await partition(cut, LONG_CUT)
                note(what)
                await asyncio.wait_for(asyncio.gather(*short.tasks, *long.tasks), STEP)
                for t in (short, long):
                    note(*(f"  {t.name}: {type(exc).__name__} after {at - on:.2f} s ({exc})"
                           for at, exc in sorted(t.errors, key=lambda e: e[0])))
                for t in (short, long):
                    assert len(t.errors) == 3, f"{t.name}: {t.errors}"  # each loop ended
                for at, exc in short.errors:
                    assert at - on < keepalive_bound(DEFAULT) + SLACK, report  # catalogue
                # The long keepalive did not fire: what ended those endpoints was retries
                # running out, on this side (PeerUnreachableError, in the retries' bound) or
                # on host 2's, which says so (closing its liveness channel) after the heal.
                assert any(_by_retries(exc) and at - on < RETRY_BOUND + SLACK
                           for at, exc in long.errors), report
                assert not any("timed out" in str(exc) for _, exc in long.errors), report
                # the idle endpoint outlived it, and carries a message again
                assert not quiet_recv.done(), quiet_recv
                await asyncio.wait_for(quiet.send(b"\x00after"), STEP)
                assert await asyncio.wait_for(quiet_recv, STEP) == b"\x00after"
                # and new connections work
                again = await _connect(h2, port, rpc_port, DEFAULT, "after the heal")
                await again.count(5)
                await again.finish()
                await _close(again)
            finally:
                await asyncio.to_thread(cut.close)
                for t in (long, *([short] if short else [])):
                    t.stop.set()
                    for task in t.tasks:
                        task.cancel()
                    await _close(t)
                await asyncio.wait_for(quiet.aclose(), STEP)

        run_on(loop, main())


# -- a host that vanishes -----------------------------------------------------------------------

@dataclass
class Pending:
    """A pending operation, and when it ended."""

    what: str
    fut: asyncio.Future[Any]
    config: Config
    at: float | None = None

    def __post_init__(self) -> None:
        self.fut.add_done_callback(lambda _f: setattr(self, "at", time.monotonic()))


@pytest.mark.timer_bound
@pytest.mark.parametrize("loop", LOOPS)
def test_a_host_that_vanishes_fails_every_pending_operation_within_the_bound(
        rdma_device: Any, loop: str) -> None:
    """One kill of host 2, every kind of pending work on host 1: a rendezvous send whose
    RTS host 2 holds and eager sends waiting for credits, a rendezvous receive whose READ is
    in flight, a one-sided 16 MiB READ in flight, an idle receive, and an RPC call; on
    endpoints with the default keepalive (3 s), and on two with a slow one (10 s): one with
    a READ in flight, one idle. Every one fails ``BrokenResourceError``: with the default
    keepalive within its bound; with the slow one, the READ by retry exhaustion
    (``PeerUnreachableError``) first, and the idle endpoint only when its keepalive runs out.
    """
    _, h2 = host_addresses()
    with RemoteProcess([sys.executable, PEER, "--host", h2, "--loop", loop, "--rpc",
                           "--recv-buffer", "0", "--region", str(BIG)]) as peer:
        port = int(peer.expect("PORT ", START).split()[1])
        rpc_port = int(peer.expect("RPC ", START).split()[1])

        async def main() -> None:
            kw: dict[str, Any] = {"timeout": STEP}
            eps = {name: await aiordma.connect(h2, port, config=cfg, **kw) for name, cfg in [
                ("sender", DEFAULT), ("reader", DEFAULT), ("oneside", DEFAULT),
                ("idle", DEFAULT), ("slow-read", SLOW_KEEPALIVE), ("slow-idle", SLOW_KEEPALIVE)]}
            rpc = await rpc_connect(h2, rpc_port, **kw)
            try:
                descs = {n: RemoteBuffer.from_wire(msgpack.unpackb(
                    await asyncio.wait_for(e.recv(), STEP))) for n, e in eps.items()}
                assert await asyncio.wait_for(rpc.add(1, 2), STEP) == 3
                pending: list[Pending] = []

                # mid-send: host 2's handler stops reading; eager sends past its window wait
                # for credits, and a rendezvous send waits for host 2 to READ it
                sender = eps["sender"]
                await asyncio.wait_for(sender.send(b"\x03"), STEP)
                eager = [asyncio.ensure_future(sender.send(b"\x00" + bytes(100)))
                         for _ in range(sender.config.data_slots + 4)]
                rendezvous = asyncio.ensure_future(sender.send(bytes(8 << 20)))
                await wait_until(lambda: sender.stats().queued > 0, "sends queued")
                pending.append(Pending("rendezvous send (RTS held)", rendezvous, DEFAULT))
                pending.append(Pending("idle recv", asyncio.ensure_future(eps["idle"].recv()),
                                       DEFAULT))
                pending.append(Pending("RPC call (hold)", asyncio.ensure_future(
                    rpc.call("hold", 3600.0)), DEFAULT))
                pending.append(Pending("idle recv, slow keepalive", asyncio.ensure_future(
                    eps["slow-idle"].recv()), SLOW_KEEPALIVE))
                # mid-READ: one-sided READs of 16 MiB from host 2's region
                for name, cfg in (("oneside", DEFAULT), ("slow-read", SLOW_KEEPALIVE)):
                    ep = eps[name]
                    mine = ep.register(bytearray(BIG))
                    pending.append(Pending(f"one-sided {BIG >> 20} MiB READ ({name})",
                                           asyncio.ensure_future(ep.read(mine[0:BIG],
                                                                         descs[name][0:BIG])),
                                           cfg))
                # mid-rendezvous on the receiving side: host 2 answers with a BIG message,
                # which this side RDMA-READs from host 2's memory
                reader = eps["reader"]
                await asyncio.wait_for(reader.send(b"\x02" + BIG.to_bytes(4, "little")), STEP)
                big_recv = asyncio.ensure_future(reader.recv())
                await wait_until(lambda: reader._onesided._ops or big_recv.done(),
                                 "the rendezvous READ was posted")
                pending.append(Pending("rendezvous recv, READ in flight", big_recv, DEFAULT))
                await asyncio.sleep(0.1)  # the READs under way
                blocked = [f for f in eager if not f.done()]
                assert blocked, "eager sends past host 2's window should wait for credits"
                # the last of them in the report; every one is checked below
                pending.append(Pending("eager send waiting for credits", blocked[-1], DEFAULT))
                scratch = eps["idle"].register(bytearray(8))  # for a READ after the kill
                unfinished = [p.what for p in pending if p.fut.done()]
                assert not unfinished, f"done before the kill: {unfinished}"

                killed_at = await asyncio.to_thread(kill_host2)
                answered = time.monotonic() - killed_at
                await asyncio.wait_for(asyncio.gather(*(p.fut for p in pending), *blocked,
                                                      return_exceptions=True),
                                       keepalive_bound(SLOW_KEEPALIVE) + SLACK + STEP)
                for f in blocked:
                    assert isinstance(f.exception(), BrokenResourceError), f.exception()
                report = [f"kill requested; the harness answered after {answered * 1000:.0f} ms"]
                for p in sorted(pending, key=lambda p: p.at or 0):
                    exc = p.fut.exception() if not p.fut.cancelled() else None
                    assert p.at is not None
                    elapsed = p.at - killed_at
                    report.append(f"{p.what}: {type(exc).__name__} after {elapsed:.2f} s"
                                  f" ({exc})")
                print(f"\nhost 2 vanished ({loop}):\n  " + "\n  ".join(report))
                for p in pending:
                    exc = p.fut.exception()
                    assert isinstance(exc, BrokenResourceError), f"{p.what}: {exc!r}"
                    assert p.at is not None
                    elapsed = p.at - killed_at
                    # Nothing outlives the first of the two bounds (keepalive, retries) that
                    # applies to its endpoint, give or take the machine's stalls.
                    bound = keepalive_bound(p.config)
                    if "READ" in p.what:
                        bound = min(bound, RETRY_BOUND)
                    assert elapsed < bound + SLACK, (  # catalogue
                        f"{p.what}: {elapsed:.2f} s\n" + "\n".join(report))
                slow_read = next(p for p in pending if "slow-read" in p.what)
                slow_idle = next(p for p in pending if "slow keepalive" in p.what)
                # Which fires first with a keepalive longer than the retries: the READ's retry
                # exhaustion, then (seconds later) the idle endpoint's keepalive.
                assert isinstance(slow_read.fut.exception(), PeerUnreachableError), report
                assert not isinstance(slow_idle.fut.exception(), PeerUnreachableError), report
                assert slow_read.at is not None and slow_idle.at is not None
                assert slow_idle.at > slow_read.at, report
                # The idle one waited for its keepalive, no less: probed each ``idle`` seconds
                # while quiet, it is dropped ``interval x probes`` after the first unanswered
                # probe, so between that and the whole bound after the kill (less a round trip,
                # for a probe sent just before the kill).
                quiet = SLOW_KEEPALIVE.keepalive_interval * SLOW_KEEPALIVE.keepalive_probes
                assert slow_idle.at - killed_at > quiet - 0.5, report
                # operations started afterwards fail at once, typed
                t0 = time.monotonic()
                with pytest.raises(BrokenResourceError):
                    await asyncio.wait_for(eps["idle"].read(scratch[0:8], descs["idle"][0:8]),
                                           STEP)
                with pytest.raises(BrokenResourceError):
                    await asyncio.wait_for(sender.send(b"late"), STEP)
                with pytest.raises(BrokenResourceError):
                    await asyncio.wait_for(rpc.add(1, 1), STEP)
                print(f"three operations started afterwards failed in "
                      f"{(time.monotonic() - t0) * 1000:.0f} ms")
            finally:
                t0 = time.monotonic()
                for e in eps.values():
                    await asyncio.wait_for(e.aclose(), STEP)
                await asyncio.wait_for(rpc.aclose(), STEP)
                print(f"closing the broken endpoints took {time.monotonic() - t0:.2f} s")

        run_on(loop, main())
