"""RPC and key-value rows, client side: ``aiordma.rpc`` against the echo service, the asyncio
TCP + msgpack baseline against its echo server, and ``aiordma.services.kv`` GETs one-sided and by RPC,
all served by the peer process.

Each row runs ``in_flight`` tasks that take calls from one shared count, so that many calls
are outstanding at once; latency is per call, throughput is calls over wall time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .measure import percentile
from .plan import Plan

if TYPE_CHECKING:
    from aiordma import Config

__all__ = ["kv_get", "rpc_echo", "tcp_echo"]

STEP = 60.0
LOCAL = "127.0.0.1"  # where the peer listens unless told (host 2's address across the wire)


async def _drive(call: Callable[[], Awaitable[Any]], calls: int, in_flight: int,
                 warmup: int, timeout: float) -> dict[str, float]:
    for _ in range(warmup):
        await asyncio.wait_for(call(), STEP)
    todo = iter(range(calls))
    lat: list[float] = []

    async def worker() -> None:
        for _ in todo:
            t0 = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    # (a task group: on time-out every worker is cancelled and awaited, nothing left behind)
    async with asyncio.timeout(timeout), asyncio.TaskGroup() as workers:
        for _ in range(in_flight):
            workers.create_task(worker())
    elapsed = time.perf_counter() - t0
    lat.sort()
    return {"p50_us": percentile(lat, 0.5) * 1e6, "p99_us": percentile(lat, 0.99) * 1e6,
            "ops_per_s": calls / elapsed}


async def rpc_echo(port: int, plan: Plan, in_flight: int, *, host: str = LOCAL,
                   config: Config | None = None, transport: str = "auto") -> dict[str, float]:
    """``echo(<payload> bytes)`` by ``aiordma.rpc``, ``in_flight`` calls outstanding, over
    ``transport`` (``"tcp"``: aiordma's TCP transport, area t)."""
    from aiordma import rpc

    payload = b"x" * plan.rpc_payload
    async with await rpc.connect(host, port, timeout=STEP, config=config,
                                 max_in_flight=max(in_flight, 1),
                                 transport=transport) as client:
        if transport != "auto" and client.transport != transport:
            raise RuntimeError(f"the row asked for {transport}, the connection is "
                               f"{client.transport}")

        async def call() -> None:
            if len(await client.call("echo", payload)) != len(payload):
                raise RuntimeError("echo returned something else")

        return await _drive(call, plan.rpc_calls, in_flight, plan.warmup, plan.row_timeout)


async def tcp_echo(port: int, plan: Plan, in_flight: int, *,
                   host: str = LOCAL) -> dict[str, float]:
    """The same calls over the asyncio TCP + msgpack baseline."""
    from .tcp_baseline import TcpEchoClient

    payload = b"x" * plan.rpc_payload
    client = await asyncio.wait_for(TcpEchoClient.connect(host, port), STEP)
    try:

        async def call() -> None:
            if len(await client.call("echo", payload)) != len(payload):
                raise RuntimeError("echo returned something else")

        return await _drive(call, plan.rpc_calls, in_flight, plan.warmup, plan.row_timeout)
    finally:
        await client.aclose()


async def kv_get(port: int, plan: Plan, *, one_sided: bool, in_flight: int,
                 host: str = LOCAL, config: Config | None = None) -> dict[str, float]:
    """GETs of ``plan.kv_keys`` keys (``plan.kv_value`` B values, loaded first), one-sided
    (one RDMA READ, validated) or by RPC. Every value is checked; the share of one-sided GETs
    answered by the READ alone is reported as ``hit``."""
    from aiordma.services import kv

    keys = [b"bench-%05d" % i for i in range(plan.kv_keys)]
    values = {k: (k * (plan.kv_value // len(k) + 1))[:plan.kv_value] for k in keys}
    async with await kv.connect(host, port, timeout=STEP, config=config,
                                readers=max(in_flight, 1)) as store:
        for k in keys:  # idempotent: every row loads the same values
            await store.put(k, values[k], timeout=STEP)
        turn = iter(range(1 << 62))

        async def call() -> None:
            k = keys[next(turn) % len(keys)]
            if await store.get(k, one_sided=one_sided, timeout=STEP) != values[k]:
                raise RuntimeError(f"GET {k!r} returned a wrong value")

        before = dict(store.counters)
        out = await _drive(call, plan.kv_gets, in_flight, plan.warmup, plan.row_timeout)
        hits = store.counters["one_sided_hit"] - before.get("one_sided_hit", 0)
    if one_sided:
        out["hit"] = hits / (plan.kv_gets + plan.warmup)  # warm-up GETs counted too
    return out
