"""One rank of area (h) for aiordma: ``python -m aiordma.services.collectives.launch -n N --
python -m aiordma.bench.collective_worker --out DIR --sizes ... --loops asyncio,uvloop``
(or under ``mpirun`` across two hosts: :mod:`aiordma.bench.collective_wire`).

For each loop in turn it forms a :class:`~aiordma.services.collectives.Group` from the
launcher's variables (any launcher ``Group.from_env`` knows), times every case (:mod:`aiordma.bench.collective_cases` says how),
size by size, checks every result, and closes the group, rewriting ``DIR/rank-<rank>.json``
(its own call times and errors, and its host's name) after every case. The bench
(:mod:`aiordma.bench.collective_rows`) merges the ranks' files. Every wait on another
rank is bounded by the group's ``timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from typing import Any

import numpy as np

from .collective_cases import (
    BATCH,
    COLLECTIVES,
    CONCURRENT,
    ROOT,
    check,
    initial,
    timed_calls,
)

GROUP_TIMEOUT = 120.0  # formation, and each collective (a 16 MiB allgather of 4 ranks: seconds)


async def _case(g: Any, collective: str, nbytes: int, warmup: int, calls: int) -> list[float]:
    """Time one case on this rank; raises ``ValueError`` if a result is wrong."""
    mine = initial(g.rank, nbytes).copy()
    work = np.empty_like(mine)
    batch = [np.empty_like(mine) for _ in range(BATCH)] if collective in CONCURRENT else []
    # (allgather's: a block per rank, preallocated, as Open MPI's Allgather takes)
    gathered = np.empty((g.world_size, *mine.shape), mine.dtype) if collective == "allgather" \
        else work
    times: list[float] = []
    if collective == "allreduce":
        def call() -> Any:
            return g.allreduce(work)
    elif collective == "broadcast":
        def call() -> Any:
            return g.broadcast(mine if g.rank == ROOT else work, root=ROOT)
    elif collective == "allgather":
        def call() -> Any:
            return g.allgather(mine, out=gathered)
    elif collective == "reduce_scatter":
        block = np.empty(mine.size // g.world_size, dtype=mine.dtype)

        def call() -> Any:
            return g.reduce_scatter(mine, out=block)
    elif collective == "alltoall":
        def call() -> Any:
            return g.alltoall(mine, out=work)
    elif collective == "allreduce_x8_gather":
        def call() -> Any:
            return asyncio.gather(*(g.allreduce(b) for b in batch))
    elif collective == "allreduce_x8_loop":
        async def one_by_one() -> Any:
            return [await g.allreduce(b) for b in batch]

        def call() -> Any:
            return one_by_one()
    else:
        raise ValueError(f"unknown collective {collective!r}")
    for i in range(warmup + calls):
        if collective == "allreduce":
            np.copyto(work, mine)
        elif (collective == "broadcast" and g.rank != ROOT) or collective == "alltoall":
            work.fill(0)
        elif collective == "allgather":
            gathered.fill(0)
        for b in batch:
            np.copyto(b, mine)
        await g.barrier()
        t0 = time.perf_counter()
        result = await call()
        elapsed = time.perf_counter() - t0
        why = check(collective, g.rank, g.world_size, nbytes, result)
        if why:
            raise ValueError(why)
        if i >= warmup:
            times.append(elapsed)
    return times


def _write(out: str, rank: int, doc: dict[str, Any]) -> None:
    """Write (replace) this rank's file: after every case, so that what was measured before a
    failure or the launch's deadline survives it."""
    path = os.path.join(out, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())  # (across two VMs: the bytes reach the shared folder first)
    os.replace(path + ".tmp", path)


async def _run(sizes: list[int], collectives: list[str], warmup: int, calls: int,
               out: dict[str, Any], save: Any, keepalive: int = 0,
               concurrent: int = 0) -> None:
    from aiordma import Config
    from aiordma.services.collectives import Group

    config = Config(keepalive_idle=keepalive, keepalive_interval=1,
                    keepalive_probes=keepalive) if keepalive else None
    cases: list[dict[str, Any]] = out["cases"]
    async with await Group.from_env(timeout=GROUP_TIMEOUT, config=config) as g:
        # size by size, as Open MPI's ranks do (mpi_worker); then the concurrent pair
        todo = [(nbytes, c) for nbytes in sizes for c in collectives]
        todo += [(concurrent, c) for c in CONCURRENT if concurrent]
        for nbytes, collective in todo:
            entry: dict[str, Any] = {"collective": collective, "bytes": nbytes,
                                     "times": [], "error": None}
            cases.append(entry)
            try:
                entry["times"] = await _case(g, collective, nbytes, warmup,
                                             timed_calls(nbytes, calls))
            except Exception as exc:  # noqa: BLE001  # reported per case; a broken group
                entry["error"] = f"{type(exc).__name__}: {exc}"  # fails the cases after it
            save()


def _place() -> tuple[int, int]:
    """(rank, world size) as the launcher set them (the local launcher's and torchrun's
    ``RANK``, mpirun's ``OMPI_COMM_WORLD_*``, srun's), for the file's name; (0, 1) outside any
    launcher (the group then fails to form and the file says why)."""
    from aiordma.services.collectives import LaunchEnvironmentError, launch_environment

    try:
        env = launch_environment()
    except LaunchEnvironmentError:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return env.rank, env.world_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="directory for rank-<rank>.json")
    p.add_argument("--sizes", required=True, help="bytes per rank, comma-separated")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--loops", default="asyncio,uvloop")
    p.add_argument("--concurrent", type=int, default=0, metavar="BYTES",
                   help=f"also {BATCH} allreduces of BYTES together and one after another "
                        "(0: not)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--keepalive", type=int, default=0, metavar="S",
                   help="the links' keepalive: idle S s, then S probes 1 s apart (default: "
                        "aiordma's; across loaded emulated hosts a longer one avoids a false "
                        "alarm)")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    collectives = a.collectives.split(",")
    rank, world = _place()
    doc: dict[str, Any] = {"system": "aiordma", "rank": rank, "world": world,
                           "host": socket.gethostname(), "runs": {}}
    for loop in a.loops.split(","):
        if loop == "uvloop":
            import uvloop

            runner: Any = uvloop.run
        else:
            runner = asyncio.run
        run: dict[str, Any] = {"cases": [], "error": None}
        doc["runs"][loop] = run
        try:
            runner(_run(sizes, collectives, a.warmup, a.calls, run,
                        lambda: _write(a.out, rank, doc), a.keepalive, a.concurrent))
        except Exception as exc:  # noqa: BLE001  # the group did not form or close: say so
            run["error"] = f"{type(exc).__name__}: {exc}"
        _write(a.out, rank, doc)
    # 0 even when a case failed: the errors are in the file, and a rank that exits non-zero
    # makes the launcher terminate the others.
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
