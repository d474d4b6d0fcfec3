"""One window case, run by every rank of a worker group (``collective_worker.py``'s
``{"window": case}``) and checked there element by element.

A case is ``{"seed", "sizes" (elements of each rank's part, by rank), "dtype", "cuts"
(segments per part, at most), "gets" (reads per rank), "together" (puts, waits and gets
started at once, or one after another)}``. :func:`plan` derives from it, the same way on
every rank (and in the test): each part cut into segments, each segment written by one rank
(any, the target itself included) or by none, with a signal (on the writer's counter: counter
``s`` counts writer ``s``'s signaled puts) or without; the values every rank's part starts
with and what each put writes; each rank's reads. Then each rank:

1. makes the window (its part starts with its initial values);
2. runs its puts, and waits for the signals its part should receive, counter by counter;
   once a counter's wait returns, the segments it announced must be in place;
3. fences; its whole part must now hold every put;
4. reads from random ranks and ranges (itself included) and compares with their final parts;
5. checks that an out-of-range put and get raise ``CollectiveArgumentError`` (the group
   stays usable), that every counter is consumed, and closes the window.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiordma.services.collectives import CollectiveArgumentError


@dataclass
class Plan:
    dtype: np.dtype[Any]
    initial: list[np.ndarray]  # by rank
    final: list[np.ndarray]
    puts: list[list[tuple[int, int, np.ndarray, bool]]]  # by writer: (target, offset, data, sig)
    signals: list[dict[int, list[tuple[int, int]]]]  # by target: writer -> [(lo, hi)] signaled
    gets: list[list[tuple[int, int, int]]] = field(default_factory=list)  # (target, lo, hi)


def _values(rng: np.random.Generator, n: int, dtype: np.dtype[Any]) -> np.ndarray:
    return rng.integers(0, 120, n).astype(dtype)


def plan(case: dict[str, Any], world: int) -> Plan:
    dtype = np.dtype(case["dtype"])
    sizes = case["sizes"][:world]
    rng = np.random.default_rng(case["seed"])
    initial = [_values(rng, n, dtype) for n in sizes]
    final = [a.copy() for a in initial]
    puts: list[list[tuple[int, int, np.ndarray, bool]]] = [[] for _ in range(world)]
    signals: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(world)]
    for t, n in enumerate(sizes):
        cuts = sorted({0, n, *rng.integers(0, n + 1, case["cuts"]).tolist()})
        for lo, hi in itertools.pairwise(cuts):
            writer = int(rng.integers(-1, world))  # -1: nobody writes this segment
            if writer < 0:
                continue
            data = _values(rng, hi - lo, dtype)
            sig = bool(rng.integers(0, 2))
            puts[writer].append((t, lo, data, sig))
            final[t][lo:hi] = data
            if sig:
                signals[t].setdefault(writer, []).append((lo, hi))
    for p in puts:
        rng.shuffle(p)  # type: ignore[arg-type]
    gets = []
    for _ in range(world):
        mine = []
        for _ in range(case["gets"]):
            t = int(rng.integers(0, world))
            lo = int(rng.integers(0, sizes[t] + 1))
            hi = int(rng.integers(lo, sizes[t] + 1))
            mine.append((t, lo, hi))
        gets.append(mine)
    return Plan(dtype, initial, final, puts, signals, gets)


async def run(g: Any, case: dict[str, Any]) -> dict[str, int]:
    """Run ``case`` on this rank (see the module); what it checked, counted."""
    r, n = g.rank, g.world_size
    p = plan(case, n)
    part = p.initial[r].copy()
    checked = 0
    async with await g.window(part) as win:
        assert win.counts == [len(a) for a in p.final], win.counts

        async def put_all() -> None:
            calls = [win.put(data, t, lo, signal=r if sig else None)
                     for t, lo, data, sig in p.puts[r]]
            if case["together"]:
                await asyncio.gather(*calls)
            else:
                for c in calls:
                    await c

        async def wait_for(writer: int, spans: list[tuple[int, int]]) -> int:
            await win.wait_signal(writer, len(spans))
            for lo, hi in spans:  # announced: in place
                np.testing.assert_array_equal(part[lo:hi], p.final[r][lo:hi],
                                              err_msg=f"rank {r}: {writer}'s signaled put")
            return sum(hi - lo for lo, hi in spans)

        waits = [wait_for(w, spans) for w, spans in sorted(p.signals[r].items())]
        if case["together"]:
            got = await asyncio.gather(put_all(), *waits)
            checked += sum(got[1:])
        else:
            await put_all()
            for w in waits:
                checked += await w
        await win.fence()
        np.testing.assert_array_equal(part, p.final[r], err_msg=f"rank {r}: after the fence")
        checked += part.size

        async def read(t: int, lo: int, hi: int) -> int:
            dst = np.full(hi - lo, 1, p.dtype)
            assert await win.get(dst, t, lo) is dst
            np.testing.assert_array_equal(dst, p.final[t][lo:hi],
                                          err_msg=f"rank {r}: get {lo}:{hi} of rank {t}")
            return hi - lo

        reads = [read(*x) for x in p.gets[r]]
        if case["together"]:
            checked += sum(await asyncio.gather(*reads))
        else:
            for c in reads:
                checked += await c
        t = (r + 1) % n
        for bad in (win.put(np.zeros(1, p.dtype), t, win.counts[t]),
                    win.get(np.zeros(2, p.dtype), t, win.counts[t] - 1)):
            try:
                await bad
            except CollectiveArgumentError:
                pass
            else:
                raise AssertionError("an out-of-range put/get was not refused")
        assert not g.broken
        for w in range(n):
            assert win.signals(w) == 0, f"rank {r}: counter {w} holds {win.signals(w)}"
        await win.fence()  # (nobody reads this rank's part any more before it changes)
    assert win.closed
    return {"checked": checked, "signals": sum(len(s) for s in p.signals[r].values()),
            "puts": len(p.puts[r]), "gets": len(p.gets[r])}
