"""The bandwidth-optimal algorithms, for large arrays: data flows round the ring of ranks.

Each rank sends only to its right neighbour (``rank + 1``) and receives only from its left
(``rank - 1``), over the plane's links, piece by piece and pipelined:

- :func:`broadcast`: a chain from the root; each rank forwards a byte range as soon as it has
  arrived (the array's description went ahead by :func:`._rounds.broadcast`).
- :func:`allgather`: ``world - 1`` steps, each forwarding the block received at the step
  before (:func:`aiordma.protocols.collectives.allgather_schedule`).
- :func:`allreduce`: reduce-scatter then allgather over ``world`` chunks
  (:func:`aiordma.protocols.collectives.allreduce_schedule`): each rank sends about
  ``2 (world - 1) / world`` times the array, and every chunk is reduced completely on one rank
  and copied to the others, so all ranks end with bit-identical results.
- :func:`reduce_scatter`: the first half of that, arranged so that rank ``r`` ends with chunk
  ``r`` (:func:`aiordma.protocols.collectives.reduce_scatter_schedule`).

A receiver never waits for its sender, and a sender waits for the receiver's progress where
step ``t`` sends what step ``t - 1`` received (:class:`._plane.Progress`), piece by piece: a
piece goes on as soon as it has arrived (and been reduced), so the transfers of one step
overlap the next step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from aiordma.protocols import collectives as proto

from ._arrays import ReduceOp
from ._links import pieces
from ._plane import CallPlane, Progress, run_both
from ._rounds import block_offsets

__all__ = ["allgather", "allreduce", "broadcast", "reduce_scatter"]


async def broadcast(plane: CallPlane, call: proto.Tag, root: int, nbytes: int) -> None:
    """Pipelined chain broadcast from ``root`` of work buffer 0's first ``nbytes`` (every rank
    knows ``nbytes`` already, from :func:`._rounds.broadcast`'s header). Each rank but the
    last of the chain forwards each byte range as soon as it has arrived."""
    n = plane.world
    pos = (plane.rank - root) % n  # 0: the root; n - 1: the end of the chain
    out, inb = plane.outs[plane.right], plane.ins[plane.left]
    sig = proto.signature("broadcast", root, nbytes)
    if pos == 0:
        await out.put(plane.region(0), plane.buffer(0), call, 2, 0, nbytes, sig)
        return
    work = plane.work(nbytes)
    arrived = Progress()

    def copy(a: int, b: int, data: np.ndarray) -> None:
        work[a:b] = data
        arrived.advance(b)

    async def receive() -> None:
        await inb.take(call, 2, 0, nbytes, sig, copy)

    async def forward() -> None:
        for a, b in _out_pieces(plane, 0, nbytes):
            await arrived.reach(b)
            await out.put(plane.region(0), plane.buffer(0), call, 2, a, b, sig)

    if pos == n - 1:
        await receive()
    else:
        await run_both(receive(), forward())


def _mark(step: int, nbytes: int) -> int:
    """A receiver's progress as one number: ``nbytes`` of step ``step``'s range are in."""
    return (step << 40) | nbytes


def _out_pieces(plane: CallPlane, lo: int, hi: int, unit: int = 1) -> list[tuple[int, int]]:
    """``lo:hi`` cut as the right neighbour's slots cut it (what one ``put`` sends)."""
    return pieces(lo, hi, plane.outs[plane.right].size, unit)


async def allgather(plane: CallPlane, call: proto.Tag, sizes: Sequence[int],
                    own: np.ndarray) -> list[np.ndarray]:
    """Ring allgather of byte blocks laid out in work buffer 0.

    ``sizes[b]`` is rank ``b``'s block size in bytes (every rank knows them all, from a prior
    exchange); ``own`` is this rank's array (any layout), copied into its block first. Returns
    each block's bytes (views of the work buffer).
    """
    offsets, total = block_offsets(sizes)
    work = plane.work(total)
    mine = offsets[plane.rank]
    np.copyto(work[mine:mine + sizes[plane.rank]].view(own.dtype).reshape(own.shape), own)
    sig = proto.signature("allgather", *sizes)
    steps = proto.allgather_schedule(plane.rank, plane.world)
    received = Progress()
    out, inb = plane.outs[plane.right], plane.ins[plane.left]

    def copy(a: int, b: int, data: np.ndarray) -> None:
        work[a:b] = data
        received.advance(received.value + (b - a))

    async def send() -> None:
        for t, (block, _) in enumerate(steps):
            o = offsets[block]
            if t == 0:  # this rank's own block
                await out.put(plane.region(0), plane.buffer(0), call, t, o, o + sizes[block],
                              sig)
                continue
            for a, b in _out_pieces(plane, o, o + sizes[block]):  # forwarded as it arrives
                await received.reach(_mark(t - 1, b - o))
                await out.put(plane.region(0), plane.buffer(0), call, t, a, b, sig)

    async def receive() -> None:
        for t, (_, block) in enumerate(steps):
            o = offsets[block]
            received.advance(_mark(t, 0))
            await inb.take(call, t, o, o + sizes[block], sig, copy)

    await run_both(send(), receive())
    return [work[offsets[b]:offsets[b] + sizes[b]] for b in range(plane.world)]


