"""Fault catalogue, item 3: wrong keys, out-of-bounds addresses, and local misuse.

The target memory is in another process (``peer_process.py``: a 64 KiB region exposed for
read, write and atomics). A forged descriptor (wrong rkey, an address before or past the
region) gives a :class:`~aiordma.RemoteAccessError` on that endpoint only: it is broken, the
peer's memory is untouched, and another connection to the same process keeps working. Local
misuse is refused with a typed error before anything is posted (the reactor's count of posted
work requests does not move) and leaves the endpoint usable.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

import aiordma
from aiordma import (
    BrokenResourceError,
    ClosedResourceError,
    LocalProtocolError,
    RemoteAccessError,
    RemoteBuffer,
)

from ..bounds import STEP
from .peers import KillablePeer, killable_peer

# the kernel's, the fds' and aiordma's counts are back after each test (conftest.py)
pytestmark = pytest.mark.usefixtures("no_leaks")

REGION = 1 << 16  # peer_process.py's exposed region


@pytest.fixture(scope="module")
def peer(rdma_device: Any) -> Iterator[KillablePeer]:
    """One peer process for the module (its start-up costs seconds in the VM)."""
    with killable_peer() as p:
        yield p


async def open_to(peer: KillablePeer, device: Any) -> tuple[aiordma.Endpoint, RemoteBuffer]:
    ep = await aiordma.connect("127.0.0.1", peer.port, timeout=STEP, device=device)
    desc = RemoteBuffer.from_wire(msgpack.unpackb(await asyncio.wait_for(ep.recv(), STEP)))
    return ep, desc


async def peer_bytes(ep: aiordma.Endpoint, offset: int, n: int) -> bytes:
    """The peer's region[offset:offset + n], as the peer itself reads it (tag 1)."""
    await asyncio.wait_for(ep.send(b"\x01" + offset.to_bytes(4, "little")
                                   + n.to_bytes(4, "little")), STEP)
    return bytes(await asyncio.wait_for(ep.recv(), STEP))


def forge(desc: RemoteBuffer, fault: str, op: str) -> RemoteBuffer:
    """An 8-byte-aligned, 64-byte descriptor that the peer never granted (an atomic uses its
    first 8 bytes)."""
    address, rkey = desc.address + 64, desc.rkey
    if fault == "wrong rkey":
        rkey ^= 0x00FF00
    elif fault == "past the end":  # a READ/WRITE straddles the end, an atomic starts at it
        address = desc.address + (REGION - 32 if op in ("read", "write") else REGION)
    elif fault == "far past the end":
        address = desc.address + (1 << 30)
    elif fault == "before the start":
        address = desc.address - 64
    address -= address % 8  # atomics need it: the fault must be the key or the range
    return RemoteBuffer(address=address, rkey=rkey, length=64, readable=True, writable=True,
                        atomic=True)


FAULTS = ["wrong rkey", "past the end", "far past the end", "before the start"]
OPS = ["write", "read", "fetch_add"]  # compare_swap takes the same path as fetch_add


async def run_op(ep: aiordma.Endpoint, op: str, local: Any, remote: RemoteBuffer) -> None:
    if op == "write":
        await ep.write(local[0:64], remote)
    elif op == "read":
        await ep.read(local[0:64], remote)
    elif op == "fetch_add":
        await ep.fetch_add(remote[0:8], 1)
    else:
        await ep.compare_swap(remote[0:8], expected=0, new=1)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", OPS)
