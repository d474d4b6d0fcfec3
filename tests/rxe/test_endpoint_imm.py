"""Endpoints' RDMA WRITEs with immediate data (``post_write(..., imm=)``, ``recv_event()``,
``Config(immediates=True)``), on both verbs paths (compiled, pyverbs'): real endpoints on rxe."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiordma
from aiordma import Config, Immediate, LocalProtocolError, RemoteBuffer, RemoteProtocolError

from ..bounds import STEP
from .test_fastpath import PATHS, path, use_path  # noqa: F401  (fixtures)

# Its subject is the loop integration: both loops under `--loops one` too (tests/loops.py).
pytestmark = pytest.mark.both_loops


@asynccontextmanager
async def pair(device: object, server: Config,
               client: Config) -> AsyncIterator[tuple[aiordma.Endpoint, aiordma.Endpoint,
                                                      bytearray, RemoteBuffer]]:
    """A connected pair (client, served) and the served side's region the client may write
    (its bytes, and the client's view of it)."""
    served: asyncio.Queue[aiordma.Endpoint] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(ep: aiordma.Endpoint) -> None:
        await served.put(ep)
        await done.wait()

    async with await aiordma.listen(handler, "127.0.0.1", 0, device=device,
                                    config=server) as listener:
        c = await aiordma.connect("127.0.0.1", listener.port, timeout=STEP, device=device,
                                  config=client)
        try:
            s = await asyncio.wait_for(served.get(), STEP)
            region = bytearray(1 << 20)
            await s.send(msgpack.packb(s.register(region).expose(write=True).to_wire()))
            got = await asyncio.wait_for(c.recv(), STEP)
            assert got is not None
            yield c, s, region, RemoteBuffer.from_wire(msgpack.unpackb(got))
        finally:
            done.set()
            c.abort()


async def exchange(c: aiordma.Endpoint, s: aiordma.Endpoint, region: bytearray,
                   peer: RemoteBuffer, ops: list[tuple[str, int, int]]) -> None:
    """``ops`` from ``c`` (``("send", n, 0)``, ``("imm", n, value)``, ``("gather", n,
    value)``: a WRITE of ``n`` bytes, gathered from two slices for the last), read by ``s``
    with ``recv_event()``: every one in order, each WRITE's bytes in place when its value
    arrives."""
    total = sum(n + 8 for _, n, _ in ops)
    src_bytes = bytearray(os.urandom(total))
    src = c.register(src_bytes)
    expected: list[tuple[str, int, int, int]] = []  # (kind, at, n, value)

    async def read_all() -> None:
        for kind, at, n, value in expected:
            got = await asyncio.wait_for(s.recv_event(), STEP)
            if kind == "send":
                assert got == src_bytes[at:at + n]
            else:
                assert type(got) is Immediate, got
                assert (got.value, got.nbytes) == (value, n)
                assert region[at:at + n] == src_bytes[at:at + n]

    at = 0
    for kind, n, value in ops:
        expected.append((kind, at, n, value))
        at += n + 8
    reader = asyncio.ensure_future(read_all())
    acks = []
    for kind, at, n, value in expected:
        # Awaited in this task (no wait_for: no task of its own), so the operations that do
        # not suspend share a loop tick: the sends after a tick's first are held for its
        # end, and a WRITE posted meanwhile must still go behind them.
        async with asyncio.timeout(STEP):
            if kind == "send":
                await c.send(src_bytes[at:at + n])
            elif kind == "imm":
                acks.append(await c.post_write(src[at:at + n], peer[at:at + n], imm=value))
            else:
                h = n // 2
                acks.append(await c.post_write((src[at:at + h], src[at + h:at + n]),
                                               peer[at:at + n], imm=value))
    await asyncio.wait_for(reader, STEP)
    await asyncio.wait_for(asyncio.gather(*acks), STEP)
    assert s.stats().received == len(ops) and c.stats().sent == len(ops)


async def test_immediates_arrive_in_order_among_messages(rdma_device, path) -> None:  # noqa: F811
    """Messages, WRITEs with immediate data and gathered ones, interleaved past the 4 data
    credits (so reservations queue behind messages): the peer gets each in order, with its
    value (every bit) and length, the data in place."""
    values = [0, 1, 0xDEAD_BEEF, 0xFFFF_FFFF]
    ops = []
    for i in range(48):
        kind = ("send", "imm", "gather")[i % 3]
        ops.append((kind, 1 + (i * 977) % 9000, values[i % 4] if kind != "send" else 0))
    async with pair(rdma_device, Config(data_slots=4, immediates=True),
                    Config(data_slots=4)) as (c, s, region, peer):
        assert c._qp.compiled == (path == "compiled")
        await exchange(c, s, region, peer, ops)



async def test_a_write_posted_behind_held_sends_goes_behind_them(
        rdma_device, path) -> None:  # noqa: F811
    """Sends of one loop tick after its first are held for the tick's end; a WRITE with
    immediate data posted in that tick (credits to spare: it need not wait) posts them first,
    so the peer reads every message and immediate in the order they were asked for."""
    ops = [("send", 10, 0), ("send", 20, 0), ("send", 30, 0), ("imm", 40, 7),
           ("send", 50, 0), ("gather", 60, 8), ("send", 70, 0), ("imm", 80, 9)]
    async with pair(rdma_device, Config(data_slots=16, immediates=True),
                    Config(data_slots=16)) as (c, s, region, peer):
        await exchange(c, s, region, peer, ops)

@settings(max_examples=4, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["send", "imm", "gather"]),
                              st.integers(2, 9000), st.integers(0, 2**32 - 1)),
                    min_size=1, max_size=30),
       budget=st.sampled_from([0, 1 << 20]))
