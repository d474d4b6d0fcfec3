"""Credit-based flow control (aiordma.protocols.messages._credits): unit tests, then two peers
played against each other by a hypothesis state machine (safety: no overrun, exact credit
conservation; liveness: no deadlock of either class and no CREDIT ping-pong). No device."""

from __future__ import annotations

import copy
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError
from aiordma.protocols.messages import CreditWindow


def window(local_data: int = 4, local_ctrl: int = 4, peer_data: int = 3, peer_ctrl: int = 3,
           threshold: int | None = None) -> CreditWindow:
    return CreditWindow(local_data_slots=local_data, local_ctrl_slots=local_ctrl,
                        peer_data_slots=peer_data, peer_ctrl_slots=peer_ctrl, threshold=threshold)


def snapshot(w: CreditWindow) -> dict[str, int]:
    return {k: getattr(w, k) for k in ("data_credits", "ctrl_credits", "owed_data", "owed_ctrl",
                                       "peer_data_credits", "peer_ctrl_credits", "held_data",
                                       "held_ctrl")}


# -- one window -------------------------------------------------------------------------------


def test_initial_credits_are_the_posted_slots() -> None:
    w = window(local_data=4, local_ctrl=4, peer_data=3, peer_ctrl=3)
    assert snapshot(w) == {"data_credits": 3, "ctrl_credits": 3, "owed_data": 0, "owed_ctrl": 0,
                           "peer_data_credits": 4, "peer_ctrl_credits": 4, "held_data": 0,
                           "held_ctrl": 0}
    assert w.threshold == 2 and w.can_send_data() and w.can_send_ctrl()
    assert not w.credit_frame_needed()
    assert window(local_data=1).threshold == 1  # never 0
    assert window(threshold=7).threshold == 7
    assert "CreditWindow" in repr(w)


@pytest.mark.parametrize("bad", ["local_data", "local_ctrl", "peer_data", "peer_ctrl"])
@pytest.mark.parametrize("value", [0, -1])
def test_every_class_needs_a_slot(bad: str, value: int) -> None:
    with pytest.raises(LocalProtocolError, match=bad.replace("_", "_.*")):
        window(**{bad: value})


@pytest.mark.parametrize("bad", ["local_ctrl", "peer_ctrl"])
def test_the_control_class_needs_three_slots(bad: str) -> None:
    with pytest.raises(LocalProtocolError, match="at least 3"):
        window(**{bad: 2})
    window(**{bad: 3})


def test_sending_spends_a_credit_and_piggybacks_what_is_owed() -> None:
    w = window(local_data=4, peer_data=3)
    assert w.send_data() == (0, 0) and w.data_credits == 2
    for control in (False, False, True):
        w.received(control=control, credits=0, ctrl_credits=0)
        w.release(control=control)
    assert (w.owed_data, w.owed_ctrl, w.peer_data_credits, w.peer_ctrl_credits) == (2, 1, 2, 3)
    assert w.send_data() == (2, 1)  # everything owed rides on the header
    assert (w.owed_data, w.owed_ctrl, w.peer_data_credits, w.peer_ctrl_credits) == (0, 0, 4, 4)
    assert w.send_data() == (0, 0) and w.data_credits == 0 and not w.can_send_data()


def test_sending_without_a_credit_is_a_local_error_and_changes_nothing() -> None:
    w = window(peer_data=1, peer_ctrl=3)
    w.send_data()
    before = snapshot(w)
    with pytest.raises(LocalProtocolError):
        w.send_data()
    w.send_ctrl()
    w.send_ctrl()
    assert not w.can_send_ctrl()
    with pytest.raises(LocalProtocolError, match="reserve"):  # the last one is the reserve
        w.send_ctrl()
    w.send_credit()  # a CREDIT frame may use it
    with pytest.raises(LocalProtocolError):
        w.send_credit()
    assert snapshot(w) == {**before, "ctrl_credits": 0}


