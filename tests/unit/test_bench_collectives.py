"""Area (h) of the bench without a device: the cases' data and checks, the slowest-rank
summary, merging the ranks' files, the rows' keys, and the rank programs' argument handling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiordma.bench.collective_cases import (
    BATCH,
    COLLECTIVES,
    CONCURRENT,
    SMALL,
    check,
    expected_allreduce,
    initial,
    summarize,
    timed_calls,
)
from aiordma.bench.collective_rows import bind_mpi, case_key, collective_specs, merge_ranks
from aiordma.bench.plan import KIB, MIB, Plan


def test_initial_data_is_exact_in_float32_and_read_only() -> None:
    a = initial(3, 4 * KIB)
    assert a.dtype == np.float32 and a.size == KIB and not a.flags.writeable
    assert a[0] == 4 and a[250] == 4 * 251 and a[251] == 4
    total = sum(initial(r, 4 * KIB) for r in range(4))
    assert np.array_equal(total, expected_allreduce(4, 4 * KIB))
    with pytest.raises(ValueError):
        initial(0, 6)


@pytest.mark.parametrize("world", [2, 4])
def test_right_results_pass_every_check(world: int) -> None:
    n = 64 * KIB
    assert check("allreduce", 1, world, n, expected_allreduce(world, n).copy()) is None
    assert check("broadcast", 1, world, n, initial(0, n).copy()) is None
    assert check("allgather", 1, world, n, [initial(r, n) for r in range(world)]) is None
    stacked = np.stack([initial(r, n) for r in range(world)])  # mpi4py's one array
    assert check("allgather", 1, world, n, stacked) is None


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_alltoall_and_the_batch_are_checked(world: int) -> None:
    n = 4 * KIB
    blocks = [np.split(initial(r, n), world) for r in range(world)]
    total = np.split(expected_allreduce(world, n), world)
    for r in range(world):
        assert check("reduce_scatter", r, world, n, total[r].copy()) is None
        assert check("alltoall", r, world, n,
                     np.concatenate([blocks[q][r] for q in range(world)])) is None
        wrong = np.concatenate([blocks[q][(r + 1) % world] for q in range(world)])
        assert "wrong" in (check("alltoall", r, world, n, wrong) or "")
        assert "wrong" in (check("reduce_scatter", r, world, n,
                                 total[(r + 1) % world].copy()) or "")
    good = [expected_allreduce(world, n)] * BATCH
    for name in CONCURRENT:
        assert check(name, 0, world, n, good) is None
        assert "returned 7 arrays" in (check(name, 0, world, n, good[:-1]) or "")
        bad = [a.copy() for a in good]
        bad[3][0] = -1
        assert "array 3" in (check(name, 0, world, n, bad) or "")


def test_wrong_results_are_named() -> None:
    n = 4 * KIB
    bad = expected_allreduce(2, n).copy()
    bad[17] += 1
    assert "1 wrong elements, first at 17" in (check("allreduce", 0, 2, n, bad) or "")
    assert "wrong" in (check("broadcast", 1, 2, n, initial(1, n)) or "")  # not root's data
    assert "returned 1 arrays for 2 ranks" in (check("allgather", 0, 2, n, [initial(0, n)])
                                               or "")
    why = check("allgather", 0, 2, n, [initial(0, n), initial(0, n)])
    assert why is not None and "rank 1's block" in why
    assert "float32 x 10, expected float32 x 1024" in (check("allreduce", 0, 2, n,
                                                np.zeros(10, np.float32)) or "")
    with pytest.raises(ValueError):
        check("reduce", 0, 2, n, bad)


def test_a_call_takes_the_slowest_ranks_time() -> None:
    s = summarize([[1.0, 4.0, 2.0], [3.0, 1.0, 2.5]])  # calls: max 3, 4, 2.5
    assert s["calls_us"] == pytest.approx([3e6, 4e6, 2.5e6])
    assert s["call_us"] == pytest.approx(3e6)
    assert (s["call_min_us"], s["call_max_us"]) == pytest.approx((2.5e6, 4e6))
    bads: list[list[list[float]]] = [[], [[]], [[1.0], [1.0, 2.0]]]
    for bad in bads:
        with pytest.raises(ValueError):
            summarize(bad)


def _doc(rank: int, runs: dict[str, Any]) -> dict[str, Any]:
    return {"rank": rank, "world": 2, "runs": runs}


def _case(collective: str, nbytes: int, times: list[float],
          error: str | None = None) -> dict[str, Any]:
    return {"collective": collective, "bytes": nbytes, "times": times, "error": error}


def test_merging_the_ranks_files() -> None:
    docs = {0: _doc(0, {"uvloop": {"cases": [_case("allreduce", 4096, [1.0, 2.0]),
                                             _case("broadcast", 4096, [1.0, 1.0])],
                                   "error": None}}),
            1: _doc(1, {"uvloop": {"cases": [_case("allreduce", 4096, [1.5, 1.0]),
                                             _case("broadcast", 4096, [], "ValueError: x")],
                                   "error": None}})}
    merged = merge_ranks(docs, 2, "launch said nothing")
    ok = merged[("uvloop", "allreduce", 4096)]
    assert isinstance(ok, dict) and ok["calls_us"] == pytest.approx([1.5e6, 2e6])
    assert merged[("uvloop", "broadcast", 4096)] == "rank 1: ValueError: x"


def test_a_missing_rank_or_a_failed_run_fails_its_cases() -> None:
    one = {0: _doc(0, {"rxe": {"cases": [_case("allgather", 4096, [1.0])], "error": None}})}
    merged = merge_ranks(one, 2, "mpirun status 1: boom")
    assert merged == {("rxe", "allgather", 4096):
                      "rank(s) [1] wrote no results: mpirun status 1: boom"}
    docs = {r: _doc(r, {"asyncio": {"cases": [], "error": "OperationTimeout: no group"}})
            for r in range(2)}
    docs[0]["runs"]["uvloop"] = {"cases": [_case("allreduce", 4096, [1.0])], "error": None}
    docs[1]["runs"]["uvloop"] = {"cases": [], "error": "BrokenResourceError: gone"}
    merged = merge_ranks(docs, 2, "")
    assert merged[("uvloop", "allreduce", 4096)] == "rank 1: BrokenResourceError: gone"


def test_rows_of_area_h() -> None:
    quick, full = Plan.quick(), Plan()
    assert quick.coll_worlds == (2,) and set(quick.coll_sizes) <= set(full.coll_sizes)
    assert full.coll_worlds == (2, 4)
    assert full.coll_sizes == (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB)
    assert full.coll_concurrent == (4, MIB)
    plain = collective_specs(full, ["asyncio", "uvloop"], peers=False)
    assert len(plain) == 2 * len(COLLECTIVES) * 5 * 2 + 2 * 2  # + the concurrent pair per loop
    assert {s.system for s in plain} == {"aiordma"}
    assert [s.key for s in plain if s.versus] == [
        case_key("allreduce_x8_gather", 4, MIB, f"aiordma.{loop}") for loop in
        ("asyncio", "uvloop")]
    with_peers = collective_specs(full, ["uvloop"], peers=True)
    keys = [s.key for s in with_peers]
    assert len(keys) == len(set(keys)) == 2 * len(COLLECTIVES) * 5 * 4 + 2
    assert {"reduce_scatter", "alltoall"} <= set(COLLECTIVES)
    assert keys[:4] == [case_key("allreduce", 2, 4 * KIB, w) for w in
                        ("aiordma.uvloop", "ompi-rxe", "ompi-shm", "ompi-tcp")]
    for s in with_peers:
        for v in s.versus:
            assert v.base in keys
            assert v.base.endswith("ompi-rxe") or v.base == case_key(
                "allreduce_x8_loop", 4, MIB, "aiordma.uvloop")
    (spec,) = [s for s in with_peers if s.key == "h.allreduce_x8_gather.4r.1048576.aiordma.uvloop"]
    assert spec.what == "8 allreduces of 1 MiB, together (asyncio.gather), 4 ranks"
    (spec,) = [s for s in with_peers if s.key == "h.reduce_scatter.2r.65536.ompi-rxe"]
    assert spec.what == "reduce_scatter 64 KiB, float32 sum, a block each 2 ranks"
    (spec,) = [s for s in with_peers if s.key == "h.allgather.4r.16777216.aiordma.uvloop"]
    assert spec.what == "allgather 16 MiB per rank, 4 ranks"
    (spec,) = [s for s in with_peers if s.key == "h.allreduce.2r.65536.ompi-tcp"]
    assert spec.what == "allreduce 64 KiB, float32 sum, in place 2 ranks"
    assert spec.system == "Open MPI over TCP" and spec.loop is None


@pytest.mark.parametrize("argv", [
    ["-m", "aiordma.bench.collective_worker"],
    # run as files under other interpreters; --help needs neither mpi4py nor ucxx
    [str(Path(__file__).resolve().parents[2] / "aiordma/bench/mpi_worker.py")],
    [str(Path(__file__).resolve().parents[2] / "aiordma/bench/ucxx_worker.py")],
])
def test_rank_programs_describe_themselves(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "--sizes" in out.stdout or "--mode" in out.stdout


def test_the_mpi_rank_program_imports_the_cases_as_a_sibling(tmp_path: Path) -> None:
    # What /usr/bin/python3 does under mpirun: run the file, import collective_cases beside it
    # (mpi4py absent here: stop right after the imports).
    path = Path(__file__).resolve().parents[2] / "aiordma" / "bench" / "mpi_worker.py"
    code = (f"import runpy, sys; sys.argv = ['x']; sys.path.insert(0, {str(path.parent)!r}); "
            f"g = runpy.run_path({str(path)!r}, run_name='not_main'); "
            f"print(g['check'].__module__, g['COLLECTIVES'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "collective_cases"
    assert json.loads(out.stdout.split(" ", 1)[1].replace("'", '"').replace("(", "[")
                      .replace(")", "]")) == list(COLLECTIVES)


def test_cases_no_rank_reported_fail_with_how_the_launch_ended() -> None:
    from aiordma.bench.collective_rows import _record
    from aiordma.bench.measure import Results

    plan = Plan.quick()
    specs = [s for s in collective_specs(plan, ["uvloop"], peers=True) if s.run == "rxe"]
    first = specs[0]
    merged: dict[tuple[str, str, int], dict[str, Any] | str] = {
        (first.run, first.collective, first.nbytes):
            {"call_us": 2.0, "call_min_us": 1.0, "call_max_us": 3.0, "calls_us": [2.0]}}
    r = Results()
    _record(r, specs, merged, output="mpirun said this", proof="pml cm + mtl ofi",
            ended="mpirun status 4: MPI_ABORT was invoked")
    assert r.rows[first.key].metrics["call_us"].samples == [2.0]
    assert r.rows[first.key].proofs == ["pml cm + mtl ofi"]
    assert r.rows[first.key].outputs == ["mpirun said this"]  # kept once per launch
    rest = [r.rows[s.key] for s in specs[1:]]
    assert rest and all(row.failed and row.outputs == [] for row in rest)
    why = "not run: the launch ended before this case (mpirun status 4: MPI_ABORT was invoked)"
    assert rest[0].errors == [why]


def test_open_mpi_binds_its_ranks_where_each_has_a_core() -> None:
    assert bind_mpi(2, cpus=2) and bind_mpi(1, cpus=1)
    assert not bind_mpi(4, cpus=2) and not bind_mpi(2, cpus=1)
    specs = collective_specs(Plan.quick(), ["uvloop"], peers=True)
    (spec,) = [s for s in specs if s.key == "h.allreduce.2r.65536.ompi-rxe"]
    assert f"--bind-to {'core' if bind_mpi(2) else 'none'}" in spec.how


def test_small_cases_get_three_times_the_timed_calls_on_both_systems() -> None:
    """Up to 64 KiB a case times three times the plan's calls (its calls take milliseconds,
    and a median of five moved by up to 2x between runs); both workers ask timed_calls()."""
    assert SMALL == 64 << 10
    assert [timed_calls(n, 5) for n in (4096, SMALL, SMALL + 4, 1 << 20)] == [15, 15, 5, 5]
    for worker in ("collective_worker.py", "mpi_worker.py"):
        source = (Path(__file__).parents[2] / "aiordma" / "bench" / worker).read_text()
        assert "timed_calls(nbytes, " in source, worker
    (spec,) = [s for s in collective_specs(Plan(), ["uvloop"], peers=False)
               if s.key == "h.allreduce.2r.4096.aiordma.uvloop"]
    assert "5 timed calls (15 up to 64 KiB)" in spec.how
