"""Where a connection's set-up spends its time: each step timed, client and server in one
process (one event loop), so that with one set-up at a time the steps do not overlap.

    python scripts/setup_phases.py [N] [IN_FLIGHT]      # default 32 connections, 1 at a time
    # where this host has no RDMA device, in the VM:
    .venv/bin/python -m harness run -- .venv/bin/python scripts/setup_phases.py 32 1

It wraps private functions of ``aiordma._endpoint`` with timers (a probe, not an API: it
follows the code as it is) and prints, per connection, the time of each step summed over both
sides where both take it, then per call. The first connection (the device's opening, the
first completion queue) is left out. Used for docs/reports/2026-11-26-connections-at-scale.md.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import sys
import time
from typing import Any

import uvloop

import aiordma
from aiordma._endpoint import connect as C
from aiordma._endpoint import driver as D
from aiordma._endpoint import listener as L
from aiordma._endpoint import onesided as O
from aiordma._endpoint import qp as Q
from aiordma._memory import region as R

spent: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its time to ``spent[label]``."""
    f = getattr(owner, name)
    if asyncio.iscoroutinefunction(f):
        @functools.wraps(f)
        async def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return await f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
                calls[label] += 1
    else:
        @functools.wraps(f)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
                calls[label] += 1
    setattr(owner, name, wrapper)


timed(C, "connect", "client connect() in all")
timed(L.Listener, "_accept", "server: Hello to Ready in all")
timed(C, "_open", "client: TCP connect")
timed(C, "_answer", "client: waiting for the Accept")
timed(C, "_device_for", "device choice")
timed(C._Resources, "__init__", "QP, slot buffer, registration, CQ share")
timed(Q.QueuePair, "__init__", "  QP creation")
timed(R.MemoryRegion, "__init__", "  memory registration")
timed(Q.QueuePair, "to_init", "QP to INIT")
timed(Q.QueuePair, "to_rtr", "QP to RTR")
timed(Q.QueuePair, "to_rts", "QP to RTS")
timed(D.EndpointDriver, "__init__", "endpoint construction (receives posted)")
timed(O.OneSided, "__init__", "  one-sided state")


async def echo(ep: aiordma.Endpoint) -> None:
    while (msg := await ep.recv()) is not None:
        await ep.send(msg)


async def main(n: int, in_flight: int) -> None:
    async with await aiordma.listen(echo, "127.0.0.1", 0, transport="rdma") as listener:
        await (await aiordma.connect("127.0.0.1", listener.port, transport="rdma")).aclose()
        spent.clear()
        calls.clear()
        gate = asyncio.Semaphore(in_flight)
        eps: list[aiordma.Endpoint] = []

        async def one() -> None:
            async with gate:
                eps.append(await aiordma.connect("127.0.0.1", listener.port,
                                                 transport="rdma"))

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        await asyncio.gather(*(ep.aclose() for ep in eps))
    print(f"{n} connections, {in_flight} in flight: {wall:.3f} s ({n / wall:.1f}/s)")
    for label, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {label:42s} {s * 1e3 / n:8.2f} ms per connection "
              f"({calls[label]} calls, {s * 1e3 / calls[label]:.2f} ms each)")


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 32,
                    int(sys.argv[2]) if len(sys.argv) > 2 else 1))