def test_credit_frame_needed() -> None:
    w = window(local_data=4, local_ctrl=3, peer_data=2, peer_ctrl=3)  # threshold 2
    assert not w.credit_frame_needed()  # nothing owed
    w.received(control=False, credits=0, ctrl_credits=0)
    w.release(control=False)
    assert w.owed_data == 1 and w.peer_data_credits == 3
    assert not w.credit_frame_needed()  # below threshold, and the peer can still send
    w.received(control=False, credits=0, ctrl_credits=0)
    w.release(control=False)
    assert w.credit_frame_needed()  # threshold reached
    assert w.send_credit() == (2, 0)
    assert not w.credit_frame_needed() and w.ctrl_credits == 2
    # a peer out of credits justifies a CREDIT frame for a single owed credit
    v = window(local_data=1, local_ctrl=3, peer_data=1, peer_ctrl=3, threshold=5)
    v.received(control=False, credits=0, ctrl_credits=0)
    assert not v.credit_frame_needed()  # held, not yet released: nothing owed
    v.release(control=False)
    assert v.peer_data_credits == 0 and v.credit_frame_needed()
    v.send_credit()
    assert v.peer_data_credits == 1
    # ... but only with two control credits (the last is kept to return control credits)
    u = window(local_data=1, local_ctrl=3, peer_data=1, peer_ctrl=3)
    u.send_ctrl()
    u.send_ctrl()
    u.received(control=False, credits=0, ctrl_credits=0)
    u.release(control=False)
    assert u.owed_data == 1 and u.peer_data_credits == 0 and not u.credit_frame_needed()


def test_control_slots_trigger_a_return_only_when_the_peer_runs_low() -> None:
    w = window(local_data=2, local_ctrl=4, peer_data=2, peer_ctrl=3, threshold=1)
    w.received(control=True, credits=0, ctrl_credits=0)
    w.release(control=True)
    w.received(control=True, credits=0, ctrl_credits=0)
    w.release(control=True)
    assert w.owed_ctrl == 2 and w.peer_ctrl_credits == 2 and not w.credit_frame_needed()
    w.received(control=True, credits=0, ctrl_credits=0)
    w.release(control=True)
    assert w.peer_ctrl_credits == 1 and w.credit_frame_needed()  # it may be stuck: return
    assert w.send_credit() == (0, 3) and w.peer_ctrl_credits == 4
    # one owed control credit never justifies a frame (that would ping-pong)
    v = window(local_ctrl=3, peer_ctrl=3)
    for _ in range(3):
        v.received(control=True, credits=0, ctrl_credits=0)
    v.release(control=True)
    assert v.peer_ctrl_credits == 0 and not v.credit_frame_needed()


@pytest.mark.parametrize("control", [False, True])
def test_a_peer_sending_without_credit_is_a_remote_error(control: bool) -> None:
    w = window(local_data=3, local_ctrl=3)
    for _ in range(3):
        w.received(control=control, credits=0, ctrl_credits=0)
    with pytest.raises(RemoteProtocolError):
        w.received(control=control, credits=0, ctrl_credits=0)
    # releasing without granting does not help: the peer does not know about the slot yet
    w.release(control=control)
    with pytest.raises(RemoteProtocolError):
        w.received(control=control, credits=0, ctrl_credits=0)
    w2 = window(local_data=3, local_ctrl=3)
    for _ in range(3):
        w2.received(control=control, credits=0, ctrl_credits=0)
        w2.release(control=control)
    w2.send_data()  # grants the freed slots back
    w2.received(control=control, credits=0, ctrl_credits=0)  # now legal again


@pytest.mark.parametrize("control", [False, True])
def test_releasing_an_empty_slot_is_a_local_error(control: bool) -> None:
    w = window()
    with pytest.raises(LocalProtocolError):
        w.release(control=control)
    w.received(control=control, credits=0, ctrl_credits=0)
    w.release(control=control)
    before = snapshot(w)
    with pytest.raises(LocalProtocolError):
        w.release(control=control)
    assert snapshot(w) == before
    with pytest.raises(LocalProtocolError):  # the other class holds nothing either
        w.release(control=not control)


