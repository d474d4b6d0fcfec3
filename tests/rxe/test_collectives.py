"""aiordma.services.collectives on a real device: groups of 2, 3 and 4 worker processes (formed from
torchrun's or srun's environment variables) against numpy, hypothesis over shapes, dtypes,
layouts, roots and sequences of collectives; a rank SIGKILLed mid-allreduce; the launcher;
and, in one process, formation failures and argument checks.

Worker processes cost 1-2 s each to start in the VM, so each group size has one group of
workers for the whole module, and every hypothesis example is a list of collectives that the
group runs back to back (a group that failed is replaced for the next example).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aiordma
from aiordma.services.collectives import (
    CollectiveArgumentError,
    CollectiveMismatchError,
    Group,
    RendezvousError,
)
from aiordma.protocols.collectives import Thresholds
from aiordma.services.collectives import _written
from aiordma.services.collectives.launch import free_port

from ..bounds import PROMPT, STEP, load_factor
from .collective_cases import ANY_DTYPES, REDUCE_DTYPES, expected_allreduce, make_input
from .collective_group import ROOT, Groups, run_cases

# PROMPT (tests/bounds.py): the bound on the survivors noticing a killed rank, measured
# from the kill to their answers on the pipe (so it includes reporting), x the load factor.

# Per world size: the workers' event loop, each rank's receive slots (ranks may differ:
# small slots split arrays into many pieces, and mixed sizes check that each writer splits
# by its receiver's slot size), and the sizes where the few-rounds algorithms give way to the
# ring ones: small, so that the cases' arrays run both kinds (with 2 ranks the broadcast and
# allgather algorithms are the same at every size); the step engine's size is the allreduce's,
# so the larger allreduces run on the links, and by the ring up to 1 MiB (the killed-rank
# tests' 256 KiB allreduces too).
GROUPS: dict[int, dict[str, str]] = {
    2: {"loop": "asyncio", "slot_bytes": "2048", "slots": "2", "env": "slurm",
        "thresholds": '{"allreduce": 4096, "engine": 4096, "written_allreduce": 1048576}'},
    3: {"loop": "uvloop", "slot_bytes": "8192", "slots": "4", "env": "torchrun",
        "thresholds": '{"allreduce": 4096, "broadcast": 512, "allgather": 20000, '
                      '"engine": 4096, "written_allreduce": 1048576}'},
    4: {"loop": "asyncio", "slot_bytes": "1024,2048,4096,8192", "slots": "1,2,3,4",
        "env": "torchrun",
        "thresholds": '{"allreduce": 20000, "broadcast": 4096, "allgather": 512, '
                      '"engine": 20000, "written_allreduce": 1048576}'},
}


@pytest.fixture(scope="module")
def groups(rdma_device: Any) -> Iterator[Groups]:
    gs = Groups(rdma_device.name, GROUPS)
    yield gs
    gs.close()


# -- cases ------------------------------------------------------------------------------------

SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=7) | st.sampled_from(
    [(0,), (1,), (2,), (3,), (2, 0, 3), (3000,), (7001,), (61, 33)])
SEEDS = st.integers(0, 2**32 - 1)
LAYOUTS = st.sampled_from(["c", "f", "strided"])


def cases(world: int) -> st.SearchStrategy[list[dict[str, Any]]]:
    allreduce = st.fixed_dictionaries({
        "kind": st.just("allreduce"), "op": st.sampled_from(["sum", "prod", "max", "min"]),
        "dtype": st.sampled_from(REDUCE_DTYPES), "shape": SHAPES, "layout": LAYOUTS,
        "seed": SEEDS})
    real_sum = st.fixed_dictionaries({
        "kind": st.just("allreduce"), "op": st.just("sum"),
        "dtype": st.sampled_from(["float32", "float64"]), "shape": SHAPES, "layout": LAYOUTS,
        "seed": SEEDS, "values": st.just("random")})
    broadcast = st.fixed_dictionaries({
        "kind": st.just("broadcast"), "root": st.integers(0, world - 1), "fill": st.booleans(),
        "dtype": st.sampled_from(ANY_DTYPES), "shape": SHAPES, "layout": LAYOUTS,
        "seed": SEEDS})
    allgather = st.fixed_dictionaries({
        "kind": st.just("allgather"), "shapes": st.lists(SHAPES, min_size=world, max_size=world),
        "dtypes": st.lists(st.sampled_from(ANY_DTYPES), min_size=world, max_size=world),
        "layout": LAYOUTS, "seed": SEEDS})
    barrier = st.just({"kind": "barrier", "seed": 0})
    return st.lists(allreduce | real_sum | broadcast | allgather | barrier, min_size=1,
                    max_size=3)


def same_bytes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), what


def check(world: int, ops: list[dict[str, Any]], outs: list[Any]) -> None:
    for i, case in enumerate(ops):
        kind = case["kind"]
        for r in range(world):
            what = f"case {i} ({kind}) on rank {r}"
            if kind == "allreduce":
                got, want = outs[r][f"c{i}"], expected_allreduce(case, world)
                assert got.dtype == make_input(case, r).dtype, what
                if case.get("values") == "random":
                    tol = 1e-5 if got.dtype == np.float32 else 1e-12
                    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)
                    same_bytes(got, outs[0][f"c{i}"], f"{what}: ranks differ")
                else:
                    np.testing.assert_array_equal(got, want, err_msg=what)
            elif kind == "broadcast":
                same_bytes(outs[r][f"c{i}"], make_input(case, case["root"]), what)
            elif kind == "allgather":
                for j in range(world):
                    same_bytes(outs[r][f"c{i}_{j}"], make_input(case, j), f"{what}, block {j}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_numpy(groups: Groups, tmp_path_factory: Any, world: int) -> None:
    out_dir = str(tmp_path_factory.mktemp(f"world{world}"))

    big, small = [7001], [3]  # 56 KiB of float64 and 24 B: both sides of every threshold

    @given(ops=cases(world))
    @example(ops=[
        {"kind": "allreduce", "op": "sum", "dtype": "float64", "shape": big, "layout": "c",
         "seed": 1, "values": "random"},
        {"kind": "allreduce", "op": "max", "dtype": "int32", "shape": small, "layout": "strided",
         "seed": 2}]).via("allreduce: ring and recursive doubling")
    @example(ops=[
        {"kind": "broadcast", "root": world - 1, "fill": True, "dtype": "float64", "shape": big,
         "layout": "c", "seed": 3},
        {"kind": "broadcast", "root": 0, "fill": False, "dtype": "int8", "shape": small,
         "layout": "c", "seed": 4}]).via("broadcast: chain and binomial tree")
    @example(ops=[
        {"kind": "allgather", "shapes": [big if r % 2 else small for r in range(world)],
         "dtypes": ["float64"] * world, "layout": "c", "seed": 5},
        {"kind": "allgather", "shapes": [small] * world, "dtypes": ["int8"] * world,
         "layout": "f", "seed": 6},
        {"kind": "barrier", "seed": 0}]).via("allgather: ring and direct; barrier")
    def run(ops: list[dict[str, Any]]) -> None:
        run_cases(groups, world, {"cases": ops, "out": out_dir})
        outs = [np.load(os.path.join(out_dir, f"rank{r}.npz")) for r in range(world)]
        check(world, ops, outs)

    run()


def test_barrier_waits_for_the_last_rank(groups: Groups) -> None:
    g = groups.get(3)
    # rank 0's head start, x the load factor (tests/bounds.py): the ranks get the command at
    # times that differ by more on a busy machine, and the check below keeps its margin
    delay = 0.3 * load_factor()
    times = g.run({"barrier": delay}, timeout=STEP)
    last_in = max(t["enter"] for t in times)
    assert times[0]["enter"] == last_in  # rank 0 slept first
    for r, t in enumerate(times):
        assert t["exit"] >= last_in, f"rank {r} left the barrier before rank 0 entered it"
    assert min(t["enter"] for t in times) <= last_in - delay * 0.8  # the others did wait


@pytest.mark.parametrize("world", [2, 3], ids=["world 2, asyncio", "world 3, uvloop"])
def test_common_small_calls_take_the_quick_path_and_let_the_loop_run(groups: Groups,
                                                                     world: int) -> None:
    """Small calls as users make them (an in-place allreduce, a broadcast into an array, an
    allgather, an allgather of a block of another size on every rank, and an allgather, a
    reduce-scatter and an alltoall into ``out=``, a barrier), back to back in processes of
    their own, 40 of each: all quick calls (services/collectives/_quick.py: none takes the
    general engine path; the allgather of mixed sizes is left open by its quick end, in its
    poll or after its wait, and ends the general way), all on the engine, every result
    numpy's; and a task beside them runs at least once every UNYIELDED (32) calls, also
    where the calls that give it its turn are those mixed allgathers (the worker starts
    them there; before 2026-11-29 such an open call did not turn the loop)."""
    from aiordma.services.collectives._quick import UNYIELDED

    answers = groups.get(world).run({"quick": 40}, timeout=STEP)
    for r, a in enumerate(answers):
        assert a["wrong"] == [], (r, a)
        assert a["engine_calls"] == a["calls"] == 8 * 40, (r, a)
        assert a["general"] == 0, (r, a)
        assert a["longest"] <= UNYIELDED, (r, a)


def test_groups_form_from_srun_and_torchrun_variables(groups: Groups, tmp_path: Any) -> None:
    # Groups.get checks each worker's "READY rank world" line: the ranks come from
    # SLURM_PROCID/SLURM_NTASKS (world 2) and RANK/WORLD_SIZE (worlds 3 and 4).
    for world in (2, 3):
        g = groups.get(world)
        assert sorted(g.ready) == [f"READY {r} {world}" for r in range(world)]
        ops = [{"kind": "allreduce", "op": "max", "dtype": "int32", "shape": [5, 2],
                "seed": world}]
        g.run({"cases": ops, "out": str(tmp_path)}, timeout=STEP)
        check(world, ops, [np.load(tmp_path / f"rank{r}.npz") for r in range(world)])


@pytest.mark.parametrize("world", [3, 4], ids=["world 3, uvloop", "world 4, asyncio"])
def test_a_killed_rank_fails_the_others_promptly(groups: Groups, world: int) -> None:
    # The module's group of that size (its last use: it is destroyed); its workers run the
    # loop GROUPS names, so both loops are covered. Its timeout is 60 s: the survivors must
    # notice the death, not time out.
    from .leaks import wait_released

    g = groups.get(world)
    try:
        g.send({"loop": 1 << 16})  # 256 KiB float32 allreduces, back to back
        assert g.answers(STEP) == ["STARTED"] * world
        time.sleep(0.2)  # well into later allreduces
        k = load_factor()
        g.kill(1)
        t0 = time.monotonic()
        answers = g.answers(STEP, ranks=[r for r in range(world) if r != 1])
        elapsed = time.monotonic() - t0
        for line in answers:
            assert line.startswith("ERR "), line
            assert json.loads(line[4:])["broken"], line  # a BrokenResourceError (or subclass)
        assert elapsed < PROMPT * k, (  # catalogue
            f"the survivors took {elapsed:.1f} s (factor {k:.1f}): {answers}")
        print(f"survivors failed {elapsed * 1000:.0f} ms after the kill: {answers}")
        wait_released(g.procs[1].pid)  # the kernel let go of the dead rank's verbs objects
    finally:
        groups.discard(world)


def test_a_rank_waiting_on_other_links_fails_when_a_neighbour_aborts(groups: Groups) -> None:
    """Rank 2 is stopped (SIGSTOP: its kernel keeps its connections open and answers for it,
    its process does nothing), then rank 1 is killed mid-allreduce. Rank 0 is then waiting only
    for rank 2's data (the ring: it receives from 2, and has sent what it can to 1): its links
    to rank 1 break, and that alone must fail its collective, promptly, with
    ``BrokenResourceError`` (a group whose rank left cannot complete anything), not leave it
    waiting for rank 2 until the group's timeout (60 s). Where a whole host vanishes, the
    ranks on the others notice at different times (those with something in flight to it by
    retry exhaustion, the others only by their keepalive), and each aborted rank must take its
    neighbours down with it: seen across two hosts (test_two_hosts_collectives.py), rank 0
    failed 15 s after rank 1."""
    g = groups.get(3)
    try:
        g.send({"loop": 1 << 16})  # 256 KiB float32 allreduces (the ring), back to back
        assert g.answers(STEP) == ["STARTED"] * 3
        g.procs[2].send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # ranks 0 and 1 stall behind rank 2
        k = load_factor()
        g.kill(1)
        t0 = time.monotonic()
        (line,) = g.answers(2 * STEP, ranks=[0])  # (the group's timeout is STEP)
        elapsed = time.monotonic() - t0
        assert line.startswith("ERR "), line
        assert json.loads(line[4:])["broken"], line
        assert elapsed < PROMPT * k, (  # catalogue
            f"rank 0 took {elapsed:.1f} s (factor {k:.1f}): {line}")
        print(f"rank 0 failed {elapsed * 1000:.0f} ms after rank 1 was killed: {line}")
    finally:
        g.procs[2].send_signal(signal.SIGCONT)
        groups.discard(3)


def test_the_launcher_runs_a_group_with_torchrun_variables(rdma_device: Any,
                                                           groups: Groups) -> None:
    groups.close()  # the workers of the tests above are no longer needed: free the CPUs
    worker = os.path.join(ROOT, "tests", "rxe", "collective_worker.py")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "aiordma.services.collectives.launch", "-n", "2", "--",
                          sys.executable, worker, "--script"], check=False, cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    # each rank's line whole, prefixed with its rank (as torchrun's)
    assert sorted(out.stdout.split("\n")[:-1]) == [f"[rank{r}]:CHECKED {r} 2" for r in range(2)]
    print(f"launcher: 2 ranks started, formed, checked and closed in "
          f"{time.monotonic() - t0:.1f} s")


# Open MPI's mpirun (ranks from OMPI_COMM_WORLD_RANK/SIZE, the rendezvous address passed on
# with -x) is make test's in test_two_hosts_mpirun.py: four ranks, every collective checked,
# two on each host. (A one-host copy of it ran here until 2026-11-27: the same launch and
# checks, 30 s of the device stage.)


# -- in one process: formation failures, argument checks ----------------------------------------


async def form(device: Any, world: int, ranks: list[int] | None = None, timeout: float = 30,
               worlds: list[int] | None = None) -> list[Any]:
    """Join ``ranks`` (default all) concurrently in this process; each result or exception."""
    port = free_port()
    ranks = list(range(world)) if ranks is None else ranks
    worlds = worlds or [world] * len(ranks)
    return await asyncio.gather(*(Group.join(r, w, "127.0.0.1", port, timeout=timeout,
                                             device=device, slot_bytes=1024)
                                  for r, w in zip(ranks, worlds, strict=True)),
                                return_exceptions=True)


async def close_all(results: list[Any]) -> None:
    await asyncio.gather(*(g.aclose() for g in results if isinstance(g, Group)))


async def test_a_duplicate_rank_fails_everyone(rdma_device: Any) -> None:
    t0 = time.monotonic()
    results = await form(rdma_device, 3, ranks=[0, 1, 1])
    await close_all(results)
    assert all(isinstance(r, RendezvousError) for r in results), results
    assert any("joined twice" in str(r) for r in results)
    assert time.monotonic() - t0 < 20  # refused at once, not at the 30 s timeout


async def test_a_world_size_mismatch_fails_everyone(rdma_device: Any) -> None:
    results = await form(rdma_device, 2, ranks=[0, 1, 2], worlds=[2, 3, 3], timeout=30)
    await close_all(results)
    assert all(isinstance(r, RendezvousError) for r in results), results


async def test_a_missing_rank_times_out(rdma_device: Any) -> None:
    t0 = time.monotonic()
    results = await form(rdma_device, 3, ranks=[0, 2], timeout=2)
    await close_all(results)
    assert all(isinstance(r, aiordma.OperationTimeout) for r in results), results
    assert time.monotonic() - t0 < 15


async def test_mismatched_collectives_raise_typed_errors_and_break_the_group(
        rdma_device: Any) -> None:
    g0, g1 = await form(rdma_device, 2)
    try:
        a = np.arange(6, dtype=np.int32)
        results = await asyncio.wait_for(asyncio.gather(
            g0.allreduce(a.copy()), g1.allreduce(a.astype(np.float32)),
            return_exceptions=True), STEP)
        assert any(isinstance(r, CollectiveMismatchError) for r in results), results
        assert all(isinstance(r, aiordma.AiordmaError) for r in results), results
        for g in (g0, g1):
            assert g.broken
            with pytest.raises(aiordma.BrokenResourceError):
                await g.barrier()
    finally:
        await close_all([g0, g1])


async def test_a_root_that_closes_right_after_its_broadcast_fails_no_one(
        rdma_device: Any) -> None:
    """A broadcast's root returns once it has written; it may close its group before the other
    rank has read the data. That rank still gets the data, and the credit it owes the closed
    root is not an error (the launcher test's script ends that way: it failed in a CI run)."""
    g0, g1 = await form(rdma_device, 2)
    try:
        data = np.arange(100, dtype=np.float64)  # one piece: the root needs no credit back
        await asyncio.wait_for(g1.broadcast(data, root=1), STEP)
        await asyncio.wait_for(g1.aclose(), STEP)
        got = await asyncio.wait_for(g0.broadcast(None, root=1), STEP)
        assert np.array_equal(got, data)
    finally:
        await close_all([g0, g1])


async def test_argument_errors_leave_the_group_usable(rdma_device: Any) -> None:
    g0, g1 = await form(rdma_device, 2)
    try:
        a = np.arange(4.0)
        with pytest.raises(CollectiveArgumentError):
            await g0.allreduce(a, op="mean")
        with pytest.raises(CollectiveArgumentError):
            await g0.allreduce(np.array(["x"]))
        ro = np.arange(3)
        ro.setflags(write=False)
        with pytest.raises(CollectiveArgumentError):
            await g0.allreduce(ro)
        with pytest.raises(CollectiveArgumentError):
            await g0.broadcast(a, root=2)
        with pytest.raises(CollectiveArgumentError):
            await g0.allgather(np.array([object()]))
        # two at once on each rank (once one at a time: BusyResourceError)
        await asyncio.wait_for(asyncio.gather(g0.barrier(), g0.barrier(), g1.barrier(),
                                              g1.barrier()), STEP)
        b = np.arange(4.0)
        await asyncio.wait_for(asyncio.gather(g0.allreduce(a), g1.allreduce(b)), STEP)
        np.testing.assert_array_equal(a, 2 * np.arange(4.0))
        np.testing.assert_array_equal(b, a)
    finally:
        await close_all([g0, g1])
    with pytest.raises(aiordma.ClosedResourceError):
        await g0.barrier()


@pytest.mark.parametrize("written", [True, False], ids=["written", "pieces"])
async def test_a_default_group_writes_large_arrays_or_takes_1_mib_pieces(
        rdma_device: Any, monkeypatch: pytest.MonkeyPatch, written: bool) -> None:
    """A group formed with the defaults receives in 2 slots of 1 MiB per link, and writes
    arrays of 1 MiB and more straight into place (the claims of docs/guides/collectives.md,
    "Formation" and "Large arrays"), and allreduces past the step engine (1 MiB at 2
    ranks); with that off (``Thresholds(written=..., written_allreduce=...)``) they go as
    several 1 MiB pieces and a tail, the 1.5 MiB allreduce by the ring. Either way the allreduce,
    allgather, reduce_scatter and alltoall come out exact."""
    ran: list[str] = []
    for name in ("allreduce", "allgather", "alltoall", "reduce_scatter"):
        async def spy(*args: Any, _real: Any = getattr(_written, name), _name: str = name
                      ) -> Any:
            ran.append(_name)
            return await _real(*args)
        monkeypatch.setattr(_written, name, spy)
    limits = None if written else Thresholds(written=1 << 62, written_allreduce=1 << 62)
    port = free_port()
    gs = list(await asyncio.gather(*(Group.join(r, 2, "127.0.0.1", port, timeout=STEP,
                                                device=rdma_device, thresholds=limits)
                                     for r in range(2))))
    try:
        for g in gs:
            plane = g._fabric.plane
            assert [(i.count, i.size) for i in plane.ins.values()] == [(2, 1 << 20)]
        n = (5 << 20) // 4 + 3  # 5 MiB and 12 B of float32: several 1 MiB pieces a step
        xs = [(np.arange(n) % 1000 + 7 * r).astype(np.float32) for r in range(2)]
        want = xs[0] + xs[1]
        parts = [x.copy() for x in xs]
        await asyncio.gather(*(g.allreduce(x) for g, x in zip(gs, xs, strict=True)))
        for x in xs:
            np.testing.assert_array_equal(x, want)
        ys = [x[:(1536 << 10) // 4].copy() for x in parts]  # 1.5 MiB: past the engine
        got = await asyncio.gather(*(g.allreduce(y, out=np.empty_like(y))
                                     for g, y in zip(gs, ys, strict=True)))
        for out in got:
            np.testing.assert_array_equal(out, ys[0] + ys[1])
        got = await asyncio.gather(*(g.allgather(x) for g, x in zip(gs, parts, strict=True)))
        for out in got:
            np.testing.assert_array_equal(out, np.stack(parts))
        ins = [p[:-1] for p in parts]  # (an even count: two equal chunks)
        got = await asyncio.gather(*(g.reduce_scatter(x) for g, x in zip(gs, ins, strict=True)))
        half = (n - 1) // 2
        for r, mine in enumerate(got):
            np.testing.assert_array_equal(mine, (ins[0] + ins[1])[r * half:(r + 1) * half])
        got = await asyncio.gather(*(g.alltoall(x) for g, x in zip(gs, ins, strict=True)))
        for r, mine in enumerate(got):
            np.testing.assert_array_equal(mine, np.concatenate(
                [x[r * half:(r + 1) * half] for x in ins]))
    finally:
        await close_all(gs)
    kinds = ["allreduce", "allreduce", "allgather", "alltoall", "reduce_scatter"]
    assert sorted(ran) == (sorted(kinds * 2) if written else [])


@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter", "alltoall"])
async def test_written_calls_that_differ_raise_the_mismatch_on_every_rank(
        rdma_device: Any, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """On the written path (here from 0 B, no step engine) ranks that pass arrays of the same
    size but another dtype learn it from the descriptors' exchange, before anything is
    written: every rank raises CollectiveMismatchError, and the group is broken."""
    exchanged: list[int] = []

    async def spy(*args: Any, _real: Any = _written.targets) -> Any:
        exchanged.append(1)
        return await _real(*args)

    monkeypatch.setattr(_written, "targets", spy)
    port = free_port()
    limits = Thresholds(written=0, written_allreduce=0, engine=0)
    gs = list(await asyncio.gather(*(Group.join(r, 2, "127.0.0.1", port, timeout=STEP,
                                                device=rdma_device, thresholds=limits)
                                     for r in range(2))))
    try:
        xs = [np.arange(4096, dtype=np.int32), np.arange(4096, dtype=np.float32)]
        results = await asyncio.wait_for(asyncio.gather(
            *(getattr(g, kind)(x) for g, x in zip(gs, xs, strict=True)),
            return_exceptions=True), STEP)
        assert all(isinstance(r, CollectiveMismatchError) for r in results), results
        assert all(g.broken for g in gs)
        assert len(exchanged) == 2  # (each rank's call took the written path)
    finally:
        await close_all(gs)


async def test_a_group_of_one(rdma_device: Any) -> None:
    async with await Group.join(0, 1, "127.0.0.1", free_port(), device=rdma_device) as g:
        a = np.arange(5)
        await g.barrier()
        assert await g.allreduce(a) is a
        assert (await g.allgather(a))[0].tolist() == a.tolist()
        assert await g.broadcast(a, root=0) is a
