"""One rank of area (h) for aiordma: ``python -m aiordma.services.collectives.launch -n N --
python -m aiordma.tools.bench.collective_worker --out DIR --sizes ... --loops asyncio,uvloop``.

For each loop in turn it forms a :class:`~aiordma.services.collectives.Group` from the
launcher's variables, times every case (:mod:`aiordma.tools.bench.collective_cases` says how),
checks every result, and closes the group; then it writes ``DIR/rank-<rank>.json`` with its own
call times and errors. The bench (:mod:`aiordma.tools.bench.collective_rows`) merges the ranks'
files. Every wait on another rank is bounded by the group's ``timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import numpy as np

from .collective_cases import COLLECTIVES, ROOT, check, initial

GROUP_TIMEOUT = 300.0  # formation, and each collective (a 16 MiB allgather of 4 ranks: seconds)


async def _case(g: Any, collective: str, nbytes: int, warmup: int, calls: int) -> list[float]:
    """Time one case on this rank; raises ``ValueError`` if a result is wrong."""
    mine = initial(g.rank, nbytes).copy()
    work = np.empty_like(mine)
    times: list[float] = []
    for i in range(warmup + calls):
        if collective == "allreduce":
            np.copyto(work, mine)
            call = g.allreduce(work)
        elif collective == "broadcast":
            if g.rank == ROOT:
                call = g.broadcast(mine, root=ROOT)
            else:
                work.fill(0)
                call = g.broadcast(work, root=ROOT)
        else:
            call = g.allgather(mine)
        await g.barrier()
        t0 = time.perf_counter()
        result = await call
        elapsed = time.perf_counter() - t0
        why = check(collective, g.rank, g.world_size, nbytes, result)
        if why:
            raise ValueError(why)
        if i >= warmup:
            times.append(elapsed)
    return times


async def _run(sizes: list[int], collectives: list[str], warmup: int,
               calls: int) -> dict[str, Any]:
    from aiordma.services.collectives import Group

    cases: list[dict[str, Any]] = []
    out: dict[str, Any] = {"cases": cases, "error": None}
    async with await Group.from_env(timeout=GROUP_TIMEOUT) as g:
        for collective in collectives:
            for nbytes in sizes:
                entry: dict[str, Any] = {"collective": collective, "bytes": nbytes,
                                         "times": [], "error": None}
                cases.append(entry)
                try:
                    entry["times"] = await _case(g, collective, nbytes, warmup, calls)
                except Exception as exc:  # noqa: BLE001  # reported per case; a broken group
                    entry["error"] = f"{type(exc).__name__}: {exc}"  # fails the cases after it
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="directory for rank-<rank>.json")
    p.add_argument("--sizes", required=True, help="bytes per rank, comma-separated")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--loops", default="asyncio,uvloop")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    collectives = a.collectives.split(",")
    rank = int(os.environ.get("RANK", "0"))
    doc: dict[str, Any] = {"system": "aiordma", "rank": rank,
                           "world": int(os.environ.get("WORLD_SIZE", "1")), "runs": {}}
    for loop in a.loops.split(","):
        if loop == "uvloop":
            import uvloop

            runner: Any = uvloop.run
        else:
            runner = asyncio.run
        try:
            doc["runs"][loop] = runner(_run(sizes, collectives, a.warmup, a.calls))
        except Exception as exc:  # noqa: BLE001  # the group did not form or close: say so
            doc["runs"][loop] = {"cases": [], "error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump(doc, f)
    # 0 even when a case failed: the errors are in the file, and a rank that exits non-zero
    # makes the launcher terminate the others before they write theirs.
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
