"""The direct algorithms: every block goes straight from the rank that has it to the rank that
needs it, in one step (gather, scatter, alltoall, the small reduce-scatter, point to point).

A *block* is a byte range with a small header (its description, or its size): one ``Value``
message carries both when they fit, else the header goes first and the bytes follow as pieces
(inline or RDMA-written, see :mod:`._links`). So every block costs at least one message,
empty ones included: a receiver always hears from each sender, and compares what it hears
with what it expects (size, dtype, shape), raising :class:`CollectiveMismatchError` on a
difference instead of waiting for bytes that will not come.

A rank visits its peers in :func:`~aiordma.protocols.collectives.pairwise` order (``rank + i``
to send, ``rank - i`` to receive), so no rank is everyone's first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiordma import RemoteProtocolError
from aiordma.protocols import collectives as proto

from ._arrays import ReduceOp
from ._errors import CollectiveMismatchError
from ._links import Inbound, Outbound
from ._plane import CallPlane, run_both

__all__ = ["alltoall", "gather", "recv_block", "reduce_scatter", "scatter", "send_block"]


async def send_block(plane: CallPlane, out: Outbound, call: proto.Tag, step: int,
                     header: Any, which: int, lo: int, hi: int, sig: int,
                     unit: int = 1) -> None:
    """Send bytes ``lo:hi`` of work buffer ``which`` with ``header`` (see the module): as
    ``[header, bytes]`` in one message of step ``step``, or ``[header, None]`` then the bytes
    as pieces of whole ``unit``-byte items, of step ``step + 1``."""
    buf = plane.buffer(which)
    if hi - lo <= out.inline_max:
        msg = proto.encode(proto.Value(group=call.group, channel=call.channel, call=call.call,
                                       op=call.op, step=step, origin=plane.rank,
                                       value=[header, buf[lo:hi].tobytes()]))
        if len(msg) <= out.ep.eager_max:
            await out.ep.send(msg)
            return
    await out.send_value(call, step, plane.rank, [header, None])
    await out.put(plane.region(which), buf, call, step + 1, lo, hi, sig, unit, base=lo)


async def recv_block(inb: Inbound, call: proto.Tag, step: int, origin: int
                     ) -> tuple[Any, bytes | None]:
    """A block's ``(header, bytes)``; bytes None: they follow as pieces (take them with
    :func:`take_block`)."""
    got = await inb.recv_value(call, step, origin)
    if not (isinstance(got, list) and len(got) == 2 and (got[1] is None
                                                        or isinstance(got[1], bytes))):
        raise RemoteProtocolError(f"rank {origin}: not a block header: {got!r:.200}")
    return got[0], got[1]


async def take_block(inb: Inbound, call: proto.Tag, step: int, data: bytes | None,
                     into: np.ndarray, sig: int) -> None:
    """Put a block's bytes (``data`` from :func:`recv_block`, or its pieces) into ``into``
    (uint8, the block's size)."""
    if data is not None:
        if len(data) != into.nbytes:
            raise CollectiveMismatchError(f"rank {inb.peer} sent {len(data)} B where "
                                          f"{into.nbytes} B were expected")
        into[:] = np.frombuffer(data, np.uint8)
        return

    def copy(a: int, b: int, got: np.ndarray) -> None:
        into[a:b] = got

    await inb.take(call, step + 1, 0, into.nbytes, sig, copy)


def _offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each block starts when laid out back to back, and the total."""
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += s
    return offsets, total


async def gather(plane: CallPlane, call: proto.Tag, root: int, header: Any, nbytes: int,
                 describe: Callable[[int, Any], np.ndarray]) -> list[np.ndarray] | None:
    """Every rank's block (the first ``nbytes`` of work buffer 0, described by ``header``) to
    ``root``. The root gets a list, in rank order, of the arrays ``describe(rank, header)``
    makes for each other rank's header (and fills); its own entry is None (the caller has
    it). The others get None."""
    sig = proto.signature("gather", root)
    if plane.rank != root:
        await send_block(plane, plane.outs[root], call, 0, header, 0, 0, nbytes, sig)
        return None
    out: list[np.ndarray | None] = [None] * plane.world
    for _, peer in proto.pairwise(plane.rank, plane.world):
        inb = plane.ins[peer]
        theirs, data = await recv_block(inb, call, 0, peer)
        arr = describe(peer, theirs)
        await take_block(inb, call, 0, data, arr.reshape(-1).view(np.uint8), sig)
        out[peer] = arr
    return out  # type: ignore[return-value]


async def scatter(plane: CallPlane, call: proto.Tag, root: int, headers: Sequence[Any] | None,
                  sizes: Sequence[int] | None,
                  describe: Callable[[Any], np.ndarray]) -> np.ndarray | None:
    """``root``'s blocks (laid out back to back in work buffer 0, ``sizes[r]`` bytes for rank
    ``r``, described by ``headers[r]``) to every rank. A rank other than the root gets the
    array ``describe(header)`` makes for its header, filled; the root gets None."""
    sig = proto.signature("scatter", root)
    if plane.rank == root:
        assert headers is not None and sizes is not None
        offsets, _ = _offsets(sizes)
        for to, _ in proto.pairwise(plane.rank, plane.world):
            o = offsets[to]
            await send_block(plane, plane.outs[to], call, 0, headers[to], 0, o, o + sizes[to],
                             sig)
        return None
    inb = plane.ins[root]
    header, data = await recv_block(inb, call, 0, root)
    arr = describe(header)
    await take_block(inb, call, 0, data, arr.reshape(-1).view(np.uint8), sig)
    return arr


async def alltoall(plane: CallPlane, call: proto.Tag, send_counts: Sequence[int],
                   recv_counts: Sequence[int | None], row: int, sig: int) -> list[int]:
    """Rows ``p`` of work buffer 0 (``send_counts[p]`` rows of ``row`` bytes, blocks back to
    back in rank order) to rank ``p``; rank ``q``'s block for this rank into work buffer 1,
    back to back in rank order. A count in ``recv_counts`` that is None is learned from the
    block's header (which carries the count and ``sig``, the dtype and row shape). This
    rank's own block is copied. Returns the counts received."""
    r = plane.rank
    got = list(recv_counts)
    got[r] = send_counts[r]
    src_offsets, _ = _offsets([c * row for c in send_counts])
    headers: dict[int, tuple[int, bytes | None]] = {}
    order = proto.pairwise(r, plane.world)

    async def send() -> None:
        for to, _ in order:
            o = src_offsets[to]
            await send_block(plane, plane.outs[to], call, 0, [send_counts[to], sig], 0, o,
                             o + send_counts[to] * row, sig)

    async def receive() -> None:
        for _, frm in order:  # first the headers: they give the counts, and so the layout
            header, data = await recv_block(plane.ins[frm], call, 0, frm)
            if not (isinstance(header, list) and len(header) == 2 and type(header[0]) is int
                    and header[0] >= 0):
                raise RemoteProtocolError(f"rank {frm}: not a block header: {header!r:.80}")
            n, theirs = header
            if theirs != sig:
                raise CollectiveMismatchError(
                    f"rank {r}: rank {frm}'s {proto.KINDS[call.op]} has another dtype or row "
                    f"shape than this rank's")
            if got[frm] is not None and got[frm] != n:
                raise CollectiveMismatchError(
                    f"rank {r}: rank {frm} sent {n} rows where this rank expected "
                    f"{got[frm]}: the counts of an {proto.KINDS[call.op]} must match")
            got[frm] = n
            headers[frm] = (n, data)
        offsets, total = _offsets([int(g) * row for g in got])  # type: ignore[arg-type]
        dst = plane.work(total, 1)
        own, mine = src_offsets[r], send_counts[r] * row
        dst[offsets[r]:offsets[r] + mine] = plane.buffer(0)[own:own + mine]
        for _, frm in order:
            n, data = headers[frm]
            await take_block(plane.ins[frm], call, 0, data,
                             dst[offsets[frm]:offsets[frm] + n * row], sig)

    await run_both(send(), receive())
    return [int(g) for g in got]  # type: ignore[arg-type]