def test_over_granting_is_a_remote_error() -> None:
    with pytest.raises(RemoteProtocolError):
        window(peer_data=3).received(control=False, credits=1, ctrl_credits=0)
    with pytest.raises(RemoteProtocolError):
        window(peer_ctrl=3).received(control=True, credits=0, ctrl_credits=1)
    w = window(peer_data=3, peer_ctrl=3)
    for _ in range(3):
        w.send_data()
    w.send_credit()
    w.received(control=False, credits=3, ctrl_credits=1)  # everything back: fine
    assert (w.data_credits, w.ctrl_credits) == (3, 3)
    with pytest.raises(RemoteProtocolError):
        w.received(control=False, credits=1, ctrl_credits=0)


@given(peer_data=st.integers(1, 50), spent=st.integers(0, 50), returned=st.integers(0, 100))
def test_over_grant_boundary(peer_data: int, spent: int, returned: int) -> None:
    w = window(peer_data=peer_data, local_data=100)
    spent = min(spent, peer_data)
    for _ in range(spent):
        w.send_data()
    if returned <= spent:
        w.received(control=False, credits=returned, ctrl_credits=0)
        assert w.data_credits == peer_data - spent + returned
    else:
        with pytest.raises(RemoteProtocolError):
            w.received(control=False, credits=returned, ctrl_credits=0)


# -- two peers --------------------------------------------------------------------------------

SIDES = ("A", "B")
Frame = tuple[bool, int, int]  # (control, credits, ctrl_credits)


class Peers:
    """Two windows configured consistently, joined by two FIFO wires of frames in flight.

    ``wire[s]`` holds the frames side ``s`` sent that the other side has not received yet.
    Control frames (DONE, CREDIT) are released as soon as they arrive, as the endpoint does."""

    def __init__(self, a_data: int, a_ctrl: int, b_data: int, b_ctrl: int,
                 a_threshold: int | None = None, b_threshold: int | None = None) -> None:
        self.slots = {"A": (a_data, a_ctrl), "B": (b_data, b_ctrl)}
        self.win = {
            "A": CreditWindow(local_data_slots=a_data, local_ctrl_slots=a_ctrl,
                              peer_data_slots=b_data, peer_ctrl_slots=b_ctrl,
                              threshold=a_threshold),
            "B": CreditWindow(local_data_slots=b_data, local_ctrl_slots=b_ctrl,
                              peer_data_slots=a_data, peer_ctrl_slots=a_ctrl,
                              threshold=b_threshold),
        }
        self.wire: dict[str, deque[Frame]] = {"A": deque(), "B": deque()}
        self.credit_frames = {"A": 0, "B": 0}

    @staticmethod
    def other(side: str) -> str:
        return "B" if side == "A" else "A"

    def send_data(self, side: str) -> None:
        self.wire[side].append((False, *self.win[side].send_data()))

    def send_done(self, side: str) -> None:
        self.wire[side].append((True, *self.win[side].send_ctrl()))

    def send_credit(self, side: str) -> None:
        assert self.win[side].credit_frame_needed()
        frame = (True, *self.win[side].send_credit())
        # a CREDIT frame grants data credits, or returns at least two control credits
        assert frame[1] > 0 or frame[2] > 1
        self.wire[side].append(frame)
        self.credit_frames[side] += 1

    def deliver(self, side: str) -> Frame:
        control, credits, ctrl = frame = self.wire[side].popleft()
        rx = self.win[self.other(side)]
        owed = rx.owed_data
        rx.received(control=control, credits=credits, ctrl_credits=ctrl)
        if control:
            rx.release(control=True)
            assert rx.owed_data == owed  # a CREDIT frame's slot owes no data credit: no ping-pong
        return frame

    def consume(self, side: str) -> None:
        self.win[side].release(control=False)

    def check(self) -> None:
        """Safety: no overrun, credits never negative, never above the slots, and every slot's
        credit is in exactly one place."""
        for tx in SIDES:
            rx = self.other(tx)
            t, r = self.win[tx], self.win[rx]
            rx_data_slots, rx_ctrl_slots = self.slots[rx]
            for name, value in vars(t).items():
                if isinstance(value, int):
                    assert value >= 0, (tx, name, value)
            in_flight_data = sum(not c for c, _, _ in self.wire[tx])
            in_flight_ctrl = sum(c for c, _, _ in self.wire[tx])
            returning_data = sum(d for _, d, _ in self.wire[rx])
            returning_ctrl = sum(c for _, _, c in self.wire[rx])
            # no overrun, per class
            assert in_flight_data + r.held_data <= rx_data_slots
            assert in_flight_ctrl + r.held_ctrl <= rx_ctrl_slots
            assert t.data_credits <= t.peer_data_slots == rx_data_slots
            assert t.ctrl_credits <= t.peer_ctrl_slots == rx_ctrl_slots
            # conservation: each of rx's slots is a credit at tx, a frame in flight, a held
            # frame, an owed credit, or a credit riding back on a frame
            assert (t.data_credits + in_flight_data + r.held_data + r.owed_data
                    + returning_data) == rx_data_slots
            assert (t.ctrl_credits + in_flight_ctrl + r.held_ctrl + r.owed_ctrl
                    + returning_ctrl) == rx_ctrl_slots
            # the receiver's view of what tx may send is never below the truth
            assert r.peer_data_credits == t.data_credits + in_flight_data + returning_data
            assert r.peer_ctrl_credits == t.ctrl_credits + in_flight_ctrl + returning_ctrl
            assert r.held_ctrl == 0  # control frames are released on arrival

    def drain(self, limit: int = 1000) -> dict[str, int]:
        """Applications consume everything, CREDIT frames go whenever needed, every frame is
        delivered; no new data. Returns the CREDIT frames each side sent meanwhile."""
        before = dict(self.credit_frames)
        for _ in range(limit):
            moved = False
            for side in SIDES:
                while self.win[side].held_data:
                    self.consume(side)
                    moved = True
                if self.win[side].credit_frame_needed():
                    self.send_credit(side)
                    moved = True
            for side in SIDES:
                if self.wire[side]:
                    self.deliver(side)
                    moved = True
            self.check()
            if not moved:
                return {s: self.credit_frames[s] - before[s] for s in SIDES}
        pytest.fail(f"no quiescence after {limit} rounds: {self.win}")


