"""Area (h): collectives. aiordma's :class:`~aiordma.services.collectives.Group` under the local
launcher and, with ``--peers``, Open MPI (mpi4py) over rxe, shared memory and TCP, all timing
and checking the same cases (:mod:`aiordma.bench.collective_cases`).

One launch per world size runs every case, on every loop in turn for aiordma (a Python start in
the VM costs seconds, so the ranks are started once); one ``mpirun`` per world size and
transport. Each rank writes its call times to a file; :func:`merge_ranks` puts them together
(the slowest rank per call). A launch that fails or times out fails all its rows; a case whose
result was wrong on any rank fails its row.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .collective_cases import BATCH, COLLECTIVES, CONCURRENT, SMALL, summarize, timed_calls
from .measure import Results, Versus
from .peers import MPI_TRANSPORTS, PeerInstall, PeerRouteError, mpi_route, mpirun_argv
from .plan import Plan, size_name

__all__ = ["CollectiveSpec", "bind_mpi", "collective_specs", "merge_ranks",
           "run_collective_rows"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveSpec:
    """One row of area (h): ``run`` is the loop (aiordma) or the transport (Open MPI)."""

    key: str
    system: str
    run: str
    loop: str | None
    collective: str
    world: int
    nbytes: int
    how: str
    versus: tuple[Versus, ...] = ()

    @property
    def what(self) -> str:
        size = size_name(self.nbytes)
        if self.collective in CONCURRENT:
            how = "together (asyncio.gather)" if self.collective.endswith("gather") else \
                "one after another"
            return f"{BATCH} allreduces of {size}, {how}, {self.world} ranks"
        per = " per rank" if self.collective in ("allgather", "alltoall") else ""
        kind = {"allreduce": " float32 sum, in place",
                "reduce_scatter": " float32 sum, a block each"}.get(self.collective, "")
        return f"{self.collective} {size}{per},{kind} {self.world} ranks"


def case_key(collective: str, world: int, nbytes: int, who: str) -> str:
    return f"h.{collective}.{world}r.{nbytes}.{who}"


def collective_specs(plan: Plan, loops: list[str], *, peers: bool) -> list[CollectiveSpec]:
    """Every row of area (h), in the table's order: per case, aiordma on each loop, then (with
    ``peers``) Open MPI over rxe, shared memory and TCP."""
    timing = (f"{plan.coll_calls} timed calls ({timed_calls(SMALL, plan.coll_calls)} up to "
              f"{size_name(SMALL)}) after {plan.coll_warmup} warm-up, barrier before each; a "
              f"call's time is the slowest rank's; every result checked")
    specs = []
    for world in plan.coll_worlds:
        for collective in COLLECTIVES:
            for nbytes in plan.coll_sizes:
                rxe = case_key(collective, world, nbytes, "ompi-rxe")
                vs = (Versus(metric="call_us", base=rxe, base_metric="call_us",
                             label="Open MPI over rxe"),) if peers else ()
                for loop in loops:
                    specs.append(CollectiveSpec(
                        key=case_key(collective, world, nbytes, f"aiordma.{loop}"),
                        system="aiordma", run=loop, loop=loop, collective=collective,
                        world=world, nbytes=nbytes, versus=vs,
                        how=f"Group, launch -n {world}; {timing}"))
                if peers:
                    for t in MPI_TRANSPORTS.values():
                        specs.append(CollectiveSpec(
                            key=case_key(collective, world, nbytes, f"ompi-{t.name}"),
                            system=t.label, run=t.name, loop=None, collective=collective,
                            world=world, nbytes=nbytes,
                            how=f"mpi4py buffer calls, mpirun -np {world} --bind-to "
                                f"{'core' if bind_mpi(world) else 'none'}; {timing}"))
        if world == plan.coll_concurrent[0]:
            specs += _concurrent_specs(world, plan.coll_concurrent[1], loops, timing)
    return specs


def _concurrent_specs(world: int, nbytes: int, loops: list[str],
                      timing: str) -> list[CollectiveSpec]:
    """aiordma's pair of rows: the batch of allreduces together, beside one after another."""
    specs = []
    together, one_by_one = CONCURRENT
    for loop in loops:
        base = case_key(one_by_one, world, nbytes, f"aiordma.{loop}")
        for collective in CONCURRENT:
            vs = (Versus(metric="call_us", base=base, base_metric="call_us",
                         label=f"{BATCH} one after another"),) if collective == together else ()
            specs.append(CollectiveSpec(
                key=case_key(collective, world, nbytes, f"aiordma.{loop}"), system="aiordma",
                run=loop, loop=loop, collective=collective, world=world, nbytes=nbytes,
                versus=vs, how=f"Group, launch -n {world}; a call is {BATCH} allreduces "
                               f"(separate arrays); {timing}"))
    return specs


