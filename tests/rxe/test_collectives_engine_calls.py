"""Barriers, allgathers, broadcasts, alltoalls and reduce-scatters on the step engine
(services/collectives/_engine.py), on a real device: mixed with allreduces in any order, they
give what the links give (hypothesis over world sizes 2-4, both runners, roots, arrays whose
dtype and shape differ between ranks, ``out=``, non-roots passing None or an array to fill,
and blocks too large for the engine, which send every rank's call to the links and leave the
engine serving the next); a barrier returns on no rank before the last rank entered it; ranks
that disagree on which collective they run get a typed error, promptly.

Each example forms two groups in this process, one with the engine and one with
``AIORDMA_COLL_ENGINE=0``; the allreduce's own cases: test_collectives_engine.py; the
alltoall's and reduce-scatter's: test_collectives_engine_blocks.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiordma
from aiordma._verbs.compiled import fastpath
from aiordma.services.collectives import CollectiveMismatchError, Group
from aiordma.services.collectives.launch import free_port

from ..bounds import STEP, load_factor
from .test_collectives_engine import engine_and_links, engine_calls, env, form

DTYPES = ["float32", ">f8", "int8", "uint16", "bool", "complex64", "<U3", "V5"]
CAP = 1 << 20  # the engine's size with the default thresholds (up to 4 ranks)


def block(seed: int, rank: int, dtype: str, shape: list[int]) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dt).reshape(shape)


@st.composite
def calls(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["barrier", "allgather", "allgather_out", "allreduce",
                                 "broadcast", "alltoall", "reduce_scatter"]))
    shapes = [[0], [1], [3], [7, 5], [2, 3, 4], [1000], [(CAP + 8) // 8]]  # the last: too large
    if kind == "allgather":  # every rank its own dtype and shape
        per = draw(st.lists(st.tuples(st.sampled_from(DTYPES), st.sampled_from(shapes)),
                            min_size=4, max_size=4))
    else:
        per = [(draw(st.sampled_from(DTYPES)), draw(st.sampled_from(shapes)))] * 4
    return {"kind": kind, "per": per, "seed": draw(st.integers(0, 2**31))}


async def run_call(gs: list[Group], call: dict[str, Any]) -> list[Any]:
    """Every rank's result of ``call``, as bytes and descriptions (comparable across groups)."""
    kind = call["kind"]
    if kind == "barrier":
        return list(await asyncio.gather(*(g.barrier() for g in gs)))
    arrays = [block(call["seed"], g.rank, *call["per"][g.rank]) for g in gs]
    if kind == "broadcast":
        root = call["seed"] % len(gs)
        fill = call["seed"] % 3 == 0  # (else the others pass None)
        given = [a if g.rank == root else (np.empty_like(arrays[root]) if fill else None)
                 for g, a in zip(gs, arrays, strict=True)]
        got = await asyncio.gather(*(g.broadcast(x, root=root)
                                     for g, x in zip(gs, given, strict=True)))
        for x, y in zip(got, given, strict=True):
            assert x is y if y is not None else x.flags.owndata
            assert x.dtype == arrays[root].dtype and x.shape == arrays[root].shape
            assert x.tobytes() == arrays[root].tobytes()
        return [(x.dtype.str, x.shape, x.tobytes()) for x in got]
    if kind in ("alltoall", "reduce_scatter"):  # (a block per rank of the drawn shape)
        world, shape = len(gs), call["per"][0][1]
        arrays = [block(call["seed"], g.rank, call["per"][0][0], [world * shape[0], *shape[1:]])
                  for g in gs]
        if kind == "alltoall":
            got = await asyncio.gather(*(g.alltoall(a) for g, a in zip(gs, arrays, strict=True)))
        else:  # (bytes as uint8: any dtype reduces)
            got = await asyncio.gather(*(g.reduce_scatter(a.view(np.uint8), "bxor")
                                         for g, a in zip(gs, arrays, strict=True)))
        return [x.tobytes() for x in got]
    if kind == "allreduce":  # (bytes reinterpreted as uint8: any dtype sums)
        got = await asyncio.gather(*(g.allreduce(a.view(np.uint8).copy(), "bxor")
                                     for g, a in zip(gs, arrays, strict=True)))
        return [x.tobytes() for x in got]
    if kind == "allgather_out":
        outs = [np.empty((len(gs), *a.shape), a.dtype) for a in arrays]
        got = await asyncio.gather(*(g.allgather(a, out=o)
                                     for g, a, o in zip(gs, arrays, outs, strict=True)))
        assert all(x is o for x, o in zip(got, outs, strict=True))
        return [(x.dtype.str, x.shape, x.tobytes()) for x in got]
    got = await asyncio.gather(*(g.allgather(a) for g, a in zip(gs, arrays, strict=True)))
    for parts in got:
        for r, part in enumerate(parts):
            assert part.dtype == arrays[r].dtype and part.shape == arrays[r].shape
            assert part.tobytes() == arrays[r].tobytes(), f"rank {r}'s block"
            assert part.flags.owndata or part.base is not None  # (a copy: not engine memory)
    return [[(p.dtype.str, p.shape, p.tobytes()) for p in parts] for parts in got]


