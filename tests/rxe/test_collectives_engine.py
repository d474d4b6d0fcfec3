"""The step engine (services/collectives/_engine.py) on a real device: small allreduces run on
it, and only they; they give the links' results bit for bit (hypothesis over ops, dtypes
including byte-swapped ones, shapes, layouts, ``out=``, world sizes 2-4, and both runners:
the compiled one with its copies and typed loops, and ``AIORDMA_FASTPATH=0``'s Python one);
several started together run in the order they started; a disagreement of the same byte size
is a typed error; a rank killed mid-call fails the others promptly.

Each example forms two groups in this process, one with the engine and one with
``AIORDMA_COLL_ENGINE=0`` (read when a group's first small allreduce forms its engine).
Groups whose ranks are processes of their own run the engine in test_collectives.py and
test_collectives_set.py (their allreduces up to the threshold run on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiordma
from aiordma._verbs.compiled import fastpath
from aiordma.services.collectives import CollectiveMismatchError, Group, Thresholds
from aiordma.services.collectives._engine import ENV, Engine
from aiordma.services.collectives.launch import free_port

from ..bounds import PROMPT, STEP, load_factor
from .collective_group import Groups

OPS = {"sum": "biufc", "prod": "biufc", "min": "biuf", "max": "biuf", "avg": "fc",
       "band": "biu", "bor": "biu", "bxor": "biu"}
DTYPES = ["float32", "float64", ">f8", "float16", "int8", "int16", "int32", ">i4", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool", "complex64"]


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """The environment variables set (hypothesis refuses pytest's function-scoped
    monkeypatch)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine_calls(g: Group) -> int:
    e = g._engine.engine
    return e.runner.calls if isinstance(e, Engine) else 0


def check_engines(on: list[Group], off: list[Group], python: bool) -> None:
    """Every group of ``on`` formed its engine, on the Python runner if ``python`` or where
    the fast path is off, else on the compiled one; every group of ``off`` has none."""
    for g in on:
        assert isinstance(g._engine.engine, Engine)
        assert g._engine.engine.runner.compiled is (not python and fastpath() is not None)
    assert all(g._engine.off for g in off)


async def form(device: Any, world: int) -> list[Group]:
    port = free_port()
    return list(await asyncio.gather(*(Group.join(r, world, "127.0.0.1", port, timeout=STEP,
                                                  device=device)
                                       for r in range(world))))


async def engine_and_links(device: Any, world: int, python: bool) -> tuple[list[Group],
                                                                         list[Group]]:
    """Two groups of ``world`` ranks in this process, each having formed (or refused) its
    engine in a barrier: one on the engine (the Python runner if ``python``), one with
    ``AIORDMA_COLL_ENGINE=0`` (read as a group's engine forms), so the later calls' results
    can be compared."""
    on, off = await form(device, world), await form(device, world)
    try:
        with env(**{ENV: "0"}):
            await asyncio.gather(*(g.barrier() for g in off))
        with env(**({"AIORDMA_FASTPATH": "0"} if python else {})):
            await asyncio.gather(*(g.barrier() for g in on))
        check_engines(on, off, python)
    except BaseException:
        await asyncio.gather(*(g.aclose() for g in on + off))
        raise
    return on, off


