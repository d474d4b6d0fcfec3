"""Issue 34's collectives on a real device: every operation (reduce, reduce_scatter, alltoall,
alltoallv, gather, scatter, send/recv, and allreduce with the new ops, out= and DLPack or
buffer inputs) against numpy element by element, several in flight on one group, subgroups
(split and subgroup) running at the same time, in groups of 2, 3 and 4 worker processes with
hypothesis-drawn sizes, dtypes, roots, counts and orders; and, in one process, ranks that
start collectives in different orders (every rank raises the typed error naming both) and a
recv of another shape.

As in test_collectives.py, each group size has one group of workers for the module (replaced
after a failure), and each hypothesis example is a list of cases the group runs back to back
(``collective_ops`` says what a case is; the test predicts every rank's results with numpy
from the same case). Receive slots are small and differ between ranks (a link of one slot
included), and the thresholds are low, so the cases' sizes run every algorithm (the written
one, :mod:`aiordma.services.collectives._written`, from 6,000-16,384 B).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aiordma
from aiordma.services.collectives import CollectiveMismatchError, Group
from aiordma.services.collectives.launch import free_port

from ..bounds import STEP
from .collective_group import Groups, play
from .collective_ops import ANY_DTYPES, OP_DTYPES

GROUPS: dict[int, dict[str, str]] = {
    2: {"loop": "uvloop", "slot_bytes": "1024", "slots": "2", "env": "torchrun",
        "thresholds": '{"allreduce": 2048, "reduce_scatter": 2048, "reduce": 2048, '
                      '"engine": 2048, "written": 16384, "written_allreduce": 16384}'},
    3: {"loop": "asyncio", "slot_bytes": "2048,4096,1024", "slots": "3,1,2", "env": "slurm",
        "thresholds": '{"allreduce": 4096, "broadcast": 512, "allgather": 4096, '
                      '"reduce_scatter": 1024, "reduce": 3000, "written": 6000, '
                      '"engine": 4096, "written_allreduce": 6000}'},
    4: {"loop": "uvloop", "slot_bytes": "4096,1024", "slots": "2,1", "env": "torchrun",
        "thresholds": '{"allreduce": 8192, "allgather": 1024, "reduce_scatter": 512, '
                      '"reduce": 512, "written": 12000, '
                      '"engine": 8192, "written_allreduce": 12000}'},
}


@pytest.fixture(scope="module")
def groups(rdma_device: Any) -> Iterator[Groups]:
    gs = Groups(rdma_device.name, GROUPS)
    yield gs
    gs.close()


# -- cases ------------------------------------------------------------------------------------

SEEDS = st.integers(0, 2**32 - 1)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=6) | st.sampled_from(
    [(0,), (3000,), (61, 33)])
ROWS = st.integers(0, 5) | st.sampled_from([200, 700])
REST = st.sampled_from([[], [3], [2, 2]])
RANK = st.integers(0, 3)  # taken modulo the group's size
OUT = st.booleans()
WRAP = st.sampled_from([None, "dlpack", "buffer"])


def _op(d: dict[str, Any]) -> dict[str, Any]:
    op, dtype = d.pop("od")
    return {**d, "op": op, "dtype": dtype}


def leaves() -> st.SearchStrategy[dict[str, Any]]:
    od = st.sampled_from(OP_DTYPES)
    shapes = st.lists(SHAPES.map(list), min_size=4, max_size=4)
    dtypes = st.lists(st.sampled_from(ANY_DTYPES), min_size=4, max_size=4)
    return st.one_of(
        st.fixed_dictionaries({"kind": st.just("allreduce"), "od": od, "shape": SHAPES.map(list),
                               "seed": SEEDS, "out": OUT, "wrap": WRAP}).map(_op),
        st.fixed_dictionaries({"kind": st.just("reduce"), "od": od, "shape": SHAPES.map(list),
                               "root": RANK, "seed": SEEDS, "out": OUT, "wrap": WRAP}).map(_op),
        st.fixed_dictionaries({"kind": st.just("reduce_scatter"), "od": od, "rows": ROWS,
                               "rest": REST, "seed": SEEDS, "out": OUT, "wrap": WRAP}).map(_op),
        st.fixed_dictionaries({"kind": st.just("alltoall"), "dtype": st.sampled_from(ANY_DTYPES),
                               "rows": ROWS, "rest": REST, "seed": SEEDS, "out": OUT,
                               "wrap": WRAP}),
        st.fixed_dictionaries({"kind": st.just("alltoallv"),
                               "dtype": st.sampled_from(ANY_DTYPES), "rest": REST,
                               "max_rows": st.sampled_from([0, 2, 5, 400]), "seed": SEEDS,
                               "recv": st.booleans()}),
        st.fixed_dictionaries({"kind": st.just("gather"), "root": RANK, "shapes": shapes,
                               "dtypes": dtypes, "seed": SEEDS, "out": OUT}),
        st.fixed_dictionaries({"kind": st.just("scatter"), "root": RANK, "shapes": shapes,
                               "dtypes": dtypes, "seed": SEEDS, "as_list": st.booleans(),
                               "out": OUT}),
        st.fixed_dictionaries({"kind": st.just("p2p"), "seed": SEEDS, "messages": st.lists(
            st.tuples(RANK, RANK, st.integers(0, 2), SHAPES.map(list),
                      st.sampled_from(ANY_DTYPES)).map(list), min_size=1, max_size=4)}),
    )


def older() -> st.SearchStrategy[dict[str, Any]]:
    """The collectives that were there before, with their arguments as they were."""
    return st.one_of(
        st.just({"kind": "barrier"}),
        st.fixed_dictionaries({"kind": st.just("broadcast"), "root": RANK,
                               "dtype": st.sampled_from(ANY_DTYPES), "shape": SHAPES.map(list),
                               "seed": SEEDS}),
        st.fixed_dictionaries({"kind": st.just("allgather"), "seed": SEEDS, "out": OUT,
                               "shapes": st.lists(SHAPES.map(list), min_size=4, max_size=4),
                               "dtypes": st.lists(st.sampled_from(ANY_DTYPES), min_size=4,
                                                  max_size=4)}),
    )


def inflight() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"kind": st.just("inflight"), "cases": st.lists(
        leaves() | older(), min_size=2, max_size=5)})


def subgroups() -> st.SearchStrategy[dict[str, Any]]:
    inner = st.lists(leaves() | older(), min_size=1, max_size=2)
    split = st.fixed_dictionaries({
        "kind": st.just("split"), "colors": st.lists(st.none() | st.integers(0, 2), min_size=4,
                                                     max_size=4),
        "keys": st.lists(st.integers(-2, 2), min_size=4, max_size=4), "cases": inner})
    sub = st.fixed_dictionaries({"kind": st.just("subgroup"),
                                 "ranks": st.lists(RANK, min_size=1, max_size=4, unique=True),
                                 "cases": inner})
    both = st.fixed_dictionaries({"kind": st.just("inflight"),
                                  "cases": st.lists(split | sub | leaves(), min_size=2,
                                                    max_size=3)})
    return split | sub | both


# -- every operation, several in flight, subgroups -----------------------------------------------

BIG = {"rows": 700, "rest": [3]}  # 2100 items per rank: over every threshold of GROUPS


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_operation_matches_numpy(groups: Groups, tmp_path_factory: Any,
                                       world: int) -> None:
    out_dir = str(tmp_path_factory.mktemp(f"ops{world}"))

    @given(ops=st.lists(leaves(), min_size=1, max_size=3))
    @example(ops=[
        {"kind": "reduce_scatter", "op": "sum", "dtype": "float32", **BIG, "seed": 1,
         "out": False, "wrap": None},
        {"kind": "reduce_scatter", "op": "bxor", "dtype": "int64", "rows": 2, "rest": [],
         "seed": 2, "out": True, "wrap": "dlpack"},
        {"kind": "reduce", "op": "avg", "dtype": "float64", "shape": [3000], "root": 1,
         "seed": 3, "out": True, "wrap": "buffer"}]).via("the ring and the direct paths")
    @example(ops=[
        {"kind": "reduce", "op": "min", "dtype": ">i4", "shape": [5], "root": 3, "seed": 4,
         "out": False, "wrap": None},
        {"kind": "alltoallv", "dtype": "float64", "rest": [2], "max_rows": 400, "seed": 5,
         "recv": True},
        {"kind": "alltoallv", "dtype": "S3", "rest": [], "max_rows": 0, "seed": 6,
         "recv": False}]).via("a tree reduce; alltoallv of large and of empty blocks")
    @example(ops=[
        {"kind": "gather", "root": 1, "shapes": [[3000], [0], [2, 3], []],
         "dtypes": ["float64", "int8", "S3", "bool"], "seed": 7, "out": False},
        {"kind": "scatter", "root": 2, "shapes": [[3000], [], [2, 0], [5]],
         "dtypes": ANY_DTYPES[:4], "seed": 8, "as_list": True, "out": False},
        {"kind": "p2p", "seed": 9, "messages": [[0, 1, 0, [3000], "float64"],
                                                [0, 1, 0, [2], "int8"], [1, 0, 2, [], "S3"]]},
    ]).via("gather, scatter and send/recv, large and small")
    @example(ops=[
        {"kind": "alltoall", "dtype": "complex64", **BIG, "seed": 10, "out": True,
         "wrap": None},
        {"kind": "allreduce", "op": "avg", "dtype": "float16", "shape": [61, 33], "seed": 11,
         "out": False, "wrap": "dlpack"}]).via("alltoall; allreduce avg in place via DLPack")
    def run(ops: list[dict[str, Any]]) -> None:
        play(groups, world, ops, out_dir)

    run()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_several_in_flight_match_numpy(groups: Groups, tmp_path_factory: Any,
                                       world: int) -> None:
    out_dir = str(tmp_path_factory.mktemp(f"inflight{world}"))
    buckets = [{"kind": "allreduce", "op": "sum", "dtype": "float32", "shape": [n],
                "seed": i, "out": False, "wrap": None}
               for i, n in enumerate([5, 3000, 1, 0, 2500, 7, 4000, 64])]

    @given(ops=st.lists(inflight(), min_size=1, max_size=2))
    @example(ops=[{"kind": "inflight", "cases": buckets}]).via("8 allreduce buckets at once")
    @example(ops=[{"kind": "inflight", "cases": [
        {"kind": "broadcast", "root": 1, "dtype": "float64", "shape": [3000], "seed": 1},
        {"kind": "reduce_scatter", "op": "max", "dtype": "int32", **BIG, "seed": 2,
         "out": False, "wrap": None},
        {"kind": "barrier"},
        {"kind": "alltoall", "dtype": "int8", **BIG, "seed": 3, "out": False, "wrap": None},
        {"kind": "p2p", "seed": 4, "messages": [[1, 0, 1, [3000], "float64"]]},
    ]}]).via("every algorithm at once")
    def run(ops: list[dict[str, Any]]) -> None:
        play(groups, world, ops, out_dir)

    run()


@pytest.mark.parametrize("world", [3, 4])
def test_subgroups_run_at_the_same_time(groups: Groups, tmp_path_factory: Any,
                                        world: int) -> None:
    out_dir = str(tmp_path_factory.mktemp(f"sub{world}"))
    big_sum = {"kind": "allreduce", "op": "sum", "dtype": "float64", "shape": [3000],
               "seed": 1, "out": False, "wrap": None}

    @given(ops=st.lists(subgroups(), min_size=1, max_size=2))
    @example(ops=[{"kind": "split", "colors": [0, 1, 0, 1], "keys": [0, 0, 0, 0],
                   "cases": [big_sum, {"kind": "barrier"}]}]).via("halves, at the same time")
    @example(ops=[{"kind": "inflight", "cases": [
        {"kind": "subgroup", "ranks": [0, 1], "cases": [big_sum]},
        {"kind": "subgroup", "ranks": [2, 1, 0], "cases": [big_sum]},
        big_sum]}]).via("overlapping subgroups and the parent, all at once")
    @example(ops=[{"kind": "split", "colors": [None, 2, 2, None], "keys": [0, 1, -1, 0],
                   "cases": [{"kind": "p2p", "seed": 3,
                              "messages": [[0, 1, 0, [4], "int8"]]}]}]).via(
        "keys reorder a subgroup; ranks left out get None")
    def run(ops: list[dict[str, Any]]) -> None:
        play(groups, world, ops, out_dir)

    run()


# -- in one process: disorder, a recv of another shape ---------------------------------------------


async def form(device: Any, world: int) -> list[Group]:
    port = free_port()
    return list(await asyncio.gather(*(Group.join(r, world, "127.0.0.1", port, timeout=STEP,
                                                  device=device, slot_bytes=1024, slots=2)
                                       for r in range(world))))


KIND_CALLS = {
    "allreduce": lambda g: g.allreduce(np.ones(300)),
    "broadcast": lambda g: g.broadcast(np.ones(300), root=0),
    "barrier": lambda g: g.barrier(),
    "allgather": lambda g: g.allgather(np.ones(3)),
    "alltoall": lambda g: g.alltoall(np.ones(2 * g.world_size)),
    "reduce_scatter": lambda g: g.reduce_scatter(np.ones(2 * g.world_size)),
}
SENDS_TO_ALL = ["allreduce", "barrier", "allgather", "alltoall", "reduce_scatter"]
# Ranks that disagree must each hear of it well inside their groups' own bound (STEP): a
# result only at that bound would be a hang caught by the timer, not a detected mismatch.
MISMATCH_BOUND = STEP / 2


@settings(max_examples=4)  # each example forms its groups anew (the mismatch breaks them)
@given(world=st.integers(2, 3), kinds=st.lists(st.sampled_from(SENDS_TO_ALL), min_size=2,
                                               max_size=3, unique=True), data=st.data(),
       together=st.booleans())
@example(world=2, kinds=["allreduce", "broadcast"], data=None, together=False).via(
    "two ranks swap two collectives")
@example(world=3, kinds=["alltoall", "allreduce", "barrier"], data=None, together=True).via(
    "three in flight, one rank starts them in another order")
def test_another_order_is_a_typed_error_on_every_rank(rdma_device: Any, world: int,
                                                      kinds: list[str], data: Any,
                                                      together: bool) -> None:
    odd = world - 1
    orders = [list(kinds) for _ in range(world)]
    orders[odd] = list(reversed(kinds)) if data is None else data.draw(
        st.permutations(kinds).filter(lambda p: list(p) != kinds), label="the odd order")
    check_orders(rdma_device, orders, together)


@pytest.mark.parametrize("kinds", [["allreduce", "barrier", "allgather"],
                                   ["allgather", "barrier", "allreduce"]])
@pytest.mark.parametrize("world", [2, 3])
def test_another_order_after_the_engine_formed_is_typed_not_a_hang(rdma_device: Any,
                                                                   world: int,
                                                                   kinds: list[str]) -> None:
    """The last rank swaps the second and third of three collectives, one after another, all
    on the step engine (the first formed it): each rank's engine sees the other's WRITE as it
    arrives and names both kinds. At 3 ranks a barrier used to wait until the group's bound
    for a WRITE the allgather never makes; and a rank that got both ranks' WRITEs into one
    landing (a barrier's and an allreduce's) before its own call started said only "out of
    turn", naming neither kind (both found by hypothesis, 2026-11-29)."""
    check_orders(rdma_device, [kinds] * (world - 1) + [[kinds[0], kinds[2], kinds[1]]],
                 together=False)


