"""RDMA WRITE with immediate data, and a WRITE posted with the message announcing it as one
chain, on both verbs paths (compiled, pyverbs'): real queue pairs and endpoints on rxe."""

from __future__ import annotations

import asyncio
import os
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiordma
from aiordma import Config, LocalProtocolError, RemoteBuffer
from aiordma.lowlevel import CompletionReactor, MemoryRegion, connect_pair

from ..bounds import STEP
from .test_fastpath import PATHS, loop_on, path, use_path  # noqa: F401  (fixtures)

# Its subject is the loop integration: both loops under `--loops one` too (tests/loops.py).
pytestmark = pytest.mark.both_loops


async def test_writes_with_imm_land_and_their_values_arrive(loop_on) -> None:  # noqa: F811
    """Each WRITE with ``imm`` consumes one posted receive, whose completion carries the value
    (host order, every bit kept) and the WRITE's byte count; the receive buffer stays as it
    was. A SEND among them completes its receive without a value."""
    lo, device = loop_on, loop_on.reactor.device
    values = [0, 1, 0x1234_5678, 0xDEAD_BEEF, 0xFFFF_FFFF, 7]
    size = 256
    dst = MemoryRegion(device, bytearray(size * len(values)), remote_write=True)
    remote = dst.expose(write=True)
    src = MemoryRegion(device, bytearray(os.urandom(size * len(values))))
    recv = MemoryRegion(device, bytearray(b"\x55" * 64 * (len(values) + 1)))
    receives = [asyncio.ensure_future(lo.b.recv_with_imm(recv[64 * i:64 * i + 64]))
                for i in range(len(values) + 1)]
    for i, v in enumerate(values):
        at = i * size
        n = size - i  # (lengths differ: the byte count is the WRITE's own)
        await asyncio.wait_for(lo.a.write(src[at:at + n], remote[at:at + n], imm=v), STEP)
    await asyncio.wait_for(lo.a.send(src[0:10]), STEP)
    got = [await asyncio.wait_for(r, STEP) for r in receives]
    assert got[:-1] == [(size - i, v) for i, v in enumerate(values)]
    assert got[-1] == (10, None)
    for i in range(len(values)):
        at = i * size
        n = size - i
        assert bytes(dst.view[at:at + n]) == bytes(src.view[at:at + n])
    assert bytes(recv.view[:64 * len(values)]) == b"\x55" * 64 * len(values)
    assert bytes(recv.view[64 * len(values):64 * len(values) + 10]) == bytes(src.view[0:10])


@pytest.mark.parametrize("bad", [-1, 1 << 32, True, 1.5, "1", b"\x01"])
async def test_a_bad_imm_is_refused_typed_before_posting(loop_on, bad) -> None:  # noqa: F811
    device, r = loop_on.reactor.device, loop_on.reactor
    dst = MemoryRegion(device, bytearray(64), remote_write=True)
    src = MemoryRegion(device, bytearray(b"x" * 64))
    with pytest.raises(LocalProtocolError, match="imm"):
        await loop_on.a.write(src.whole(), dst.expose(write=True), imm=bad)
    assert r.pending == 0  # nothing was posted
    assert bytes(dst.view) == bytes(64)


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=12),
       seed=st.integers(0, 2**16))
async def test_drawn_writes_with_imm_on_both_paths(rdma_device, sizes, seed) -> None:
    """Drawn lengths (past one MTU and one 8 KiB slot), drawn values: each receive gets its
    WRITE's count and value, in order, and the bytes land, on each path."""
    rnd = random.Random(seed)
    values = [rnd.getrandbits(32) for _ in sizes]
    with pytest.MonkeyPatch.context() as mp:
        for p in PATHS:
            use_path(p, mp)
            reactor = CompletionReactor(rdma_device)
            try:
                a, b = connect_pair(rdma_device, reactor)
                assert a.compiled == (p == "compiled")
                total = sum(sizes)
                dst = MemoryRegion(rdma_device, bytearray(total), remote_write=True)
                remote = dst.expose(write=True)
                src = MemoryRegion(rdma_device, bytearray(rnd.randbytes(total)))
                sink = MemoryRegion(rdma_device, bytearray(8))
                receives = [asyncio.ensure_future(b.recv_with_imm(sink.whole())) for _ in sizes]
                at = 0
                for n, v in zip(sizes, values, strict=True):
                    await asyncio.wait_for(a.write(src[at:at + n], remote[at:at + n], imm=v),
                                           STEP)
                    at += n
                got = [await asyncio.wait_for(r, STEP) for r in receives]
                assert got == list(zip(sizes, values, strict=True))
                assert bytes(dst.view) == bytes(src.view)
            finally:
                reactor.close()


async def test_post_write_chained_with_its_message_keeps_the_order(
        rdma_device, path) -> None:  # noqa: F811
    """post_write with ``notify`` (one chain when a credit is free, the WRITE alone and the
    message queued when not: 4 data slots make both happen) and plain sends, interleaved:
    the peer gets every message in the order sent, each WRITE's data in place before its
    message."""
    config = Config(data_slots=4)
    served: asyncio.Queue[aiordma.Endpoint] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(ep: aiordma.Endpoint) -> None:
        await served.put(ep)
        await done.wait()

    n, size = 60, 3000
    async with await aiordma.listen(handler, "127.0.0.1", 0, device=rdma_device,
                                    config=config) as listener:
        c = await aiordma.connect("127.0.0.1", listener.port, timeout=STEP, device=rdma_device,
                                  config=config)
        try:
            assert c._qp.compiled == (path == "compiled")
            s = await asyncio.wait_for(served.get(), STEP)
            region = bytearray(n * size)
            await s.send(msgpack.packb(s.register(region).expose(write=True).to_wire()))
            peer = RemoteBuffer.from_wire(msgpack.unpackb(await c.recv()))
            src = c.register(bytearray(os.urandom(n * size)))

            async def read_all() -> None:
                for i in range(n):
                    got = await asyncio.wait_for(s.recv(), STEP)
                    assert got is not None
                    kind, k = got[:1], int.from_bytes(got[1:], "little")
                    assert k == i
                    if kind == b"w":
                        assert region[i * size:(i + 1) * size] == src.view[i * size:
                                                                            (i + 1) * size]
                    else:
                        assert kind == b"s"

            reader = asyncio.ensure_future(read_all())
            acks = []
            for i in range(n):
                tag = i.to_bytes(4, "little")
                if i % 3 == 2:
                    await asyncio.wait_for(c.send(b"s" + tag), STEP)
                else:
                    acks.append(await asyncio.wait_for(c.post_write(
                        src[i * size:(i + 1) * size], peer[i * size:(i + 1) * size],
                        notify=b"w" + tag), STEP))
            await asyncio.wait_for(reader, STEP)
            await asyncio.wait_for(asyncio.gather(*acks), STEP)
        finally:
            done.set()
            c.abort()
