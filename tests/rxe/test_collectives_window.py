"""Windows on a real device (issue 34, item 4): groups of 2 and 3 worker processes run
hypothesis-drawn window cases (``window_ops``: parts of different sizes, an empty one
included, one dtype per case, puts by any rank to any rank with and without signals, waits
per counter, a fence, reads of any range of any rank), every rank checking what it sees
element by element against the plan numpy derives; and, in one process, ranks that pass
different dtypes (a typed error on every rank), and a rank that dies while another waits for
its signal (the wait ends with ``BrokenResourceError``, well before the timeout).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import aiordma
from aiordma.services.collectives import CollectiveMismatchError, Group
from aiordma.services.collectives.launch import free_port

from ..bounds import STEP
from .collective_group import Groups, WorkerError
from .window_ops import plan

GROUPS: dict[int, dict[str, str]] = {
    2: {"loop": "uvloop", "slot_bytes": "1024", "slots": "2", "env": "torchrun",
        "thresholds": "{}"},
    3: {"loop": "asyncio", "slot_bytes": "2048,4096,1024", "slots": "3,1,2", "env": "slurm",
        "thresholds": "{}"},
}


@pytest.fixture(scope="module")
def groups(rdma_device: Any) -> Iterator[Groups]:
    gs = Groups(rdma_device.name, GROUPS)
    yield gs
    gs.close()


SIZES = st.lists(st.integers(0, 50) | st.sampled_from([0, 4096, 70000]), min_size=3,
                 max_size=3)
CASES = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1), "sizes": SIZES,
    "dtype": st.sampled_from(["float64", "int32", "uint8", ">i4", "complex64"]),
    "cuts": st.integers(0, 6), "gets": st.integers(0, 4), "together": st.booleans()})


@pytest.mark.parametrize("world", [2, 3])
def test_puts_gets_and_signals_match_the_plan(groups: Groups, world: int) -> None:
    @settings(max_examples=8)  # each example: a window made, used and closed by every rank
    @given(case=CASES)
    @example(case={"seed": 1, "sizes": [70000, 0, 4096], "dtype": "float64", "cuts": 6,
                   "gets": 4, "together": True}).via("large parts, an empty one, all at once")
    @example(case={"seed": 2, "sizes": [5, 3, 1], "dtype": ">i4", "cuts": 6, "gets": 3,
                   "together": False}).via("tiny parts, one after another")
    def run(case: dict[str, Any]) -> None:
        g = groups.get(world)
        try:
            answers = g.run({"window": case}, timeout=STEP)
        except WorkerError as exc:
            if not exc.usable:
                groups.discard(world)
            raise
        except BaseException:  # a worker did not answer: the group is out of step
            groups.discard(world)
            raise
        p = plan(case, world)
        for r, a in enumerate(answers):
            assert a["puts"] == len(p.puts[r]) and a["gets"] == len(p.gets[r]), (r, a)
            assert a["signals"] == sum(len(s) for s in p.signals[r].values()), (r, a)
            assert a["checked"] >= len(p.final[r]), (r, a)  # (its whole part, at least)
        assert sum(a["signals"] for a in answers) == sum(
            1 for puts in p.puts for *_, sig in puts if sig)

    run()


# -- in one process ---------------------------------------------------------------------------


async def form(device: Any, world: int, timeout: float = STEP) -> list[Group]:
    port = free_port()
    return list(await asyncio.gather(*(Group.join(r, world, "127.0.0.1", port, timeout=timeout,
                                                  device=device, slot_bytes=1024, slots=2)
                                       for r in range(world))))


async def test_ranks_that_pass_different_dtypes_get_a_typed_error(rdma_device: Any) -> None:
    gs = await form(rdma_device, 2)
    try:
        got = await asyncio.wait_for(asyncio.gather(
            gs[0].window(np.zeros(4, np.float64)), gs[1].window(np.zeros(4, np.float32)),
            return_exceptions=True), STEP)
        for r, res in enumerate(got):
            assert isinstance(res, CollectiveMismatchError), f"rank {r}: {res!r}"
            assert "dtype" in str(res)
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))


async def test_a_wait_for_a_signal_from_a_rank_that_dies_ends_broken(rdma_device: Any) -> None:
    gs = await form(rdma_device, 2, timeout=120.0)
    try:
        parts = [np.zeros(8, np.int64), np.zeros(8, np.int64)]
        wins = await asyncio.wait_for(asyncio.gather(
            *(g.window(a) for g, a in zip(gs, parts, strict=True))), STEP)
        await asyncio.wait_for(wins[1].put(np.arange(3), 0, 5, signal=1), STEP)
        await asyncio.wait_for(wins[0].wait_signal(1), STEP)
        assert parts[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 2]
        waiting = asyncio.ensure_future(wins[0].wait_signal(1))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        gs[1].abort()  # (as a process that dies: its connections close at once)
        with pytest.raises(aiordma.BrokenResourceError):
            await asyncio.wait_for(waiting, STEP)
        assert time.monotonic() - t0 < 100  # ended by the link, not by the group's 120 s
        assert gs[0].broken
        with pytest.raises(aiordma.BrokenResourceError):
            await wins[0].put(np.arange(3), 1, 0)
        await wins[0].aclose()  # (releases without a fence: the group is broken)
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))