def check_orders(device: Any, orders: list[list[str]], together: bool) -> None:
    """Every rank runs its ``orders`` (the last one another order of the others'), one after
    another or all at once; every rank must get a typed mismatch, one after another naming
    the first two kinds that differ, within the test's bound."""
    world, kinds, odd = len(orders), orders[0], orders[-1]

    async def rank(g: Group, order: list[str]) -> None:
        if together:
            await asyncio.gather(*(KIND_CALLS[k](g) for k in order))
        else:
            for k in order:
                await KIND_CALLS[k](g)

    async def main() -> list[Any]:
        gs = await form(device, world)
        try:
            return await asyncio.wait_for(asyncio.gather(
                *(rank(g, o) for g, o in zip(gs, orders, strict=True)), return_exceptions=True),
                MISMATCH_BOUND)
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    results = asyncio.run(main())
    first = next(i for i in range(len(kinds)) if odd[i] != kinds[i])
    pair = {kinds[first], odd[first]}
    for r, res in enumerate(results):
        assert isinstance(res, CollectiveMismatchError), f"rank {r}: {res!r}"
        if not together:  # (in flight, the first pair noticed may be another)
            assert all(k in str(res) for k in pair), f"rank {r}: {res}"


async def test_a_recv_of_another_shape_is_typed(rdma_device: Any) -> None:
    g0, g1 = await form(rdma_device, 2)
    try:
        await asyncio.wait_for(g0.send(np.arange(6.0), 1, tag=3), STEP)
        with pytest.raises(CollectiveMismatchError, match="shape"):
            await asyncio.wait_for(g1.recv(np.zeros(5), 0, tag=3), STEP)
        assert g1.broken
        with pytest.raises(aiordma.BrokenResourceError):
            await g1.barrier()
        # the sender hears of it (its group breaks too): its next collective fails at once
        with pytest.raises((CollectiveMismatchError, aiordma.BrokenResourceError)):
            await asyncio.wait_for(g0.barrier(), STEP)
    finally:
        await asyncio.gather(g0.aclose(), g1.aclose())