@settings(deadline=None, max_examples=8)
@given(world=st.sampled_from([2, 3, 4]), python=st.booleans(),
       todo=st.lists(calls(), min_size=1, max_size=6))
def test_barriers_and_allgathers_on_the_engine_give_the_links_results(
        rdma_device: Any, world: int, python: bool, todo: list[dict[str, Any]]) -> None:
    async def main() -> None:
        on, off = await engine_and_links(rdma_device, world, python)
        try:
            for call in todo:
                theirs = await asyncio.wait_for(run_call(off, call), STEP)
                ours = await asyncio.wait_for(run_call(on, call), STEP)
                assert ours == theirs, f"the engine differs from the links: {call['kind']}"
            sized = ("allreduce", "alltoall", "reduce_scatter")  # (on the links if too large)
            on_engine = 1 + sum(c["kind"] not in sized or int(np.prod(c["per"][0][1]))
                                * np.dtype(c["per"][0][0]).itemsize <= CAP for c in todo)
            assert [engine_calls(g) for g in on] == [on_engine] * world
            assert [engine_calls(g) for g in off] == [0] * world
        finally:
            await asyncio.gather(*(g.aclose() for g in on + off))

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["barrier", "broadcast"])
def test_a_barrier_returns_on_no_rank_before_the_last_entered(rdma_device: Any,
                                                              kind: str) -> None:
    """Three ranks, the last entering each call 50 ms after the others: on the engine, no
    rank's barrier, nor a broadcast on its root (rank 0), returns before that rank's call
    began, ten times in a row."""
    async def main() -> None:
        gs = await form(rdma_device, 3)
        try:
            await asyncio.gather(*(g.barrier() for g in gs))  # (forms the engine)
            entered: list[float] = []
            left: dict[int, list[float]] = {0: [], 1: []}
            data = np.arange(16, dtype=np.int32)

            def call(g: Group) -> Any:
                return g.barrier() if kind == "barrier" else g.broadcast(
                    data if g.rank == 0 else None, root=0)

            async def early(g: Group) -> None:
                for _ in range(10):
                    await call(g)
                    left[g.rank].append(time.monotonic())

            async def late(g: Group) -> None:
                for _ in range(10):
                    await asyncio.sleep(0.05)
                    entered.append(time.monotonic())
                    got = await call(g)
                    assert kind == "barrier" or np.array_equal(got, data)

            await asyncio.wait_for(asyncio.gather(early(gs[0]), early(gs[1]), late(gs[2])),
                                   STEP)
            for r in (0, 1):
                assert all(t > e for t, e in zip(left[r], entered, strict=True)), r
            assert [engine_calls(g) for g in gs] == [11, 11, 11]
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())


