"""The send arena of a shared receive pool (issue 37, item 2), over rxe: the listener's
connections on the pool send from chunks of slots shared by up to 32 connections (one memory
region per chunk, not one per connection). Bounded by counts, never by time.

Eight connections on one chunk pipeline 120 messages each from the server, far beyond their
reserve of 4 slots, while one connection's reader reads nothing: every message of the others
arrives intact and in order; the stalled one's sender waits for credits holding no shared slot
once its completions came; then its reader reads everything, intact. The kernel holds the
pool's memory region and the chunk's, beside the clients' own; every count is back after the
close.
"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import aiordma
from aiordma import Config

from ..bounds import STEP
from .leaks import back, kernel_back, snapshot
from .test_endpoint_pool import POOL, Served, _connect
from .test_receive_pool import _kernel

CONNECTIONS = 8
MESSAGES = 120  # per connection, pipelined: far beyond a reserve of 4 send slots
STALLED = Config(receive_pool=True, recv_buffer=0, data_slots=8)  # holds 8 messages unread


def _msg(conn: int, i: int) -> bytes:
    return bytes([(conn * 31 + i) % 251]) * (100 + i % 900)


async def test_a_chunk_s_connections_pipeline_past_their_reserve(rdma_device: Any) -> None:
    pid = os.getpid()
    s = Served()
    s.listener = await aiordma.listen(s.handler, "127.0.0.1", 0, device=rdma_device,
                                      config=POOL)
    pairs: list[tuple[Any, Any]] = []
    try:
        client, server = await _connect(s, rdma_device)  # warm-up: what stays open
        await client.aclose()
        await server.aclose()
        # What earlier tests of this process left to the collector is freed now, not between
        # the baseline and the count below (three MRs of one did, making it 7, not 10).
        gc.collect()
        kernel_before = _kernel(pid)
        mine = await snapshot()
        pairs.append(await _connect(s, rdma_device, STALLED))
        for _ in range(CONNECTIONS - 1):
            pairs.append(await _connect(s, rdma_device))
        servers = [srv for _, srv in pairs]
        pool = servers[0]._pool
        seats = [srv._seat for srv in servers]
        chunk = seats[0].chunk
        assert all(seat.region is seats[0].region for seat in seats), "one chunk for all"
        assert sorted(seat.member for seat in seats) == list(range(CONNECTIONS))
        # the clients' own regions, the pool's and the chunk's: not one per server side
        assert _kernel(pid)["mr"] - kernel_before["mr"] == CONNECTIONS + 2
        shared = len(chunk.shared)
        assert shared == POOL.send_slots

        sends = [[asyncio.ensure_future(srv.send(_msg(k, i))) for i in range(MESSAGES)]
                 for k, srv in enumerate(servers)]
        await asyncio.sleep(0)  # the first sends post at once: beyond the reserves, borrowed
        lowest = len(chunk.shared)

        async def read_all(k: int) -> None:
            client = pairs[k][0]
            for i in range(MESSAGES):
                assert await asyncio.wait_for(client.recv(), STEP) == _msg(k, i), (k, i)

        async with asyncio.TaskGroup() as tg:
            for k in range(1, CONNECTIONS):
                tg.create_task(read_all(k))
        await asyncio.wait_for(asyncio.gather(*(f for fs in sends[1:] for f in fs)), STEP)
        assert lowest < shared, "no connection borrowed a shared slot"
        # The stalled connection's sender waits for credits; once its completions came it
        # holds no shared slot: every one is back.
        async with asyncio.timeout(STEP):
            while len(chunk.shared) < shared:
                await asyncio.sleep(0.01)
        assert not all(f.done() for f in sends[0]) and servers[0]._proto.queued > 0
        await read_all(0)
        await asyncio.wait_for(asyncio.gather(*sends[0]), STEP)
        async with asyncio.timeout(STEP):
            while len(chunk.shared) < shared:
                await asyncio.sleep(0.01)
    finally:
        await asyncio.gather(*(c.aclose() for c, _ in pairs), return_exceptions=True)
        s.done.set()
        await s.listener.aclose()
    assert pool.closed and not pool.send_arenas
    await kernel_back(pid, kernel_before, timeout=STEP)  # the chunk's region closed with its last connection
    await back(mine, timeout=STEP)
