"""The latency-optimal algorithms, for small arrays: few rounds, each one message deep.

- :func:`exchange`: every rank's small value to every rank, directly (one round).
- :func:`barrier`: the dissemination barrier, ``ceil(log2 world)`` rounds of one message.
- :func:`broadcast`: the binomial tree, ``ceil(log2 world)`` rounds; the array's description
  (and, when it fits a message, the array itself) travels in one message per edge. Large
  arrays only send their description this way, then go by the ring's chain.
- :func:`allgather`: every block to every rank directly, after an :func:`exchange` of sizes.
- :func:`allreduce`: recursive doubling, ``log2`` rounds for any world size (see
  :func:`aiordma.protocols.collectives.recursive_doubling`); results bit-identical on every
  rank.
- :func:`reduce`: the binomial tree the other way, ``ceil(log2 world)`` rounds.

The schedules are :mod:`aiordma.protocols.collectives`'s; data moves over the plane's links
(inline when a piece fits a message, else RDMA WRITE plus a message).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiordma import RemoteProtocolError
from aiordma.protocols import collectives as proto

from ._arrays import ReduceOp
from ._meta import meta_nbytes
from ._plane import CallPlane, run_both

__all__ = ["allgather", "allreduce", "barrier", "broadcast", "exchange", "reduce"]

_ALIGN = 64  # blocks in the work buffer start on 64-byte boundaries
# A group asks for the same few schedules over and over: computed once each.
_doubling = functools.lru_cache(maxsize=256)(proto.recursive_doubling)
_tree = functools.lru_cache(maxsize=256)(proto.binomial_tree)
_dissemination = functools.lru_cache(maxsize=256)(proto.dissemination_schedule)


async def exchange(plane: CallPlane, call: proto.Tag, value: Any) -> list[Any]:
    """Every rank's ``value`` (small: one eager message to every other rank), in rank order.
    Once a rank has every value, every rank has entered the call."""
    r, n = plane.rank, plane.world
    values: list[Any] = [None] * n
    values[r] = value
    others = [(r + i) % n for i in range(1, n)]  # staggered, so that no rank is everyone's first

    async def send() -> None:
        for p in others:
            await plane.outs[p].send_value(call, 0, r, value)

    async def receive() -> None:
        for p in reversed(others):  # the first to send to this rank is the last in its list
            values[p] = await plane.ins[p].recv_value(call, 0, p)

    await send()  # eager messages: posted without waiting for the peers
    await receive()
    return values


async def barrier(plane: CallPlane, call: proto.Tag) -> None:
    """Return once every rank has called it (dissemination: ``ceil(log2 world)`` rounds)."""
    r = plane.rank
    for k, (to, frm) in enumerate(_dissemination(r, plane.world)):
        await plane.outs[to].send_value(call, k, r, None)
        await plane.ins[frm].recv_value(call, k, frm)


async def broadcast(plane: CallPlane, call: proto.Tag, root: int, nbytes: int | None, meta: Any,
                    by_tree: Callable[[int], bool]) -> tuple[Any, int]:
    """Binomial-tree broadcast from ``root`` of the array's description, and of its bytes (the
    first ``nbytes`` of work buffer 0) when ``by_tree(nbytes)`` says so.

    The root passes ``meta`` and ``nbytes``; the others pass None and learn both from their
    parent, in one message that also carries the bytes when they fit it. Returns ``(meta,
    nbytes)``; the bytes are in work buffer 0, unless ``by_tree`` declined them (then the
    caller moves them, e.g. by :func:`._ring.broadcast`).
    """
    r, n = plane.rank, plane.world
    parent, children = _tree(r, n, root)
    inline: Any = None
    if parent is not None:
        got = await plane.ins[parent].recv_value(call, 0, root)
        if not (isinstance(got, list) and len(got) == 2):
            raise RemoteProtocolError(f"rank {parent}: not a broadcast header: {got!r:.200}")
        meta, inline = got
        nbytes = meta_nbytes(meta)
    assert nbytes is not None
    tree = by_tree(nbytes)
    work = plane.work(nbytes)
    sig = proto.signature("broadcast", root, nbytes)
    if parent is not None and tree:
        if isinstance(inline, bytes) and len(inline) == nbytes:
            work[:] = np.frombuffer(inline, np.uint8)
        else:
            def copy(a: int, b: int, got: np.ndarray) -> None:
                work[a:b] = got

            await plane.ins[parent].take(call, 1, 0, nbytes, sig, copy)
    whole: bytes | None = None  # the header with the bytes in it, when that fits a message
    if tree and children and nbytes <= plane.outs[children[0]].inline_max:
        whole = proto.encode(proto.Value(group=call.group, channel=call.channel, call=call.call,
                                         op=call.op, step=0, origin=root,
                                         value=[meta, work.tobytes()]))
    for child in children:
        out = plane.outs[child]
        if whole is not None and len(whole) <= out.ep.eager_max:
            await out.ep.send(whole)
            continue
        await out.send_value(call, 0, root, [meta, None])
        if tree:
            await out.put(plane.region(0), plane.buffer(0), call, 1, 0, nbytes, sig)
    return meta, nbytes


def block_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each rank's block starts in the work buffer, and the total (64-byte aligned)."""
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += -(-s // _ALIGN) * _ALIGN
    return offsets, total


async def allgather(plane: CallPlane, call: proto.Tag, sizes: Sequence[int],
                    own: np.ndarray) -> list[np.ndarray]:
    """Every rank's block sent to every rank directly. ``sizes[b]`` is rank ``b``'s block size
    in bytes (from a prior :func:`exchange`); ``own`` is this rank's array. Returns each block's
    bytes (views of work buffer 0)."""
    r, n = plane.rank, plane.world
    offsets, total = block_offsets(sizes)
    work = plane.work(total)
    mine = offsets[r]
    np.copyto(work[mine:mine + sizes[r]].view(own.dtype).reshape(own.shape), own)
    sig = proto.signature("allgather", *sizes)
    others = [(r + i) % n for i in range(1, n)]

    async def send() -> None:
        for p in others:
            await plane.outs[p].put(plane.region(0), plane.buffer(0), call, 0, mine,
                                    mine + sizes[r], sig)

    async def receive() -> None:
        for p in reversed(others):
            o = offsets[p]

            def copy(a: int, b: int, got: np.ndarray) -> None:
                work[a:b] = got

            await plane.ins[p].take(call, 0, o, o + sizes[p], sig, copy)

    if all(plane.outs[p].fits(mine, mine + sizes[r]) for p in others):
        await send()
        await receive()
    else:
        await run_both(send(), receive())
    return [work[offsets[b]:offsets[b] + sizes[b]] for b in range(n)]


async def allreduce(plane: CallPlane, call: proto.Tag, count: int, dtype: np.dtype[Any],
                    op: ReduceOp) -> np.ndarray:
    """Recursive-doubling allreduce of the ``count`` items of ``dtype`` at the start of work
    buffer 0. Returns the result (a typed view of work buffer 0 or 1)."""
    r, n = plane.rank, plane.world
    item = dtype.itemsize
    nbytes = count * item
    plan = _doubling(r, n)
    sig = proto.signature("allreduce", op.name, dtype.str, count)
    ufunc = op.ufunc
    bufs = (plane.work(nbytes, 0).view(dtype), plane.work(nbytes, 1).view(dtype))
    cur = 0

    async def exchange_with(peer: int, step: int, src: int, dst: int, lower: bool) -> None:
        """Send buffer ``src`` to ``peer`` and combine its partial with ours into ``dst``
        (its partial first if ``lower``, else ours first)."""
        out, inb = plane.outs[peer], plane.ins[peer]
        mine, into = bufs[src], bufs[dst]

        def combine(a: int, b: int, got: np.ndarray) -> None:
            i, j = a // item, b // item
            theirs = got.view(dtype)
            if lower:
                ufunc(theirs, mine[i:j], out=into[i:j])
            else:
                ufunc(mine[i:j], theirs, out=into[i:j])

        await plane.settle(dst)  # WRITEs of the round before read dst
        region, buffer = plane.region(src), plane.buffer(src)
        if out.fits(0, nbytes, item):  # (send, then receive: no task for either)
            await out.put(region, buffer, call, step, 0, nbytes, sig, item)
            await inb.take(call, step, 0, nbytes, sig, combine, item)
        else:
            await run_both(out.put(region, buffer, call, step, 0, nbytes, sig, item),
                           inb.take(call, step, 0, nbytes, sig, combine, item))

    def copy_into(dst: int) -> Any:
        def copy(a: int, b: int, got: np.ndarray) -> None:
            bufs[dst].view(np.uint8)[a:b] = got
        return copy

    if plan.fold_to is not None:  # hand our data over, get the result back
        await plane.outs[plan.fold_to].put(plane.region(0), plane.buffer(0), call, 0, 0,
                                           nbytes, sig, item)
        await plane.settle(1)
        await plane.ins[plan.fold_to].take(call, 1, 0, nbytes, sig, copy_into(1), item)
        return bufs[1]
    if plan.fold_from is not None:  # the lower rank's data first
        peer = plan.fold_from
        mine0, into1 = bufs[0], bufs[1]

        def fold(a: int, b: int, got: np.ndarray) -> None:
            i, j = a // item, b // item
            ufunc(got.view(dtype), mine0[i:j], out=into1[i:j])

        await plane.settle(1)
        await plane.ins[peer].take(call, 0, 0, nbytes, sig, fold, item)
        cur = 1
    for k, (partner, lower) in enumerate(plan.rounds):
        await exchange_with(partner, 1 + k, cur, 1 - cur, lower)
        cur = 1 - cur
    if plan.fold_from is not None:
        await plane.outs[plan.fold_from].put(plane.region(cur), plane.buffer(cur), call,
                                             1, 0, nbytes, sig, item)
    return bufs[cur]


async def reduce(plane: CallPlane, call: proto.Tag, root: int, count: int,
                 dtype: np.dtype[Any], op: ReduceOp) -> np.ndarray | None:
    """Binomial-tree reduce to ``root`` of the ``count`` items of ``dtype`` at the start of
    work buffer 0: a rank combines its children's partial results into its own, the smallest
    subtree first (the first one ready), then sends the result to its parent. The root gets
    the result (a typed view of work buffer 0), the others None."""
    r, n = plane.rank, plane.world
    item = dtype.itemsize
    nbytes = count * item
    parent, children = _tree(r, n, root)
    acc = plane.work(nbytes, 0).view(dtype)
    sig = proto.signature("reduce", op.name, dtype.str, count, root)
    ufunc = op.ufunc

    def combine(a: int, b: int, got: np.ndarray) -> None:
        part = acc[a // item:b // item]
        ufunc(part, got.view(dtype), out=part)

    for child in reversed(children):
        await plane.ins[child].take(call, 0, 0, nbytes, sig, combine, item)
    if parent is None:
        return acc
    await plane.outs[parent].put(plane.region(0), plane.buffer(0), call, 0, 0, nbytes, sig,
                                 item)
    return None