async def test_a_forged_descriptor_breaks_only_that_endpoint(peer: KillablePeer, rdma_device: Any,
                                                             op: str, fault: str) -> None:
    bystander, desc = await open_to(peer, rdma_device)
    victim, _ = await open_to(peer, rdma_device)
    try:
        before = await peer_bytes(bystander, 0, REGION)
        local = victim.register(bytearray(os.urandom(64)))
        with pytest.raises(RemoteAccessError) as info:
            await asyncio.wait_for(run_op(victim, op, local, forge(desc, fault, op)), STEP)
        assert info.value.status_name in ("IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR",
                                          "IBV_WC_REM_OP_ERR"), info.value
        assert victim.broken
        with pytest.raises(BrokenResourceError):  # the whole endpoint is broken, typed
            await asyncio.wait_for(victim.send(b"\x00after"), STEP)
        with pytest.raises(BrokenResourceError):
            await asyncio.wait_for(victim.read(local[0:8], desc[0:8]), STEP)
        # the peer's memory is untouched and the other connection is fine: a message, a good
        # one-sided write and read through it
        assert await peer_bytes(bystander, 0, REGION) == before
        await asyncio.wait_for(bystander.send(b"\x00still here"), STEP)
        assert await asyncio.wait_for(bystander.recv(), STEP) == b"\x00still here"
        mine = bystander.register(bytearray(os.urandom(64)))
        await asyncio.wait_for(bystander.write(mine[0:64], desc[128:192]), STEP)
        assert await peer_bytes(bystander, 128, 64) == bytes(mine.view)
    finally:
        victim.abort()
        await asyncio.wait_for(bystander.aclose(), STEP)


async def test_local_misuse_is_refused_before_posting(peer: KillablePeer,
                                                      rdma_device: Any) -> None:
    ep, desc = await open_to(peer, rdma_device)
    try:
        mr = ep.register(bytearray(256))
        readonly = ep.register(b"\x00" * 64)
        closed = ep.register(bytearray(64))
        closed.close()
        read_only_desc = RemoteBuffer(address=desc.address, rkey=desc.rkey, length=REGION,
                                      readable=True)
        write_only_desc = RemoteBuffer(address=desc.address, rkey=desc.rkey, length=REGION,
                                       writable=True)
        cases: list[tuple[str, Any, type[Exception]]] = [
            ("misaligned atomic", lambda: ep.fetch_add(desc[4:12], 1), LocalProtocolError),
            ("misaligned compare-swap",
             lambda: ep.compare_swap(desc[9:17], expected=0, new=1), LocalProtocolError),
            ("atomic on 4 bytes", lambda: ep.fetch_add(desc[0:4], 1), LocalProtocolError),
            ("atomic without atomic access", lambda: ep.fetch_add(read_only_desc[0:8], 1),
             LocalProtocolError),
            ("write to a read-only descriptor",
             lambda: ep.write(mr[0:64], read_only_desc[0:64]), LocalProtocolError),
            ("read from a write-only descriptor",
             lambda: ep.read(mr[0:64], write_only_desc[0:64]), LocalProtocolError),
            ("length mismatch", lambda: ep.write(mr[0:64], desc[0:65]), LocalProtocolError),
            ("read into read-only memory",
             lambda: ep.read(readonly[0:64], desc[0:64]), LocalProtocolError),
            ("unregistered buffer as the source",
             lambda: ep.write(bytearray(64), desc[0:64]), LocalProtocolError),  # type: ignore[arg-type]
            ("deregistered region as the source",
             lambda: ep.write(closed[0:64], desc[0:64]), (LocalProtocolError,
                                                          ClosedResourceError)),
            ("deregistered region as the destination",
             lambda: ep.read(closed[0:64], desc[0:64]), (LocalProtocolError,
                                                         ClosedResourceError)),
        ]
        posted = ep._reactor.pending  # work requests posted and not completed
        for what, call, error in cases:
            with pytest.raises(error):  # type: ignore[call-overload]
                await asyncio.wait_for(call(), STEP)
            assert ep._reactor.pending == posted, f"{what}: something was posted"
            assert not ep.broken and not ep.closed, f"{what} broke the endpoint"
        # slicing past a descriptor or a region is refused when the slice is taken
        for what, make in [("descriptor past its end", lambda: desc[0:REGION + 1]),
                           ("descriptor before its start", lambda: desc[-8:4]),
                           ("descriptor with a step", lambda: desc[0:64:2]),
                           ("region past its end", lambda: mr[0:257]),
                           ("region with a negative start", lambda: mr[-1:8])]:
            with pytest.raises(LocalProtocolError):
                make()
        # still usable: a real write and read round trip through the same endpoint
        mr.view[:64] = os.urandom(64)
        await asyncio.wait_for(ep.write(mr[0:64], desc[256:320]), STEP)
        await asyncio.wait_for(ep.read(mr[64:128], desc[256:320]), STEP)
        assert mr.view[64:128] == mr.view[:64]
    finally:
        await asyncio.wait_for(ep.aclose(), STEP)
