"""Stream calls in the RPC wire protocol (aiordma.protocols.rpc._stream and its use by
aiordma.protocols.rpc): sans-I/O, no device.

* the stream table: every state reachable, every legal transition works through a connection,
  every missing (role, state, direction, event) is a typed error that changes nothing (derived
  from ``TRANSITIONS``), and the call table and the stream table agree on the call's own
  frames;
* flow control and crossings, case by case: the window, credits and their bounds, items
  crossing a Cancel or an answer, out-of-band items;
* a hypothesis stateful machine that drives a client and a server through random
  interleavings of stream calls (and unary calls beside them), items both ways, credits,
  Ends, Cancels, answers and errors, delivering each side's messages one at a time, and
  checks: every item delivered once and in order, a receiver never holds more than its
  window, a send without credit refused and harmless, every illegal frame in the current
  state a RemoteProtocolError, and no stream stuck once both sides stop (the teardown drains
  everything and must end with nothing open).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from aiordma.protocols import rpc
from aiordma.protocols.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from aiordma.protocols.rpc import (
    NEED_DATA,
    Cancel,
    Credit,
    Data,
    End,
    Error,
    Request,
    Response,
    Role,
    RpcConnection,
    RpcEvent,
)
from aiordma.protocols.rpc import _frame as rpc_frame
from aiordma.protocols.rpc._state import TRANSITIONS as CALL_TRANSITIONS
from aiordma.protocols.rpc._state import Calls, CallState
from aiordma.protocols.rpc._stream import (
    IGNORED,
    MAX_CREDIT,
    STREAM_EVENTS,
    TRANSITIONS,
    Streams,
    StreamState,
)

from .rpc_builds import rpc_build  # noqa: F401  # (each test with both builds)
from .transition_paths import shortest_paths

THRESHOLD = 32  # small: out-of-band items stay cheap to generate
C, S = Role.CLIENT, Role.SERVER
TX, RX = rpc.Direction.SEND, rpc.Direction.RECV


def conn(role: Role, **kw: Any) -> RpcConnection:
    kw.setdefault("oob_threshold", THRESHOLD)
    return RpcConnection(role, **kw)


def enc(event: RpcEvent) -> list[bytes | memoryview]:
    """``event`` as a peer sends it (a Request binds its method: the first call of a fresh
    connection)."""
    return rpc.encode(event, oob_threshold=THRESHOLD)


def feed(c: RpcConnection, messages: list[Any]) -> list[RpcEvent]:
    for m in messages:
        c.receive_message(m)
    events: list[RpcEvent] = []
    for _ in range(1000):
        ev = c.next_event()
        if ev is NEED_DATA:
            return events
        assert isinstance(ev, RpcEvent)
        events.append(ev)
    pytest.fail("next_event() did not return NEED_DATA")


def sample(name: str, call_id: int = 0, count: int = 1) -> RpcEvent:
    return {"Request": lambda: Request(id=call_id, method="m", args=(1,), stream=True),
            "Response": lambda: Response(id=call_id, result=[b"y" * 40, 2]),
            "Error": lambda: Error(id=call_id, type="ValueError", message="bad"),
            "Cancel": lambda: Cancel(id=call_id),
            "Data": lambda: Data(id=call_id, value=[b"d" * 40, "x"]),
            "Credit": lambda: Credit(id=call_id, count=count),
            "End": lambda: End(id=call_id)}[name]()


def put(c: RpcConnection, direction: rpc.Direction, event: RpcEvent) -> list[RpcEvent]:
    """Send ``event`` from ``c`` (TX) or feed it to ``c`` as its peer sent it (RX)."""
    if direction is TX:
        c.send(event)
        return []
    return feed(c, enc(event))


def snapshot(c: RpcConnection, call_id: int = 0) -> tuple[Any, ...]:
    return (c.stream_state(call_id), c.stream_credit(call_id), c.stream_window(call_id),
            c.call_state(call_id), c.in_flight, c.streams)


# -- the stream table ---------------------------------------------------------------------------


PATHS = {role: shortest_paths(TRANSITIONS, role, StreamState.NONE) for role in Role}
GRANT = 5  # what drive() grants each way while the stream is OPEN


def drive(role: Role, state: StreamState) -> RpcConnection:
    """A connection whose call 0 is in ``state`` (a stream, or a unary call for UNARY), brought
    there by legal sends and receives; while OPEN, it granted GRANT items to its peer and was
    granted GRANT."""
    c = conn(role)
    if state is StreamState.UNARY:
        put(c, TX if role is C else RX, Request(id=0, method="m"))
        assert c.stream_state(0) is state
        return c
    for direction, name, expected in PATHS[role][state]:
        put(c, direction, sample(name))
        if expected is StreamState.OPEN:  # credits both ways, before anything ends
            put(c, TX, sample("Credit", count=GRANT))
            put(c, RX, sample("Credit", count=GRANT))
        assert c.stream_state(0) is expected
    assert c.stream_state(0) is state
    return c


def test_every_state_is_reachable_by_its_role() -> None:
    stored = {StreamState.NONE, StreamState.OPEN, StreamState.ENDED, StreamState.CANCELLED,
              StreamState.DONE}
    assert set(PATHS[C]) == set(PATHS[S]) == stored
    assert {name for (_, _, _, name) in TRANSITIONS} >= set(STREAM_EVENTS)
    assert IGNORED <= set(TRANSITIONS)


@pytest.mark.parametrize(("key", "nxt"), list(TRANSITIONS.items()),
                         ids=[f"{r.name}-{s.name}-{d.name}-{n}" for r, s, d, n in TRANSITIONS])
def test_every_legal_transition_works_through_a_connection(key: tuple, nxt: StreamState) -> None:
    role, state, direction, name = key
    c = drive(role, state)
    dropped = c.streams_dropped
    ev = sample(name)
    delivered = put(c, direction, ev)
    if direction is RX:
        assert delivered == ([] if key in IGNORED else [ev])
        assert c.streams_dropped == dropped + (key in IGNORED)
    assert c.stream_state(0) is nxt


REACHABLE = [(role, state) for role in Role for state in [*PATHS[role], StreamState.UNARY]]
ILLEGAL = [(role, state, direction, name)
           for role, state in REACHABLE for direction in (TX, RX) for name in STREAM_EVENTS
           if (role, state, direction, name) not in TRANSITIONS]


def test_illegal_combinations_are_numerous() -> None:
    assert len(ILLEGAL) > 30


@pytest.mark.parametrize(("role", "state", "direction", "name"), ILLEGAL,
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_illegal_stream_event_is_a_typed_error(role: Role, state: StreamState,
                                                     direction: rpc.Direction,
                                                     name: str) -> None:
    c = drive(role, state)
    before = snapshot(c)
    if direction is TX:
        with pytest.raises(LocalProtocolError) as info:
            c.send(sample(name))
        assert type(info.value) is LocalProtocolError
    else:
        with pytest.raises(RemoteProtocolError) as info:
            feed(c, enc(sample(name)))
        assert type(info.value) is RemoteProtocolError
    assert name in str(info.value) and state.name in str(info.value)
    assert snapshot(c) == before  # a refused event changes nothing


CALL_STATE = {(C, StreamState.OPEN): CallState.WAITING, (C, StreamState.ENDED): CallState.WAITING,
              (C, StreamState.CANCELLED): CallState.CANCEL_SENT,
              (S, StreamState.OPEN): CallState.RUNNING, (S, StreamState.ENDED): CallState.RUNNING,
              (S, StreamState.CANCELLED): CallState.CANCELLED}


@pytest.mark.parametrize(("role", "state"), list(CALL_STATE))
def test_the_call_table_and_the_stream_table_agree(role: Role, state: StreamState) -> None:
    """For a stream call, the call's own frames (Cancel, the answers) are allowed by the call
    table exactly where the stream table says what they do."""
    c = drive(role, state)
    assert c.call_state(0) is CALL_STATE[(role, state)]
    for direction in (TX, RX):
        for name in ("Cancel", "Response", "Error"):
            call_ok = (role, CALL_STATE[(role, state)], direction, name) in CALL_TRANSITIONS
            assert call_ok == ((role, state, direction, name) in TRANSITIONS), (direction, name)


# -- flow control, case by case -----------------------------------------------------------------


def opened(window: int = 2, server_window: int = 0) -> tuple[RpcConnection, RpcConnection]:
    """A client and a server with stream call 0 open: the client granted ``window`` items, the
    server ``server_window`` (delivered)."""
    c, s = conn(C), conn(S)
    call_id, msgs = c.send_request("rows", (1,), stream=True)
    assert call_id == 0
    assert feed(s, msgs + c.send_credit(0, window)) == [
        Request(id=0, method="rows", args=(1,), stream=True), Credit(id=0, count=window)]
    if server_window:
        assert feed(c, s.send_credit(0, server_window)) == [Credit(id=0, count=server_window)]
    return c, s


def test_a_stream_request_is_flagged_and_a_unary_one_is_not() -> None:
    c = conn(C)
    _, msgs = c.send_request("rows", stream=True)
    assert rpc_frame.HEADER.unpack_from(msgs[0])[2] & rpc_frame.F_STREAM
    _, msgs = c.send_request("rows")
    assert not rpc_frame.HEADER.unpack_from(msgs[0])[2] & rpc_frame.F_STREAM
    assert c.streams == {0} and c.in_flight == {0, 1}
    with pytest.raises(LocalProtocolError):
        c.send_request("rows", stream=1)  # type: ignore[arg-type]


def test_items_flow_only_within_the_window() -> None:
    c, s = opened(window=2)
    got = feed(c, s.send_data(0, "a") + s.send_data(0, "b"))
    assert got == [Data(id=0, value="a"), Data(id=0, value="b")]
    assert s.stream_credit(0) == 0 and c.stream_window(0) == 0
    before = snapshot(s)
    with pytest.raises(LocalProtocolError, match="no credit"):
        s.send_data(0, "c")
    assert snapshot(s) == before
    with pytest.raises(RemoteProtocolError, match="beyond the window"):  # a peer that ignores it
        feed(c, enc(Data(id=0, value="c")))
    c, s = opened(window=2)
    feed(c, s.send_data(0, "a") + s.send_data(0, "b"))
    feed(s, c.send_credit(0, 1))  # the client read one: one more may come
    assert s.stream_credit(0) == 1
    assert feed(c, s.send_data(0, "c")) == [Data(id=0, value="c")]


def test_the_client_sends_only_what_the_server_granted() -> None:
    c, s = opened(window=1)
    with pytest.raises(LocalProtocolError, match="no credit"):
        c.send_data(0, "up")  # the server granted nothing yet
    with pytest.raises(RemoteProtocolError, match="beyond the window"):
        feed(s, enc(Data(id=0, value="up")))
    c, s = opened(window=1, server_window=2)
    assert feed(s, c.send_data(0, 1) + c.send_data(0, 2) + c.send_end(0)) == [
        Data(id=0, value=1), Data(id=0, value=2), End(id=0)]
    assert s.stream_state(0) is StreamState.ENDED
    with pytest.raises(LocalProtocolError):
        s.send_credit(0, 1)  # the client's items have ended: nothing to grant
    with pytest.raises(LocalProtocolError):
        c.send_data(0, 3)  # after its End


@pytest.mark.parametrize("count", [0, -1, MAX_CREDIT + 1, True, 1.0, "1", None])
def test_a_credit_count_is_1_to_2_to_the_32_minus_1(count: Any) -> None:
    _, s = opened()
    with pytest.raises(LocalProtocolError):
        s.send_credit(0, count)
    assert s.stream_window(0) == 0


def test_credits_are_bounded_on_both_sides() -> None:
    c, s = opened(window=MAX_CREDIT)
    with pytest.raises(LocalProtocolError, match="Credit"):
        c.send_credit(0, 1)  # the window is at its bound
    assert s.stream_credit(0) == MAX_CREDIT
    with pytest.raises(RemoteProtocolError, match="Credit"):
        feed(s, [rpc_frame.frame(6, 0, method=1)])  # a peer past the bound
    c, s = opened(window=1)
    with pytest.raises(RemoteProtocolError, match="Credit of 0"):
        feed(s, [rpc_frame.frame(6, 0, method=0)])
    c, s = opened(window=1)
    feed(c, s.send_data(0, "x"))
    assert feed(s, c.send_credit(0, MAX_CREDIT)) == [Credit(id=0, count=MAX_CREDIT)]
    assert s.stream_credit(0) == MAX_CREDIT


@pytest.mark.parametrize("frame", [
    rpc_frame.frame(5, 0, b"\x01", deadline=1),  # a Data with a deadline
    rpc_frame.frame(5, 0, b"\x01", method=1),  # a Data with a method index
    rpc_frame.frame(5, 0, b"\x91\x01"),  # a container without F_WALK
    rpc_frame.frame(5, 0, b""),  # no value
    rpc_frame.frame(5, 0, b"\x01", flags=rpc_frame.F_STREAM),  # a Request's flag
    rpc_frame.frame(6, 0, b"\x01", method=1),  # a Credit with a body
    rpc_frame.frame(6, 0, method=1, flags=rpc_frame.F_WALK),
    rpc_frame.frame(6, 0, method=1, deadline=5),
    rpc_frame.frame(7, 0, b"\xc0"),  # an End with a body
    rpc_frame.frame(7, 0, method=1),
    rpc_frame.frame(7, 0, nbufs=1),
    rpc_frame.frame(5, 0, b"\x01", nbufs=1),  # a buffer announced and not used
    rpc_frame.frame(8, 0),  # no kind 8
], ids=lambda f: f[1:4].hex())
def test_malformed_stream_frames_are_remote_errors(frame: bytes) -> None:
    _, s = opened(window=1, server_window=4)
    with pytest.raises(RemoteProtocolError):
        feed(s, [frame])


def test_stream_frames_for_other_calls_are_refused() -> None:
    s = conn(S)
    feed(s, enc(Request(id=0, method="unary")))
    for name in STREAM_EVENTS:
        with pytest.raises(RemoteProtocolError, match="not a stream"):
            feed(conn(S), enc(Request(id=0, method="unary")) + enc(sample(name)))
        with pytest.raises(RemoteProtocolError, match="no such call"):
            feed(conn(S), enc(sample(name, 7)))
    c = conn(C)
    c.send_request("unary")
    with pytest.raises(RemoteProtocolError, match="not a stream"):
        feed(c, enc(Data(id=0, value=1)))
    with pytest.raises(RemoteProtocolError):
        feed(opened()[0], enc(End(id=0)))  # a server never sends End


def test_items_that_cross_a_cancel_are_dropped_and_counted() -> None:
    c, s = opened(window=3, server_window=1)
    in_flight = s.send_data(0, "a") + s.send_credit(0, 1)
    cancel = c.send_cancel(0)
    assert c.stream_state(0) is StreamState.CANCELLED
    assert feed(c, in_flight) == [] and c.streams_dropped == 2
    with pytest.raises(LocalProtocolError):
        c.send_data(0, "up")  # nothing goes after a Cancel
    assert feed(s, cancel) == [Cancel(id=0)]
    with pytest.raises(LocalProtocolError):
        s.send_data(0, "b")  # nor from a server that got it
    assert feed(c, s.send_error(0, "CancelledError", "")) == [
        Error(id=0, type="CancelledError", message="")]
    assert c.streams == s.streams == c.in_flight == s.in_flight == frozenset()


def test_items_that_cross_the_answer_are_dropped_and_counted() -> None:
    c, s = opened(window=1, server_window=2)
    in_flight = c.send_data(0, "a") + c.send_data(0, "b") + c.send_end(0) + c.send_credit(0, 1)
    answer = s.send_response(0, 42)  # the server answered before reading them
    assert s.stream_state(0) is StreamState.DONE and s.streams == frozenset()
    assert feed(s, in_flight) == [] and s.streams_dropped == 4
    assert feed(c, answer) == [Response(id=0, result=42)]
    assert c.stream_state(0) is StreamState.DONE
    with pytest.raises(RemoteProtocolError):
        feed(c, enc(Data(id=0, value=1)))  # a server sends nothing after its answer


def test_out_of_band_items_are_the_original_objects() -> None:
    c, s = opened(window=2, server_window=1)
    big = bytearray(b"z" * (4 * THRESHOLD))
    msgs = s.send_data(0, {"blob": big})
    assert len(msgs) == 2 and msgs[1].obj is big  # (a view of it, not a copy)
    assert feed(c, msgs[:1]) == [] and c.expecting_buffers == 1
    (ev,) = feed(c, msgs[1:])
    assert isinstance(ev, Data) and bytes(ev.value["blob"]) == big
    # the server answers while a client item's buffer is on its way: dropped when it lands
    up = c.send_data(0, memoryview(big))
    assert feed(s, up[:1]) == []
    answer = s.send_response(0, None)
    assert feed(s, up[1:]) == [] and s.streams_dropped == 1
    assert feed(c, answer) == [Response(id=0, result=None)]


def test_a_stream_call_in_a_batch() -> None:
    c, s = conn(C), conn(S)
    out = rpc.Outbox(1 << 16)
    for call_id in range(3):
        i, msgs = c.send_request("rows", (call_id,), stream=True)
        out.add(msgs)
        out.add(c.send_credit(i, 2))
        out.add(c.send_end(i))
    msgs = out.take()
    assert len(msgs) == 1
    events = feed(s, msgs)
    assert [type(e).__name__ for e in events] == ["Request", "Credit", "End"] * 3
    assert s.streams == {0, 1, 2}


def test_the_streams_table_alone() -> None:
    calls = Calls(C, 2)
    streams = Streams(C, calls)
    assert streams.state(0) is StreamState.NONE and not streams
    step = streams.step(0, TX, "Request")
    calls.apply(0, TX, "Request")
    streams.commit(0, TX, "Request", *step)
    assert streams.state(0) is StreamState.OPEN and streams.open == {0}
    assert streams.apply(0, TX, "Credit", 3) and streams.flow(0).window == 3  # type: ignore[union-attr]
    calls.apply(1, TX, "Request")
    assert streams.state(1) is StreamState.UNARY
    calls.apply(0, RX, "Response")
    streams.answered(0)
    assert streams.state(0) is StreamState.DONE and not streams


# -- random interleavings of both ends ----------------------------------------------------------

LIMIT = 4
ITEMS = st.integers(-5, 5) | st.binary(min_size=THRESHOLD, max_size=2 * THRESHOLD)


@dataclass
class Way:
    """One direction of one stream, as the model sees it."""

    window: int  # the receiver's initial grant
    sent: list[Any] = field(default_factory=list)  # items the sender sent
    delivered: int = 0  # items the receiver's connection took (dropped ones too)
    got: list[Any] = field(default_factory=list)  # items delivered to the receiver's app
    buffer: deque[Any] = field(default_factory=deque)  # delivered, not consumed yet
    owed: int = 0  # consumed, not granted back yet
    granted: int = 0  # credits the receiver sent
    credited: int = 0  # credits delivered to the sender

    @property
    def credit(self) -> int:
        """What the sender may still send, by the model."""
        return self.credited - len(self.sent)

    @property
    def room(self) -> int:
        """What the receiver's connection still takes, by the model."""
        return self.granted - self.delivered


