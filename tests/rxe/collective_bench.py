"""Timings of the collectives, for the docs' reports: run under a launcher, e.g.

    python -m aiordma.services.collectives.launch -n 4 -- python tests/rxe/collective_bench.py

Each rank runs every collective ``--repeat`` times after one warm-up, with a barrier before
each timed call (so all ranks start together); rank 0 prints the median, min and max of its
own wall time per call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from aiordma.services.collectives import Group


async def timed(g: Group, repeat: int, fn: Callable[[], Awaitable[Any]]) -> list[float]:
    await fn()  # warm-up: buffers registered
    out = []
    for _ in range(repeat):
        await g.barrier()
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def main(a: argparse.Namespace) -> None:
    async with await Group.from_env(timeout=120, slot_bytes=a.slot_bytes) as g:
        n = a.bytes // 4
        arr = np.ones(n, np.float32)
        small = np.ones(1, np.float32)
        rows: list[tuple[str, list[float]]] = [
            ("barrier", await timed(g, a.repeat, g.barrier)),
            ("allreduce 4 B", await timed(g, a.repeat, lambda: g.allreduce(small))),
            (f"allreduce {a.bytes} B float32",
             await timed(g, a.repeat, lambda: g.allreduce(arr))),
            (f"broadcast {a.bytes} B", await timed(
                g, a.repeat, lambda: g.broadcast(arr if g.rank == 0 else None, root=0))),
            (f"allgather {a.bytes} B per rank", await timed(g, a.repeat,
                                                           lambda: g.allgather(arr))),
        ]
        if g.rank == 0:
            print(f"world {g.world_size}, slot_bytes {a.slot_bytes}, {a.repeat} calls each, "
                  f"loop {a.loop}")
            for name, ts in rows:
                print(f"{name:32s} median {statistics.median(ts) * 1e3:8.2f} ms  "
                      f"min {min(ts) * 1e3:8.2f}  max {max(ts) * 1e3:8.2f}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=1 << 20)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--slot-bytes", type=int, default=256 << 10)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    args = p.parse_args()
    (uvloop.run if args.loop == "uvloop" else asyncio.run)(main(args))
