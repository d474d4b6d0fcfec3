"""The TCP transport's message protocol (aiordma.protocols.tcp): sans-I/O, no sockets.

Two :class:`StreamMessages` joined by byte pipes that cut and merge what travels anywhere:

* a hypothesis state machine sends messages of every size class from either side, delivers
  bytes in arbitrary pieces, reads on either side at any time, and checks after every step
  that messages arrive whole, in order, once; that a receiver never holds more than its
  budget, its slots' worth of eager messages and one held message; and that once both
  applications read everything, every queued message goes and every send is done (no
  deadlock);
* a held message's sender is done only when the peer's application took it;
* closing: counts, the answer, end of stream, what is dropped;
* every rule the peer can break is a :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError
from aiordma.protocols.messages import Lifecycle
from aiordma.protocols.tcp import (
    CLOSE,
    CREDIT,
    DATA,
    HEADER,
    MESSAGE_OVERHEAD,
    SLOT,
    StreamMessages,
)


def pair(*, budget: int = 1000, slots: int = 2, eager_max: int = 100,
         max_message: int = 1 << 20, b_budget: int | None = None, b_slots: int | None = None
         ) -> tuple[StreamMessages, StreamMessages]:
    bb = budget if b_budget is None else b_budget
    bs = slots if b_slots is None else b_slots
    a = StreamMessages(recv_budget=budget, slots=slots, eager_max=eager_max,
                       max_message=max_message, peer_budget=bb, peer_slots=bs,
                       peer_eager_max=eager_max, peer_max_message=max_message)
    b = StreamMessages(recv_budget=bb, slots=bs, eager_max=eager_max, max_message=max_message,
                       peer_budget=budget, peer_slots=slots, peer_eager_max=eager_max,
                       peer_max_message=max_message)
    return a, b


def carry(src: StreamMessages, dst: StreamMessages, cuts: int = 1) -> None:
    """Move everything ``src`` has to send into ``dst``, in ``cuts`` pieces."""
    data = b"".join(src.data_to_send())
    if not data:
        return
    bounds = sorted({0, len(data), *random.Random(cuts).sample(range(len(data) + 1),
                                                                 min(cuts, len(data)))})
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            dst.receive_data(data[lo:hi])


def settle(a: StreamMessages, b: StreamMessages) -> None:
    for _ in range(20):
        if not (a.outgoing or b.outgoing):
            return
        carry(a, b)
        carry(b, a)
    raise AssertionError("the two sides keep sending each other frames")


# -- the basics ---------------------------------------------------------------------------------


def test_a_message_fits_the_window_and_arrives_whole() -> None:
    a, b = pair()
    assert a.send(b"hello") == 0  # framed already: its send is complete
    assert a.outgoing == [HEADER.pack(DATA, 0, 0, 5) + b"hello"]
    carry(a, b, cuts=17)
    assert list(b.inbox) == [b"hello"] and b.buffered == 5 + MESSAGE_OVERHEAD
    assert b.pop() == b"hello" and b.buffered == 0 and b.delivered == 1


def test_every_size_arrives_whole_over_one_byte_pieces() -> None:
    a, b = pair(budget=1 << 20, eager_max=1000)
    msgs = [b"", b"x", bytes(range(256)) * 3, random.Random(1).randbytes(70_000)]
    for m in msgs:
        a.send(m)
    data = b"".join(a.data_to_send())
    for i in range(len(data)):  # one byte at a time: every header and body is cut
        b.receive_data(data[i:i + 1])
    assert [bytes(b.pop()) for _ in msgs] == msgs


def test_past_the_window_a_message_takes_a_slot_then_waits() -> None:
    a, b = pair(budget=200, slots=2, eager_max=100)
    assert a.send(bytes(100)) == 0  # 164 of the 200 bytes
    assert a.send(bytes(50)) == 0  # in a slot (eager: done at once)
    t = a.send(bytes(150))  # held (larger than eager_max), in the last slot: it waits
    assert t and t not in a.done
    t2 = a.send(bytes(10))  # no slot left: queued
    assert t2 and a.queued == 1
    carry(a, b)
    assert [len(m) for m in b.inbox] == [100, 50, 150]
    assert b.inbox and b.pop() and b.pop()  # a slot comes back at once ...
    carry(b, a)
    assert t2 in a.done and t not in a.done  # ... and the queued message goes in it
    carry(a, b)
    b.pop()  # the held message is taken: its sender is done
    carry(b, a)
    assert t in a.done


def test_only_one_held_message_is_out_at_a_time() -> None:
    a, b = pair(budget=0, slots=5, eager_max=10)
    t1, t2 = a.send(bytes(50)), a.send(bytes(50))
    assert t1 and t2 and a.queued == 1  # the second waits for the first to be taken
    carry(a, b)
    b.pop()
    carry(b, a)
    assert a.done == [t1] and a.queued == 0  # the second went in its slot
    carry(a, b)
    b.pop()
    carry(b, a)
    assert a.done == [t1, t2]


def test_a_withdrawn_message_is_not_sent_and_the_next_one_may_go() -> None:
    a, b = pair(budget=0, slots=1, eager_max=10)
    a.send(b"1")
    t2, t3 = a.send(b"2"), a.send(b"3")
    assert a.withdraw(t2) and not a.withdraw(t2) and a.queued == 1
    carry(a, b)
    b.pop()
    carry(b, a)
    assert a.done == [t3]
    carry(a, b)
    assert b.pop() == b"3"


def test_try_send_sends_small_messages_only_when_nothing_waits() -> None:
    a, _b = pair(budget=100, slots=1, eager_max=10)
    assert a.try_send(b"x") is True
    assert a.try_send(bytes(11)) is False  # not eager
    assert a.try_send(bytes(10)) is True  # past the window: the slot
    assert a.try_send(b"y") is False  # no room
    assert a.queued == 0 and a.sent == 2


def test_credit_goes_back_a_quarter_of_the_budget_at_a_time() -> None:
    a, b = pair(budget=4000, slots=1, eager_max=10)
    for _ in range(30):
        a.send(bytes(36))  # 100 bytes each, with the overhead
    carry(a, b)
    frames = []
    for i in range(30):
        b.pop()
        frames += b.data_to_send()
        assert len(frames) == (i + 1) // 10  # at 1000, 2000, 3000 bytes
    assert frames == [HEADER.pack(CREDIT, 0, 0, 1000)] * 3


# -- closing ---------------------------------------------------------------------------------


def test_close_counts_the_messages_and_the_peer_answers() -> None:
    a, b = pair()
    for m in (b"1", b"22", b""):
        a.send(m)
    a.close()
    assert a.state is Lifecycle.CLOSING and a.flushed
    a.send_close()
    assert a.outgoing[-1] == HEADER.pack(CLOSE, 0, 0, 3) and a.state is Lifecycle.CLOSE_SENT
    carry(a, b)
    assert b.peer_total == 3 and b.state is Lifecycle.CLOSED  # answered at once
    assert b.outgoing == [HEADER.pack(CLOSE, 0, 0, 0)] and not b.at_eof
    with pytest.raises(LocalProtocolError):
        b.send(b"late")
    assert [b.pop() for _ in range(3)] == [b"1", b"22", b""] and b.at_eof
    carry(b, a)
    assert a.state is Lifecycle.CLOSED and a.at_eof


def test_what_is_queued_or_held_when_the_peer_closes_is_dropped() -> None:
    a, b = pair(budget=0, slots=1, eager_max=10)
    held = a.send(bytes(20))
    queued = a.send(b"q")
    b.close()
    b.send_close()
    carry(b, a)
    assert sorted(a.dropped) == sorted([held, queued]) and a.queued == 0
    assert a.state is Lifecycle.CLOSED and a.outgoing[-1] == HEADER.pack(CLOSE, 0, 0, 1)
    carry(a, b)  # the held message arrived before a's CLOSE: b may still read it
    assert b.pop() == bytes(20) and b.at_eof


def test_a_graceful_close_waits_for_a_held_message_to_be_read() -> None:
    a, b = pair(budget=0, slots=1, eager_max=10)
    t = a.send(bytes(20))
    a.close()
    assert not a.flushed
    carry(a, b)
    b.pop()
    carry(b, a)
    assert a.flushed and a.done == [t]


# -- the peer's broken rules -------------------------------------------------------------------


def frame(kind: int, flags: int = 0, slots: int = 0, value: int = 0, body: bytes = b"") -> bytes:
    return HEADER.pack(kind, flags, slots, value) + body


@pytest.mark.parametrize(("frames", "words"), [
    ([frame(DATA, 0, 0, 1000, bytes(1000))], "overruns"),  # 1064 > 1000 granted
    ([frame(DATA, SLOT, 0, 1, b"x")] * 3, "no slot free"),
    ([frame(DATA, SLOT, 0, 101, bytes(101))] * 2, "second held"),
    ([frame(DATA, 0, 0, 2 << 20)], "limit"),
    ([frame(CREDIT, 0, 0, 1)], "gave back 1 B"),
    ([frame(CREDIT, 0, 1, 0)], "gave back 1 slots"),
    ([frame(CLOSE, 0, 0, 1)], "says it sent 1"),
    ([frame(CLOSE), frame(CLOSE)], "second CLOSE"),
    ([frame(CLOSE), frame(DATA, 0, 0, 1, b"x")], "after the peer's CLOSE"),
    ([frame(9)], "unknown frame"),
    ([frame(DATA, 2, 0, 1, b"x")], "unknown frame"),
    ([frame(DATA, 0, 1, 1, b"x")], "unknown frame"),
    ([frame(CLOSE, 0, 1, 0)], "unknown frame"),
], ids=str)
def test_broken_rules_are_remote_protocol_errors(frames: list[bytes], words: str) -> None:
    _a, b = pair(budget=1000, slots=2, eager_max=100)
    with pytest.raises(RemoteProtocolError, match=words):
        for f in frames:
            b.receive_data(f)


def test_unusable_parameters_are_typed_errors() -> None:
    with pytest.raises(LocalProtocolError):
        StreamMessages(recv_budget=-1, slots=1, eager_max=0, max_message=0, peer_budget=0,
                       peer_slots=1, peer_eager_max=0, peer_max_message=0)
    with pytest.raises(RemoteProtocolError, match="peer's slots"):
        StreamMessages(recv_budget=0, slots=1, eager_max=0, max_message=0, peer_budget=0,
                       peer_slots=0, peer_eager_max=0, peer_max_message=0)


def test_a_message_past_the_peers_limit_is_refused_before_anything_is_framed() -> None:
    a, _b = pair(max_message=10)
    with pytest.raises(LocalProtocolError, match="limit"):
        a.send(bytes(11))
    assert a.outgoing == [] and a.sent == 0


def test_nothing_is_received_after_fail_or_release() -> None:
    a, _b = pair()
    t = a.send(bytes(10))
    assert t == 0
    a.fail()
    with pytest.raises(LocalProtocolError):
        a.receive_data(b"x")
    a.release()
    assert a.state is Lifecycle.RELEASED


# -- the two sides under any schedule -------------------------------------------------------------

SIZES = st.sampled_from([0, 1, 40, 99, 100, 101, 300, 2000])


class Pair(RuleBasedStateMachine):
    """Sends, deliveries in arbitrary pieces and reads, on both sides, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.budget, self.slots, self.eager_max = 500, 3, 100
        self.ends = pair(budget=self.budget, slots=self.slots, eager_max=self.eager_max)
        self.wire: list[bytearray] = [bytearray(), bytearray()]  # bytes on their way to i
        self.expected: list[deque[bytes]] = [deque(), deque()]  # messages on their way to i
        self.pending: list[set[int]] = [set(), set()]  # tickets not yet done, per sender
        self.counter = itertools.count()

    def _flush(self, i: int) -> None:
        self.wire[1 - i] += b"".join(self.ends[i].data_to_send())
        self.pending[i] -= set(self.ends[i].done)
        self.ends[i].done.clear()

    @rule(i=st.integers(0, 1), size=SIZES)
    def send(self, i: int, size: int) -> None:
        payload = next(self.counter).to_bytes(8, "little")[:size].ljust(size, b"z")
        ticket = self.ends[i].send(payload)
        if ticket:
            self.pending[i].add(ticket)
        self.expected[1 - i].append(payload)
        self._flush(i)

    @rule(i=st.integers(0, 1), n=st.integers(1, 700))
    def deliver(self, i: int, n: int) -> None:
        data, self.wire[i][:n] = bytes(self.wire[i][:n]), b""
        if data:
            self.ends[i].receive_data(data)
            self._flush(i)

    @precondition(lambda self: self.ends[0].inbox or self.ends[1].inbox)
    @rule(i=st.integers(0, 1))
    def read(self, i: int) -> None:
        end = self.ends[i]
        if not end.inbox:
            return
        assert bytes(end.pop()) == self.expected[i].popleft()
        self._flush(i)

    @invariant()
    def bounded(self) -> None:
        for end in self.ends:
            held = [m for m in end.inbox if len(m) > self.eager_max]
            assert end.buffered <= self.budget
            assert sum(map(len, end.inbox)) <= (self.budget + self.slots * self.eager_max
                                                + max(map(len, held), default=0))

    def teardown(self) -> None:
        # Both applications read everything: every message arrives, every send is done.
        for _ in range(200):
            for i in (0, 1):
                self.deliver(i, 1 << 30)
                while self.ends[i].inbox:
                    self.read(i)
            if not any(self.wire) and not any(e.queued for e in self.ends):
                break
        assert not any(e.queued for e in self.ends), "a queued message never went"
        assert self.pending == [set(), set()], "a send never completed"
        assert self.expected == [deque(), deque()]


Pair.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_any_schedule = Pair.TestCase


@given(sizes=st.lists(st.integers(0, 5000), max_size=30), cut=st.integers(1, 50))
def test_a_reader_that_reads_everything_gets_everything(sizes: list[int], cut: int) -> None:
    a, b = pair(budget=2000, slots=2, eager_max=100)
    msgs = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    tickets = [a.send(m) for m in msgs]
    got: list[bytes] = []
    for _ in range(len(msgs) * 4 + 4):
        carry(a, b, cuts=cut)
        while b.inbox:
            got.append(bytes(b.pop()))
        carry(b, a)
    assert got == msgs
    assert set(a.done) >= {t for t in tickets if t}


def test_statistics_count_what_went_each_way() -> None:
    a, b = pair()
    for m in (b"a", b"bb"):
        a.send(m)
    settle(a, b)
    assert (a.sent, b.received, b.delivered) == (2, 2, 0)
    b.pop()
    assert b.delivered == 1 and b.buffered == 2 + MESSAGE_OVERHEAD
    _unused: Any = None