SLOTS = st.integers(1, 6)
CTRL_SLOTS = st.integers(3, 5)
THRESHOLDS = st.none() | st.integers(1, 7)
SIDE = st.sampled_from(SIDES)


class TwoPeers(RuleBasedStateMachine):
    peers: Peers

    @initialize(a_data=SLOTS, a_ctrl=CTRL_SLOTS, b_data=SLOTS, b_ctrl=CTRL_SLOTS,
                a_threshold=THRESHOLDS, b_threshold=THRESHOLDS)
    def setup(self, a_data: int, a_ctrl: int, b_data: int, b_ctrl: int,
              a_threshold: int | None, b_threshold: int | None) -> None:
        self.peers = Peers(a_data, a_ctrl, b_data, b_ctrl, a_threshold, b_threshold)

    @rule(side=SIDE)
    def app_sends(self, side: str) -> None:
        w = self.peers.win[side]
        if w.can_send_data():
            self.peers.send_data(side)
        else:
            before = snapshot(w)
            with pytest.raises(LocalProtocolError):
                w.send_data()
            assert snapshot(w) == before

    @rule(side=SIDE)
    def app_acknowledges(self, side: str) -> None:
        """A DONE frame (it spends control credits, never data credits)."""
        w = self.peers.win[side]
        if w.can_send_ctrl():
            self.peers.send_done(side)
        else:
            with pytest.raises(LocalProtocolError):
                w.send_ctrl()

    @rule(side=SIDE)
    def deliver(self, side: str) -> None:
        if self.peers.wire[side]:
            self.peers.deliver(side)

    @rule(side=SIDE)
    def app_consumes(self, side: str) -> None:
        w = self.peers.win[side]
        if w.held_data:
            self.peers.consume(side)
        else:
            with pytest.raises(LocalProtocolError):
                w.release(control=False)

    @rule(side=SIDE)
    def credit_frame(self, side: str) -> None:
        if self.peers.win[side].credit_frame_needed():
            self.peers.send_credit(side)

    @rule()
    def quiesce(self) -> None:
        self.peers.drain()

    @invariant()
    def safe(self) -> None:
        self.peers.check()

    @invariant()
    def live(self) -> None:
        """From here, consuming everything and answering with CREDIT frames when needed ends
        with both sides able to send data and DONE frames again, after a bounded number of
        CREDIT frames."""
        p = copy.deepcopy(self.peers)
        backlog = {s: p.win[s].held_data + sum(not c for c, _, _ in p.wire[p.other(s)])
                   for s in SIDES}  # data frames each side has yet to consume
        ctrl_in_flight = sum(c for s in SIDES for c, _, _ in p.wire[s])
        sent = p.drain()
        for s in SIDES:
            w = p.win[s]
            assert not p.wire[s] and w.held_data == w.held_ctrl == 0
            assert w.can_send_data(), f"deadlock: {s} cannot send data: {p.win}"
            assert w.can_send_ctrl(), f"deadlock: {s} cannot send DONE: {p.win}"
            assert not w.credit_frame_needed()
        # each CREDIT frame needs consumed data frames or received control frames behind it
        assert sum(sent.values()) <= sum(backlog.values()) + ctrl_in_flight + 4
        # quiescent: delivering and answering CREDIT frames stops at once
        assert p.drain() == {"A": 0, "B": 0}


