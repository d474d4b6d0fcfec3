"""A send arena's chunk (aiordma.protocols.send_arena): many message protocols sending from one
chunk's slots, each over its own simulated device (``message_sim.py``), under hypothesis
schedules of posts, deliveries, completions and pipelined sends, with readers that stall. No
device.

After every step: no slot is in use by two connections (nor twice by one); what each protocol
counts in flight is what its device has posted; every slot is in exactly one place (a member's
own free list, the shared list, or in flight); the shared list never holds a slot in flight; no
connection has more posts in flight than its cap; a borrowed slot in flight always has a
signaled post at or after it (so it comes back with the connection's own completions); a
connection whose own slots are all in flight has a signaled post in flight that returns one of
them (its reserve never starves). At the end every message arrived intact and in order, and
every shared slot is back.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.protocols import messages as m
from aiordma.protocols.errors import LocalProtocolError
from aiordma.protocols.send_arena import SendChunk

from .message_sim import SIDES, Params, Sim, other
from .test_protocol_messages import load, messages

SLOT = 128


def chunk_world(n: int, *, reserve: int, shared: int, cap: int, members: int | None = None,
                budget: int = 1 << 20, signal_every: int = 16,
                data_slots: int = 8) -> tuple[SendChunk, list[Sim]]:
    """``n`` connections whose A sides send from one chunk (``members`` places, default n)."""
    chunk = SendChunk(members=members or n, reserve=reserve, shared=shared)
    region = bytearray(chunk.slots * SLOT)
    pa = Params(slot_size=SLOT, send_slots=cap, data_slots=data_slots,
                signal_every=signal_every)
    pb = Params(slot_size=SLOT, send_slots=8, data_slots=data_slots, recv_budget=budget)
    return chunk, [Sim(pa, pb, chunk=(chunk, region)) for _ in range(n)]


def own(sim: Sim) -> range:
    r = sim.chunk[0].reserve  # type: ignore[index]
    return range(sim.member * r, (sim.member + 1) * r)


def check(chunk: SendChunk, sims: list[Sim]) -> None:
    """The invariants of the module documentation, after any step."""
    busy: dict[int, int] = {}
    for i, sim in enumerate(sims):
        side, p = sim.sides["A"], sim.sides["A"].proto
        for slot in side.send_busy:
            assert slot not in busy, f"slot {slot} in use by connections {busy[slot]} and {i}"
            busy[slot] = i
        assert sorted(s for _, s in p._inflight) == sorted(side.send_busy), i
        assert len(side.send_busy) <= side.params.send_slots, f"{i}: beyond its cap"
        assert set(p._free) <= set(own(sim)), f"{i}: a free slot not its own"
        posted = list(side.send_posted)
        borrowed = [k for k, (_, s, _) in enumerate(posted) if s >= chunk.shared_start]
        signaled = [k for k, (_, _, sig) in enumerate(posted) if sig]
        if borrowed:
            assert signaled and signaled[-1] >= borrowed[-1], f"{i}: holds a borrowed slot"
        if not p._free and posted:
            first_own = next(k for k, (_, s, _) in enumerate(posted) if s < chunk.shared_start)
            assert signaled and signaled[-1] >= first_own, f"{i}: its reserve cannot come back"
    assert len(chunk.shared) == len(set(chunk.shared)), "a shared slot listed twice"
    assert not set(chunk.shared) & set(busy), "the shared list holds a slot in flight"
    free = [s for sim in sims for s in sim.sides["A"].proto._free]
    places = sorted([*chunk.shared, *busy, *free])
    everything = sorted([*range(chunk.shared_start, chunk.slots),
                         *(s for sim in sims for s in own(sim))])
    assert places == everything, "a slot lost or in two places"


def drain(chunk: SendChunk, sims: list[Sim], *, receive: bool = True) -> None:
    """Run every event but new sends until nothing is left, checking after each."""
    for _ in range(100_000):
        events = [(sim, e) for sim in sims for e in sim.possible()
                  if e[0] != "send" and (receive or e[0] != "recv")]
        if not events:
            return
        sim, e = events[0]
        sim.do(e)
        check(chunk, sims)
    raise AssertionError("no quiescence")


def delivered(sims: list[Sim]) -> None:
    for sim in sims:
        for s in SIDES:
            assert sim.sides[s].got == sim.sides[other(s)].sent_msgs


# -- the chunk by hand ------------------------------------------------------------------------


def test_a_chunk_lays_out_reserves_then_shared_slots() -> None:
    c = SendChunk(members=3, reserve=4, shared=5)
    assert (c.slots, c.shared_start, sorted(c.shared)) == (17, 12, list(range(12, 17)))
    assert [c.join() for _ in range(3)] == [0, 1, 2] and c.full and c.occupied == 3
    assert c.reserve_of(1) == [4, 5, 6, 7]
    with pytest.raises(LocalProtocolError, match="taken"):
        c.join()
    c.leave(1)
    assert not c.full and c.join() == 1
    with pytest.raises(LocalProtocolError):
        c.leave(7)
    c.leave(2)
    with pytest.raises(LocalProtocolError):
        c.leave(2)  # twice


@pytest.mark.parametrize("kw", [{"members": 0, "reserve": 4, "shared": 1},
                                {"members": 1, "reserve": 1, "shared": 1},
                                {"members": 1, "reserve": 4, "shared": -1}])
def test_a_chunk_of_no_use_is_refused(kw: dict[str, int]) -> None:
    with pytest.raises(LocalProtocolError):
        SendChunk(**kw)


def test_a_protocol_refuses_a_reserve_beyond_its_cap_and_a_short_region() -> None:
    c = SendChunk(members=2, reserve=4, shared=4)
    kw: dict[str, Any] = {
        "recv_region": memoryview(bytearray(10 * SLOT)), "slot_size": SLOT, "data_slots": 4,
        "ctrl_slots": 3, "peer_slot_size": SLOT, "peer_data_slots": 4, "peer_ctrl_slots": 3,
        "peer_max_message": 1 << 20, "max_message": 1 << 20, "recv_budget": 0,
        "send_chunk": c, "send_member": 0}
    with pytest.raises(LocalProtocolError, match="beyond the cap"):
        m.MessageProtocol(send_region=memoryview(bytearray(c.slots * SLOT)), send_slots=3, **kw)
    with pytest.raises(LocalProtocolError, match="smaller"):
        m.MessageProtocol(send_region=memoryview(bytearray(8 * SLOT)), send_slots=64, **kw)


# -- counts -----------------------------------------------------------------------------------


def test_one_message_at_a_time_stays_within_the_reserve() -> None:
    """RTT-style traffic: each message delivered and its completions polled before the next:
    no slot borrowed; one completion per ``reserve`` messages (the post that takes the last
    own slot)."""
    chunk, (sim,) = chunk_world(1, reserve=4, shared=64, cap=64)
    load(sim, "A", [100] * 64)
    signaled = 0
    while sim.sides["A"].outbox:
        sim.app_send("A")
        posted = sim.sides["A"].send_posted[-1]
        assert posted[1] < chunk.shared_start, "borrowed"
        signaled += posted[2]
        drain(chunk, [sim])
    assert signaled == 64 // 4
    delivered([sim])


def test_a_stream_borrows_and_gives_every_shared_slot_back() -> None:
    """A sender that pipelines 200 messages before anything completes: beyond its reserve it
    borrows up to its cap; the shared slots all come back with its own completions."""
    chunk, (sim,) = chunk_world(1, reserve=4, shared=64, cap=32, members=4, data_slots=40)
    load(sim, "A", [100] * 200)
    side = sim.sides["A"]
    while side.outbox:
        sim.app_send("A")
        check(chunk, [sim])
    assert len(side.send_busy) == 32 and sum(s >= chunk.shared_start for s in side.send_busy) == 28
    drain(chunk, [sim])
    assert len(chunk.shared) == 64
    delivered([sim])


def test_a_stalled_reader_holds_no_shared_slot_once_its_sends_completed() -> None:
    """Connection 0's reader reads nothing and has no budget: its sender waits for credits
    with slots borrowed; the completions of what it sent give every shared slot back, and
    connection 1 borrows them all."""
    chunk, sims = chunk_world(2, reserve=2, shared=8, cap=10, budget=0, data_slots=12)
    for sim in sims:
        load(sim, "A", [50] * 40)
    while sims[0].sides["A"].outbox:
        sims[0].app_send("A")
        check(chunk, sims)
    drain(chunk, [sims[0]], receive=False)
    a0 = sims[0].sides["A"]
    assert a0.tickets, "it waits for credits"
    assert not [s for s in a0.proto._free if s >= chunk.shared_start]
    assert not [s for _, s in a0.proto._inflight if s >= chunk.shared_start]
    assert len(chunk.shared) == 8
    while sims[1].sides["A"].outbox and len(sims[1].sides["A"].send_busy) < 10:
        sims[1].app_send("A")
        check(chunk, sims)
    assert sum(s >= chunk.shared_start for s in sims[1].sides["A"].send_busy) == 8
    drain(chunk, sims)
    for sim in sims:
        while sim.sides["A"].outbox:
            sim.app_send("A")
        drain(chunk, sims)
    delivered(sims)


def test_release_sends_puts_borrowed_slots_back() -> None:
    chunk, (sim,) = chunk_world(1, reserve=2, shared=6, cap=8, members=2)
    load(sim, "A", [10] * 8)
    while sim.sides["A"].outbox:
        sim.app_send("A")
    assert len(chunk.shared) == 0
    sim.sides["A"].proto.release_sends()  # (its queue pair is destroyed)
    chunk.leave(sim.member)
    assert sorted(chunk.shared) == list(range(4, 10)) and chunk.occupied == 0


# -- hypothesis -------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 4), reserve=st.integers(2, 4), shared=st.integers(0, 8),
       extra_cap=st.integers(0, 8), signal_every=st.integers(1, 20),
       budgets=st.lists(st.sampled_from([0, 300, 1 << 20]), min_size=4, max_size=4),
       sizes=st.lists(st.sampled_from([0, 1, 100, 300]), min_size=1, max_size=30),
       data=st.data())
def test_many_connections_on_one_chunk_under_any_schedule(
        n: int, reserve: int, shared: int, extra_cap: int, signal_every: int,
        budgets: list[int], sizes: list[int], data: st.DataObject) -> None:
    """Random interleavings across the connections of one chunk (pipelined sends both ways,
    deliveries, completions, READs, readers that stall): the invariants hold after every
    step; at the end everything arrived and every shared slot is back."""
    chunk, sims = chunk_world(n, reserve=reserve, shared=shared, cap=reserve + extra_cap,
                              signal_every=signal_every)
    for sim, budget in zip(sims, budgets, strict=False):
        sim.sides["B"].proto.recv_budget = budget
        load(sim, "A", sizes)
        load(sim, "B", sizes[: len(sizes) // 2])
    check(chunk, sims)
    for _ in range(data.draw(st.integers(10, 400), label="steps")):
        events = [(i, e) for i, sim in enumerate(sims) for e in sim.possible()]
        if not events:
            break
        i, e = data.draw(st.sampled_from(events))
        sims[i].do(e)
        check(chunk, sims)
    for _ in range(1000):
        drain(chunk, sims)
        for sim in sims:
            for s in SIDES:
                while sim.sides[s].outbox:
                    sim.app_send(s)
                    check(chunk, sims)
        if not any(sim.possible() for sim in sims):
            break
    delivered(sims)
    assert len(chunk.shared) == shared, "a shared slot held by an idle connection"


def test_messages_of_one_connection_are_those_written() -> None:
    """(The simulated device reads a frame at delivery: a slot written by another connection
    while in flight would change what arrives.)"""
    chunk, sims = chunk_world(3, reserve=2, shared=3, cap=6)
    for k, sim in enumerate(sims):
        sim.sides["A"].outbox.extend(messages([60] * 20, 17 + k))
    for _ in range(20):
        for sim in sims:
            sim.app_send("A")
            check(chunk, sims)
    drain(chunk, sims)
    delivered(sims)


class _Counting(Sim):
    """A simulation that counts A's posts, borrowed posts and signaled posts."""

    posts = borrowed = signaled = 0

    def _run_actions(self, name: str, side: Any) -> None:
        before = len(side.send_posted)
        super()._run_actions(name, side)
        if name == "A":
            new = list(side.send_posted)[before:]
            self.posts += len(new)
            self.signaled += sum(sig for _, _, sig in new)
            if self.chunk is not None:
                self.borrowed += sum(s >= self.chunk[0].shared_start for _, s, _ in new)


