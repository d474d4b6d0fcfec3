"""The endpoint's message protocol (aiordma.protocols.messages): one instance by hand, then two joined
by the simulated device of ``message_sim.py`` (no verbs): pipelined batches that nobody reads
yet, the receive budget's backpressure and its release, zero-copy hand-over to a waiting
receiver, close counts, and hypothesis schedules over all of it. No device."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.protocols import framing
from aiordma.protocols import messages as m
from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError
from aiordma.protocols.messages._state import TRANSITIONS, Lifecycle, next_lifecycle

from .message_sim import SIDES, Params, Sim, other

L = Lifecycle


def one(**over: int) -> m.MessageProtocol:
    p = {"slot_size": 128, "send_slots": 4, "data_slots": 4, "ctrl_slots": 3,
         "peer_slot_size": 128, "peer_data_slots": 4, "peer_ctrl_slots": 3,
         "peer_max_message": 1 << 20, "max_message": 1 << 20, "recv_budget": 1 << 16,
         "signal_every": 2, **over}
    return m.MessageProtocol(send_region=memoryview(bytearray(p["send_slots"] * p["slot_size"])),
                             recv_region=memoryview(bytearray(
                                 (p["data_slots"] + p["ctrl_slots"]) * p["slot_size"])), **p)


def frame_into(proto: m.MessageProtocol, slot: int, data: bytes) -> None:
    """Put ``data`` in receive ``slot`` and report its completion."""
    base = slot * 128
    proto._recv[base:base + len(data)] = data
    proto.on_completion(slot, len(data))


def data_frame(payload: bytes, credits: int = 0, ctrl: int = 0) -> bytes:
    buf = bytearray(framing.HEADER_SIZE + len(payload))
    framing.pack_data_header(buf, 0, len(payload), credits, ctrl)
    buf[framing.HEADER_SIZE:] = payload
    return bytes(buf)


def rts_frame(size: int, token: int, address: int = 0x1000, rkey: int = 7) -> bytes:
    buf = bytearray(framing.HEADER_SIZE + framing.RTS_BODY.size)
    framing.pack_rts(buf, 0, size=size, address=address, rkey=rkey, token=token, credits=0,
                     ctrl=0)
    return bytes(buf)


def done_frame(token: int) -> bytes:
    buf = bytearray(framing.HEADER_SIZE + framing.DONE_BODY.size)
    framing.pack_done(buf, 0, token=token, credits=0, ctrl=0)
    return bytes(buf)


# -- one instance -----------------------------------------------------------------------------


def test_every_receive_slot_is_posted_first() -> None:
    p = one(data_slots=4, ctrl_slots=3)
    assert p.take_actions() == [m.PostRecv(s) for s in range(7)]
    assert p.take_actions() == []
    assert p.state is L.OPEN and p.head == m.EMPTY and not p.at_eof and p.flushed


def test_work_request_ids() -> None:
    assert m.decode_wr_id(m.send_wr_id(5)) == (True, 5)
    assert m.decode_wr_id(m.send_wr_id((1 << 31) + 5)) == (True, 5)  # 31-bit wrap
    assert m.decode_wr_id(3) == (False, 3)


def test_eager_send_posts_at_once_then_queues_past_the_credits() -> None:
    p = one(peer_data_slots=2, send_slots=8)
    p.take_actions()
    assert p.send_data(b"one") == 0
    (post,) = p.take_actions()
    assert isinstance(post, m.PostSend) and post.length == framing.HEADER_SIZE + 3
    assert bytes(p._send[post.offset + 12:post.offset + 15]) == b"one"
    assert p.send_data(b"two") == 0
    p.take_actions()
    ticket = p.send_data(bytearray(b"three"))  # no credit left: queued
    assert ticket > 0 and p.take_actions() == [] and not p.flushed
    assert p.try_send_data(b"four") is False  # something is queued before it
    # the peer returns two credits on a CREDIT frame
    buf = bytearray(framing.HEADER_SIZE)
    framing.pack_credit(buf, 0, credits=2, ctrl=0)
    frame_into(p, 0, bytes(buf))
    acts = p.take_actions()
    assert acts[0] == m.PostRecv(0)  # the CREDIT frame's slot, reposted before anything else
    assert [type(a) for a in acts[1:]] == [m.PostSend, m.SendPosted]
    assert acts[2] == m.SendPosted(ticket) and p.flushed
    assert p.try_send_data(b"four") is True and p.sent == 4


def test_too_large_for_eager_and_past_the_peer_limit() -> None:
    p = one(peer_slot_size=100, peer_max_message=1000)
    assert p.eager_max == 88
    with pytest.raises(LocalProtocolError):
        p.send_data(bytes(89))
    assert p.try_send_data(bytes(89)) is False
    with pytest.raises(LocalProtocolError, match="limit"):
        p.send_rts(1001, 0, 0)
    assert p.send_rts(1000, 0, 0) > 0


def test_rendezvous_is_done_when_its_token_comes_back() -> None:
    p = one()
    p.take_actions()
    token = p.send_rts(5000, 0xABC, 9)
    (post,) = p.take_actions()
    assert framing.parse(p._send, post.offset, post.length) == framing.RtsFrame(
        credits=0, ctrl_credits=0, size=5000, address=0xABC, rkey=9, token=token)
    assert p.pending_rendezvous == 1 and not p.flushed
    frame_into(p, 2, done_frame(token))
    assert p.take_actions() == [m.PostRecv(2), m.SendDone(token)] and p.flushed
    with pytest.raises(RemoteProtocolError, match="unknown rendezvous token"):
        frame_into(p, 3, done_frame(token))  # twice


def test_withdraw_only_what_is_not_posted() -> None:
    p = one(peer_data_slots=1)
    p.take_actions()
    t1 = p.send_rts(5000, 1, 1)  # posted: the only credit
    t2 = p.send_rts(5000, 2, 2)  # queued
    t3 = p.send_data(b"x")  # queued
    assert not p.withdraw(t1, rendezvous=True)
    assert p.withdraw(t2, rendezvous=True) and p.pending_rendezvous == 1
    assert p.withdraw(t3) and not p.withdraw(t3)


def test_a_message_is_taken_out_of_its_slot_at_once_within_the_budget() -> None:
    p = one(recv_budget=200)
    p.take_actions()
    frame_into(p, 0, data_frame(b"a" * 100))  # 164 counted: fits
    assert p.take_actions() == [m.PostRecv(0)] and p.buffered == 164
    frame_into(p, 1, data_frame(b"b" * 10))  # 74 more: past the budget, stays in slot 1
    assert p.take_actions() == [] and p.credits.held_data == 1
    assert p.head == m.READY and p.pop() == b"a" * 100
    # popping freed the budget: the held message is copied out, its slot reposted
    assert p.take_actions()[0] == m.PostRecv(1) and p.buffered == 74
    assert p.pop() == b"b" * 10 and p.buffered == 0 and p.delivered == 2


def test_zero_budget_keeps_messages_in_their_slots_until_read() -> None:
    p = one(recv_budget=0)
    p.take_actions()
    frame_into(p, 0, data_frame(b"hello"))
    frame_into(p, 1, rts_frame(5000, 1))
    assert p.take_actions() == [] and p.credits.held_data == 2
    assert p.pop() == b"hello"
    assert p.take_actions() == [m.PostRecv(0)]
    assert p.head == m.UNREAD
    item = p.pop()
    assert isinstance(item, m.Incoming) and item.size == 5000 and item.token == 1
    recv, credit = p.take_actions()  # two owed: the threshold, so a CREDIT frame returns them
    assert recv == m.PostRecv(1)
    assert framing.parse(p._send, credit.offset, credit.length) == framing.CreditFrame(
        credits=2, ctrl_credits=0)
    p.read_done(item)  # the receiver read it into its own buffer
    (done,) = p.take_actions()
    assert framing.parse(p._send, done.offset, done.length) == framing.DoneFrame(
        credits=0, ctrl_credits=0, token=1)


def test_a_rendezvous_message_is_read_into_an_endpoint_buffer_unless_a_receiver_waits() -> None:
    p = one()
    p.take_actions()
    frame_into(p, 0, rts_frame(3000, 5))
    (read,) = [a for a in p.take_actions() if isinstance(a, m.StartRead)]
    item = read.message
    assert p.head == m.READING and p.buffered == 3064
    with pytest.raises(LocalProtocolError):
        p.pop()
    p.read_done(item, bytearray(b"x" * 3000))
    assert p.head == m.READY and p.pop() == b"x" * 3000 and p.buffered == 0
    assert [type(a) for a in p.take_actions()] == [m.PostSend]  # the DONE
    # a waiting receiver: the message is left unread for it
    p.receivers_waiting = 1
    frame_into(p, 1, rts_frame(3000, 6))
    assert p.take_actions() == [] and p.head == m.UNREAD
    # ... until it leaves without it
    p.receivers_waiting = 0
    p.receiver_left()
    acts = p.take_actions()
    assert m.PostRecv(1) in acts and any(isinstance(a, m.StartRead) for a in acts)


def test_a_message_larger_than_the_budget_waits_for_a_receiver() -> None:
    p = one(recv_budget=1000)
    p.take_actions()
    frame_into(p, 0, rts_frame(5000, 1))
    frame_into(p, 1, data_frame(b"small"))  # behind it, and it fits
    assert p.take_actions() == [m.PostRecv(1)]
    assert p.head == m.UNREAD and p.credits.held_data == 1
    assert isinstance(p.pop(), m.Incoming) and p.pop() == b"small"


def test_buffered_reads_in_flight_are_bounded() -> None:
    p = one(max_reads=2, data_slots=5)
    p.take_actions()
    for slot, token in enumerate((1, 2, 3)):
        frame_into(p, slot, rts_frame(100, token))
    reads = [a.message for a in p.take_actions() if isinstance(a, m.StartRead)]
    assert [r.token for r in reads] == [1, 2] and p.credits.held_data == 1
    p.read_done(reads[0], bytearray(100))
    more = [a.message.token for a in p.take_actions() if isinstance(a, m.StartRead)]
    assert more == [3]


@pytest.mark.parametrize(("frame", "match"), [
    (b"\x01" * 5, "shorter than its header"),
    (bytes([9]) + bytes(11), "unknown frame kind"),
    (data_frame(b"abc")[:-1], "declares"),
    (bytes([1, 1]) + bytes(10), "flag or reserved"),
    (bytes(framing.HEADER.pack(2, 0, 0, 0, 0, 4)) + bytes(4), "RTS frame of the wrong size"),
    (bytes(framing.HEADER.pack(3, 0, 0, 0, 0, 1)) + bytes(1), "DONE frame of the wrong size"),
    (bytes(framing.HEADER.pack(4, 0, 0, 0, 0, 1)) + bytes(1), "CREDIT frame with a body"),
    (data_frame(b"", credits=9), "more credits"),
])
def test_bad_frames_are_remote_errors(frame: bytes, match: str) -> None:
    p = one()
    p.take_actions()
    with pytest.raises(RemoteProtocolError, match=match):
        frame_into(p, 0, frame)


def test_rts_past_the_local_limit_is_a_remote_error() -> None:
    p = one(max_message=4096)
    p.take_actions()
    frame_into(p, 0, rts_frame(4096, 1))
    with pytest.raises(RemoteProtocolError, match="limit"):
        frame_into(p, 1, rts_frame(4097, 2))


def test_an_eager_message_past_the_local_limit_is_a_remote_error() -> None:
    # The limit is told to the peer at set-up; a peer that sends a larger message anyway (it
    # fits the slot) breaks the rules, eager or not.
    p = one(max_message=10)
    p.take_actions()
    frame_into(p, 0, data_frame(b"x" * 10))
    assert p.received == 1
    with pytest.raises(RemoteProtocolError, match="limit is 10 B"):
        frame_into(p, 1, data_frame(b"x" * 11))


def test_an_eager_message_past_the_peers_limit_is_refused_before_anything_is_posted() -> None:
    p = one(peer_max_message=10)
    p.take_actions()
    with pytest.raises(LocalProtocolError, match="the peer's limit 10 B"):
        p.send_data(bytes(11))
    assert p.try_send_data(bytes(11)) is False
    assert not p.take_actions() and p.sent == 0
    assert p.send_data(bytes(10)) == 0 and p.sent == 1


def test_a_peer_without_credits_is_a_remote_error() -> None:
    p = one(data_slots=2, recv_budget=0)
    p.take_actions()
    frame_into(p, 0, data_frame(b"1"))
    frame_into(p, 1, data_frame(b"2"))
    with pytest.raises(RemoteProtocolError, match="without a data credit"):
        frame_into(p, 2, data_frame(b"3"))


def test_peer_windows_are_checked() -> None:
    with pytest.raises(RemoteProtocolError, match="peer_ctrl_slots"):
        one(peer_ctrl_slots=2)
    with pytest.raises(LocalProtocolError, match="local_ctrl_slots"):
        one(ctrl_slots=2)
    with pytest.raises(RemoteProtocolError, match="slot size"):
        one(peer_slot_size=30)
    with pytest.raises(LocalProtocolError):
        one(send_slots=1)


def test_close_counts() -> None:
    p = one()
    p.take_actions()
    p.send_data(b"x")
    frame_into(p, 0, data_frame(b"1"))
    p.peer_closed(2)  # one more is on its way
    assert p.state is L.PEER_CLOSED and not p.answer_due and not p.at_eof
    with pytest.raises(LocalProtocolError):
        p.send_data(b"y")
    frame_into(p, 1, data_frame(b"2"))
    assert p.answer_due and not p.at_eof
    with pytest.raises(RemoteProtocolError, match="after the peer's Close"):
        frame_into(p, 2, data_frame(b"3"))
    assert p.pop() == b"1" and p.pop() == b"2" and p.at_eof
    assert p.close_sent() == 1 and p.state is L.CLOSED and not p.answer_due


def test_a_close_that_undercounts_is_a_remote_error() -> None:
    p = one()
    p.take_actions()
    frame_into(p, 0, data_frame(b"1"))
    with pytest.raises(RemoteProtocolError):
        p.peer_closed(0)


def test_queued_messages_are_dropped_when_the_peer_closes() -> None:
    p = one(peer_data_slots=1)
    p.take_actions()
    p.send_data(b"posted")
    t = p.send_data(b"queued")
    token = p.send_rts(4000, 1, 1)
    p.take_actions()
    p.peer_closed(0)
    assert p.take_actions() == [m.SendDropped(t, False), m.SendDropped(token, True)]
    assert p.flushed


def test_the_lifecycle_table() -> None:
    assert next_lifecycle(L.OPEN, "close") is L.CLOSING
    assert next_lifecycle(L.CLOSING, "close_sent") is L.CLOSE_SENT
    assert next_lifecycle(L.CLOSE_SENT, "peer_close") is L.CLOSED
    assert next_lifecycle(L.OPEN, "peer_close") is L.PEER_CLOSED
    assert next_lifecycle(L.PEER_CLOSED, "close_sent") is L.CLOSED
    for s in Lifecycle:
        assert next_lifecycle(s, "release") is L.RELEASED
        if s is not L.RELEASED:
            assert next_lifecycle(s, "fail") is L.BROKEN
    for bad in [(L.OPEN, "close_sent"), (L.CLOSED, "peer_close"), (L.RELEASED, "close"),
                (L.BROKEN, "close_sent"), (L.RELEASED, "fail")]:
        assert bad not in TRANSITIONS
        with pytest.raises(LocalProtocolError):
            next_lifecycle(*bad)
    p = one()
    p.fail()
    assert p.state is L.BROKEN
    p.release()
    p.fail()  # after release: stays released
    assert p.state is L.RELEASED


# -- two instances over the simulated device --------------------------------------------------


def messages(sizes: list[int], tag: int) -> list[bytes]:
    return [bytes([(tag + i + j) % 251 for j in range(n)]) for i, n in enumerate(sizes)]


def load(sim: Sim, side: str, sizes: list[int]) -> None:
    sim.sides[side].outbox.extend(messages(sizes, 17 if side == "A" else 101))


def finish(sim: Sim) -> None:
    """Both applications read everything; then both close; check everything arrived."""
    for _ in range(100_000):
        sim.quiesce()
        for s in SIDES:
            while sim.sides[s].outbox:
                sim.app_send(s)
        if not sim.possible():
            break
    for s in SIDES:
        sim.app_close(s)
    for _ in range(1000):
        moved = sim.quiesce() + sum(sim.maybe_send_close(s) for s in SIDES)
        if not moved:
            break
    for s in SIDES:
        side, peer = sim.sides[s], sim.sides[other(s)]
        assert side.got == peer.sent_msgs, f"{s} got other messages than {other(s)} sent"
        assert side.proto.at_eof and side.proto.state is L.CLOSED, side.proto
        assert side.proto.flushed and not side.tickets and not side.rdv
        assert side.proto.buffered == 0 and side.proto.credits.held_data == 0
    assert not sim.memory and not sim.reads


@pytest.mark.parametrize("size", [1, 100, 5000])
def test_a_pipelined_batch_is_sent_whole_before_anybody_reads(size: int) -> None:
    # The echo deadlock of issue 11: both send a batch, then read. Within the receive budget
    # every send completes (posted, or read and DONE) without a single application read.
    sim = Sim(Params(recv_budget=1 << 22), Params(recv_budget=1 << 22))
    for s in SIDES:
        load(sim, s, [size] * 300)
    for s in SIDES:
        while sim.sides[s].outbox:
            sim.app_send(s)
            sim.quiesce(receive=False)
    for s in SIDES:
        side = sim.sides[s]
        assert not side.tickets and not side.rdv, f"{s}: sends still waiting"
        assert side.proto.flushed and side.proto.credits.held_data == 0
        assert len(sim.sides[other(s)].proto.inbox) == 300
    finish(sim)


def test_past_the_budget_the_sender_waits_and_is_released_as_the_reader_reads() -> None:
    pa, pb = Params(), Params(recv_budget=2000)
    sim = Sim(pa, pb)
    load(sim, "A", [100] * 40 + [3000] * 5 + [100] * 20)
    while sim.sides["A"].outbox:
        sim.app_send("A")
    sim.quiesce(receive=False)
    b, a = sim.sides["B"], sim.sides["A"]
    assert b.proto.buffered <= 2000 and b.proto.credits.held_data == pb.data_slots
    assert a.tickets  # backpressure reached the sender
    stalled = len(b.proto.inbox)
    for _ in range(10):
        assert sim.app_recv("B")
        sim.quiesce(receive=False)
    assert len(b.got) == 10 and b.proto.received > stalled  # reading released more
    finish(sim)
    assert sim.max_buffered["B"] <= 2000


def test_a_waiting_receiver_gets_the_rendezvous_message_unread() -> None:
    sim = Sim(Params(), Params())
    assert not sim.app_recv("B")  # B waits
    load(sim, "A", [4000])
    sim.app_send("A")
    sim.quiesce(receive=False)
    assert sim.sides["B"].proto.head == m.UNREAD and not sim.reads
    assert sim.app_recv("B")
    (read,) = sim.reads
    assert read[2] == 0  # into the application's buffer: zero-copy
    finish(sim)


def test_control_frames_flow_while_the_reader_holds_every_data_slot() -> None:
    # B reads nothing and has no budget, so A's messages fill B's data slots; B's rendezvous
    # messages to A are still read by A and acknowledged: DONE spends control credits.
    sim = Sim(Params(), Params(recv_budget=0))
    load(sim, "A", [50] * 10)
    load(sim, "B", [4000] * 12)
    for s in SIDES:
        while sim.sides[s].outbox:
            sim.app_send(s)
    sim.quiesce(receive=False)
    assert sim.sides["B"].proto.credits.held_data == 4
    assert not sim.sides["B"].rdv, "B's rendezvous sends wait for DONE"
    finish(sim)


SIZES = st.lists(st.sampled_from([0, 1, 7, 100, 115, 116, 117, 300, 3000]) | st.integers(0, 600),
                 max_size=40)


@st.composite
def params(draw: st.DrawFn) -> Params:
    slot = draw(st.sampled_from([64, 128, 256]))
    return Params(slot_size=slot, send_slots=draw(st.integers(2, 6)),
                  data_slots=draw(st.integers(1, 6)), ctrl_slots=draw(st.integers(3, 5)),
                  recv_budget=draw(st.sampled_from([0, 100, 1000, 5000, 1 << 20])),
                  signal_every=draw(st.integers(1, 5)), max_reads=draw(st.integers(1, 3)))


@settings(max_examples=200)
@given(pa=params(), pb=params(), sizes_a=SIZES, sizes_b=SIZES, data=st.data())
def test_any_schedule_delivers_everything_once_in_order(pa: Params, pb: Params,
                                                        sizes_a: list[int], sizes_b: list[int],
                                                        data: st.DataObject) -> None:
    """Random interleavings of sends, deliveries, completions, READs and lazy reads (a reader
    that pauses, waits, gives up, reads in batches): every message arrives once, in order,
    byte for byte; no RNR, no slot reused while posted, credits never negative, the budget
    never exceeded; and once the readers read, nothing stays stuck."""
    sim = Sim(pa, pb)
    load(sim, "A", sizes_a)
    load(sim, "B", sizes_b)
    run_schedule(sim, data)


def run_schedule(sim: Sim, data: st.DataObject) -> None:
    """Up to 400 drawn events (what the simulation allows, and receivers that wait or give
    up), then everything read and closed (:func:`finish`), the budgets kept."""
    for _ in range(data.draw(st.integers(0, 400), label="steps")):
        events = sim.possible()
        extra = [("wait", s) for s in SIDES] + [("give_up", s) for s in SIDES]
        choice = data.draw(st.sampled_from(events + extra))
        if choice[0] == "wait":
            sim.app_recv(choice[1])
        elif choice[0] == "give_up":
            sim.app_gives_up(choice[1])
        else:
            sim.do(choice)
    for s in SIDES:
        sim.app_gives_up(s)
    finish(sim)
    for s in SIDES:
        assert sim.max_buffered[s] <= sim.sides[s].params.recv_budget


@settings(max_examples=50)
@given(pa=params(), pb=params(), sizes=SIZES, data=st.data())
def test_closing_early_drops_only_what_was_never_posted(pa: Params, pb: Params,
                                                        sizes: list[int],
                                                        data: st.DataObject) -> None:
    """B closes while A is still sending: A's messages posted before B's Close arrived are
    delivered or counted; those still queued are dropped and reported; the counts agree."""
    sim = Sim(pa, pb)
    load(sim, "A", sizes)
    for _ in range(data.draw(st.integers(0, 60))):
        if not sim.sides["A"].outbox:
            break
        sim.app_send("A")
    sim.app_close("B")
    sim.maybe_send_close("B")  # B is flushed: it sent nothing
    for _ in range(data.draw(st.integers(0, 200))):
        events = sim.possible()
        if not events:
            break
        sim.do(data.draw(st.sampled_from(events)))
    sim.quiesce()
    sim.app_close("A")
    for _ in range(100):
        if not (sim.quiesce() + sum(sim.maybe_send_close(s) for s in SIDES)):
            break
    a, b = sim.sides["A"], sim.sides["B"]
    assert b.got == a.sent_msgs[:a.proto.sent]  # what A posted, in order
    assert a.dropped == len(a.sent_msgs) - a.proto.sent
    assert a.proto.state is L.CLOSED and b.proto.state is L.CLOSED and b.proto.at_eof