def inputs(case: dict[str, Any], world: int) -> list[np.ndarray]:
    """Every rank's array: random bits for integers, random normals for floats (both ends of
    the range: wrapping sums, infinities and NaNs from products)."""
    dtype = np.dtype(case["dtype"])
    out = []
    for r in range(world):
        rng = np.random.default_rng([case["seed"], r])
        shape = tuple(case["shape"])
        n = int(np.prod(shape))
        if dtype.kind in "fc":
            base = (rng.standard_normal(n) * case["scale"]).astype(dtype)
        elif dtype.kind == "b":
            base = rng.integers(0, 2, n).astype(dtype)
        else:
            base = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
        base = base.reshape(shape)
        if case["layout"] == "f":
            base = np.asfortranarray(base)
        elif case["layout"] == "strided" and base.ndim:
            wide = np.zeros(base.shape[:-1] + (2 * base.shape[-1],), dtype)
            wide[..., ::2] = base
            base = wide[..., ::2]
        out.append(base)
    return out


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    kind = np.dtype(dtype).kind
    op = draw(st.sampled_from([o for o, kinds in OPS.items() if kind in kinds]))
    shape = draw(st.sampled_from([[0], [1], [3], [7, 5], [2, 3, 4], [1000], [4096 // 8]]))
    return {"dtype": dtype, "op": op, "shape": shape, "seed": draw(st.integers(0, 2**31)),
            "layout": draw(st.sampled_from(["c", "f", "strided"])), "out": draw(st.booleans()),
            "scale": draw(st.sampled_from([1.0, 1e30]))}


async def run_case(gs: list[Group], case: dict[str, Any]) -> list[bytes]:
    arrays = inputs(case, len(gs))
    if case["out"]:
        outs = [np.empty_like(a) for a in arrays]
        got = await asyncio.gather(*(g.allreduce(a, case["op"], out=o)
                                     for g, a, o in zip(gs, arrays, outs, strict=True)))
        assert all(x is o for x, o in zip(got, outs, strict=True))
    else:
        got = await asyncio.gather(*(g.allreduce(a, case["op"])
                                     for g, a in zip(gs, arrays, strict=True)))
        assert all(x is a for x, a in zip(got, arrays, strict=True))
    return [canonical(x) for x in got]


def canonical(x: np.ndarray) -> bytes:
    """``x``'s bytes with every NaN the same NaN: which NaN a sum or product of two NaNs is
    differs even within one numpy call (tests/unit/test_step_reduce.py)."""
    x = np.ascontiguousarray(x)
    if x.dtype.kind in "fc":
        x = x.copy()
        x[np.isnan(x)] = np.nan
    return x.tobytes()


@settings(deadline=None, max_examples=8)
@given(world=st.sampled_from([2, 3, 4]), python=st.booleans(),
       todo=st.lists(cases(), min_size=1, max_size=5))
def test_small_allreduces_on_the_engine_give_the_links_results_bit_for_bit(
        rdma_device: Any, world: int, python: bool, todo: list[dict[str, Any]]) -> None:
    async def main() -> None:
        on, off = await form(rdma_device, world), await form(rdma_device, world)
        try:
            with env(**{ENV: "0"}):  # (read as each group's engine forms)
                await run_case(off, todo[0])
            with env(**({"AIORDMA_FASTPATH": "0"} if python else {})):
                await run_case(on, todo[0])
            check_engines(on, off, python)
            for case in todo:
                theirs = await asyncio.wait_for(run_case(off, case), STEP)
                ours = await asyncio.wait_for(run_case(on, case), STEP)
                assert len(set(ours)) == 1, f"ranks differ: {case}"
                assert ours == theirs, f"the engine differs from the links: {case}"
            assert [engine_calls(g) for g in on] == [len(todo) + 1] * world
            assert [engine_calls(g) for g in off] == [0] * world
        finally:
            await asyncio.gather(*(g.aclose() for g in on + off))

    asyncio.run(main())


def test_several_in_flight_run_in_the_order_they_started(rdma_device: Any) -> None:
    """Eight small allreduces started together (sizes 8 B to 1 KiB) and a larger one among
    them (2 MiB: on the links): every result right, the small ones on the engine one at a
    time."""
    async def main() -> None:
        gs = await form(rdma_device, 3)
        try:
            sizes = [2 << k for k in range(8)] + [1 << 19]  # float32 elements; the last: 2 MiB

            async def rank(g: Group) -> list[np.ndarray]:
                arrays = [np.full(n, g.rank + k, np.float32) for k, n in enumerate(sizes)]
                return list(await asyncio.gather(*(g.allreduce(a) for a in arrays)))

            results = await asyncio.wait_for(asyncio.gather(*(rank(g) for g in gs)), STEP)
            for r, got in enumerate(results):
                for k, a in enumerate(got):
                    assert np.all(a == sum(q + k for q in range(3))), (r, k)
            assert [engine_calls(g) for g in gs] == [8, 8, 8]
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())


def test_a_disagreement_of_the_same_size_is_typed_on_the_engine(rdma_device: Any) -> None:
    """int32 on one rank, float32 on the other (the same bytes): the engine's signature check
    (the WRITE's immediate value) fails the call on every rank, typed, and the group breaks."""
    async def main() -> None:
        gs = await form(rdma_device, 2)
        try:
            ok = [np.ones(4, np.float32) for _ in gs]
            await asyncio.gather(*(g.allreduce(a) for g, a in zip(gs, ok, strict=True)))
            assert all(engine_calls(g) == 1 for g in gs)
            results = await asyncio.wait_for(asyncio.gather(
                gs[0].allreduce(np.arange(6, dtype=np.int32)),
                gs[1].allreduce(np.arange(6, dtype=np.float32)), return_exceptions=True), STEP)
            assert any(isinstance(r, CollectiveMismatchError) for r in results), results
            assert all(isinstance(r, aiordma.AiordmaError) for r in results), results
            assert all(g.broken for g in gs)
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())


@pytest.mark.parametrize("formed", [True, False], ids=["engine formed", "first call"])
def test_a_size_on_the_engine_against_one_on_the_links_is_typed_at_once(
        rdma_device: Any, formed: bool) -> None:
    """Rank 0 allreduces 400 B (the engine), rank 1 400 KB (past the engine's limit: the
    links' ring): a CollectiveMismatchError on both, long before the group's 30 s bound (the
    engine's rank sees the other's pieces arrive on its links for a call it runs on the
    engine), with the engine formed before or formed by that call."""
    async def main() -> None:
        port = free_port()
        gs = list(await asyncio.gather(*(Group.join(r, 2, "127.0.0.1", port, timeout=30,
                                                    device=rdma_device) for r in range(2))))
        try:
            if formed:
                await asyncio.gather(*(g.allreduce(np.ones(4)) for g in gs))
                assert all(engine_calls(g) == 1 for g in gs)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(
                gs[0].allreduce(np.ones(100, np.float32)),
                gs[1].allreduce(np.ones(100_000, np.float32)), return_exceptions=True), STEP)
            elapsed = time.monotonic() - t0
            assert all(isinstance(r, CollectiveMismatchError) for r in results), results
            assert elapsed < 10 * load_factor(), f"{elapsed:.1f} s"  # (the bound: 30 s)
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())