async def reduce_scatter(plane: CallPlane, call: proto.Tag, count: int, dtype: np.dtype[Any],
                         op: ReduceOp) -> np.ndarray:
    """Direct reduce-scatter of the ``count`` items of ``dtype`` at the start of work buffer 0
    (``count`` a multiple of the world size): chunk ``p`` goes to rank ``p``; each rank
    combines what it gets into its own chunk, which it returns (a typed view)."""
    r, item = plane.rank, dtype.itemsize
    values = plane.work(count * item).view(dtype)
    chunks = proto.chunk_bounds(count, plane.world)
    sig = proto.signature("reduce_scatter", op.name, dtype.str, count)
    lo, hi = chunks[r]
    mine = values[lo:hi]
    nbytes = (hi - lo) * item
    ufunc = op.ufunc

    async def send() -> None:
        for to, _ in proto.pairwise(r, plane.world):
            a, b = chunks[to]
            await send_block(plane, plane.outs[to], call, 0, sig, 0, a * item, b * item, sig,
                             item)

    async def receive() -> None:
        for _, frm in proto.pairwise(r, plane.world):
            inb = plane.ins[frm]
            theirs, data = await recv_block(inb, call, 0, frm)
            if theirs != sig:
                raise CollectiveMismatchError(
                    f"rank {r}: rank {frm}'s reduce_scatter differs from this rank's (op, "
                    f"dtype or count: {op.name}, {dtype}, {count} items here)")
            if data is not None:
                if len(data) != nbytes:
                    raise CollectiveMismatchError(f"rank {frm} sent {len(data)} B where "
                                                  f"{nbytes} B were expected")
                ufunc(mine, np.frombuffer(data, dtype), out=mine)
                continue

            def combine(a: int, b: int, got: np.ndarray) -> None:
                part = mine[a // item:b // item]
                ufunc(part, got.view(dtype), out=part)

            await inb.take(call, 1, 0, nbytes, sig, combine, item)

    await run_both(send(), receive())
    return mine