async def test_a_subgroup_waits_for_no_other(rdma_device: Any) -> None:
    """Rank 0 starts collectives on two subgroups at once; rank 1 starts its part of the
    first only once the second has finished: so the second ran while the first waited."""
    gs = await form(rdma_device, 3)
    try:
        first = [g.subgroup([0, 1]) for g in gs]
        second = [g.subgroup([0, 2]) for g in gs]
        second_done = asyncio.Event()
        x = [np.full(3000, r + 1.0) for r in range(3)]
        y = [np.full(5, r + 1.0) for r in range(3)]

        async def rank0() -> None:
            a = asyncio.ensure_future(first[0].allreduce(x[0]))  # type: ignore[union-attr]
            await second[0].allreduce(y[0])  # type: ignore[union-attr]
            assert not a.done()  # rank 1 has not started it yet
            second_done.set()
            await a

        async def rank1() -> None:
            await second_done.wait()
            await first[1].allreduce(x[1])  # type: ignore[union-attr]

        async def rank2() -> None:
            await second[2].allreduce(y[2])  # type: ignore[union-attr]

        assert first[2] is None and second[1] is None
        await asyncio.wait_for(asyncio.gather(rank0(), rank1(), rank2()), STEP)
        assert (x[0] == 3.0).all() and (x[1] == 3.0).all() and (x[2] == 3.0).all()
        assert (y[0] == 4.0).all() and (y[2] == 4.0).all() and (y[1] == 2.0).all()
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))