def test_ranks_whose_thresholds_differ_get_a_typed_error(rdma_device: Any) -> None:
    """Every rank must pass the same thresholds; ranks whose engines would differ in size
    (4 KiB against 64 KiB) find it out as the engine forms, typed, on both."""
    async def main() -> None:
        port = free_port()
        gs = list(await asyncio.gather(*(
            Group.join(r, 2, "127.0.0.1", port, timeout=STEP, device=rdma_device,
                       thresholds=Thresholds(engine=4096 if r == 0 else 65536))
            for r in range(2))))
        try:
            results = await asyncio.wait_for(asyncio.gather(
                *(g.allreduce(np.ones(25)) for g in gs), return_exceptions=True), STEP)
            assert all(isinstance(r, aiordma.AiordmaError) for r in results), results
            assert any("thresholds differ" in str(r) for r in results), results
            assert all(g.broken for g in gs)
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())


def mapping_of(arr: np.ndarray) -> Any:
    """The mapping under one of the group's buffers (``numpy.frombuffer`` of an ``mmap``),
    through any views."""
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def group_buffers(g: Group) -> list[np.ndarray]:
    """The group's own registered memory: its work buffers, its engine's, its receive slots."""
    plane = g._fabric.plane
    assert plane is not None
    found = [b.data for w in plane._all for b in w._bufs]
    found += [inb.slots for inb in plane.ins.values()]
    e = g._engine.engine
    if isinstance(e, Engine):
        found += [e._work, e._land]
    return found


def test_a_closed_group_lets_its_memory_go_while_still_referenced(rdma_device: Any) -> None:
    """Closing a group returns its buffers (work, engine, receive slots: mappings of their
    own) to the system, though the caller keeps the Group: at 4 ranks and 16 MiB allgathers a
    closed group held some 90 MiB per rank until its event loop ended (measured in the VM)."""
    async def main() -> list[weakref.ref[Any]]:
        gs = await form(rdma_device, 2)
        try:
            await asyncio.wait_for(asyncio.gather(*(g.allreduce(np.ones(64)) for g in gs)),
                                   STEP)  # (the engine, where it forms)
            got = await asyncio.wait_for(asyncio.gather(
                *(g.allgather(np.full(1 << 17, g.rank)) for g in gs)), STEP)  # 1 MiB each
            assert all((o[1] == 1).all() for o in got)
            bufs = [b for g in gs for b in group_buffers(g) if b.nbytes >= 1 << 20]
            assert bufs, "no buffer of 1 MiB or more"
            refs = [weakref.ref(mapping_of(b)) for b in bufs]
            del bufs
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))
        gc.collect()
        assert all(g.closed for g in gs)
        return refs

    refs = asyncio.run(main())
    assert [r() for r in refs] == [None] * len(refs)


@pytest.fixture(scope="module")
def groups(rdma_device: Any) -> Any:
    gs = Groups(rdma_device.name, {3: {"loop": "uvloop", "slot_bytes": "262144", "slots": "4",
                                       "env": "torchrun", "thresholds": "{}"}})
    yield gs
    gs.close()


def test_a_rank_killed_mid_call_fails_the_others_promptly(groups: Groups) -> None:
    """Ranks in processes of their own run 256 B allreduces back to back (on the engine); one
    is SIGKILLed: the others fail with BrokenResourceError within PROMPT (tests/bounds.py),
    not at the group's 60 s timeout."""
    g = groups.get(3)
    try:
        g.send({"loop": 64})
        assert g.answers(STEP) == ["STARTED"] * 3
        time.sleep(0.2)
        k = load_factor()
        g.kill(1)
        t0 = time.monotonic()
        answers = g.answers(STEP, ranks=[0, 2])
        elapsed = time.monotonic() - t0
        for line in answers:
            assert line.startswith("ERR "), line
            assert json.loads(line[4:])["broken"], line
        assert elapsed < PROMPT * k, f"the survivors took {elapsed:.1f} s"
    finally:
        groups.discard(3)
