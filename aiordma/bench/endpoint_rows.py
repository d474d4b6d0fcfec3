"""aiordma's endpoint rows, client side: each opens its own connections to the peer process
(:mod:`aiordma.bench.peer`) through the public API, measures, and returns its figures.

Each takes the peer's ``host`` (default 127.0.0.1; host 2's address across the wire) and the
endpoints' ``config``. Times are taken with ``time.perf_counter``; bandwidth is in MiB/s (2**20
bytes per second, perftest's unit), from the first post to the last completion, as perftest
measures it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack

import aiordma
from aiordma import Config, Endpoint, RemoteBuffer

from .measure import percentile
from .plan import MIB, Plan

__all__ = ["message_rate", "onesided_bandwidth", "ping_pong", "rendezvous_bandwidth",
           "scaling"]

STEP = 60.0  # bound on any one wait for the peer
LOCAL = "127.0.0.1"  # where the peer listens unless told (host 2's address across the wire)


def _wakeups(*eps: Endpoint) -> int | None:
    """fd wake-ups so far of the completion reactors behind ``eps`` (each counted once).

    aiordma has no public accessor for this counter yet, so this reads a private attribute;
    None if that changes.
    """
    reactors = {id(r): r for ep in eps if (r := getattr(ep, "_reactor", None)) is not None}
    counts = [getattr(r, "wakeups", None) for r in reactors.values()]
    return None if not counts or None in counts else sum(counts)  # type: ignore[arg-type]


async def _command(ep: Endpoint, mode: str, count: int = 0) -> None:
    await ep.send(msgpack.packb([mode, count]))


@asynccontextmanager
async def _connected(port: int, host: str, config: Config | None) -> AsyncIterator[Endpoint]:
    async with await aiordma.connect(host, port, timeout=STEP, config=config,
                                     transport="rdma") as ep:
        yield ep


async def ping_pong(port: int, plan: Plan, size: int = 64, *, host: str = LOCAL,
                    config: Config | None = None) -> dict[str, float]:
    """``size`` B round trips, one at a time: p50, p99 (us) and fd wake-ups per round trip."""
    msg = b"x" * size
    async with _connected(port, host, config) as ep:
        await _command(ep, "echo", plan.warmup + plan.rtt_iters)
        for _ in range(plan.warmup):
            await ep.send(msg)
            await asyncio.wait_for(ep.recv(), STEP)
        w0 = _wakeups(ep)
        rtts = []
        for _ in range(plan.rtt_iters):
            t0 = time.perf_counter()
            await ep.send(msg)
            reply = await ep.recv()
            rtts.append(time.perf_counter() - t0)
            if reply is None or len(reply) != size:
                raise RuntimeError(f"the peer answered {reply!r:.40}")
        w1 = _wakeups(ep)
    rtts.sort()
    out = {"p50_us": percentile(rtts, 0.5) * 1e6, "p99_us": percentile(rtts, 0.99) * 1e6}
    if w0 is not None and w1 is not None:
        out["wakeups_per_op"] = (w1 - w0) / plan.rtt_iters
    return out


async def _region(ep: Endpoint) -> RemoteBuffer:
    await _command(ep, "region")
    wire = await asyncio.wait_for(ep.recv(), STEP)
    if wire is None:
        raise RuntimeError("the peer closed instead of describing its region")
    return RemoteBuffer.from_wire(msgpack.unpackb(wire))


async def onesided_bandwidth(port: int, plan: Plan, op: str, size: int, *, host: str = LOCAL,
                             config: Config | None = None) -> dict[str, float]:
    """RDMA ``op`` ("write" or "read") of ``size`` B, ``plan.bw_window`` in flight: MiB/s."""
    iters = plan.bw_iters(size)
    async with _connected(port, host, config) as ep:
        remote = (await _region(ep))[0:size]
        # One local buffer for all operations in flight, as perftest does: concurrent READs
        # into it race, which is harmless here (nobody reads the data).
        local = ep.register(bytearray(size)).whole()
        run = ep.write if op == "write" else ep.read
        await run(local, remote)  # warm-up (first touch of both buffers)
        todo = iter(range(iters))

        async def worker() -> None:
            for _ in todo:
                await run(local, remote)

        t0 = time.perf_counter()
        # A task group, not gather: when the row's time runs out (under loss, a 4 MiB READ can
        # take minutes), every worker is cancelled and awaited before the endpoint closes,
        # and no "exception was never retrieved" is logged.
        async with asyncio.timeout(plan.row_timeout), asyncio.TaskGroup() as workers:
            for _ in range(plan.bw_window):
                workers.create_task(worker())
        elapsed = time.perf_counter() - t0
    return {"mibs": size * iters / elapsed / MIB}


async def message_rate(port: int, plan: Plan, size: int = 64, *, host: str = LOCAL,
                       config: Config | None = None) -> dict[str, float]:
    """``size`` B messages one way, as fast as credits allow (the peer's receive slots are
    the window); the clock stops when the peer confirms it received them all."""
    msg = b"x" * size
    async with _connected(port, host, config) as ep:
        for count, timed in ((plan.warmup * 4, False), (plan.rate_count, True)):
            await _command(ep, "sink", count)
            w0 = _wakeups(ep)
            t0 = time.perf_counter()
            for _ in range(count):
                await ep.send(msg)
            if await asyncio.wait_for(ep.recv(), STEP) != b"ok":
                raise RuntimeError("the peer did not confirm the messages")
            elapsed = time.perf_counter() - t0
            w1 = _wakeups(ep)
    out = {"msgs_per_s": plan.rate_count / elapsed}
    if w0 is not None and w1 is not None:
        out["wakeups_per_op"] = (w1 - w0) / plan.rate_count
    return out


async def rendezvous_bandwidth(port: int, plan: Plan, *, registered: bool = False,
                               host: str = LOCAL,
                               config: Config | None = None) -> dict[str, float]:
    """``plan.rdv_count`` messages of ``plan.rdv_size`` one way, one after another (the peer
    RDMA-READs each into its buffer): MiB/s until the peer confirms the last. ``registered``:
    sent from a region registered once (``send(region.whole())``), else from a bytearray
    that each send registers and deregisters."""
    data: Any = bytearray(plan.rdv_size)
    async with _connected(port, host, config) as ep:
        if registered:
            data = ep.register(data, remote_read=True).whole()
        for count, timed in ((1, False), (plan.rdv_count, True)):
            await _command(ep, "sink", count)
            t0 = time.perf_counter()
            for _ in range(count):
                await asyncio.wait_for(ep.send(data), STEP)
            if await asyncio.wait_for(ep.recv(), STEP) != b"ok":
                raise RuntimeError("the peer did not confirm the messages")
            elapsed = time.perf_counter() - t0
    return {"mibs": plan.rdv_size * plan.rdv_count / elapsed / MIB}


async def scaling(port: int, plan: Plan, endpoints: int, size: int = 64, *, host: str = LOCAL,
                  config: Config | None = None) -> dict[str, float]:
    """``plan.scale_in_flight`` 64 B round trips in flight, spread over ``endpoints``
    connections (one task each at 64): wall time per round trip, in us."""
    if plan.scale_in_flight % endpoints:
        raise ValueError("the round trips in flight must divide evenly among the endpoints")
    tasks_per_ep = plan.scale_in_flight // endpoints
    per_task = max(1, plan.scale_ops // plan.scale_in_flight)
    warm = 2
    msg = b"x" * size
    eps: list[Endpoint] = []
    try:
        for _ in range(endpoints):  # one after another: set-up is not what is measured
            eps.append(await aiordma.connect(host, port, timeout=STEP, config=config,
                                             transport="rdma"))
        for ep in eps:
            await _command(ep, "echo", tasks_per_ep * (warm + per_task))

        async def task(ep: Endpoint, n: int) -> None:
            for _ in range(n):
                await ep.send(msg)
                if await ep.recv() is None:
                    raise RuntimeError("the peer closed")

        async def all_tasks(n: int) -> None:
            async with asyncio.timeout(plan.row_timeout), asyncio.TaskGroup() as tasks:
                for ep in eps:
                    for _ in range(tasks_per_ep):
                        tasks.create_task(task(ep, n))

        await all_tasks(warm)
        w0 = _wakeups(*eps)
        t0 = time.perf_counter()
        await all_tasks(per_task)
        elapsed = time.perf_counter() - t0
        w1 = _wakeups(*eps)
    finally:
        await asyncio.gather(*(ep.aclose() for ep in eps), return_exceptions=True)
    ops = per_task * plan.scale_in_flight
    out: dict[str, Any] = {"us_per_op": elapsed / ops * 1e6, "ops_per_s": ops / elapsed}
    if w0 is not None and w1 is not None:
        out["wakeups_per_op"] = (w1 - w0) / ops
    return out