def merge_ranks(docs: dict[int, dict[str, Any]], world: int,
                failure: str) -> dict[tuple[str, str, int], dict[str, Any] | str]:
    """(run, collective, bytes) -> the case's figures (:func:`summarize`), or why it failed.

    ``docs`` maps rank to its file; a missing rank fails every case with ``failure`` (what
    the launch said) added.
    """
    missing = [r for r in range(world) if r not in docs]
    if missing:
        why = f"rank(s) {missing} wrote no results: {failure}"
        return {k: why for k in _case_keys(docs.values())}
    out: dict[tuple[str, str, int], dict[str, Any] | str] = {}
    for key in _case_keys(docs.values()):
        run, collective, nbytes = key
        times, errors = [], []
        for r in range(world):
            entry = docs[r]["runs"].get(run, {})
            case = next((c for c in entry.get("cases", []) if c["collective"] == collective
                         and c["bytes"] == nbytes), None)
            if entry.get("error"):
                errors.append(f"rank {r}: {entry['error']}")
            elif case is None:
                errors.append(f"rank {r}: no result")
            elif case["error"]:
                errors.append(f"rank {r}: {case['error']}")
            else:
                times.append(case["times"])
        try:
            out[key] = "; ".join(errors) if errors else summarize(times)
        except ValueError as exc:
            out[key] = str(exc)
    return out


def _case_keys(docs: Any) -> list[tuple[str, str, int]]:
    keys: dict[tuple[str, str, int], None] = {}
    for doc in docs:
        for run, entry in doc["runs"].items():
            for c in entry.get("cases", []):
                keys[(run, c["collective"], c["bytes"])] = None
    return list(keys)