@dataclass
class Call:
    id: int
    stream: bool
    up: Way  # client -> server
    down: Way  # server -> client
    ended: bool = False  # the client sent End
    cancelled: bool = False  # the client sent Cancel
    started: bool = False  # the server got the Request
    got_end: bool = False
    got_cancel: bool = False
    answered: bool = False  # the server sent its answer
    done: bool = False  # the client got it


class StreamsMachine(RuleBasedStateMachine):
    """A client and a server over two ordered queues, each message delivered by a rule."""

    def __init__(self) -> None:
        super().__init__()
        self.client = conn(C, peer_max_in_flight=LIMIT)
        self.server = conn(S, max_in_flight=LIMIT)
        self.to_server: deque[tuple[Any, Any]] = deque()  # (message, (kind, id, count) | None)
        self.to_client: deque[tuple[Any, Any]] = deque()
        self.calls: dict[int, Call] = {}
        self.client_log: list[Any] = []  # how to rebuild each side: its sends and receipts
        self.server_log: list[Any] = []
        self.frame_meta: dict[Role, Any] = {}

    # -- helpers

    def out(self, queue: deque[tuple[Any, Any]], msgs: list[Any], kind: int, call_id: int,
            count: int = 1) -> None:
        queue.append((msgs[0], (kind, call_id, count)))
        queue.extend((m, None) for m in msgs[1:])

    def client_send(self, what: Any, kind: int, call_id: int, count: int = 1) -> None:
        self.client_log.append(("send", what))
        self.out(self.to_server, what(self.client), kind, call_id, count)

    def server_send(self, what: Any, kind: int, call_id: int, count: int = 1) -> None:
        self.server_log.append(("send", what))
        self.out(self.to_client, what(self.server), kind, call_id, count)

    def live(self, **want: bool) -> list[int]:
        return sorted(i for i, c in self.calls.items() if c.stream and not c.done
                      and all(getattr(c, k) == v for k, v in want.items()))

    @staticmethod
    def twin(role: Role, log: list[Any]) -> RpcConnection:
        """A new connection brought to the same state by the same sends and receipts."""
        c = conn(role, **({"peer_max_in_flight": LIMIT} if role is C else
                          {"max_in_flight": LIMIT}))
        for op, what in log:
            if op == "send":
                what(c)
            else:
                c.receive_message(what)
                while c.next_event() is not NEED_DATA:
                    pass
        return c

    # -- the client

    @precondition(lambda self: len(self.client.in_flight) < LIMIT)
    @rule(window=st.integers(0, 3), server_window=st.integers(0, 3), items=st.booleans())
    def open_stream(self, window: int, server_window: int, items: bool) -> None:
        call_id = self.client.next_id

        def request(c: RpcConnection) -> list[Any]:
            return c.send_request("s", (call_id,), stream=True)[1]

        self.client_send(request, 1, call_id)
        # the server's window rides in the arguments, for the model's server to grant
        call = self.calls[call_id] = Call(call_id, True, Way(server_window if items else 0),
                                          Way(window))
        if window:
            self.grant(C, call, window)
        if not items:
            self.client_send(lambda c: c.send_end(call_id), 7, call_id)
            call.ended = True

    @precondition(lambda self: len(self.client.in_flight) < LIMIT)
    @rule()
    def unary_call(self) -> None:
        call_id = self.client.next_id
        self.client_send(lambda c: c.send_request("u", (call_id,))[1], 1, call_id)
        self.calls[call_id] = Call(call_id, False, Way(0), Way(0))

    @precondition(lambda self: self.live(ended=False, cancelled=False))
    @rule(data=st.data(), item=ITEMS)
    def client_sends(self, data: st.DataObject, item: Any) -> None:
        call = self.calls[data.draw(st.sampled_from(self.live(ended=False, cancelled=False)))]
        if call.up.credit == 0:
            before = snapshot(self.client, call.id)
            with pytest.raises(LocalProtocolError, match="no credit"):
                self.client.send_data(call.id, item)
            assert snapshot(self.client, call.id) == before
            return
        self.client_send(lambda c: c.send_data(call.id, item), 5, call.id)
        call.up.sent.append(item)

    @precondition(lambda self: self.live(ended=False, cancelled=False))
    @rule(data=st.data())
    def client_ends(self, data: st.DataObject) -> None:
        call = self.calls[data.draw(st.sampled_from(self.live(ended=False, cancelled=False)))]
        self.client_send(lambda c: c.send_end(call.id), 7, call.id)
        call.ended = True

    @precondition(lambda self: self.live(cancelled=False))
    @rule(data=st.data())
    def client_cancels(self, data: st.DataObject) -> None:
        call = self.calls[data.draw(st.sampled_from(self.live(cancelled=False)))]
        self.client_send(lambda c: c.send_cancel(call.id), 4, call.id)
        call.cancelled = True

    def grant(self, role: Role, call: Call, count: int) -> None:
        way = call.down if role is C else call.up
        send = self.client_send if role is C else self.server_send
        send(lambda c: c.send_credit(call.id, count), 6, call.id, count)
        way.granted += count

    @precondition(lambda self: any(self.calls[i].down.buffer for i in self.live()))
    @rule(data=st.data(), grant=st.booleans())
    def client_consumes(self, data: st.DataObject, grant: bool) -> None:
        call = self.calls[data.draw(st.sampled_from(
            [i for i in self.live() if self.calls[i].down.buffer]))]
        call.down.buffer.popleft()
        call.down.owed += 1
        if grant and not call.cancelled:
            self.grant(C, call, call.down.owed)
            call.down.owed = 0

    # -- the server

    @precondition(lambda self: any(c.started and not c.answered for c in self.calls.values()))
    @rule(data=st.data(), error=st.booleans(), result=ITEMS)
    def server_answers(self, data: st.DataObject, error: bool, result: Any) -> None:
        ids = sorted(i for i, c in self.calls.items() if c.started and not c.answered)
        call = self.calls[data.draw(st.sampled_from(ids))]
        if error:
            self.server_send(lambda c: c.send_error(call.id, "E", "mid-stream"), 3, call.id)
        else:
            self.server_send(lambda c: c.send_response(call.id, result), 2, call.id)
        call.answered = True

    @precondition(lambda self: self.live(started=True, answered=False, got_cancel=False))
    @rule(data=st.data(), item=ITEMS)
    def server_sends(self, data: st.DataObject, item: Any) -> None:
        call = self.calls[data.draw(st.sampled_from(
            self.live(started=True, answered=False, got_cancel=False)))]
        if call.down.credit == 0:
            before = snapshot(self.server, call.id)
            with pytest.raises(LocalProtocolError, match="no credit"):
                self.server.send_data(call.id, item)
            assert snapshot(self.server, call.id) == before
            return
        self.server_send(lambda c: c.send_data(call.id, item), 5, call.id)
        call.down.sent.append(item)

    @precondition(lambda self: any(self.calls[i].up.buffer for i in self.live()))
    @rule(data=st.data(), grant=st.booleans())
    def server_consumes(self, data: st.DataObject, grant: bool) -> None:
        call = self.calls[data.draw(st.sampled_from(
            [i for i in self.live() if self.calls[i].up.buffer]))]
        call.up.buffer.popleft()
        call.up.owed += 1
        if grant and not (call.got_end or call.got_cancel or call.answered):
            self.grant(S, call, call.up.owed)
            call.up.owed = 0

    # -- delivery

    def take(self, side: Role) -> tuple[tuple[int, int, int], list[RpcEvent], int] | None:
        """Deliver the next message to ``side``; once a frame is whole (its buffers in): its
        (kind, id, count), its events, and the dropped count before it."""
        queue, receiver, log = ((self.to_server, self.server, self.server_log) if side is S
                                else (self.to_client, self.client, self.client_log))
        msg, meta = queue.popleft()
        log.append(("recv", msg))
        if meta is not None:  # a frame (else one of its buffers)
            self.frame_meta[side] = (meta, receiver.streams_dropped)
        events = feed(receiver, [msg])
        if receiver.expecting_buffers:
            assert events == []
            return None
        meta, dropped = self.frame_meta[side]
        return meta, events, dropped

    @precondition(lambda self: self.to_server)
    @rule()
    def deliver_to_server(self) -> None:
        taken = self.take(S)
        if taken is None:
            return
        (kind, call_id, count), events, dropped = taken
        call = self.calls[call_id]
        if call.answered and kind != 1:  # crossed the answer
            assert events == []
            assert self.server.streams_dropped == dropped + (kind != 4)
            return
        (ev,) = events
        assert ev.id == call_id
        if kind == 1:
            assert isinstance(ev, Request) and ev.stream == call.stream
            call.started = True
            if call.stream and call.up.window:
                self.grant(S, call, call.up.window)
        elif kind == 5:
            assert isinstance(ev, Data)
            way = call.up
            assert way.room >= 1  # the window was not exceeded
            assert same(ev.value, way.sent[len(way.got)])  # once, in order
            way.delivered += 1
            way.got.append(ev.value)
            way.buffer.append(ev.value)
        elif kind == 6:
            assert ev == Credit(id=call_id, count=count)
            call.down.credited += count
        elif kind == 7:
            assert isinstance(ev, End)
            call.got_end = True
        else:
            assert isinstance(ev, Cancel)
            call.got_cancel = True

    @precondition(lambda self: self.to_client)
    @rule()
    def deliver_to_client(self) -> None:
        taken = self.take(C)
        if taken is None:
            return
        (kind, call_id, count), events, dropped = taken
        call = self.calls[call_id]
        if kind == 5:
            way = call.down
            assert way.room >= 1  # the window was not exceeded
            way.delivered += 1
            if call.cancelled:  # crossed the Cancel
                assert events == [] and self.client.streams_dropped == dropped + 1
                return
            (ev,) = events
            assert isinstance(ev, Data) and same(ev.value, way.sent[len(way.got)])
            way.got.append(ev.value)
            way.buffer.append(ev.value)
        elif kind == 6:
            call.up.credited += count
            if call.ended or call.cancelled:  # crossed the End or the Cancel
                assert events == [] and self.client.streams_dropped == dropped + 1
            else:
                assert events == [Credit(id=call_id, count=count)]
        else:
            (ev,) = events
            assert isinstance(ev, (Response, Error)) and ev.id == call_id
            call.done = True

    # -- illegal frames, each in the receiver's state now (fed to a twin)

    @precondition(lambda self: self.calls)
    @rule(data=st.data())
    def illegal_to_server(self, data: st.DataObject) -> None:
        bad: list[bytes] = [rpc_frame.frame(7, 1000 + max(self.calls))]  # no such call
        for c in self.calls.values():
            if not c.started or c.answered:
                continue
            if not c.stream:
                bad.append(rpc_frame.frame(5, c.id, b"\x01"))  # not a stream
                continue
            if c.got_cancel:
                bad += [rpc_frame.frame(5, c.id, b"\x01"), rpc_frame.frame(7, c.id),
                        rpc_frame.frame(6, c.id, method=1)]
                continue
            if c.got_end:
                bad += [rpc_frame.frame(5, c.id, b"\x01"), rpc_frame.frame(7, c.id)]
            elif c.up.room == 0:
                bad.append(rpc_frame.frame(5, c.id, b"\x01"))  # beyond the window
            held = c.down.credited - len(c.down.sent)
            if held:
                bad.append(rpc_frame.frame(6, c.id, method=MAX_CREDIT - held + 1))
            bad.append(rpc_frame.frame(6, c.id, method=0))
        frame = data.draw(st.sampled_from(bad))
        if self.server.expecting_buffers:
            return  # (the next message is a buffer, whatever it holds)
        with pytest.raises(RemoteProtocolError):
            feed(self.twin(S, self.server_log), [frame])

    @precondition(lambda self: self.calls)
    @rule(data=st.data())
    def illegal_to_client(self, data: st.DataObject) -> None:
        bad: list[bytes] = []
        for c in self.calls.values():
            if not c.stream:
                if not c.done:
                    bad.append(rpc_frame.frame(5, c.id, b"\x01"))
                continue
            if c.done:
                bad += [rpc_frame.frame(5, c.id, b"\x01"), rpc_frame.frame(6, c.id, method=1)]
                continue
            bad.append(rpc_frame.frame(7, c.id))  # a server never sends End
            if c.down.room == 0:
                bad.append(rpc_frame.frame(5, c.id, b"\x01"))
            held = c.up.credited - len(c.up.sent)
            if held:
                bad.append(rpc_frame.frame(6, c.id, method=MAX_CREDIT - held + 1))
        if not bad or self.client.expecting_buffers:
            return
        with pytest.raises(RemoteProtocolError):
            feed(self.twin(C, self.client_log), [data.draw(st.sampled_from(bad))])

    # -- what must always hold

    @invariant()
    def windows_bound_what_receivers_hold(self) -> None:
        for c in self.calls.values():
            if c.stream:
                assert len(c.up.buffer) <= c.up.window and len(c.down.buffer) <= c.down.window
                assert len(c.up.sent) <= c.up.granted and len(c.down.sent) <= c.down.granted
                assert c.up.got == c.up.sent[:len(c.up.got)]
        live = {i for i, c in self.calls.items() if c.stream and not c.done}
        assert self.client.streams == live
        assert self.server.streams == {i for i, c in self.calls.items()
                                       if c.stream and c.started and not c.answered}

    def teardown(self) -> None:
        """Both sides stop starting things; each finishes what it has: receivers read and
        grant, senders send two more items where they still may, the server answers once its
        items are out. Everything must drain, with nothing left open."""
        extra = {i: 2 for i in self.calls}
        for c in self.calls.values():  # a client that granted nothing starts reading
            if c.stream and not (c.done or c.cancelled) and not c.down.granted:
                self.grant(C, c, 1)
        for _ in range(400):
            if self.to_server:
                self.deliver_to_server()
                continue
            if self.to_client:
                self.deliver_to_client()
                continue
            progressed = False
            for c in self.calls.values():
                if not c.stream or c.done:
                    continue
                if c.down.buffer or c.up.buffer:
                    c.down.owed += len(c.down.buffer)
                    c.up.owed += len(c.up.buffer)
                    c.down.buffer.clear()
                    c.up.buffer.clear()
                if c.down.owed and not c.cancelled:
                    self.grant(C, c, c.down.owed)
                    c.down.owed, progressed = 0, True
                if c.up.owed and c.started and not (c.got_end or c.got_cancel or c.answered):
                    self.grant(S, c, c.up.owed)
                    c.up.owed, progressed = 0, True
            for c in self.calls.values():
                if c.done:
                    continue
                if c.stream and not (c.ended or c.cancelled) and c.up.credit:
                    self.client_send(lambda x, i=c.id: x.send_data(i, "up"), 5, c.id)
                    c.up.sent.append("up")
                    progressed = True
                elif c.stream and not (c.ended or c.cancelled):
                    self.client_send(lambda x, i=c.id: x.send_end(i), 7, c.id)
                    c.ended = progressed = True
                if not c.started or c.answered:
                    continue
                if c.stream and not c.got_cancel and extra[c.id] and c.down.credit:
                    self.server_send(lambda x, i=c.id: x.send_data(i, "down"), 5, c.id)
                    c.down.sent.append("down")
                    extra[c.id] -= 1
                    progressed = True
                elif not c.stream or c.got_cancel or not extra[c.id]:
                    self.server_send(lambda x, i=c.id: x.send_response(i, None), 2, c.id)
                    c.answered = progressed = True
            if not progressed:
                break
        assert not (self.to_server or self.to_client), "messages left undelivered"
        stuck = {i: c for i, c in self.calls.items() if not c.done}
        assert not stuck, f"streams stuck: {stuck}"
        assert self.client.in_flight == self.server.in_flight == frozenset()
        assert self.client.streams == self.server.streams == frozenset()
        for c in self.calls.values():
            if c.stream:
                assert c.up.got == c.up.sent[:len(c.up.got)]
                if not c.cancelled:
                    assert c.down.got == c.down.sent  # everything, in order, once


