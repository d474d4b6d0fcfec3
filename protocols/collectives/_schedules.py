"""The collectives' schedules: who sends what to whom at each step (sans-I/O, pure arithmetic).

Re-exported by :mod:`aiordma.protocols.collectives`, which documents the wire. Every function
here is a plain function of ``(rank, world, ...)``, the same on every rank, so each rank
computes its part of a schedule without talking to the others, and the tests play whole
schedules for every rank with numpy.

Ring (bandwidth-optimal, for large arrays): :func:`allreduce_schedule` (reduce-scatter then
allgather), :func:`reduce_scatter_schedule` and :func:`allgather_schedule`. Few rounds, for
small arrays: :func:`recursive_doubling` (allreduce in ``log2`` rounds, any world size),
:func:`binomial_tree` (broadcast, and reduce the other way, in ``ceil(log2 world)`` rounds)
and :func:`dissemination_schedule` (barrier). Direct: :func:`pairwise` (alltoall; and the
order in which a rank visits its peers for gather, scatter and the direct reduce-scatter).
:func:`choose` picks one by size and world.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import LocalProtocolError

__all__ = [
    "RecursiveDoubling", "Thresholds", "allgather_schedule", "allreduce_schedule",
    "binomial_tree", "choose", "chunk_bounds", "dissemination_schedule", "pairwise",
    "piece_bounds", "recursive_doubling", "reduce_scatter_schedule",
]


def chunk_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(count)`` into ``parts`` consecutive chunks whose sizes differ by at most
    one (the first ``count % parts`` are one longer); chunks may be empty when
    ``count < parts``."""
    if count < 0 or parts < 1:
        raise LocalProtocolError(f"chunk_bounds({count}, {parts})")
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append((start, stop))
        start = stop
    return out


def piece_bounds(start: int, stop: int, max_count: int) -> Iterator[tuple[int, int]]:
    """Split ``range(start, stop)`` into consecutive pieces of at most ``max_count`` items
    (none when it is empty): what fits one receive slot."""
    if max_count < 1:
        raise LocalProtocolError("max_count must be at least 1")
    for a in range(start, stop, max_count):
        yield a, min(a + max_count, stop)


def allreduce_schedule(rank: int, world: int) -> list[tuple[int, int, bool]]:
    """The ring allreduce of ``rank``: ``(send_chunk, recv_chunk, reduce)`` per step.

    ``world - 1`` reduce-scatter steps (``reduce=True``: the received chunk is combined into
    the local one), after which rank ``r`` holds the complete chunk ``(r + 1) % world``; then
    ``world - 1`` allgather steps (``reduce=False``: the received chunk replaces the local one).
    The chunk sent at step ``t > 0`` is the one received at step ``t - 1``, so each rank sends
    ``2 (world - 1) / world`` of the data, the bandwidth-optimal amount.
    """
    steps = []
    for t in range(world - 1):  # reduce-scatter
        steps.append(((rank - t) % world, (rank - t - 1) % world, True))
    for u in range(world - 1):  # allgather of the reduced chunks
        steps.append(((rank + 1 - u) % world, (rank - u) % world, False))
    return steps


def reduce_scatter_schedule(rank: int, world: int) -> list[tuple[int, int, bool]]:
    """The ring reduce-scatter of ``rank``, in :func:`allreduce_schedule`'s form (every step
    reduces): ``world - 1`` steps after which rank ``r`` holds the complete chunk ``r`` (its
    own, as ``reduce_scatter`` promises; the allreduce's first half leaves chunk ``r + 1``
    there instead). Step ``t`` sends chunk ``r - t - 1`` and receives chunk ``r - t - 2``,
    so the chunk sent at step ``t > 0`` is the one received at step ``t - 1``."""
    return [((rank - t - 1) % world, (rank - t - 2) % world, True) for t in range(world - 1)]


def allgather_schedule(rank: int, world: int) -> list[tuple[int, int]]:
    """The ring allgather of ``rank``: ``(block_sent, block_received)`` per step; block ``b``
    is rank ``b``'s contribution. Step 0 sends the rank's own block, step ``t > 0`` forwards the
    block received at step ``t - 1``."""
    return [((rank - t) % world, (rank - t - 1) % world) for t in range(world - 1)]


def pairwise(rank: int, world: int) -> list[tuple[int, int]]:
    """``(send_to, receive_from)`` per step ``i = 1 .. world - 1``: ``rank + i`` and
    ``rank - i``. At every step each rank sends to exactly one rank and receives from exactly
    one, so in an alltoall no rank is everyone's first destination."""
    return [((rank + i) % world, (rank - i) % world) for i in range(1, world)]


def dissemination_schedule(rank: int, world: int) -> list[tuple[int, int]]:
    """The dissemination barrier of ``rank``: ``(send_to, receive_from)`` per round, rounds
    ``k = 0 .. ceil(log2 world) - 1`` with distance ``2**k``. After round ``k`` a rank has heard,
    directly or through others, from the ``2**(k + 1) - 1`` ranks before it; after the last,
    from everyone."""
    out, d = [], 1
    while d < world:
        out.append(((rank + d) % world, (rank - d) % world))
        d *= 2
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RecursiveDoubling:
    """One rank's part in a recursive-doubling allreduce of ``world`` ranks.

    With ``P`` the largest power of two not over ``world`` and ``extra = world - P``, the first
    ``2 * extra`` ranks pair up before the rounds: each even one (``fold_to`` set) sends its data
    to the odd one above it and waits for the result from it; each odd one (``fold_from`` set)
    combines that data with its own, lower rank's first. Then ``P`` ranks run ``log2 P``
    rounds: in each, partners exchange their partial results and both combine them, the
    partial of the lower block first, so every rank computes the same expression and ends
    with bit-identical results. Finally each odd folding rank sends the result to ``fold_from``.

    Attributes:
        fold_to: the rank to hand this rank's data to (and get the result from), or None.
        fold_from: the rank whose data is combined in before the rounds (and gets the result
            after them), or None.
        rounds: ``(partner, partner_is_lower)`` per round; empty for a rank with ``fold_to``.
    """

    fold_to: int | None
    fold_from: int | None
    rounds: tuple[tuple[int, bool], ...]