def test_a_barrier_against_an_allgather_is_typed_promptly(rdma_device: Any) -> None:
    """Rank 0 runs a barrier where rank 1 runs an allgather (both on the engine): a typed
    error on both, well before the group's 30 s bound, and the group is broken."""
    async def main() -> None:
        port = free_port()
        gs = list(await asyncio.gather(*(Group.join(r, 2, "127.0.0.1", port, timeout=30,
                                                    device=rdma_device) for r in range(2))))
        try:
            await asyncio.gather(*(g.barrier() for g in gs))
            assert all(engine_calls(g) == 1 for g in gs)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(
                gs[0].barrier(), gs[1].allgather(np.ones(3)), return_exceptions=True), STEP)
            elapsed = time.monotonic() - t0
            assert all(isinstance(r, aiordma.AiordmaError) for r in results), results
            assert any(isinstance(r, CollectiveMismatchError) for r in results), results
            assert all(g.broken for g in gs)
            assert elapsed < 10 * load_factor(), f"{elapsed:.1f} s"  # (the bound: 30 s)
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())


def test_an_allgather_into_out_with_another_shape_is_typed_on_the_engine(
        rdma_device: Any) -> None:
    async def main() -> None:
        gs = await form(rdma_device, 2)
        try:
            await asyncio.gather(*(g.barrier() for g in gs))
            arrays = [np.ones(4, np.float32), np.ones(5, np.float32)]
            results = await asyncio.wait_for(asyncio.gather(
                *(g.allgather(a, out=np.empty((2, 4), np.float32))
                  if g.rank == 0 else g.allgather(a)
                  for g, a in zip(gs, arrays, strict=True)), return_exceptions=True), STEP)
            assert isinstance(results[0], CollectiveMismatchError), results
            assert engine_calls(gs[0]) == 2
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())


@pytest.mark.parametrize("python", [False, True], ids=["compiled runner", "Python runner"])
@pytest.mark.parametrize("root_sends", ["another shape", "too large for the engine"])
def test_a_broadcast_into_an_array_that_does_not_match_is_typed(
        rdma_device: Any, root_sends: str, python: bool) -> None:
    """Rank 1 passes an array of 10 float32 to fill; root 0 sends 12 (on the engine), or an
    array past the engine's size (which takes the root to the links): a
    ``CollectiveMismatchError`` on rank 1 naming its shape, every rank's answer typed or the
    root's own array, well before the group's 30 s bound, and the group broken. With the
    compiled runner rank 1's call is a quick call (services/collectives/_quick.py: the
    runner copies out only what matches the rank's array); with the Python one, the general
    path's."""
    async def main() -> None:
        port = free_port()
        gs = list(await asyncio.gather(*(Group.join(r, 2, "127.0.0.1", port, timeout=30,
                                                    device=rdma_device) for r in range(2))))
        try:
            with env(**({"AIORDMA_FASTPATH": "0"} if python else {})):
                await asyncio.gather(*(g.barrier() for g in gs))
            quick = not python and fastpath() is not None
            assert all((g._engine.quick is not None) is quick for g in gs)
            sent = (np.arange(12, dtype=np.float32) if root_sends == "another shape"
                    else np.zeros(CAP // 4 + 16, np.float32))
            mine = np.zeros(10, np.float32)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(
                gs[0].broadcast(sent, root=0), gs[1].broadcast(mine, root=0),
                return_exceptions=True), STEP)
            elapsed = time.monotonic() - t0
            assert isinstance(results[1], CollectiveMismatchError), results
            assert "shape (10,)" in str(results[1]), results
            assert results[0] is sent or isinstance(results[0], aiordma.AiordmaError), results
            assert not mine.any()  # (nothing was copied into it)
            assert elapsed < 10 * load_factor(), f"{elapsed:.1f} s"  # (the bound: 30 s)
            with pytest.raises(aiordma.AiordmaError):
                await asyncio.wait_for(gs[0].barrier(), STEP)
            assert all(g.broken for g in gs)
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())