TestTwoPeers = TwoPeers.TestCase
TestTwoPeers.settings = settings(stateful_step_count=50)


def test_crossing_credit_frames_do_not_ping_pong() -> None:
    p = Peers(2, 3, 2, 3)
    for s in SIDES:
        p.send_data(s)
        p.send_data(s)
    for s in SIDES:
        p.deliver(s)
        p.deliver(s)
    for s in SIDES:
        p.consume(s)
        p.consume(s)
    assert all(p.win[s].credit_frame_needed() for s in SIDES)
    for s in SIDES:  # both at once: the frames cross on the wires
        p.send_credit(s)
    assert not any(p.win[s].credit_frame_needed() for s in SIDES)
    for _ in range(10):
        if not (p.wire["A"] or p.wire["B"]):
            break
        for s in SIDES:
            if p.wire[s]:
                p.deliver(s)
            if p.win[s].credit_frame_needed():
                p.send_credit(s)
        p.check()
    else:
        pytest.fail("CREDIT frames kept flowing")
    assert p.credit_frames == {"A": 1, "B": 1}
    assert all(p.win[s].data_credits == 2 and p.win[s].ctrl_credits == 2 for s in SIDES)
    assert all(p.win[s].owed_ctrl == 1 for s in SIDES)  # returned on the next data frame
    p.send_data("A")
    p.deliver("A")
    assert p.win["B"].ctrl_credits == 3
    p.check()


def test_a_one_slot_stream_never_deadlocks() -> None:
    # a one-way stream through a single data slot: B answers every message with a CREDIT
    # frame, which spends one of B's control credits; A returns it on its next message
    p = Peers(1, 3, 1, 3)
    for i in range(20):
        assert p.win["A"].can_send_data()
        p.send_data("A")
        assert not p.win["A"].can_send_data()
        assert p.wire["A"][-1] == (False, 0, min(i, 1))  # the control credit rides back
        p.drain()
        assert p.win["B"].ctrl_credits == 2 and p.win["A"].owed_ctrl == 1
    assert p.credit_frames == {"A": 0, "B": 20}
    p.send_data("A")
    p.deliver("A")
    assert p.win["B"].ctrl_credits == 3 and p.win["A"].owed_ctrl == 0
    p.check()


def test_acknowledgements_flow_without_any_data_frame() -> None:
    # B acknowledges a burst of A's rendezvous messages while A sends nothing but waits: B's
    # control credits come back on CREDIT frames from A, never stuck behind data
    p = Peers(4, 3, 4, 3)
    for _ in range(30):
        p.drain()
        assert p.win["B"].can_send_ctrl()
        p.send_done("B")
    p.drain()
    assert p.credit_frames["A"] >= 10 and p.credit_frames["B"] == 0
    assert p.win["B"].can_send_ctrl()


def test_overrun_by_a_peer_that_ignores_credits() -> None:
    p = Peers(2, 3, 2, 3)
    p.send_data("A")
    p.send_data("A")
    p.wire["A"].append((False, 0, 0))  # A's third frame, sent without a credit
    p.deliver("A")
    p.deliver("A")
    with pytest.raises(RemoteProtocolError):
        p.deliver("A")
