"""Two-sided SEND and one-sided RDMA WRITE/READ/atomics through the completion reactor.

Real verbs on a real device: two RC queue pairs on one rxe (or NIC) port, connected to each
other in this process, completions delivered by the completion channel fd in the event loop.
Each test runs on the default asyncio loop and on uvloop (see tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import gc
import random
import weakref

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from aiordma import ClosedResourceError, LocalProtocolError, RemoteAccessError
from aiordma.lowlevel import MemoryRegion, RemoteBuffer

from ..bounds import STEP

# Its subject is the loop integration: both loops under `--loops one` too (tests/loops.py).
pytestmark = pytest.mark.both_loops

# 0..64 KiB, with the edges around rxe's 1024-byte MTU and page sizes drawn often.
EDGES = [0, 1, 63, 64, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 65535, 65536]
SIZES = st.one_of(st.sampled_from(EDGES), st.integers(0, 65536))


@given(size=SIZES, seed=st.integers(0, 2**32 - 1))
@example(size=1024, seed=1).via("MTU edge")
@example(size=1025, seed=2).via("MTU edge")
@example(size=0, seed=3).via("empty")
async def test_send_delivers_every_byte(pair, size: int, seed: int) -> None:
    data = random.Random(seed).randbytes(size)
    src = MemoryRegion(pair.device, bytearray(data))
    dst = MemoryRegion(pair.device, bytearray(size + 8))  # room to spare: byte_len must be exact
    try:
        got = pair.b.recv_future(dst.whole())
        await asyncio.wait_for(pair.a.send(src.whole()), STEP)
        wc = await asyncio.wait_for(got, STEP)
        assert wc.byte_len == size
        assert bytes(dst.view[:size]) == data
        assert bytes(dst.view[size:]) == bytes(8)
    finally:
        src.close()
        dst.close()


@given(size=SIZES, offset=st.integers(0, 64), seed=st.integers(0, 2**32 - 1))
@example(size=1023, offset=0, seed=1).via("MTU edge")
@example(size=1025, offset=7, seed=2).via("MTU edge, unaligned")
async def test_rdma_write_lands_byte_for_byte(pair, size: int, offset: int, seed: int) -> None:
    data = random.Random(seed).randbytes(size)
    src = MemoryRegion(pair.device, bytearray(data))
    target = bytearray(b"\xee" * (size + 128))
    dst = MemoryRegion(pair.device, target, remote_write=True)
    try:
        desc = dst.expose(write=True)[offset:offset + size]
        await asyncio.wait_for(pair.a.write(src.whole(), desc), STEP)
        assert bytes(target[offset:offset + size]) == data
        # nothing outside the range was touched
        assert target[:offset] == b"\xee" * offset
        assert target[offset + size:] == b"\xee" * (128 - offset)
    finally:
        src.close()
        dst.close()


@given(size=SIZES, seed=st.integers(0, 2**32 - 1))
async def test_rdma_read_fetches_byte_for_byte(pair, size: int, seed: int) -> None:
    data = random.Random(seed).randbytes(size)
    exposed = MemoryRegion(pair.device, bytearray(data), remote_read=True)
    dst = MemoryRegion(pair.device, bytearray(size))
    try:
        await asyncio.wait_for(pair.a.read(dst.whole(), exposed.expose(read=True)), STEP)
        assert bytes(dst.view) == data
    finally:
        exposed.close()
        dst.close()


async def test_atomics_fetch_add_and_compare_swap(pair) -> None:
    counter = bytearray(16)
    target = MemoryRegion(pair.device, counter, remote_write=True, atomic=True)
    result = MemoryRegion(pair.device, bytearray(8))
    word = target.expose(atomic=True)[8:16]
    old = await asyncio.wait_for(pair.a.fetch_add(result.whole(), word, 5), STEP)
    assert old == 0 and int.from_bytes(counter[8:], "little") == 5
    old = await asyncio.wait_for(pair.a.fetch_add(result.whole(), word, 2**64 - 1), STEP)
    assert old == 5 and int.from_bytes(counter[8:], "little") == 4  # wraps modulo 2**64
    old = await asyncio.wait_for(pair.a.compare_swap(result.whole(), word, 3, 99), STEP)
    assert old == 4 and int.from_bytes(counter[8:], "little") == 4  # no swap: expected != 4
    old = await asyncio.wait_for(pair.a.compare_swap(result.whole(), word, 4, 99), STEP)
    assert old == 4 and int.from_bytes(counter[8:], "little") == 99
    assert counter[:8] == bytes(8)


async def test_misaligned_atomic_is_refused_before_posting(pair) -> None:
    target = MemoryRegion(pair.device, bytearray(16), remote_write=True, atomic=True)
    result = MemoryRegion(pair.device, bytearray(8))
    posted = pair.reactor.pending
    with pytest.raises(LocalProtocolError, match="aligned"):
        await pair.a.fetch_add(result.whole(), target.expose(atomic=True)[4:12], 1)
    assert pair.reactor.pending == posted


async def test_wrong_rkey_is_a_remote_access_error(pair) -> None:
    dst = MemoryRegion(pair.device, bytearray(64), remote_write=True)
    src = MemoryRegion(pair.device, bytearray(b"z" * 64))
    good = dst.expose(write=True)
    bad = RemoteBuffer(address=good.address, rkey=good.rkey ^ 0x5A5A00, length=64, writable=True)
    with pytest.raises(RemoteAccessError) as info:
        await asyncio.wait_for(pair.a.write(src.whole(), bad), STEP)
    assert info.value.status_name in ("IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR")
    assert bytes(dst.view) == bytes(64)


async def test_a_closed_region_lets_its_buffer_go(pair) -> None:
    """A buffer made for a region (an endpoint's slots, a group's buffers) goes when the
    region closes, though the region itself is still referenced."""
    buf = np.zeros(8192, np.uint8)
    gone = weakref.ref(buf)
    region = MemoryRegion(pair.device, buf)
    del buf
    gc.collect()
    assert gone() is not None  # held while registered
    region.close()
    gc.collect()
    assert gone() is None and region.closed and region.obj is None


async def test_close_wakes_a_pending_receive_with_closed_error(pair) -> None:
    dst = MemoryRegion(pair.device, bytearray(64))
    fut = pair.b.recv_future(dst.whole())
    await asyncio.sleep(0)
    pair.reactor.close()
    with pytest.raises(ClosedResourceError):
        await asyncio.wait_for(fut, STEP)
    pair.reactor.close()  # idempotent


async def test_many_sends_in_flight_complete_in_order(pair) -> None:
    n, size = 64, 100
    srcs = [MemoryRegion(pair.device, bytearray(bytes([i]) * size)) for i in range(n)]
    dsts = [MemoryRegion(pair.device, bytearray(size)) for _ in range(n)]
    recvs = [pair.b.recv_future(d.whole()) for d in dsts]
    await asyncio.wait_for(asyncio.gather(*(pair.a.send(s.whole()) for s in srcs)), STEP)
    wcs = await asyncio.wait_for(asyncio.gather(*recvs), STEP)
    assert [wc.byte_len for wc in wcs] == [size] * n
    # receives complete in posting order, so message i lands in buffer i
    assert [d.view[0] for d in dsts] == list(range(n))
