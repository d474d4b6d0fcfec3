"""Many connections to one server in another process (issue 37): bounded by counts, never by
a rate.

Every connection is served (its own 64 B message comes back to it); the server's kernel holds
one queue pair per open connection and one memory region per connection (the receive and send
slots share one registration; the atomics' scratch is registered only by an endpoint that makes
an atomic), or, where its receives come from a shared receive pool, one shared receive queue
and one memory region per pool and one per 32 connections (a chunk of the pool's send arena);
and after the close both processes are back to their counts before (the kernel's lists,
``rdma resource show``; the open fds; aiordma's own counts for this process).

(:mod:`tests.rxe.test_thousand_connections` holds 1,000 the same way, alone.)
"""

from __future__ import annotations

import asyncio

import aiordma
from aiordma._endpoint.send_arena import ARENA_MEMBERS
from aiordma.bench.connections import kernel_totals, open_files, own_objects, server_process

from ..bounds import STEP
from ..restrack import kernel_counts
from .leaks import back, snapshot

N = 128  # connections open at once
LISTED = 256  # above this, the kernel's objects are counted, not listed (rdma resource show)
IN_FLIGHT = 16  # set-ups at a time


def _totals() -> dict[str, int]:
    """The kernel's count of queue pairs, memory regions and shared receive queues on every
    device (its summary: no list of the objects; ``rdma resource show srq`` lists each SRQ's
    queue pairs, and did not answer in 180 s with 2,000 of them in the VM); it must be
    readable here."""
    totals = kernel_totals()
    assert totals is not None, "rdma -j resource show could not be read"
    return totals


async def served(rdma_device: object, loop: str, n: int, *, pool: int = 0, send_slots: int = 0,
                 keepalive: int = 0, config: aiordma.Config | None = None) -> dict[str, int]:
    """``n`` connections to a server process (``pool``: its pool's slots; ``send_slots`` and
    ``keepalive``: its endpoints', as :func:`server_process` takes them), one echo each, every
    count back after the close; returns the server's kernel objects with them open."""
    open_files(n + 256)
    with server_process(loop, pool, send_slots, keepalive) as (port, pid):
        kw = {"timeout": 4 * STEP, "device": rdma_device, "transport": "rdma",
              "config": config}
        # warm-up: this process opens the device (and the server its first reactor)
        await (await aiordma.connect("127.0.0.1", port, **kw)).aclose()
        async with asyncio.timeout(STEP):  # the server's side of it closed too
            while (before := await snapshot(pid))[0].kernel["qp"]:
                await asyncio.sleep(0.1)
        mine = await snapshot()
        base = await asyncio.to_thread(_totals) if n > LISTED else {}
        gate = asyncio.Semaphore(IN_FLIGHT)
        eps: list[aiordma.Endpoint] = []

        async def one() -> None:
            async with gate:
                eps.append(await aiordma.connect("127.0.0.1", port, **kw))

        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(n):
                    tg.create_task(one())
            assert len(eps) == n

            async def echo(i: int, ep: aiordma.Endpoint) -> None:
                msg = i.to_bytes(4, "little") * 16  # 64 B, this connection's own
                await ep.send(msg)
                assert await asyncio.wait_for(ep.recv(), 4 * STEP) == msg

            async with asyncio.TaskGroup() as tg:
                for i, ep in enumerate(eps):
                    tg.create_task(echo(i, ep))
            if n <= LISTED:
                objects = kernel_counts([pid], ("qp", "mr", "srq"))[pid]
                (server,) = await snapshot(pid)
                held = {k: server.kernel[k] - before[0].kernel[k] for k in ("qp", "mr")}
            else:  # (listing thousands of objects took more than 5 minutes in the VM)
                now = await asyncio.to_thread(_totals)
                mine_now = own_objects(eps)  # (less the clients', by their own account)
                objects = {"srq": now["srq"] - mine_now["srq"]}
                held = {k: now[k] - base[k] - mine_now[k] for k in ("qp", "mr")}
            assert held["qp"] == n, (held, objects)
            if objects["srq"]:  # one region per pool, and one per chunk of its send arena:
                # 32 connections a chunk, one partial chunk per pool at most
                chunks = held["mr"] - objects["srq"]
                assert -(-n // ARENA_MEMBERS) <= chunks < -(-n // ARENA_MEMBERS) + objects["srq"], (
                    held, objects)
            else:  # one region per connection (its receive and send slots)
                assert held["mr"] == n, (held, objects)
        finally:
            await asyncio.gather(*(ep.aclose() for ep in eps), return_exceptions=True)
        await back([*before, *mine], timeout=4 * STEP)
        return objects


async def test_many_connections_are_served_and_released(rdma_device) -> None:
    objects = await served(rdma_device, "asyncio", N)
    # (AIORDMA_RECEIVE_POOL=1 in the environment puts both ends on the pool: one holds them)
    assert objects["srq"] == (1 if aiordma.Config().receive_pool else 0), objects