async def allreduce(plane: CallPlane, call: proto.Tag, count: int, dtype: np.dtype[Any],
                    op: ReduceOp) -> np.ndarray:
    """Ring allreduce, in place, of the ``count`` items of ``dtype`` at the start of work
    buffer 0; returns them (a typed view)."""
    steps = proto.allreduce_schedule(plane.rank, plane.world)
    sig = proto.signature("allreduce", op.name, dtype.str, count)
    return await _reduce_ring(plane, call, count, dtype, op, steps, sig)


async def reduce_scatter(plane: CallPlane, call: proto.Tag, count: int, dtype: np.dtype[Any],
                         op: ReduceOp, first_step: int = 0) -> np.ndarray:
    """Ring reduce-scatter of the ``count`` items of ``dtype`` at the start of work buffer 0
    (``count`` a multiple of the world size): afterwards chunk ``rank`` (of
    :func:`~aiordma.protocols.collectives.chunk_bounds`) holds the reduction of every rank's
    chunk ``rank``; returns all ``count`` items (a typed view; the other chunks hold partial
    results). Steps are numbered from ``first_step`` (a reduce goes on after them)."""
    steps = proto.reduce_scatter_schedule(plane.rank, plane.world)
    sig = proto.signature("reduce_scatter", op.name, dtype.str, count)
    return await _reduce_ring(plane, call, count, dtype, op, steps, sig, first_step)


async def _reduce_ring(plane: CallPlane, call: proto.Tag, count: int, dtype: np.dtype[Any],
                       op: ReduceOp, steps: list[tuple[int, int, bool]], sig: int,
                       first_step: int = 0) -> np.ndarray:
    """Run a ring schedule of ``(send_chunk, recv_chunk, reduce)`` steps in place over the
    ``count`` items of ``dtype`` at the start of work buffer 0."""
    item = dtype.itemsize
    values = plane.work(count * item).view(dtype)
    region = plane.region(0)
    chunks = proto.chunk_bounds(count, plane.world)
    received = Progress()
    as_bytes = values.view(np.uint8)
    out, inb = plane.outs[plane.right], plane.ins[plane.left]
    ufunc = op.ufunc
    s0 = first_step

    async def send() -> None:
        for t, (chunk, _, _) in enumerate(steps):
            lo, hi = chunks[chunk]
            if t == 0:
                await out.put(region, plane.buffer(0), call, s0, lo * item, hi * item, sig,
                              item)
                continue
            # the chunk received (and reduced) at step t - 1, forwarded piece by piece as it
            # arrives: the next transfer overlaps this rank's reduction of the following piece
            for a, b in _out_pieces(plane, lo * item, hi * item, item):
                await received.reach(_mark(t - 1, b - lo * item))
                await out.put(region, plane.buffer(0), call, s0 + t, a, b, sig, item)

    def combine(a: int, b: int, data: np.ndarray) -> None:
        i, j = a // item, b // item
        ufunc(values[i:j], data.view(dtype), out=values[i:j])
        received.advance(received.value + (b - a))

    def copy(a: int, b: int, data: np.ndarray) -> None:
        as_bytes[a:b] = data
        received.advance(received.value + (b - a))

    async def unread(a: int, b: int) -> None:
        await out.settle(region, a, b)

    async def receive() -> None:
        for t, (_, chunk, reduce) in enumerate(steps):
            lo, hi = chunks[chunk]
            received.advance(_mark(t, 0))
            # In the allgather half a chunk comes back that this rank sent in the
            # reduce-scatter half: its WRITE must be over before the bytes change (the data's
            # arrival proves the peer has it, not that the acknowledgement came back).
            await inb.take(call, s0 + t, lo * item, hi * item, sig,
                           combine if reduce else copy, item,
                           guard=None if reduce else unread)

    await run_both(send(), receive())
    return values
