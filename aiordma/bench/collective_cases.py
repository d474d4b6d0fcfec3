"""What area (h) times, shared by every system's rank program: the cases (collective, bytes),
the data each rank starts with, the checks of every result, and the summary of the timings.

Depends on numpy and the standard library only, so that the Open MPI rank program
(:mod:`aiordma.bench.mpi_worker`, run by Debian's ``/usr/bin/python3``, which has mpi4py
but not aiordma) imports this file as a sibling module, and aiordma's rank program
(:mod:`aiordma.bench.collective_worker`) as part of the package: both systems time the
same thing the same way.

How a case is timed, on every rank: ``warmup`` untimed calls, then ``calls`` timed ones
(three times that up to :data:`SMALL` bytes: :func:`timed_calls`), each after a barrier; a
rank's time for a call runs from its return from the barrier to its return from the
collective. A call's time is the **slowest rank's** (the collective is done when the
last rank has its result); the row's figure is the median over the timed calls, with the
fastest and slowest call beside it.

The data (float32, ``bytes // 4`` elements per rank): rank ``r`` holds
``(r + 1) * (i % 251 + 1)`` at index ``i``, so every sum is an exact small integer in float32
and every result is checked element by element after every call, warm-up included.

Beside the cases of every size, aiordma alone has one pair of cases, :data:`CONCURRENT`:
:data:`BATCH` allreduces of one size, started together (``asyncio.gather``) or one after
another (a loop); a call's time is that of all of them.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BATCH", "COLLECTIVES", "CONCURRENT", "SMALL", "check", "expected_allreduce",
           "initial", "summarize", "timed_calls"]

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
"""allreduce: sum, float32, in place. broadcast: root 0's array into every other rank's array
(in place). allgather: every rank's array, ``bytes`` per rank, into every rank.
reduce_scatter: every rank's ``bytes`` summed (float32), rank ``r`` gets block ``r`` of
``world`` equal blocks, into a preallocated array. alltoall: block ``p`` of rank ``r``'s
``bytes`` goes to rank ``p``, as block ``r`` of a preallocated array."""

BATCH = 8
CONCURRENT = ("allreduce_x8_gather", "allreduce_x8_loop")
""":data:`BATCH` in-place allreduces of ``bytes`` each (separate arrays): all started at once
(``asyncio.gather``), or each awaited before the next is started."""

ROOT = 0

SMALL = 64 << 10
"""Cases of at most this many bytes get three times the timed calls: their calls take
milliseconds, and a median of five of them moved by up to 2x between runs in the test VM."""


def timed_calls(nbytes: int, calls: int) -> int:
    """The timed calls of a case of ``nbytes`` when the plan asks for ``calls``."""
    return 3 * calls if nbytes <= SMALL else calls


@functools.lru_cache(maxsize=5)  # a 4-rank allgather's check reads all 4
def initial(rank: int, nbytes: int) -> np.ndarray:
    """Rank ``rank``'s data for a case of ``nbytes`` (float32), read-only (cached: the checks
    use it after every call; copy it to pass a writable array)."""
    if nbytes % 4:
        raise ValueError(f"{nbytes} bytes is not a whole number of float32")
    i = np.arange(nbytes // 4, dtype=np.int64)
    arr = ((rank + 1) * (i % 251 + 1)).astype(np.float32)
    arr.flags.writeable = False
    return arr


@functools.lru_cache(maxsize=2)
def expected_allreduce(world: int, nbytes: int) -> np.ndarray:
    """The sum over ``world`` ranks of :func:`initial` (read-only)."""
    arr = initial(0, nbytes) * np.float32(world * (world + 1) // 2)
    arr.flags.writeable = False
    return arr


def check(collective: str, rank: int, world: int, nbytes: int, result: Any) -> str | None:
    """None if ``result`` (an array, or a list of arrays for allgather) is right, else what is
    wrong, in words."""
    if collective == "allreduce":
        want = expected_allreduce(world, nbytes)
        got = np.asarray(result)
    elif collective in CONCURRENT:
        if len(result) != BATCH:
            return f"{collective} returned {len(result)} arrays, not {BATCH}"
        for k, one in enumerate(result):
            why = check("allreduce", rank, world, nbytes, one)
            if why:
                return f"{collective}, array {k}: {why}"
        return None
    elif collective == "reduce_scatter":
        want = _block(expected_allreduce(world, nbytes), rank, world)
        got = np.asarray(result)
    elif collective == "alltoall":
        want = np.concatenate([_block(initial(q, nbytes), rank, world) for q in range(world)])
        got = np.asarray(result)
    elif collective == "broadcast":
        want = initial(ROOT, nbytes)
        got = np.asarray(result)
    elif collective == "allgather":
        if len(result) != world:
            return f"allgather returned {len(result)} arrays for {world} ranks"
        for r, part in enumerate(result):
            why = _compare(np.asarray(part).reshape(-1), initial(r, nbytes))
            if why:
                return f"allgather: rank {r}'s block on rank {rank}: {why}"
        return None
    else:
        raise ValueError(f"unknown collective {collective!r}")
    why = _compare(got.reshape(-1), want)
    return None if why is None else f"{collective} on rank {rank}: {why}"


def _block(arr: np.ndarray, k: int, world: int) -> np.ndarray:
    """Block ``k`` of ``world`` equal blocks of ``arr`` (``arr.size`` a multiple of ``world``:
    every size of the plan is)."""
    n = arr.size // world
    return arr[k * n:(k + 1) * n]


def _compare(got: np.ndarray, want: np.ndarray) -> str | None:
    if got.dtype != want.dtype or got.size != want.size:
        return f"{got.dtype} x {got.size}, expected {want.dtype} x {want.size}"
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        return f"{bad.size} wrong elements, first at {i}: {got[i]!r} instead of {want[i]!r}"
    return None


def summarize(per_rank: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The case's figures from every rank's call times (seconds, rank order, same length):
    each call's time is the slowest rank's; median, min and max over the calls, in us."""
    if not per_rank or not per_rank[0] or len({len(t) for t in per_rank}) != 1:
        raise ValueError("every rank must report the same, non-zero number of calls")
    slowest = [max(ts) for ts in zip(*per_rank, strict=True)]
    return {"call_us": statistics.median(slowest) * 1e6, "call_min_us": min(slowest) * 1e6,
            "call_max_us": max(slowest) * 1e6, "calls_us": [t * 1e6 for t in slowest]}