async def test_drawn_immediates_and_messages_on_both_paths(rdma_device, ops,
                                                           budget) -> None:
    """Drawn kinds, lengths and values, with and without a receive budget (without one, each
    immediate holds its slot until read): everything in order, on each path."""
    with pytest.MonkeyPatch.context() as mp:
        for p in PATHS:
            use_path(p, mp)
            async with pair(rdma_device, Config(data_slots=4, immediates=True,
                                                recv_buffer=budget),
                            Config(data_slots=4)) as (c, s, region, peer):
                await exchange(c, s, region, peer, ops)


async def test_recv_leaves_an_immediate_to_recv_event(rdma_device, path) -> None:  # noqa: F811
    async with pair(rdma_device, Config(immediates=True), Config()) as (c, s, region, peer):
        src = c.register(bytearray(b"abc"))
        await asyncio.wait_for(c.post_write(src.whole(), peer[0:3], imm=5), STEP)
        await asyncio.wait_for(c.send(b"after"), STEP)
        for _ in range(100):
            if s.stats().received == 2:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(LocalProtocolError, match="recv_event"):
            await asyncio.wait_for(s.recv(), STEP)
        with pytest.raises(LocalProtocolError, match="recv_event"):
            await asyncio.wait_for(s.recv_into(bytearray(10)), STEP)
        got = await asyncio.wait_for(s.recv_event(), STEP)
        assert type(got) is Immediate and (got.value, got.nbytes) == (5, 3)
        assert region[0:3] == b"abc"
        assert await asyncio.wait_for(s.recv_event(), STEP) == b"after"


async def test_an_immediate_to_an_endpoint_that_does_not_accept_them_breaks_it(
        rdma_device, path) -> None:  # noqa: F811
    """The peer broke the protocol: the endpoint fails with a RemoteProtocolError naming
    the immediate, on both paths (the compiled CQ driver's direct call passes the opcode)."""
    async with pair(rdma_device, Config(), Config()) as (c, s, _region, peer):
        assert s._qp.compiled == (path == "compiled")
        src = c.register(bytearray(b"x" * 64))
        await asyncio.wait_for(c.post_write(src.whole(), peer[0:64], imm=1), STEP)
        with pytest.raises(RemoteProtocolError, match="does not accept"):
            await asyncio.wait_for(s.recv(), STEP)


@pytest.mark.parametrize("bad", [-1, 1 << 32, True, 1.5, "1"])
async def test_bad_immediates_are_refused_typed_before_posting(rdma_device, bad) -> None:
    async with pair(rdma_device, Config(immediates=True), Config()) as (c, s, region, peer):
        src = c.register(bytearray(16))
        with pytest.raises(LocalProtocolError, match="imm"):
            await c.post_write(src.whole(), peer[0:16], imm=bad)
        with pytest.raises(LocalProtocolError, match="not both"):
            await c.post_write(src.whole(), peer[0:16], imm=1, notify=b"x")
        with pytest.raises(LocalProtocolError, match="two slices"):
            await c.post_write((src[0:4], src[4:8], src[8:16]), peer[0:16], imm=1)
        with pytest.raises(LocalProtocolError, match="remote range"):
            await c.post_write((src[0:4], src[4:8]), peer[0:16], imm=1)
        assert c.stats().sent == 0
        await asyncio.wait_for(c.send(b"still fine"), STEP)
        assert await asyncio.wait_for(s.recv_event(), STEP) == b"still fine"
        assert region[0:16] == bytes(16)