def _run_group(cmd: list[str], timeout: float, cwd: str,
               env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group (the launcher and its ranks, or mpirun and its
    ranks); at the deadline the whole group is killed. (exit status or None, output)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=cwd, env=env, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return None, out + f"\n(killed after {timeout:.0f} s)"


def _read_ranks(folder: str) -> dict[int, dict[str, Any]]:
    docs = {}
    for path in Path(folder).glob("rank-*.json"):
        doc = json.loads(path.read_text())
        docs[int(doc["rank"])] = doc
    return docs


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def _worker_args(plan: Plan) -> list[str]:
    return ["--sizes", ",".join(map(str, plan.coll_sizes)), "--warmup", str(plan.coll_warmup),
            "--calls", str(plan.coll_calls)]


def _concurrent_args(plan: Plan, world: int) -> list[str]:
    """aiordma's ranks only: the batch of allreduces, at the plan's world size."""
    ranks, nbytes = plan.coll_concurrent
    return ["--concurrent", str(nbytes)] if world == ranks else []


def bind_mpi(world: int, cpus: int | None = None) -> bool:
    """Whether Open MPI's ranks are bound each to a core: where there is a core for each, as
    ``mpirun`` does by default for up to 2 ranks (``--bind-to core``). Measured in the VM on
    2026-11-26 (2 ranks, allreduce over rxe, one boot): bound, 0.2 ms at 4 KiB and 17-46 ms at
    1 MiB; unbound, 8-10 ms and 58-84 ms. With more ranks than cores (4 ranks on 2 vCPUs)
    ``mpirun`` refuses to bind them."""
    return world <= (len(os.sched_getaffinity(0)) if cpus is None else cpus)


def _netdev(device: str, port: int, gid_index: int) -> str:
    """The network interface behind ``device``'s GID (Open MPI's TCP BTL is kept to it)."""
    path = f"/sys/class/infiniband/{device}/ports/{port}/gid_attrs/ndevs/{gid_index}"
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "lo"


def _how_it_ended(status: int | None, out: str, specs: list[CollectiveSpec],
                  merged: dict[tuple[str, str, int], dict[str, Any] | str]) -> str:
    """Why the cases no rank reported were not run: the first case that failed (the ranks
    stop there), else the launch's exit status and last lines."""
    for s in specs:
        if isinstance(merged.get((s.run, s.collective, s.nbytes)), str):
            return f"status {status}, after {s.what} failed"
    return f"status {status}: {_tail(out)}"


def _record(results: Results, specs: list[CollectiveSpec],
            merged: dict[tuple[str, str, int], dict[str, Any] | str], *, output: str,
            proof: str | None, ended: str) -> None:
    """Record each spec's figures or failure; ``ended``: how the launch ended (for cases no
    rank reported)."""
    for i, s in enumerate(specs):
        if i:
            output = ""  # the launch's output is kept once, with its first row
        meta: dict[str, Any] = {"area": "h", "what": s.what, "system": s.system,
                                "loop": s.loop, "how": s.how, "versus": list(s.versus)}
        got = merged.get((s.run, s.collective, s.nbytes),
                         f"not run: the launch ended before this case ({ended})")
        if isinstance(got, str):
            results.fail(s.key, got, output=output or None, **meta)
            print(f"  [h] {s.system} {s.loop or ''}: {s.what}: FAILED ({got})", flush=True)
            continue
        values = {k: got[k] for k in ("call_us", "call_min_us", "call_max_us")}
        results.record(s.key, values, proof=proof, output=output or None, **meta)
        print(f"  [h] {s.system} {s.loop or ''}: {s.what}: {values['call_us'] / 1e3:.2f} ms "
              f"per call [{values['call_min_us'] / 1e3:.2f}..{values['call_max_us'] / 1e3:.2f}]",
              flush=True)


def run_collective_rows(plan: Plan, *, loops: list[str], dev: Any, results: Results,
                        peers: PeerInstall | None) -> None:
    """One repeat of area (h): aiordma's launches, then Open MPI's (with ``peers``)."""
    specs = collective_specs(plan, loops, peers=peers is not None)
    for s in specs:  # the table lists each case's systems together
        results.declare(s.key, area="h", what=s.what, system=s.system, loop=s.loop, how=s.how,
                        versus=list(s.versus))
    for world in plan.coll_worlds:
        mine = [s for s in specs if s.world == world and s.system == "aiordma"]
        with tempfile.TemporaryDirectory(prefix="aiordma-bench-h-") as d:
            cmd = [sys.executable, "-m", "aiordma.services.collectives.launch", "-n",
                   str(world), "--", sys.executable, "-m",
                   "aiordma.bench.collective_worker", "--out", d, "--loops",
                   ",".join(loops), *_worker_args(plan), *_concurrent_args(plan, world)]
            t0 = time.perf_counter()
            status, out = _run_group(cmd, plan.coll_timeout, d)
            merged = merge_ranks(_read_ranks(d), world, f"launcher status {status}: "
                                                        f"{_tail(out)}")
            ended = "launcher " + _how_it_ended(status, out, mine, merged)
        print(f"  [h] aiordma, {world} ranks: launch took {time.perf_counter() - t0:.1f} s",
              flush=True)
        _record(results, mine, merged, output=out, proof=None, ended=ended)
        if peers is None:
            continue
        for t in MPI_TRANSPORTS.values():
            theirs = [s for s in specs if s.world == world and s.run == t.name]
            with tempfile.TemporaryDirectory(prefix="aiordma-bench-h-mpi-") as d:
                program = [peers.mpi_python, str(Path(__file__).with_name("mpi_worker.py")),
                           "--out", d, "--transport", t.name, *_worker_args(plan)]
                cmd = mpirun_argv(peers, t.name, world, device=dev.name,
                                  netdev=_netdev(dev.name, dev.port, dev.gid_index),
                                  program=program, bind_to_core=bind_mpi(world))
                t0 = time.perf_counter()
                status, out = _run_group(cmd, plan.coll_timeout, d)
                docs = _read_ranks(d)
            merged = merge_ranks(docs, world, f"mpirun status {status}: {_tail(out)}")
            ended = "mpirun " + _how_it_ended(status, out, theirs, merged)
            proof = None
            try:
                proof = mpi_route(t.name, out, world, device=dev.name,
                                  mapped=docs.get(0, {}).get("mapped", []))
            except PeerRouteError as exc:
                merged = {k: f"route not proven: {exc}" for k in merged} or {
                    (t.name, s.collective, s.nbytes): f"route not proven: {exc}"
                    for s in theirs}
            print(f"  [h] {t.label}, {world} ranks: mpirun took "
                  f"{time.perf_counter() - t0:.1f} s; {proof or 'route not proven'}",
                  flush=True)
            _record(results, theirs, merged, output=out, proof=proof, ended=ended)
