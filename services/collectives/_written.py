"""The written algorithms, for large arrays over RDMA links: every block goes to each rank that
needs it as one RDMA WRITE straight into its place in that rank's work buffer, with its note
behind it (a rendezvous, as Open MPI's large messages go).

A call first tells every rank where the others' work buffers are (one :func:`._rounds.exchange`
of a descriptor: the buffer's address and a key that lets the group's ranks write into it,
made once per work buffer and kept while it lives), then each rank posts one WRITE per block
it sends and waits for the notes of the blocks written into it: a note arrives behind its
WRITE on the same queue pair, so the data is in place when it is read. Against the pieces of
:mod:`._ring` and :mod:`._rounds` (each one receive slot long, copied out of the slot, its
slot given back by a credit), nothing is copied on the way, no credit flows, and Python runs
once per block instead of once per piece.

- :func:`allgather`: every rank's block into every rank's buffer, at its offset.
- :func:`alltoall` (equal blocks): block ``p`` of every rank's input into rank ``p``'s work
  buffer 1, at the sender's place.
- :func:`reduce_scatter`: chunk ``c`` of every rank's input into rank ``c``'s work buffer 1,
  where it reduces them in rank order.
- :func:`allreduce`: that, then each rank's reduced chunk written to every rank: every chunk
  is reduced on one rank, so the results are bit-identical on every rank.

A rank writes only into buffers whose descriptors came for this call, and a call returns once
its own WRITEs are acknowledged (their sources may change then) and every block written into it
has arrived, so no WRITE of a call lands in a buffer another call has leased.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiordma import LocalProtocolError, RemoteBuffer, RemoteProtocolError
from aiordma._memory.region import LocalSlice, MemoryRegion
from aiordma.protocols import collectives as proto

from . import _rounds
from ._arrays import ReduceOp
from ._errors import CollectiveMismatchError
from ._plane import CallPlane
from ._rounds import block_offsets

__all__ = ["allgather", "allreduce", "alltoall", "reduce_scatter"]


async def targets(plane: CallPlane, call: proto.Tag, which: int, nbytes: int, sig: int
                  ) -> dict[int, RemoteBuffer]:
    """Every other rank's work buffer ``which`` (exposed for writing; reserved to at least
    ``nbytes`` on every rank), by rank, from one exchange, which also compares the ranks'
    ``sig`` (the call's kind, op, dtype and size: :func:`~aiordma.protocols.collectives.
    signature`) before anything is written.

    Raises:
        CollectiveMismatchError: a rank's call differs (its signature).
        RemoteProtocolError: a rank sent a descriptor that is not one, not writable, or too
            short.
    """
    plane.work(nbytes, which)
    region = _region(plane, which)
    got = await _rounds.exchange(plane, call, [sig, *region.expose(write=True).to_wire()])
    remotes = {}
    for p, value in enumerate(got):
        if p == plane.rank:
            continue
        if not (isinstance(value, list) and value and value[0] == sig):
            theirs = value[0] if isinstance(value, list) and value else value
            raise CollectiveMismatchError(
                f"rank {plane.rank}: rank {p}'s {proto.KINDS[call.op]} differs from this "
                f"rank's (signature {theirs!r:.40} against {sig}): the ranks must pass the "
                f"same op, dtype and size")
        try:
            remote = RemoteBuffer.from_wire(value[1:])
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"rank {p}: {exc}") from None
        if not remote.writable or remote.length < nbytes:
            raise RemoteProtocolError(f"rank {p}'s work buffer {remote} does not take "
                                      f"{nbytes} B written")
        remotes[p] = remote
    return remotes


async def write(plane: CallPlane, call: proto.Tag, step: int,
                blocks: Sequence[tuple[int, LocalSlice, RemoteBuffer]]
                ) -> list[asyncio.Future[None]]:
    """Post each ``(rank, source, target)`` block's WRITE with a note of ``step`` behind it
    (an empty block: the note alone); the WRITEs' acknowledgements."""
    acks = []
    for p, src, dst in blocks:
        out = plane.outs[p]
        ep, note = out.ep, out.value_message(call, step, plane.rank, None)
        if len(src):
            acks.append(await ep.post_write(src, dst, notify=note))  # type: ignore[union-attr]
        else:
            await ep.send(note)
    return acks


async def arrived(plane: CallPlane, call: proto.Tag, step: int, ranks: Sequence[int]) -> None:
    """Wait for the notes of ``step`` from ``ranks``: their blocks are in place."""
    for p in ranks:
        await plane.ins[p].recv_value(call, step, p)


def _region(plane: CallPlane, which: int) -> MemoryRegion:
    """Work buffer ``which``'s registration (reserved already)."""
    region = plane.region(which)
    if region is None:  # (the callers choose this module for RDMA links only)
        raise LocalProtocolError("the written algorithms need RDMA links")
    return region


def _order(plane: CallPlane) -> tuple[list[int], list[int]]:
    """The ranks to write to and to hear from, in :func:`~aiordma.protocols.collectives.
    pairwise` order (so that no rank is everyone's first)."""
    steps = proto.pairwise(plane.rank, plane.world)
    return [to for to, _ in steps], [frm for _, frm in steps]


async def allgather(plane: CallPlane, call: proto.Tag, sizes: Sequence[int],
                    own: np.ndarray) -> list[np.ndarray]:
    """Every rank's block written into every rank's work buffer 0, at the block's offset.
    ``sizes[b]`` is rank ``b``'s block size in bytes (from a prior exchange); ``own`` is this
    rank's array. Returns each block's bytes (views of work buffer 0)."""
    r = plane.rank
    offsets, total = block_offsets(sizes)
    work = plane.work(total)
    mine, size = offsets[r], sizes[r]
    np.copyto(work[mine:mine + size].view(own.dtype).reshape(own.shape), own)
    remotes = await targets(plane, call, 0, total, proto.signature("allgather", *sizes))
    region = _region(plane, 0)
    others, senders = _order(plane)
    acks = await write(plane, call, 1, [(p, region[mine:mine + size],
                                         remotes[p][mine:mine + size]) for p in others])
    await arrived(plane, call, 1, senders)
    for ack in acks:
        await ack
    return [work[offsets[b]:offsets[b] + sizes[b]] for b in range(plane.world)]


async def alltoall(plane: CallPlane, call: proto.Tag, block: int, sig: int) -> None:
    """Equal blocks of ``block`` bytes: block ``p`` of work buffer 0 (back to back in rank
    order) written to rank ``p``'s work buffer 1 at this rank's place, ``rank * block``; this
    rank's own block copied there. ``sig`` the call's kind, dtype, row shape and count."""
    r = plane.rank
    remotes = await targets(plane, call, 1, plane.world * block, sig)
    region = _region(plane, 0)
    others, senders = _order(plane)
    at = r * block
    acks = await write(plane, call, 1, [(p, region[p * block:(p + 1) * block],
                                         remotes[p][at:at + block]) for p in others])
    plane.buffer(1)[at:at + block] = plane.buffer(0)[at:at + block]
    await arrived(plane, call, 1, senders)
    for ack in acks:
        await ack


async def reduce_scatter(plane: CallPlane, call: proto.Tag, count: int, dtype: np.dtype[Any],
                         op: ReduceOp) -> np.ndarray:
    """Reduce-scatter of the ``count`` items of ``dtype`` at the start of work buffer 0, in
    place: afterwards chunk ``rank`` (of :func:`~aiordma.protocols.collectives.chunk_bounds`)
    holds the reduction of every rank's chunk ``rank``, reduced in rank order; returns all
    ``count`` items (a typed view; the other chunks are this rank's input)."""
    chunks = proto.chunk_bounds(count, plane.world)
    width = _width(chunks, dtype)
    sig = proto.signature("reduce_scatter", op.name, dtype.str, count)
    remotes = await targets(plane, call, 1, plane.world * width, sig)
    return await _reduce_chunks(plane, call, chunks, dtype, op, remotes, width)


async def allreduce(plane: CallPlane, call: proto.Tag, count: int, dtype: np.dtype[Any],
                    op: ReduceOp) -> np.ndarray:
    """Allreduce, in place, of the ``count`` items of ``dtype`` at the start of work buffer 0:
    :func:`reduce_scatter`, then each rank's reduced chunk written to every rank (into a
    second area of work buffer 1, then copied into place: a chunk this rank sent in the first
    half may still be read by its WRITE); returns them (a typed view)."""
    r, n, item = plane.rank, plane.world, dtype.itemsize
    chunks = proto.chunk_bounds(count, n)
    width = _width(chunks, dtype)
    sig = proto.signature("allreduce", op.name, dtype.str, count)
    remotes = await targets(plane, call, 1, 2 * n * width, sig)
    values = await _reduce_chunks(plane, call, chunks, dtype, op, remotes, width)
    region = _region(plane, 0)
    lo, hi = chunks[r]
    at = (n + r) * width
    others, senders = _order(plane)
    acks = await write(plane, call, 2, [(p, region[lo * item:hi * item],
                                         remotes[p][at:at + (hi - lo) * item]) for p in others])
    await arrived(plane, call, 2, senders)
    landing = plane.buffer(1)
    for p in others:
        lo, hi = chunks[p]
        at = (n + p) * width
        values[lo:hi] = landing[at:at + (hi - lo) * item].view(dtype)
    for ack in acks:
        await ack
    return values


def _width(chunks: Sequence[tuple[int, int]], dtype: np.dtype[Any]) -> int:
    """The bytes of one rank's landing place in work buffer 1: the largest chunk, aligned."""
    return -(-max(hi - lo for lo, hi in chunks) * dtype.itemsize // 64) * 64


async def _reduce_chunks(plane: CallPlane, call: proto.Tag, chunks: Sequence[tuple[int, int]],
                         dtype: np.dtype[Any], op: ReduceOp, remotes: dict[int, RemoteBuffer],
                         width: int) -> np.ndarray:
    """:func:`reduce_scatter`'s work on ``chunks`` (of the call's items), with the ranks' work
    buffers 1 known (``remotes``), each rank's chunk landing at ``rank * width`` there."""
    r, n, item = plane.rank, plane.world, dtype.itemsize
    values = plane.work(chunks[-1][1] * item).view(dtype)
    region = _region(plane, 0)
    others, senders = _order(plane)
    blocks = []
    for p in others:
        lo, hi = chunks[p]
        blocks.append((p, region[lo * item:hi * item],
                       remotes[p][r * width:r * width + (hi - lo) * item]))
    acks = await write(plane, call, 1, blocks)
    await arrived(plane, call, 1, senders)
    lo, hi = chunks[r]
    landing = plane.buffer(1)
    mine = values[lo:hi]
    parts = [mine if p == r else landing[p * width:p * width + (hi - lo) * item].view(dtype)
             for p in range(n)]
    acc = parts[0]  # (rank 0's own chunk, or a landing place: either may be overwritten)
    for part in parts[1:]:
        op.ufunc(acc, part, out=acc)
    if acc is not mine:
        mine[...] = acc
    for ack in acks:  # (the chunks sent are not changed here; their sources free on return)
        await ack
    return values