@pytest.mark.parametrize("burst", [1, 2, 4, 8, 16, 32])
def test_what_a_stream_costs_in_completions(burst: int) -> None:
    """Bursts of ``burst`` messages, each burst delivered and completed before the next: with
    64 slots of its own a sender asks for a completion every 16th post; on a chunk (reserve
    4, 64 shared) the post that takes its last own slot is signaled, and so is each borrowed
    one (it is the last post the driver takes: the next message is not sent yet). So a burst
    of k > 4 costs 1 + (k - 4) completions, one of at most 4 costs one per 4 messages."""
    pa = Params(slot_size=SLOT, send_slots=64, data_slots=64, signal_every=16)
    pb = Params(slot_size=SLOT, send_slots=64, data_slots=64)
    chunk = SendChunk(members=32, reserve=4, shared=64)
    own, seat = _Counting(pa, pb), _Counting(pa, pb, chunk=(chunk, bytearray(chunk.slots * SLOT)))
    total = 32 * 4  # a multiple of every burst and of the reserve
    for sim in (own, seat):
        load(sim, "A", [64] * total)
        while sim.sides["A"].outbox:
            for _ in range(burst):
                sim.app_send("A")
            sim.quiesce()
        assert sim.posts == total  # (no CREDIT frame: B's 64 slots come back in time)
    assert own.signaled == total // 16
    bursts = total // burst
    if burst <= 4:
        assert (seat.signaled, seat.borrowed) == (total // 4, 0)
    else:
        assert (seat.signaled, seat.borrowed) == (bursts * (1 + burst - 4), bursts * (burst - 4))
    assert len(chunk.shared) == 64
