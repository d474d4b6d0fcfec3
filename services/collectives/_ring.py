"""The data plane of a group: a ring of endpoints, receive slots, and the four algorithms.

Every rank holds two endpoints: ``right`` (to ``rank + 1``) and ``left`` (from ``rank - 1``).
Data flows rightwards only.

Slots and credits
    Each rank registers one receive buffer of ``slots`` slots of ``slot_bytes`` bytes, exposed
    for remote write to its left neighbour (sent once, as :class:`aiordma.protocols.collectives.Slots`).
    A writer owns one credit per slot: it writes a piece (at most one slot) with ``ep.write``,
    which returns once the neighbour acknowledged the data, then sends a small ``Piece``
    message saying where it is; slots are used round-robin. The reader consumes pieces in order
    (copies or reduces them out of the slot) and returns a ``Credit``. The buffers are
    registered once per group, whatever the collectives' sizes.

Work buffer
    A collective first copies its input into a registered *work* buffer (grown geometrically
    when a larger call comes, otherwise reused): RDMA WRITEs come from there, received pieces go
    there, and the result is copied out. So any array works (non-contiguous, any byte order,
    0-d, empty), the caller's memory is never registered, and a cancelled collective cannot
    leave the NIC writing into it.

Concurrency
    A collective runs a *sender* and a *receiver* task side by side. The receiver never waits
    for the sender: it frees every slot as soon as it has copied or reduced it, so data keeps
    moving round the ring and there is no circular wait, whatever the array size. The sender
    waits for the receiver's progress where the algorithm needs it (ring step ``t`` sends what
    step ``t - 1`` received; a broadcast forwards a byte range once it has arrived).

Each writer splits data by the *receiver's* slot size; the receiver does the same with its
own, so both agree on the pieces without further messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np

from aiordma import (
    BrokenResourceError,
    Endpoint,
    MemoryRegion,
    RemoteBuffer,
    RemoteProtocolError,
)
from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import ProtocolError

from ._errors import CollectiveMismatchError

__all__ = ["REDUCE_OPS", "Ring"]

#: The reduction ops of ``allreduce`` and the numpy ufuncs that implement them.
REDUCE_OPS: dict[str, np.ufunc] = {
    "sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
}
_ALIGN = 64  # blocks in the work buffer start on 64-byte boundaries
_LEFT_GONE = ("PEER_CLOSED", "CLOSED")  # endpoint states once the peer closed gracefully


class _Progress:
    """A counter that tasks can wait on (how far the receiver got)."""

    def __init__(self) -> None:
        self.value = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def advance(self, value: int) -> None:
        self.value = value
        still = []
        for n, fut in self._waiters:
            if n <= value:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((n, fut))
        self._waiters = still

    async def reach(self, n: int) -> None:
        if self.value >= n:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        await fut


async def run_both(*coros: Coroutine[Any, Any, Any]) -> list[Any]:
    """Run coroutines concurrently; the first failure cancels the others and is raised as is
    (not wrapped in an ``ExceptionGroup``: callers expect aiordma's typed errors)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _mismatch(expected: str, got: proto.Event) -> CollectiveMismatchError:
    return CollectiveMismatchError(f"expected {expected}, the left neighbour sent {got!r:.300}; "
                                   f"the ranks are not running the same collectives")


class Ring:
    """A rank's two ring endpoints, its receive slots and its work buffer.

    Built by :class:`aiordma.services.collectives.Group` once the ring is connected; the algorithms
    take a ``call`` number that every rank counts identically.
    """

    def __init__(self, *, rank: int, world: int, left: Endpoint, right: Endpoint,
                 slots_mr: MemoryRegion, slots: np.ndarray, slot_count: int, slot_bytes: int,
                 remote: RemoteBuffer, remote_count: int, remote_bytes: int) -> None:
        self.rank, self.world = rank, world
        self.left, self.right = left, right
        self._slots_mr = slots_mr
        self._slots = slots  # uint8, slot_count * slot_bytes
        self.slot_count, self.slot_bytes = slot_count, slot_bytes
        self._remote = remote
        self.remote_count, self.remote_bytes = remote_count, remote_bytes
        self._credits = remote_count  # slots of the right neighbour we may fill
        self._written = 0  # pieces written to the right neighbour (its slot = count % slots)
        self._read = 0  # pieces received from the left neighbour
        self._work = np.empty(0, np.uint8)
        self._work_mr: MemoryRegion | None = None
        self.left_rank, self.right_rank = (rank - 1) % world, (rank + 1) % world

    # -- buffers -------------------------------------------------------------------------------

    def work(self, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of the registered work buffer (grown if needed)."""
        if self._work_mr is None or nbytes > self._work.nbytes:
            cap = max(nbytes, 2 * self._work.nbytes, 4096)
            cap = -(-cap // 4096) * 4096
            new = np.empty(cap, np.uint8)
            mr = self.right.register(new)  # a WRITE source: local access only
            if self._work_mr is not None:
                self._work_mr.close()
            self._work, self._work_mr = new, mr
        return self._work[:nbytes]

    def close(self) -> None:
        """Deregister the work buffer (the endpoints deregister the rest when they close)."""
        if self._work_mr is not None:
            self._work_mr.close()

    # -- messages ------------------------------------------------------------------------------

    async def _recv(self, ep: Endpoint, who: int) -> proto.Event:
        data = await ep.recv()
        if data is None:
            raise BrokenResourceError(f"rank {who} left the group (closed its connection)")
        try:
            return proto.decode(data)
        except ProtocolError as exc:
            raise RemoteProtocolError(f"rank {who}: {exc}") from exc

    async def _recv_left(self) -> proto.Event:
        return await self._recv(self.left, self.left_rank)

    async def _take_credit(self) -> None:
        while self._credits == 0:
            ev = await self._recv(self.right, self.right_rank)
            if not isinstance(ev, proto.Credit):
                raise RemoteProtocolError(f"rank {self.right_rank} sent {ev!r:.200}, not a "
                                          f"Credit")
            self._credits += ev.count
        self._credits -= 1

    async def write_piece(self, call: int, step: int, offset: int, nbytes: int,
                          sig: int) -> None:
        """RDMA WRITE ``work[offset:offset + nbytes]`` into the right neighbour's next slot and
        tell it (``nbytes`` is at most its slot size)."""
        assert self._work_mr is not None and 0 < nbytes <= self.remote_bytes
        await self._take_credit()
        slot = self._written % self.remote_count
        self._written += 1
        base = slot * self.remote_bytes
        await self.right.write(self._work_mr[offset:offset + nbytes],
                               self._remote[base:base + nbytes])
        await self.right.send(proto.encode(proto.Piece(
            call=call, step=step, slot=slot, offset=offset, nbytes=nbytes, signature=sig)))

    async def read_piece(self, call: int, step: int, offset: int, nbytes: int,
                         sig: int) -> np.ndarray:
        """Wait for the expected piece from the left; its bytes (a view of the slot, valid
        until :meth:`release`)."""
        ev = await self._recv_left()
        slot = self._read % self.slot_count
        want = proto.Piece(call=call, step=step, slot=slot, offset=offset, nbytes=nbytes,
                           signature=sig)
        if ev != want:
            raise _mismatch(repr(want), ev)
        self._read += 1
        base = slot * self.slot_bytes
        return self._slots[base:base + nbytes]

    async def release(self) -> None:
        """The oldest slot read is free again: give the left neighbour its credit. Not when it
        has closed gracefully: it writes nothing more, and the credit for the last piece of a
        collective may cross its close (a broadcast's root returns once it has written)."""
        left = self.left
        if left.state not in _LEFT_GONE:
            try:
                await left.send(proto.encode(proto.Credit(count=1)))
            except BrokenResourceError:
                if left.state not in _LEFT_GONE:
                    raise

    async def send_value(self, call: int, step: int, origin: int, value: Any) -> None:
        await self.right.send(proto.encode(proto.Value(call=call, step=step, origin=origin,
                                                       value=value)))

    async def recv_value(self, call: int, step: int, origin: int) -> Any:
        ev = await self._recv_left()
        if not (isinstance(ev, proto.Value) and (ev.call, ev.step, ev.origin)
                == (call, step, origin)):
            raise _mismatch(f"Value(call={call}, step={step}, origin={origin})", ev)
        return ev.value

    # -- algorithms ----------------------------------------------------------------------------

    async def exchange(self, call: int, value: Any) -> list[Any]:
        """Allgather of small msgpack values by messages: ``world - 1`` steps; at step ``t``
        each rank forwards the value of rank ``r - t``. Once a rank has every value, every
        rank has entered the call: that is the barrier."""
        r, n = self.rank, self.world
        values: list[Any] = [None] * n
        values[r] = value
        for t in range(n - 1):
            src, dst = (r - t) % n, (r - t - 1) % n
            # Sent and received concurrently: a value too large for an eager message goes by
            # rendezvous, whose send waits for the peer's recv.
            _, values[dst] = await run_both(self.send_value(call, t, src, values[src]),
                                            self.recv_value(call, t, dst))
        return values

    async def broadcast(self, call: int, root: int, data: np.ndarray | None,
                        meta: Any) -> tuple[Any, np.ndarray]:
        """Pipelined chain broadcast along the ring from ``root``.

        The root sends ``meta`` (the array's dtype and shape) as a value, then the bytes of
        ``data`` (a uint8 view of the work buffer). Every other rank receives them into its
        work buffer and, unless it is the last of the chain, forwards each byte range as soon
        as it has arrived. Returns ``(meta, bytes)`` (the root's own for the root).
        """
        n = self.world
        pos = (self.rank - root) % n  # 0: the root; n - 1: the end of the chain
        if pos == 0:
            assert data is not None
            await self.send_value(call, 0, root, meta)
            sig = proto.signature("broadcast", root, data.nbytes)
            for a, b in proto.piece_bounds(0, data.nbytes, self.remote_bytes):
                await self.write_piece(call, 0, a, b - a, sig)
            return meta, data
        got = await self.recv_value(call, 0, root)
        nbytes = meta_nbytes(got)
        work = self.work(nbytes)
        sig = proto.signature("broadcast", root, nbytes)
        arrived = _Progress()

        async def receive() -> None:
            for a, b in proto.piece_bounds(0, nbytes, self.slot_bytes):
                work[a:b] = await self.read_piece(call, 0, a, b - a, sig)
                await self.release()
                arrived.advance(b)

        async def forward() -> None:
            await self.send_value(call, 0, root, got)
            for a, b in proto.piece_bounds(0, nbytes, self.remote_bytes):
                await arrived.reach(b)
                await self.write_piece(call, 0, a, b - a, sig)

        if pos == n - 1:
            await receive()
        else:
            await run_both(receive(), forward())
        return got, work

    async def allgather(self, call: int, sizes: Sequence[int],
                        own: np.ndarray) -> list[np.ndarray]:
        """Ring allgather of byte blocks laid out in the work buffer.

        ``sizes[b]`` is rank ``b``'s block size in bytes (every rank knows them all, from a
        prior :meth:`exchange`); ``own`` is this rank's array (any layout), copied into its
        block first. Returns each block's bytes (views of the work buffer).
        """
        offsets, total = [], 0
        for s in sizes:
            offsets.append(total)
            total += -(-s // _ALIGN) * _ALIGN
        work = self.work(total)
        mine = offsets[self.rank]
        np.copyto(work[mine:mine + sizes[self.rank]].view(own.dtype).reshape(own.shape), own)
        sig = proto.signature("allgather", *sizes)
        steps = proto.allgather_schedule(self.rank, self.world)
        received = _Progress()

        async def send() -> None:
            for t, (block, _) in enumerate(steps):
                await received.reach(t)
                o = offsets[block]
                for a, b in proto.piece_bounds(o, o + sizes[block], self.remote_bytes):
                    await self.write_piece(call, t, a, b - a, sig)

        async def receive() -> None:
            for t, (_, block) in enumerate(steps):
                o = offsets[block]
                for a, b in proto.piece_bounds(o, o + sizes[block], self.slot_bytes):
                    work[a:b] = await self.read_piece(call, t, a, b - a, sig)
                    await self.release()
                received.advance(t + 1)

        await run_both(send(), receive())
        return [self._work[offsets[b]:offsets[b] + sizes[b]] for b in range(self.world)]

    async def allreduce(self, call: int, values: np.ndarray, op: str) -> None:
        """Ring allreduce, in place, of ``values`` (a 1-d view of the work buffer).

        Reduce-scatter then allgather over ``world`` chunks of whole elements
        (:func:`aiordma.protocols.collectives.allreduce_schedule`). Each chunk is reduced completely
        on one rank and then copied to the others, so every rank ends with bit-identical
        results (floating-point sums are not in numpy's order, though).
        """
        ufunc = REDUCE_OPS[op]
        item = values.itemsize
        chunks = proto.chunk_bounds(values.size, self.world)
        steps = proto.allreduce_schedule(self.rank, self.world)
        sig = proto.signature("allreduce", op, values.dtype.str, values.size)
        out_items = max(1, self.remote_bytes // item)
        in_items = max(1, self.slot_bytes // item)
        received = _Progress()
        as_bytes = values.view(np.uint8)

        async def send() -> None:
            for t, (chunk, _, _) in enumerate(steps):
                await received.reach(t)
                lo, hi = chunks[chunk]
                for a, b in proto.piece_bounds(lo, hi, out_items):
                    await self.write_piece(call, t, a * item, (b - a) * item, sig)

        async def receive() -> None:
            for t, (_, chunk, reduce) in enumerate(steps):
                lo, hi = chunks[chunk]
                for a, b in proto.piece_bounds(lo, hi, in_items):
                    got = await self.read_piece(call, t, a * item, (b - a) * item, sig)
                    if reduce:
                        ufunc(values[a:b], got.view(values.dtype), out=values[a:b])
                    else:
                        as_bytes[a * item:b * item] = got
                    await self.release()
                received.advance(t + 1)

        await run_both(send(), receive())


def meta_nbytes(meta: Any) -> int:
    """The byte size of the array a ``(descr, shape)`` meta value describes."""
    dtype, shape = meta_dtype_shape(meta)
    return int(dtype.itemsize * int(np.prod(shape, dtype=np.int64)))


def meta_of(arr: np.ndarray) -> list[Any]:
    """The msgpack value describing ``arr``'s dtype and shape."""
    return [np.lib.format.dtype_to_descr(arr.dtype), list(arr.shape)]


def meta_dtype_shape(meta: Any) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """Inverse of :func:`meta_of`.

    Raises:
        RemoteProtocolError: not a valid description.
    """
    try:
        descr, shape = meta
        dtype = np.lib.format.descr_to_dtype(descr)
        shp = tuple(int(s) for s in shape)
        if any(s < 0 for s in shp) or dtype.hasobject:
            raise ValueError("negative extent or object dtype")
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"not an array description: {meta!r:.200}") from exc
    return dtype, shp

