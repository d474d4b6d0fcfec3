"""One rank of area (h) for Open MPI: ``mpirun ... /usr/bin/python3 mpi_worker.py --out DIR
--sizes ...`` (run as a file, by Debian's interpreter, which has mpi4py; it does not import
aiordma, only its sibling :mod:`collective_cases`, so both systems time and check the same
cases the same way).

mpi4py's buffer calls, as an MPI user would write them: ``Allreduce(IN_PLACE, x, SUM)`` on
float32, ``Bcast(x, root=0)`` into an existing array, ``Allgather(x, out)`` into a
preallocated array of ``world`` blocks, ``Reduce_scatter_block(x, out, SUM)`` and
``Alltoall(x, out)`` into preallocated arrays. It writes ``DIR/rank-<rank>.json`` (the format of
:mod:`aiordma.bench.collective_worker`) after every case, with the MPI library's
version and which shared objects of the verbs stack the process had mapped (the bench's
evidence, beside Open MPI's own component selection, of what carried the data). An MPI error
or a case that outlives ``--case-timeout`` is recorded, then ends the job (``MPI_Abort``, or an
exit without ``MPI_Finalize``), so that nothing waits for a rank that gave up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from typing import Any

import numpy as np

try:  # as part of the package (tests, type checks)
    from .collective_cases import COLLECTIVES, ROOT, check, initial, timed_calls
except ImportError:  # as a file, by mpirun: the script's folder is on sys.path
    from collective_cases import (  # type: ignore[no-redef]
        COLLECTIVES,
        ROOT,
        check,
        initial,
        timed_calls,
    )


def _case(comm: Any, mpi: Any, collective: str, nbytes: int, warmup: int,
          calls: int) -> list[float]:
    rank, world = comm.Get_rank(), comm.Get_size()
    mine = initial(rank, nbytes).copy()
    work = np.empty_like(mine)
    gathered = np.empty(world * mine.size, dtype=mine.dtype)
    times: list[float] = []
    for i in range(warmup + calls):
        result: Any
        if collective == "allreduce":
            np.copyto(work, mine)
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(mpi.IN_PLACE, work, op=mpi.SUM)
            elapsed = time.perf_counter() - t0
            result = work
        elif collective == "broadcast":
            buf = mine if rank == ROOT else work
            if rank != ROOT:
                work.fill(0)
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Bcast(buf, root=ROOT)
            elapsed = time.perf_counter() - t0
            result = buf
        elif collective == "allgather":
            gathered.fill(0)
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allgather(mine, gathered)
            elapsed = time.perf_counter() - t0
            result = gathered.reshape(world, mine.size)
        elif collective == "reduce_scatter":
            block = work[:mine.size // world]
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Reduce_scatter_block(mine, block, op=mpi.SUM)
            elapsed = time.perf_counter() - t0
            result = block
        elif collective == "alltoall":
            work.fill(0)
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Alltoall(mine, work)
            elapsed = time.perf_counter() - t0
            result = work
        else:
            raise ValueError(f"unknown collective {collective!r}")
        why = check(collective, rank, world, nbytes, result)
        if why:
            raise ValueError(why)
        if i >= warmup:
            times.append(elapsed)
    return times


def _mapped_verbs_libraries() -> list[str]:
    """The verbs stack's shared objects this process has mapped (libibverbs, a provider,
    libfabric's), from /proc/self/maps."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if line.strip() else ""
            base = os.path.basename(path)
            if base.startswith(("libibverbs", "librxe", "libfabric", "librdmacm")):
                names.add(base)
    return sorted(names)


def _write(out: str, rank: int, doc: dict[str, Any]) -> None:
    """Write (replace) this rank's file: after every case, so that what was measured before a
    failure survives it."""
    path = os.path.join(out, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())  # (across two VMs: the bytes reach the shared folder first)
    os.replace(path + ".tmp", path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--transport", default="")
    p.add_argument("--case-timeout", type=float, default=120.0,
                   help="seconds for one case on this rank; then it records the timeout and "
                        "exits, which ends the job")
    a = p.parse_args()
    from mpi4py import MPI  # Debian's, for /usr/bin/python3 (imported after --help)

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    cases: list[dict[str, Any]] = []
    run: dict[str, Any] = {"cases": cases, "error": None}
    doc = {"system": "Open MPI", "rank": rank, "world": comm.Get_size(),
           "host": socket.gethostname(),
           "runs": {a.transport or "mpi": run},
           "library": MPI.Get_library_version().splitlines()[0].strip(),
           "mapped": _mapped_verbs_libraries()}
    # Size by size, every collective at each: a failure at one size (e.g. a message larger
    # than the device's max_msg_sz) ends the job, and only the cases after it are lost.
    for nbytes in (int(s) for s in a.sizes.split(",")):
        for collective in a.collectives.split(","):
            entry: dict[str, Any] = {"collective": collective, "bytes": nbytes, "times": [],
                                     "error": None}
            cases.append(entry)

            def expire(entry: dict[str, Any] = entry) -> None:
                entry["error"] = f"TimeoutError: no result within {a.case_timeout} s"
                _write(a.out, rank, doc)
                os._exit(3)  # a rank gone without MPI_Finalize: mpirun ends the job

            watchdog = threading.Timer(a.case_timeout, expire)
            watchdog.daemon = True
            watchdog.start()
            try:
                entry["times"] = _case(comm, MPI, collective, nbytes, a.warmup,
                                       timed_calls(nbytes, a.calls))
            except ValueError as exc:  # a wrong result; the ranks stay in step
                entry["error"] = f"ValueError: {exc}"
            except MPI.Exception as exc:  # the library failed: the ranks are out of step
                entry["error"] = f"MPI error: {exc}"
                _write(a.out, rank, doc)
                comm.Abort(4)
            finally:
                watchdog.cancel()
            _write(a.out, rank, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
