"""Across two hosts, the faults one host cannot show: a host that vanishes.

Run only on host 1 of ``aiordma rxe run --hosts 2`` (``scripts/two-host-tests.sh``). Host 2 is
killed by the harness on this host's request (:func:`aiordma.tools.remote.kill_host2`: its QEMU
process gets SIGKILL, so its kernel sends no FIN, no RST, and the link does not go down), and
booted again after each test (``two_hosts.host2_may_vanish``), so the tests after it find the
pair whole.

What notices a vanished host on host 1 is one of two things (README, "When things go wrong"):

* the liveness channel's TCP keepalive (``Config.keepalive_*``): idle, then probes; an endpoint
  is broken ``idle + interval x probes`` seconds after the last packet from the peer at most
  (3 s by default), whatever it is doing;
* the queue pair's retry exhaustion: an operation whose packets go unacknowledged is retried
  ``retry_cnt`` (6) times, 0.54 s apart (``aiordma/_qp.py``), then fails
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
from aiordma.tools.remote import RemoteProcess, host_addresses, kill_host2

from ..bounds import STEP
from .peers import LOOPS, run_on, wait_until
from .two_hosts import PEER, START, host2_may_vanish

pytestmark = pytest.mark.two_hosts

BIG = 16 << 20  # a READ of this size takes seconds across the link: killed mid-way
DEFAULT = Config()
#: Keepalive long enough that retry exhaustion (about 3.8 s) fires first on an endpoint with
#: an operation in flight: idle 5 s, 5 probes 1 s apart.
SLOW_KEEPALIVE = Config(keepalive_idle=5, keepalive_interval=1, keepalive_probes=5)
RETRY_BOUND = 7 * 0.54  # 6 retries after the first try, 0.54 s each (aiordma/_qp.py)
#: What a loaded machine adds to a bound: the emulated CPUs stall for seconds under load (the
#: machine has two cores, shared with other VMs), and the kernel's timers and the loop's
#: wake-ups run late by as much.
SLACK = 3.0


def keepalive_bound(config: Config) -> float:
    return config.keepalive_idle + config.keepalive_interval * config.keepalive_probes


@dataclass
class Pending:
    """A pending operation, and when it ended."""

    what: str
    fut: asyncio.Future[Any]
    config: Config
    at: float | None = None

    def __post_init__(self) -> None:
        self.fut.add_done_callback(lambda _f: setattr(self, "at", time.monotonic()))


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
    with host2_may_vanish(), \
            RemoteProcess([sys.executable, PEER, "--host", h2, "--loop", loop, "--rpc",
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
                    assert elapsed < bound + SLACK, f"{p.what}: {elapsed:.2f} s\n" + "\n".join(
                        report)
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
