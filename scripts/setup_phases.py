"""Where a connection's set-up spends its time: each step timed, client and server in one
process (one event loop), so that with one set-up at a time the steps do not overlap.

    python scripts/setup_phases.py [N] [IN_FLIGHT] [pool]   # default 32 connections, 1 at a time
    # where this host has no RDMA device, in the VM:
    .venv/bin/python -m harness run -- .venv/bin/python scripts/setup_phases.py 32 1

It wraps private functions of ``aiordma._endpoint`` with timers (a probe, not an API: it
follows the code as it is) and prints, per connection, the time of each step summed over both
sides where both take it, then per call: wall time and the process's CPU time
(``time.process_time``: user + system, which a busy host stretches less than the wall time;
a step that awaits includes the other side's work done meanwhile, in the same process).
``pool``: both sides with ``Config(receive_pool=True)`` (the listener's receives from its
shared pool, its sends from the pool's send arena). The first connection (the device's opening, the
first completion queue) is left out. Used for docs/reports/2026-11-26-connections-at-scale.md.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
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
cpu: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its time to ``spent[label]``."""
    f = getattr(owner, name)
    if asyncio.iscoroutinefunction(f):
        @functools.wraps(f)
        async def wrapper(*a: Any, **k: Any) -> Any:
            t, c = time.perf_counter(), time.process_time()
            try:
                return await f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
                cpu[label] += time.process_time() - c
                calls[label] += 1
    else:
        @functools.wraps(f)
        def wrapper(*a: Any, **k: Any) -> Any:
            t, c = time.perf_counter(), time.process_time()
            try:
                return f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
                cpu[label] += time.process_time() - c
                calls[label] += 1
    setattr(owner, name, wrapper)


timed(C, "connect", "client connect() in all")
timed(L.Listener, "_accept", "server: Hello to Ready in all")
timed(L.Listener, "_accept_rdma", "server: Hello to Accept sent")
timed(C, "_open", "client: TCP connect")
timed(C, "_device_ahead", "client: device before the TCP connect")
timed(C, "_answer", "client: waiting for the Accept")
timed(C, "_device_for", "device choice")
timed(C._Resources, "__init__", "_Resources (QP, slots, registration, CQ share)")
timed(Q.QueuePair, "__init__", "  QP creation")
timed(R.MemoryRegion, "__init__", "  memory registration")
timed(C, "shared_reactor", "  CQ share (shared_reactor)")
timed(C, "join_pool", "  pool join (join_pool)")
timed(C, "join_send_arena", "  send arena seat")
timed(Q.QueuePair, "to_init", "QP to INIT")
timed(Q.QueuePair, "to_rtr", "QP to RTR")
timed(Q.QueuePair, "to_rts", "QP to RTS")
timed(C._Resources, "params", "Hello/Accept parameters")
timed(D.EndpointDriver, "__init__", "endpoint construction (receives posted)")
timed(O.OneSided, "__init__", "  one-sided state")
timed(D.EndpointDriver, "_teardown", "endpoint teardown (at close)")


async def echo(ep: aiordma.Endpoint) -> None:
    while (msg := await ep.recv()) is not None:
        await ep.send(msg)


async def main(n: int, in_flight: int, pool: bool) -> None:
    config = aiordma.Config(receive_pool=True) if pool else None
    async with await aiordma.listen(echo, "127.0.0.1", 0, transport="rdma",
                                    config=config) as listener:
        await (await aiordma.connect("127.0.0.1", listener.port, transport="rdma",
                                     config=config)).aclose()
        spent.clear()
        cpu.clear()
        calls.clear()
        gate = asyncio.Semaphore(in_flight)
        eps: list[aiordma.Endpoint] = []

        async def one() -> None:
            async with gate:
                eps.append(await aiordma.connect("127.0.0.1", listener.port,
                                                 transport="rdma", config=config))

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one() for _ in range(n)))
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        await asyncio.gather(*(ep.aclose() for ep in eps))
    print(f"{n} connections, {in_flight} in flight, {'pool' if pool else 'own slots'}: "
          f"{wall:.3f} s ({n / wall:.1f}/s), CPU {used * 1e3 / n:.2f} ms per connection "
          f"(both sides); load average {os.getloadavg()[0]:.2f}")
    print(f"  {'step':46s} {'wall ms/conn':>12s} {'CPU ms/conn':>12s}  calls  CPU ms/call")
    for label, s in sorted(spent.items(), key=lambda kv: -cpu[kv[0]]):
        print(f"  {label:46s} {s * 1e3 / n:12.2f} {cpu[label] * 1e3 / n:12.2f}  "
              f"{calls[label]:5d}  {cpu[label] * 1e3 / calls[label]:.2f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "pool"]
    uvloop.run(main(int(args[0]) if args else 32, int(args[1]) if len(args) > 1 else 1,
                    "pool" in sys.argv[1:]))
