"""Windows without a device: the range checks (hypothesis against a plain model), the signal
counters (consumed in order, waiters served first come first served, a waiter that leaves
gives nothing away), and every call on a group of one (which moves data by copying: the
argument handling, the results and the closed/timeout errors). Over RDMA the window is tested
in tests/rxe/test_collectives_window.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma import ClosedResourceError, OperationTimeout, UnsupportedOperationError
from aiordma.services.collectives import CollectiveArgumentError, Group, Window
from aiordma.services.collectives._window import Signals, element_span

from ..bounds import STEP
from .test_collectives_tcp import form


@given(offset=st.integers(-5, 40), count=st.integers(0, 40), size=st.integers(0, 40))
def test_a_span_is_accepted_exactly_when_it_lies_in_the_part(offset: int, count: int,
                                                              size: int) -> None:
    inside = 0 <= offset and offset + count <= size
    if inside:
        assert element_span(offset, count, size, 1, "put") == (offset, offset + count)
        assert element_span(np.int64(offset), count, size, 1, "put") == (offset, offset + count)
    else:
        with pytest.raises(CollectiveArgumentError, match="rank 1's part"):
            element_span(offset, count, size, 1, "put")


@pytest.mark.parametrize("bad", [1.0, "1", None, True])
def test_a_span_needs_an_int_offset(bad: Any) -> None:
    with pytest.raises(CollectiveArgumentError, match="offset must be an int"):
        element_span(bad, 1, 10, 0, "get")


@given(events=st.lists(st.tuples(st.sampled_from(["signal", "wait"]), st.integers(0, 1),
                                 st.integers(0, 3)), max_size=30))
def test_signals_are_consumed_in_order_and_never_twice(events: list[tuple[str, int, int]]) -> None:
    """Model: per counter, the arrived count and a FIFO of waits; a wait is served once the
    signals not consumed by the waits before it reach its count."""

    async def main() -> None:
        s = Signals()
        model_have = {0: 0, 1: 0}
        model_q: dict[int, list[int]] = {0: [], 1: []}
        futs: dict[int, list[tuple[int, asyncio.Future[None] | None]]] = {0: [], 1: []}
        for what, k, n in events:
            if what == "signal":
                s.signal(k, n)
                model_have[k] += n
            else:
                futs[k].append((n, s.take(k, n)))
                model_q[k].append(n)
            for c in (0, 1):  # the model serves its queue
                while model_q[c] and model_have[c] >= model_q[c][0]:
                    model_have[c] -= model_q[c].pop(0)
            await asyncio.sleep(0)
            for c in (0, 1):
                served = len(futs[c]) - len(model_q[c])
                for i, (_, f) in enumerate(futs[c]):
                    assert (f is None or f.done()) == (i < served), (c, i, served)
                assert s.counts.get(c, 0) == model_have[c]

    asyncio.run(main())


def test_a_waiter_that_leaves_takes_nothing_and_closing_fails_the_rest() -> None:
    async def main() -> None:
        s = Signals()
        first = s.take(0, 2)
        second = s.take(0, 1)
        assert first is not None and second is not None
        first.cancel()  # (as wait_signal does when it times out)
        s.signal(0)
        assert second.done() and s.counts[0] == 0
        third = s.take(0, 1)
        assert third is not None
        s.end(ClosedResourceError("the window is closed"))
        with pytest.raises(ClosedResourceError):
            third.result()
        with pytest.raises(ClosedResourceError):
            s.take(0, 1)

    asyncio.run(main())


def test_a_window_of_one_rank_puts_gets_signals_and_closes() -> None:
    async def main() -> None:
        g = await Group.join(0, 1, "127.0.0.1", 29500, timeout=5)
        part = np.zeros((2, 5), np.int32)
        async with await g.window(part) as win:
            assert isinstance(win, Window) and win.counts == [10]
            await win.put(np.array([7, 8, 9], np.int32), 0, 4, signal=3)
            assert part.reshape(-1).tolist() == [0, 0, 0, 0, 7, 8, 9, 0, 0, 0]
            assert win.signals(3) == 1
            await win.wait_signal(3)
            assert win.signals(3) == 0
            got = np.full((2, 2), -1, np.int32)
            assert await win.get(got, 0, 3) is got
            assert got.tolist() == [[0, 7], [8, 9]]
            await win.put(np.zeros(0, np.int32), 0, 10)  # empty, at the end: fine
            with pytest.raises(CollectiveArgumentError, match="outside"):
                await win.put(np.ones(3, np.int32), 0, 8)
            with pytest.raises(CollectiveArgumentError, match="int32"):
                await win.put(np.ones(3, np.int64), 0, 0)
            with pytest.raises(CollectiveArgumentError, match="rank"):
                await win.get(got, 1, 0)
            with pytest.raises(CollectiveArgumentError, match="signal"):
                await win.put(np.ones(1, np.int32), 0, 0, signal=-1)
            with pytest.raises(OperationTimeout, match="wait_signal"):
                await win.wait_signal(0, 1, timeout=0.05)
            assert not g.broken  # (a local wait: the group stays usable)
            waiting = asyncio.ensure_future(win.wait_signal(1, 2))
            await asyncio.sleep(0)
            await win.fence()
        with pytest.raises(ClosedResourceError):
            await waiting
        with pytest.raises(ClosedResourceError, match="window is closed"):
            await win.put(np.ones(1, np.int32), 0, 0)
        await win.aclose()  # idempotent
        ro = np.zeros(3)
        ro.setflags(write=False)
        for bad in (ro, np.zeros((4, 4))[:, 1], [1, 2]):
            with pytest.raises(CollectiveArgumentError):
                await g.window(bad)
        await g.aclose()

    asyncio.run(main())


def test_closing_a_subgroup_ends_its_windows_waits_at_once() -> None:
    """A wait_signal on a subgroup's window ends, typed, when that subgroup is closed (not at
    its timeout); the parent group goes on."""
    async def main() -> None:
        g = await Group.join(0, 1, "127.0.0.1", 29500, timeout=5)
        sub = g.subgroup([0])
        assert sub is not None
        win = await sub.window(np.zeros(4, np.int32))
        waiting = asyncio.ensure_future(win.wait_signal(0, 1, timeout=None))
        await asyncio.sleep(0)
        assert not waiting.done()
        await sub.aclose()
        with pytest.raises(ClosedResourceError, match="subgroup was closed"):
            await asyncio.wait_for(waiting, 2.0)  # (a bound for the test; it ends at once)
        await g.barrier()  # the parent is untouched
        await g.aclose()

    asyncio.run(main())


def test_a_window_over_tcp_links_is_refused_with_a_typed_error() -> None:
    """Windows need one-sided RDMA; a group whose links are TCP says so (and stays usable)."""
    async def main() -> None:
        gs = await form(2)
        try:
            for g in gs:
                with pytest.raises(UnsupportedOperationError, match="RDMA links"):
                    await g.window(np.zeros(4))
            await asyncio.wait_for(asyncio.gather(*(g.barrier() for g in gs)), STEP)
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))

    asyncio.run(main())
