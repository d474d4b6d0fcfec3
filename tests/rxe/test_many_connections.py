"""Many connections to one server in another process (issue 37): bounded by counts, never by
a rate.

Every connection is served (its own 64 B message comes back to it), the server's kernel holds
one queue pair and one memory region per open connection (the receive and send slots share one
registration; the atomics' scratch is registered only by an endpoint that makes an atomic),
and after the close both processes are back to their counts before (the kernel's lists,
``rdma resource show``; the open fds; aiordma's own counts for this process).
"""

from __future__ import annotations

import asyncio

import aiordma
from aiordma.bench.connections import server_process

from ..bounds import STEP
from .leaks import back, snapshot

N = 128  # connections open at once
IN_FLIGHT = 16  # set-ups at a time


async def test_many_connections_are_served_and_released(rdma_device) -> None:
    with server_process("asyncio") as (port, pid):
        kw = {"timeout": 4 * STEP, "device": rdma_device, "transport": "rdma"}
        # warm-up: this process opens the device (and the server its first reactor)
        await (await aiordma.connect("127.0.0.1", port, **kw)).aclose()
        async with asyncio.timeout(STEP):  # the server's side of it closed too
            while (before := await snapshot(pid))[0].kernel["qp"]:
                await asyncio.sleep(0.1)
        mine = await snapshot()
        gate = asyncio.Semaphore(IN_FLIGHT)
        eps: list[aiordma.Endpoint] = []

        async def one() -> None:
            async with gate:
                eps.append(await aiordma.connect("127.0.0.1", port, **kw))

        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(N):
                    tg.create_task(one())
            assert len(eps) == N

            async def echo(i: int, ep: aiordma.Endpoint) -> None:
                msg = i.to_bytes(4, "little") * 16  # 64 B, this connection's own
                await ep.send(msg)
                assert await asyncio.wait_for(ep.recv(), 4 * STEP) == msg

            async with asyncio.TaskGroup() as tg:
                for i, ep in enumerate(eps):
                    tg.create_task(echo(i, ep))
            (server,) = await snapshot(pid)
            for kind in ("qp", "mr"):
                assert server.kernel[kind] == before[0].kernel[kind] + N, (kind, before, server)
        finally:
            await asyncio.gather(*(ep.aclose() for ep in eps), return_exceptions=True)
        await back([*before, *mine], timeout=4 * STEP)
