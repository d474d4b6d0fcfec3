"""Endpoints on the shared receive pool (issue 37), over rxe: a listener with
``Config(receive_pool=True)`` takes the receives of every client that offers it from one shared
receive queue, and grants each connection data credits from it (the rules of
:mod:`aiordma.protocols.receive_pool`, carried by WANT/RECLAIM/RETURN frames); a client with it
with ``client_pool`` too takes its own receives from its event loop's pool the same way (without
it, a client only offers to follow the listener's pool, as before 2026-11-28). Bounded by
counts, never by time.

Every size class both ways (eager and rendezvous), on both posting paths; pipelined sends that
outnumber a connection's share; a reader that does not read while another connection on the
same pool keeps being served; many connections on one pool (one SRQ and one pool MR in the
kernel, and one MR for the send slots of 32 connections: a chunk of the pool's send arena) and the kernel's counts back to where
they were after the close; one connection's peer dying leaves the others serving; and the
negotiation: a pool only when both ends choose it.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

import aiordma
from aiordma import Config

from ..bounds import STEP
from .leaks import back, kernel_back, snapshot
from .test_fastpath import path  # noqa: F401  (the fixture: both posting paths)
from .test_receive_pool import _kernel  # (the kernel's counts, SRQs too)

POOL = Config(receive_pool=True, pool_buffers=256)
BOTH = Config(receive_pool=True, client_pool=True, pool_buffers=256)  # (a client's own, too)
SIZES = [0, 1, 100, 8192 - 12, 8192 - 11, 65536, 1 << 20]  # eager up to 8180 B, then rendezvous


class Served:
    """A listener whose handler hands each endpoint to the test and keeps it open."""

    def __init__(self) -> None:
        self.endpoints: asyncio.Queue[Any] = asyncio.Queue()
        self.done = asyncio.Event()
        self.listener: Any = None

    async def handler(self, ep: Any) -> None:
        await self.endpoints.put(ep)
        await self.done.wait()

    async def next(self) -> Any:
        return await asyncio.wait_for(self.endpoints.get(), STEP)


@pytest.fixture
async def served(rdma_device: Any) -> AsyncIterator[Served]:
    s = Served()
    s.listener = await aiordma.listen(s.handler, "127.0.0.1", 0, device=rdma_device,
                                      config=POOL)
    yield s
    s.done.set()
    await s.listener.aclose()


async def _connect(served: Served, device: Any, config: Config = POOL) -> tuple[Any, Any]:
    client = await aiordma.connect("127.0.0.1", served.listener.port, timeout=STEP,
                                   device=device, config=config, transport="rdma")
    return client, await served.next()


async def _every_size_both_ways(a: Any, b: Any) -> None:
    """Each size of SIZES from ``a`` to ``b`` and back, reversed, intact."""
    for size in SIZES:
        msg = os.urandom(size)
        await a.send(msg)
        assert await asyncio.wait_for(b.recv(), STEP) == msg
        await b.send(msg[::-1])
        assert await asyncio.wait_for(a.recv(), STEP) == msg[::-1]


async def _pipelined(sender: Any, receiver: Any, n: int) -> None:
    """``n`` messages of a few sizes sent at once by ``sender``, read in order by
    ``receiver``, intact."""
    msgs = [i.to_bytes(4, "little") * (1 + i % 50) for i in range(n)]
    sends = asyncio.gather(*(sender.send(m) for m in msgs))
    got = [await asyncio.wait_for(receiver.recv(), STEP) for _ in range(n)]
    await asyncio.wait_for(sends, STEP)
    assert got == msgs


@pytest.mark.parametrize("client_pool", [True, False], ids=["both-pooled", "listener-pooled"])
async def test_every_size_class_both_ways_on_the_pool(served: Served, rdma_device: Any,
                                                      path: str,  # noqa: F811
                                                      client_pool: bool) -> None:
    client, server = await _connect(served, rdma_device, BOTH if client_pool else POOL)
    try:
        assert server._pool is not None  # the listener's receives
        assert (client._pool is not None) is client_pool  # and the client's, its loop's pool
        assert client._peer_pool and server._peer_pool is client_pool
        assert client._proto.credits.data_credits == server._proto.credits.peer_data_credits
        assert server._proto.credits.data_credits == client._proto.credits.peer_data_credits
        await _every_size_both_ways(client, server)
        pool = server._pool  # (the client's too, when pooled: one per loop and device)
        assert client._pool in (None, pool)
        assert pool.posted == pool.buffers  # every slot back in the queue
    finally:
        await client.aclose()


async def test_pipelined_sends_beyond_the_share(served: Served, rdma_device: Any) -> None:
    client, server = await _connect(served, rdma_device,
                                    Config(receive_pool=True, recv_buffer=0))
    n = 3 * server._pool.rules.share_max  # more than the connection may have outstanding
    try:
        await _pipelined(client, server, n)
        assert client._proto.sent == n and server._proto.delivered == n
    finally:
        await client.aclose()


async def test_a_slow_reader_holds_its_share_and_others_are_served(served: Served,
                                                                   rdma_device: Any) -> None:
    slow_cfg = Config(receive_pool=True)
    slow, slow_server = await _connect(served, rdma_device, slow_cfg)
    other, other_server = await _connect(served, rdma_device)
    pool, rules = slow_server._pool, slow_server._pool.rules
    share = rules.share_max
    # The listener buffers nothing for the slow connection: its frames stay in pool slots.
    slow_server._proto.recv_budget = 0
    n = 2 * share
    try:
        sends = [asyncio.ensure_future(slow.send(bytes([i % 256]) * 64)) for i in range(n)]
        async with asyncio.timeout(STEP):  # the slow connection fills its share, no more
            while rules._conns[slow_server._qp.qp_num].held < share:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        held = rules._conns[slow_server._qp.qp_num]
        assert held.held + held.outstanding <= share and not all(s.done() for s in sends)
        for i in range(4 * share):  # the other connection on the same pool keeps going
            await other.send(i.to_bytes(4, "little"))
            assert await asyncio.wait_for(other_server.recv(), STEP) == i.to_bytes(4, "little")
        assert other_server._pool is pool
        got = [await asyncio.wait_for(slow_server.recv(), STEP) for _ in range(n)]
        assert got == [bytes([i % 256]) * 64 for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*sends), STEP)
    finally:
        await slow.aclose()
        await other.aclose()


N = 32  # connections on one pool


@pytest.mark.parametrize("client_pool", [True, False], ids=["both-pooled", "listener-pooled"])
async def test_many_connections_share_one_pool_and_release_it(rdma_device: Any,
                                                              client_pool: bool) -> None:
    config = BOTH if client_pool else POOL
    pid = os.getpid()
    s = Served()
    s.listener = await aiordma.listen(s.handler, "127.0.0.1", 0, device=rdma_device,
                                      config=POOL)
    pairs: list[tuple[Any, Any]] = []
    try:
        # warm-up: the loop's first connection opens what stays (the device, loop fds)
        client, server = await _connect(s, rdma_device, config)
        await client.aclose()
        await server.aclose()
        # what earlier tests of this process left to the collector is freed now, not between
        # the baseline and the counts below (test_send_arena's count once came out 3 short)
        gc.collect()
        kernel_before = _kernel(pid)
        mine = await snapshot()
        for _ in range(N):
            pairs.append(await _connect(s, rdma_device, config))
        pool = pairs[0][1]._pool
        assert all(srv._pool is pool for _, srv in pairs)
        assert all(c._pool is (pool if client_pool else None) for c, _ in pairs)
        # one SRQ (both ends in one loop: one pool); per connection 2 QPs; the pool's one MR
        # and one per chunk of the send arena (32 senders each); a client not pooled: its MR
        now = _kernel(pid)
        chunks = 2 if client_pool else 1
        assert now["srq"] - kernel_before["srq"] == 1
        assert now["qp"] - kernel_before["qp"] == 2 * N
        assert now["mr"] - kernel_before["mr"] == 1 + chunks + (0 if client_pool else N)
        assert [a.chunks for a in pool.send_arenas.values()] == [chunks]

        async def echo(i: int, client: Any, server: Any) -> None:
            for r in range(8):
                msg = (i * 100 + r).to_bytes(4, "little") * 16
                await client.send(msg)
                assert await asyncio.wait_for(server.recv(), STEP) == msg
                await server.send(msg)
                assert await asyncio.wait_for(client.recv(), STEP) == msg

        async with asyncio.TaskGroup() as tg:
            for i, (c, srv) in enumerate(pairs):
                tg.create_task(echo(i, c, srv))
        assert pool.received >= 8 * N
    finally:
        await asyncio.gather(*(c.aclose() for c, _ in pairs), return_exceptions=True)
        s.done.set()
        await s.listener.aclose()
    assert pool.closed  # the last connection's close closed the pool, after its queue pairs
    await kernel_back(pid, kernel_before, timeout=STEP)
    await back(mine, timeout=STEP)


async def test_one_peer_dying_leaves_the_others_serving(served: Served,
                                                        rdma_device: Any) -> None:
    pairs = [await _connect(served, rdma_device) for _ in range(4)]
    try:
        dead_client, dead_server = pairs[1]
        pending = asyncio.ensure_future(dead_server.recv())
        await dead_client.send(b"last words")
        assert await asyncio.wait_for(pending, STEP) == b"last words"
        pending = asyncio.ensure_future(dead_server.recv())
        dead_client.abort()  # its process might as well have died: the socket closes
        with pytest.raises(aiordma.BrokenResourceError):
            await asyncio.wait_for(pending, STEP)
        for i, (c, srv) in enumerate(pairs):
            if i == 1:
                continue
            for r in range(3 * srv._pool.rules.share_max):
                await c.send(bytes([i, r % 256]))
                assert await asyncio.wait_for(srv.recv(), STEP) == bytes([i, r % 256])
        pool = pairs[0][1]._pool
        assert not dead_server._pool_slots  # the slots it held went back at the failure
        await dead_server.aclose()  # and its credits and reserve at the close
        assert dead_server._qp.qp_num not in pool.rules._conns and not pool.closed
    finally:
        await asyncio.gather(*(c.aclose() for c, _ in pairs), return_exceptions=True)


async def test_a_refused_access_breaks_both_ends_of_a_pooled_connection(
        served: Served, rdma_device: Any) -> None:
    """A WRITE through a forged writable descriptor of memory the listener's side exposed
    read-only: the device refuses it, the client's WRITE fails ``RemoteAccessError``, and the
    refusal puts the listener's queue pair in the error state too. That queue pair has no
    receives of its own to flush (they are the pool's), so the listener's endpoint hears of
    it from the client's end of the control channel: its idle receive fails
    ``BrokenResourceError``. Before 2026-11-27 it heard nothing until the client closed.
    Another connection on the pool keeps being served."""
    client, server = await _connect(served, rdma_device)
    other, other_server = await _connect(served, rdma_device)
    try:
        region = server.register(bytearray(4096))
        exp = await asyncio.wait_for(server.expose(region[0:4096], read=True), STEP)
        forged = aiordma.RemoteBuffer(address=exp.remote.address, rkey=exp.remote.rkey,
                                      length=64, writable=True)
        pending = asyncio.ensure_future(server.recv())
        with pytest.raises(aiordma.RemoteAccessError):
            await asyncio.wait_for(client.write(client.register(bytearray(range(64)))[0:64],
                                                forged), STEP)
        with pytest.raises(aiordma.BrokenResourceError):
            await asyncio.wait_for(pending, STEP)
        assert bytes(region.view) == bytes(4096)  # nothing written
        assert exp.revoked or server.broken  # catalogue
        for r in range(2 * other_server._pool.rules.share_max):
            await other.send(bytes([r % 256]) * 100)
            assert await asyncio.wait_for(other_server.recv(), STEP) == bytes([r % 256]) * 100
    finally:
        await asyncio.gather(client.aclose(), other.aclose(), return_exceptions=True)


@pytest.mark.parametrize(("client_pool", "server_pool"), [(True, False), (False, True)])
async def test_a_pool_only_when_both_ends_choose_it(rdma_device: Any, client_pool: bool,
                                                    server_pool: bool) -> None:
    """The listener's pool only when both choose it; a client's own receives only with
    client_pool too."""
    s = Served()
    s.listener = await aiordma.listen(s.handler, "127.0.0.1", 0, device=rdma_device,
                                      config=Config(receive_pool=server_pool))
    try:
        client, server = await _connect(s, rdma_device, Config(receive_pool=client_pool))
        try:
            assert server._pool is None and not client._peer_pool
            assert client._pool is None and not server._peer_pool
            await client.send(b"x" * 100)
            assert await asyncio.wait_for(server.recv(), STEP) == b"x" * 100
        finally:
            await client.aclose()
    finally:
        s.done.set()
        await s.listener.aclose()


async def test_a_clients_pool_with_a_listener_that_has_none(rdma_device: Any) -> None:
    """A client with client_pool takes its receives from its loop's pool whatever the
    listener chooses: the listener, on slots of its own, follows that pool's grants."""
    s = Served()
    s.listener = await aiordma.listen(s.handler, "127.0.0.1", 0, device=rdma_device,
                                      config=Config(receive_pool=False))
    try:
        client, server = await _connect(s, rdma_device, BOTH)
        try:
            assert client._pool is not None and server._pool is None
            assert server._peer_pool and not client._peer_pool
            await _every_size_both_ways(server, client)
            pool = client._pool
            # pipelined beyond its share of the client's pool
            await _pipelined(server, client, 3 * pool.rules.share_max)
        finally:
            await client.aclose()
        assert pool.closed  # its only user closed
    finally:
        s.done.set()
        await s.listener.aclose()


async def test_the_environment_switch_turns_the_default_on(rdma_device: Any,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setenv("AIORDMA_RECEIVE_POOL", "1")  # (how the endpoint suite runs on a pool)
    assert Config().receive_pool
    s = Served()
    s.listener = await aiordma.listen(s.handler, "127.0.0.1", 0, device=rdma_device)
    try:
        client, server = await _connect(s, rdma_device, Config())
        try:
            assert server._pool is not None and client._peer_pool
            assert client._pool is None and not server._peer_pool  # (client_pool: off)
        finally:
            await client.aclose()
    finally:
        s.done.set()
        await s.listener.aclose()