async def test_cancelling_one_of_several_in_flight_breaks_the_others_typed(
        rdma_device: Any) -> None:
    gs = await form(rdma_device, 2)
    try:
        arrays = [[np.ones(4000) for _ in range(3)] for _ in gs]
        # rank 1 takes part in the first only: the others wait on it, and rank 0's first is
        # cancelled while they do
        tasks0 = [asyncio.ensure_future(gs[0].allreduce(a)) for a in arrays[0]]
        task1 = asyncio.ensure_future(gs[1].allreduce(arrays[1][0]))
        await asyncio.wait_for(asyncio.shield(task1), STEP)
        await asyncio.sleep(0.2)
        tasks0[1].cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks0, return_exceptions=True), STEP)
        assert results[0] is arrays[0][0]
        assert isinstance(results[1], asyncio.CancelledError)
        assert isinstance(results[2], aiordma.BrokenResourceError), results[2]
        assert "another one failed" in str(results[2])
        assert gs[0].broken
        with pytest.raises(aiordma.BrokenResourceError):  # rank 1 hears of it too
            await asyncio.wait_for(gs[1].barrier(), STEP)
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))


async def test_links_with_small_message_slots(rdma_device: Any) -> None:
    """Every collectives message must fit one of the links' message slots (an operation that
    takes over reading a link cancels the background reader's recv(), which is safe only
    while no rendezvous message is being read): with 256 B slots everything still runs, and a
    description too long for a slot is a typed error, not a lost message."""
    port = free_port()
    config = aiordma.Config(slot_size=256)
    gs = await asyncio.gather(*(Group.join(r, 3, "127.0.0.1", port, timeout=STEP,
                                           device=rdma_device, config=config, slot_bytes=1024)
                                for r in range(3)))
    try:
        xs = [np.arange(3000, dtype=np.int64) * (r + 1) for r in range(3)]
        await asyncio.wait_for(asyncio.gather(*(g.allreduce(x) for g, x in zip(gs, xs))), STEP)
        assert all((x == np.arange(3000) * 6).all() for x in xs)
        parts = await asyncio.wait_for(asyncio.gather(
            *(g.allgather(np.full(7, g.rank, np.int8)) for g in gs)), STEP)
        assert [[int(p[0]) for p in got] for got in parts] == [[0, 1, 2]] * 3
        many = np.zeros(2, [(f"field{i}", "<i4") for i in range(40)])  # a long description
        results = await asyncio.wait_for(asyncio.gather(
            *(g.allgather(many) for g in gs), return_exceptions=True), STEP)
        assert all(isinstance(r, aiordma.AiordmaError) for r in results), results
        assert any(isinstance(r, aiordma.LocalProtocolError) and "slot_size" in str(r)
                   for r in results), results
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))