def same(a: Any, b: Any) -> bool:
    """An item as it arrived equals the item sent (out-of-band bytes arrive as memoryviews)."""
    if isinstance(a, (bytes, bytearray, memoryview)):
        return bytes(a) == bytes(b)
    return bool(a == b) and type(a) is type(b)


def test_random_interleavings_of_streams() -> None:
    run_state_machine_as_test(StreamsMachine)


# -- hostile input while streams are open -------------------------------------------------------

HEADERS = st.fixed_dictionaries({
    "kind": st.integers(0, 9), "call_id": st.integers(0, 3),
    "flags": st.sampled_from([0, rpc_frame.F_WALK, rpc_frame.F_STREAM]) | st.integers(0, 0xFFFF),
    "nbufs": st.integers(0, 2), "method": st.integers(0, 3) | st.just(MAX_CREDIT),
    "deadline": st.integers(0, 2)})


@given(role=st.sampled_from(list(Role)),
       frames=st.lists(st.tuples(HEADERS, st.integers(0, 3) | st.none()), max_size=5),
       batch=st.booleans())
def test_arbitrary_frames_against_open_streams(role: Role, frames: list[tuple[dict, Any]],
                                               batch: bool) -> None:
    c, s = opened(window=2, server_window=2)
    target = s if role is S else c
    msgs = []
    for h, v in frames:
        body = b"" if v is None else bytes([v])
        msgs.append(rpc_frame.frame(h.pop("kind"), h.pop("call_id"), body, **h))
    try:
        for m in ([b"".join(msgs)] if batch and msgs else msgs):
            feed(target, [m])
    except RemoteProtocolError:
        pass
    except ProtocolError as exc:
        pytest.fail(f"receiving raised {exc!r}")
    assert target.stream_window(0) <= 2