def recursive_doubling(rank: int, world: int) -> RecursiveDoubling:
    """The plan of ``rank`` in a recursive-doubling allreduce (see :class:`RecursiveDoubling`)."""
    if not (0 <= rank < world):
        raise LocalProtocolError(f"rank {rank} is not in a world of {world}")
    p = 1 << (world.bit_length() - 1)
    extra = world - p
    if rank < 2 * extra and rank % 2 == 0:
        return RecursiveDoubling(fold_to=rank + 1, fold_from=None, rounds=())
    fold_from = rank - 1 if rank < 2 * extra else None
    v = rank // 2 if rank < 2 * extra else rank - extra  # this rank's place among the P

    def real(u: int) -> int:
        return 2 * u + 1 if u < extra else u + extra

    rounds, mask = [], 1
    while mask < p:
        u = v ^ mask
        rounds.append((real(u), u < v))
        mask *= 2
    return RecursiveDoubling(fold_to=None, fold_from=fold_from, rounds=tuple(rounds))


def binomial_tree(rank: int, world: int, root: int) -> tuple[int | None, list[int]]:
    """``rank``'s place in the binomial broadcast tree rooted at ``root``: its parent (None for
    the root) and its children, the largest subtree first (sent to first, so the deepest
    branch starts earliest). Depth ``ceil(log2 world)``. A reduce runs the same tree the
    other way: a rank combines its children's partial results, the smallest subtree first
    (the first to be ready), then sends its own to its parent."""
    if not (0 <= rank < world and 0 <= root < world):
        raise LocalProtocolError(f"rank {rank} or root {root} is not in a world of {world}")
    v = (rank - root) % world
    low = v & -v if v else 1 << max(0, (world - 1).bit_length())
    parent = None if v == 0 else ((v - low) + root) % world
    children, m = [], low >> 1
    while m:
        if v + m < world:
            children.append((v + m + root) % world)
        m >>= 1
    return parent, children


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """Where the latency-optimal algorithms give way to the bandwidth-optimal ones (bytes of
    the array; of all ranks' blocks for allgather; of the whole input for reduce_scatter).
    Every rank must use the same values: they decide who sends what."""

    allreduce: int = 64 << 10
    broadcast: int = 64 << 10
    allgather: int = 64 << 10
    reduce_scatter: int = 64 << 10
    reduce: int = 64 << 10
    written: int = 1 << 20
    """Over RDMA links, an allgather, alltoall or reduce_scatter of at least this many bytes
    (counted as above; the whole input for alltoall) writes each block straight into its
    place (``"written"``)."""
    written_allreduce: int = 256 << 10
    """The same for an allreduce (a written reduce-scatter, then each reduced chunk written to
    every rank): from the step engine's size up, written beat the links' ring at 2 and 4
    ranks, where a reduce-scatter or allgather of the same bytes did not yet."""
    engine: int = 1 << 20
    """Over RDMA links, an allreduce, barrier or broadcast of at most this many bytes, and in
    groups of up to 16 ranks an allgather, alltoall or reduce_scatter whose every block is,
    runs on the group's step engine (at most 1 MiB, and 256 KiB in groups of more than 4
    ranks; every rank must pass the same). The other thresholds choose the links'
    algorithms; :func:`choose` does not read this one."""


_WRITTEN = frozenset({"allreduce", "allgather", "alltoall", "reduce_scatter"})


def choose(kind: str, nbytes: int, world: int, limits: Thresholds = Thresholds(),
           one_sided: bool = False) -> str:
    """The algorithm for a collective: ``"recursive_doubling"`` or ``"ring"`` (allreduce),
    ``"binomial"`` or ``"chain"`` (broadcast), ``"direct"`` or ``"ring"`` (allgather,
    reduce_scatter), ``"binomial"`` or ``"ring"`` (reduce: a tree, or a ring reduce-scatter
    whose chunks go to the root), ``"direct"`` (alltoall). Small sizes take the few-rounds
    algorithm, large ones the bandwidth-optimal one; with ``one_sided`` links (RDMA), an
    allgather, alltoall or reduce_scatter of at least ``limits.written`` bytes, or an
    allreduce of at least ``limits.written_allreduce``, is ``"written"``: every block
    straight into its place by one WRITE."""
    if one_sided and kind in _WRITTEN and nbytes >= (
            limits.written_allreduce if kind == "allreduce" else limits.written):
        return "written"
    if kind == "allreduce":
        return "recursive_doubling" if nbytes <= limits.allreduce else "ring"
    if kind == "broadcast":
        return "binomial" if nbytes <= limits.broadcast or world < 3 else "chain"
    if kind == "allgather":
        return "direct" if nbytes <= limits.allgather or world < 3 else "ring"
    if kind == "reduce_scatter":
        return "direct" if nbytes <= limits.reduce_scatter or world < 3 else "ring"
    if kind == "reduce":
        return "binomial" if nbytes <= limits.reduce or world < 3 else "ring"
    if kind == "alltoall":
        return "direct"
    raise LocalProtocolError(f"no algorithm for {kind!r}")
