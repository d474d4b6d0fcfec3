"""``aiordma._places.Notify``, a ReadyChannel's wake-up that is a call (device-free: the
completion queue's driver is stood in for by its two attributes, ``draining`` and ``later``;
tests/rxe/test_fastpath.py checks the real drivers of both paths)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from aiordma._places import Notify, wake_first


def test_a_wake_up_during_a_drain_waits_for_its_end_and_fires_once() -> None:
    fired: list[str] = []
    batch = SimpleNamespace(draining=True, later=[])
    waiters: deque = deque([Notify(lambda: fired.append("a"), batch)])
    assert wake_first(waiters) and not waiters  # (dropped from the deque when woken)
    assert fired == [] and len(batch.later) == 1
    batch.draining = False
    for call in batch.later:
        call()
    assert fired == ["a"]
    assert not wake_first(waiters)  # nothing left to wake: it fired once


def test_a_wake_up_outside_a_drain_or_without_one_is_a_call_now() -> None:
    fired: list[int] = []
    idle = SimpleNamespace(draining=False, later=[])
    for batch in (idle, None):
        n = Notify(lambda: fired.append(1), batch)
        assert not n.done() and not n.cancelled()
        n.set_result(None)
    assert fired == [1, 1] and idle.later == []
