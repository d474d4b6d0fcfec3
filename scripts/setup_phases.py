"""Where a connection's set-up spends its time: each step timed, client and server in one
process (one event loop), so that with one set-up at a time the steps do not overlap.

    python scripts/setup_phases.py [N] [IN_FLIGHT] [pool] [stock=K] [asyncio]  # 32, 1, uvloop
    # where this host has no RDMA device, in the VM:
    .venv/bin/python -m harness run -- .venv/bin/python scripts/setup_phases.py 32 1

It wraps private functions of ``aiordma._endpoint`` with timers (a probe, not an API: it
follows the code as it is) and prints, per connection, the time of each step summed over both
sides where both take it, then per call: wall time and the process's CPU time
(``time.process_time``: user + system, which a busy host stretches less than the wall time;
a step that awaits includes the other side's work done meanwhile, in the same process).
``pool``: both sides on their loop's shared pool (the listener with
``Config(receive_pool=True)``, the client with ``client_pool=True`` too: receives from the
pool, sends from the pool's send arena); ``asyncio``: the standard loop, not uvloop;
``stock=K``: the listener with ``Config(setup_stock=K)``, its stock made before the first
timed set-up (with one set-up at a time it is made up again between two: its making is timed
apart). The first connection
(the device's opening, the first completion queue) is left out. Used for
docs/reports/2026-11-26-connections-at-scale.md.
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
from aiordma._endpoint import stock as S
from aiordma._reactor import reactor as RR
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
_made = C._Resources.__init__


def _resources(self: Any, *a: Any, **k: Any) -> None:
    """(The stock's, made ahead, apart from the set-ups' own.)"""
    if not k.get("ahead"):
        _made(self, *a, **k)
        return
    t, c = time.perf_counter(), time.process_time()
    try:
        _made.__wrapped__(self, *a, **k)  # type: ignore[attr-defined]
    finally:
        spent["stock: _Resources made ahead"] += time.perf_counter() - t
        cpu["stock: _Resources made ahead"] += time.process_time() - c
        calls["stock: _Resources made ahead"] += 1


C._Resources.__init__ = _resources  # type: ignore[method-assign]
timed(S.SetupStock, "take", "server: stock take (claim)")
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
timed(Q.QueuePair, "message_route", "  message route")
timed(Q.QueuePair, "prepare_slots", "  receive slots prepared")
timed(Q.QueuePair, "action_runner", "  action runner")
timed(D.EndpointDriver, "_run", "  first actions (receives posted)")
timed(RR.CompletionReactor, "add_route", "  reactor route")
timed(D, "RegistrationCache", "  registration cache")
_protocol = D.message_protocol


def _timed_protocol() -> Any:
    cls = _protocol()

    def make(*a: Any, **k: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        try:
            return cls(*a, **k)
        finally:
            spent["  message protocol"] += time.perf_counter() - t
            cpu["  message protocol"] += time.process_time() - c
            calls["  message protocol"] += 1
    return make


D.message_protocol = _timed_protocol  # type: ignore[assignment]
timed(D.EndpointDriver, "_teardown", "endpoint teardown (at close)")


async def echo(ep: aiordma.Endpoint) -> None:
    while (msg := await ep.recv()) is not None:
        await ep.send(msg)


async def main(n: int, in_flight: int, pool: bool, stock: int) -> None:
    config = aiordma.Config(receive_pool=True, client_pool=True) if pool else None
    server = aiordma.Config(receive_pool=pool, setup_stock=stock)
    async with await aiordma.listen(echo, "127.0.0.1", 0, transport="rdma",
                                    config=server) as listener:
        await (await aiordma.connect("127.0.0.1", listener.port, transport="rdma",
                                     config=config)).aclose()
        while listener.stock is not None and len(listener.stock) < stock:
            await asyncio.sleep(0.05)
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
    print(f"{n} connections, {in_flight} in flight, {'pool' if pool else 'own slots'}, "
          f"stock {stock} ({listener.stock!r}): "
          f"{wall:.3f} s ({n / wall:.1f}/s), CPU {used * 1e3 / n:.2f} ms per connection "
          f"(both sides); load average {os.getloadavg()[0]:.2f}")
    print(f"  {'step':46s} {'wall ms/conn':>12s} {'CPU ms/conn':>12s}  calls  CPU ms/call")
    for label, s in sorted(spent.items(), key=lambda kv: -cpu[kv[0]]):
        print(f"  {label:46s} {s * 1e3 / n:12.2f} {cpu[label] * 1e3 / n:12.2f}  "
              f"{calls[label]:5d}  {cpu[label] * 1e3 / calls[label]:.2f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:]
            if a not in ("pool", "asyncio") and not a.startswith("stock=")]
    stocked = [int(a[6:]) for a in sys.argv[1:] if a.startswith("stock=")]
    run = asyncio.run if "asyncio" in sys.argv[1:] else uvloop.run
    run(main(int(args[0]) if args else 32, int(args[1]) if len(args) > 1 else 1,
                    "pool" in sys.argv[1:], stocked[0] if stocked else 0))
