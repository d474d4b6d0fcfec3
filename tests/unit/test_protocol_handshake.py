"""The control-channel handshake (aiordma.protocols.handshake): sans-I/O, no device, no sockets.

* a whole exchange between a client and a server, with the bytes between them re-split and
  merged arbitrarily, gives back exactly the events that were sent;
* every (role, state, direction, event) combination missing from the transition table is a
  typed error (derived from ``TRANSITIONS``, so a new state or event is covered automatically);
* malformed input of any kind is a :class:`RemoteProtocolError` (or :data:`NEED_DATA` while the
  input is merely incomplete), never another exception and never a hang;
* an absurd declared length is refused from its 4-byte prefix alone, without buffering;
* with a shared secret: the same secret on both sides connects (over any split of the bytes),
  a different or missing secret, a tampered parameter, a replayed or reflected proof and a
  skipped challenge are typed errors, and nothing but Reject can follow a failed check.
"""

from __future__ import annotations

import itertools
import struct
import tracemalloc
from dataclasses import fields
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocols import handshake
from aiordma.protocols.errors import (
    AuthenticationError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from aiordma.protocols.handshake import (
    MAX_FRAME,
    NEED_DATA,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    RDMA_VERSION,
    Accept,
    Challenge,
    Close,
    ConnectionClosed,
    ControlConnection,
    Event,
    Hello,
    Proof,
    Ready,
    Reject,
    RejectCategory,
    Role,
    State,
    TcpAccept,
    TcpHello,
)
from aiordma.protocols.handshake._state import TRANSITIONS, Direction, next_state

from .param_ids import stable_repr
from .transition_paths import shortest_paths

# -- helpers ---------------------------------------------------------------------------------


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


# Every event that travels on the wire (ConnectionClosed is local, the _QPParams base has no code).
WIRE_EVENTS: dict[str, type[Event]] = {c.__name__: c for c in _subclasses(Event) if c.code > 0}

GID = bytes(range(0xF0, 0x100))


def qp_fields(**over: Any) -> dict[str, Any]:
    d = {"version": RDMA_VERSION, "qp_num": 0x1234, "psn": 0xABCDE, "gid": GID, "lid": 0,
         "mtu": 5, "data_slots": 8, "ctrl_slots": 2, "slot_size": 4096, "max_rd_atomic": 16}
    d.update(over)
    return d


SAMPLES: dict[str, Event] = {
    "Hello": Hello(**qp_fields()),
    "Accept": Accept(**qp_fields(qp_num=0x4321, psn=7, lid=3, mtu=3)),
    "Reject": Reject(reason="no thanks"),
    "Ready": Ready(),
    "Close": Close(sent=42),
    "Challenge": Challenge(nonce=b"n" * NONCE_SIZE),
    "Proof": Proof(mac=b"m" * NONCE_SIZE),
    "TcpHello": TcpHello(recv_buffer=1 << 20, slots=64, eager_max=8180, max_message=1 << 30),
    "TcpAccept": TcpAccept(recv_buffer=0, slots=1, eager_max=0, max_message=1),
}
# What a connection is asked to send: authentication fields empty (it fills them in).
TEMPLATES: dict[str, Event] = {**SAMPLES, "Challenge": Challenge(), "Proof": Proof()}
SECRET = b"s" * 32


# (role, state) where the event is legal, so only the bytes can be at fault
WHERE = {"Hello": (Role.SERVER, State.START), "Accept": (Role.CLIENT, State.HELLO_SENT),
         "Reject": (Role.CLIENT, State.HELLO_SENT), "Ready": (Role.SERVER, State.ACCEPTED),
         "Close": (Role.CLIENT, State.OPEN), "Challenge": (Role.CLIENT, State.AUTH_HELLO_SENT),
         "Proof": (Role.SERVER, State.CHALLENGE_SENT),
         "TcpHello": (Role.SERVER, State.START), "TcpAccept": (Role.CLIENT, State.TCP_HELLO_SENT)}


def raw_frame(body: bytes) -> bytes:
    """A length prefix and ``body``, whatever ``body`` is."""
    return struct.pack(">I", len(body)) + body


def packed_frame(obj: Any) -> bytes:
    return raw_frame(msgpack.packb(obj, use_bin_type=True))


MISSING = object()


def event_map(name: str, **over: Any) -> dict[Any, Any]:
    """The msgpack map ``encode`` would produce for SAMPLES[name], with fields overridden
    (a value of ``MISSING`` removes the field)."""
    ev = SAMPLES[name]
    d: dict[Any, Any] = {"t": type(ev).code, **{f.name: getattr(ev, f.name) for f in fields(ev)}}
    for k, v in over.items():
        if v is MISSING:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def _paths(role: Role) -> dict[State, tuple[State, list[tuple[Direction, str, State]]]]:
    """state -> (start state, shortest path): from START where possible, else AUTH_START."""
    out = {s: (State.AUTH_START, p)
           for s, p in shortest_paths(TRANSITIONS, role, State.AUTH_START).items()}
    out.update({s: (State.START, p)
                for s, p in shortest_paths(TRANSITIONS, role, State.START).items()})
    return out


PATHS = {role: _paths(role) for role in Role}
OTHER = {Role.CLIENT: Role.SERVER, Role.SERVER: Role.CLIENT}


class Driven:
    """A connection and its peer, moved in lockstep through legal events only."""

    def __init__(self, role: Role, state: State, *, max_frame: int = MAX_FRAME) -> None:
        start, path = PATHS[role][state]
        secret = SECRET if start is State.AUTH_START else None
        self.conn = ControlConnection(role, max_frame=max_frame, secret=secret)
        self.peer = ControlConnection(OTHER[role], secret=secret)
        self.received: list[Event] = []
        for direction, name, expected in path:
            self.step(direction, name)
            assert self.conn.state is expected
        assert self.conn.state is state

    def step(self, direction: Direction, name: str) -> Event:
        """``conn`` sends ``name`` to the peer, or receives it from the peer."""
        src, dst = (self.conn, self.peer) if direction is Direction.SEND else (self.peer,
                                                                             self.conn)
        data = src.send(TEMPLATES[name])
        if src.state is not State.AUTH_START and not src.uses_secret:
            assert data == handshake.encode(TEMPLATES[name])  # nothing filled in
        dst.receive_data(data)
        ev = dst.next_event()
        assert type(ev).__name__ == name and dst.next_event() is NEED_DATA
        assert isinstance(ev, Event)
        if direction is Direction.RECV:
            self.received.append(ev)
        return ev


def drive(role: Role, state: State, *, max_frame: int = MAX_FRAME) -> ControlConnection:
    """A connection brought into ``state`` through legal sends and receives only."""
    return Driven(role, state, max_frame=max_frame).conn


def pump(conn: ControlConnection, limit: int) -> list[Event]:
    """Events until NEED_DATA; fails if the connection never asks for data (a hang)."""
    events: list[Event] = []
    for _ in range(limit):
        ev = conn.next_event()
        if ev is NEED_DATA:
            return events
        assert isinstance(ev, Event), ev
        events.append(ev)
    pytest.fail(f"next_event() did not return NEED_DATA within {limit} calls")


REACHABLE = [(role, state) for role in Role for state in PATHS[role]]

# -- the transition table itself --------------------------------------------------------------


def test_table_names_only_wire_events_and_every_wire_event_is_used() -> None:
    names = {name for (_, _, _, name) in TRANSITIONS}
    assert names == set(WIRE_EVENTS)
    assert set(WIRE_EVENTS) == set(SAMPLES)  # a new wire event needs a sample here
    assert {cls.code for cls in WIRE_EVENTS.values()} == set(range(1, len(WIRE_EVENTS) + 1))


def test_every_state_is_reachable_by_some_role() -> None:
    assert set(PATHS[Role.CLIENT]) | set(PATHS[Role.SERVER]) == set(State)
    # Only the other role's half of set-up is out of reach; any other unreachable state would
    # escape the tests below, so it fails here.
    assert set(State) - set(PATHS[Role.CLIENT]) == {
        State.HELLO_RECEIVED, State.AUTH_HELLO_RECEIVED, State.CHALLENGE_SENT,
        State.PROOF_RECEIVED, State.TCP_HELLO_RECEIVED, State.TCP_AUTH_HELLO_RECEIVED,
        State.TCP_CHALLENGE_SENT, State.TCP_PROOF_RECEIVED}
    assert set(State) - set(PATHS[Role.SERVER]) == {
        State.HELLO_SENT, State.AUTH_HELLO_SENT, State.CHALLENGED, State.PROOF_SENT,
        State.TCP_HELLO_SENT, State.TCP_AUTH_HELLO_SENT, State.TCP_CHALLENGED,
        State.TCP_PROOF_SENT}


def test_every_send_has_a_matching_receive_on_the_other_side() -> None:
    # a table in which one role may send what the other can never receive is a dead end
    for (role, _, direction, name) in TRANSITIONS:
        other = {(r, d, n) for (r, _, d, n) in TRANSITIONS}
        flipped = Direction.RECV if direction is Direction.SEND else Direction.SEND
        assert (OTHER[role], flipped, name) in other, (role, direction, name)


@pytest.mark.parametrize(("role", "state"), REACHABLE, ids=lambda v: v.name)
def test_drive_reaches_every_reachable_state(role: Role, state: State) -> None:
    d = Driven(role, state)
    assert d.conn.state is state
    # peer_params is exactly the set-up message the connection received, if any
    params = [e for e in d.received if isinstance(e, (Hello, Accept, TcpHello, TcpAccept))]
    assert d.conn.peer_params == (params[-1] if params else None)


@pytest.mark.parametrize(("key", "nxt"), list(TRANSITIONS.items()),
                         ids=[f"{r.name}-{s.name}-{d.name}-{n}" for r, s, d, n in TRANSITIONS])
def test_every_legal_transition_works_through_a_connection(key: tuple, nxt: State) -> None:
    role, state, direction, name = key
    d = Driven(role, state)
    d.step(direction, name)  # the peer, in lockstep, sends or receives it too
    assert d.conn.state is nxt


ILLEGAL = [(role, state, direction, name)
           for role, state in REACHABLE for direction in Direction for name in WIRE_EVENTS
           if (role, state, direction, name) not in TRANSITIONS]


def test_illegal_combinations_are_numerous() -> None:
    # guards the parametrization below against silently becoming empty
    n_all = sum(len(PATHS[r]) for r in Role) * len(Direction) * len(WIRE_EVENTS)
    assert len(ILLEGAL) == n_all - len(TRANSITIONS) > 100


@pytest.mark.parametrize(("role", "state", "direction", "name"), ILLEGAL,
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_illegal_transition_is_a_typed_error(role: Role, state: State,
                                                   direction: Direction, name: str) -> None:
    conn = drive(role, state)
    ev = SAMPLES[name]
    if direction is Direction.SEND:
        with pytest.raises(LocalProtocolError) as info:
            conn.send(TEMPLATES[name])
        assert type(info.value) is LocalProtocolError
    else:
        conn.receive_data(handshake.encode(ev))
        with pytest.raises(RemoteProtocolError) as info:
            conn.next_event()
        assert type(info.value) is RemoteProtocolError
    assert name in str(info.value) and state.name in str(info.value)
    assert conn.state is state  # a refused event changes nothing
    # the table lookup itself agrees
    with pytest.raises(LocalProtocolError if direction is Direction.SEND else RemoteProtocolError):
        next_state(role, state, direction, name)


def test_local_events_and_invalid_fields_cannot_be_sent() -> None:
    conn = ControlConnection(Role.CLIENT)
    with pytest.raises(LocalProtocolError):
        conn.send(ConnectionClosed(graceful=True))
    for bad in ({"qp_num": 1 << 24}, {"gid": b"x" * 15}, {"mtu": 0}, {"mtu": 6},
                {"data_slots": 0}, {"slot_size": 63}, {"psn": -1}, {"qp_num": True}):
        with pytest.raises(LocalProtocolError):
            conn.send(Hello(**qp_fields(**bad)))
    assert conn.state is State.START
    conn.send(SAMPLES["Hello"])
    assert conn.state is State.HELLO_SENT


# -- whatever may be sent can be received ----------------------------------------------------

WIDE_REASONS = ["", "x" * 1024, "\u20ac" * 1024, "\U0001f600" * 1024, "\x00" * 1024]


@pytest.mark.parametrize("reason", WIDE_REASONS, ids=["empty", "ascii", "3-byte", "4-byte", "nul"])
def test_any_valid_reason_reaches_the_peer(reason: str) -> None:
    # the limit is 1024 characters: the peer must accept every one of them, whatever its
    # UTF-8 size (up to 4 KiB)
    server = drive(Role.SERVER, State.HELLO_RECEIVED)
    client = drive(Role.CLIENT, State.HELLO_SENT)
    client.receive_data(server.send(Reject(reason=reason)))
    assert client.next_event() == Reject(reason=reason)


@pytest.mark.parametrize("reason", ["x" * 1025, "\ud800", "ok \udfff", 7, b"bytes"], ids=repr)
def test_invalid_reasons_are_local_errors(reason: Any) -> None:
    server = drive(Role.SERVER, State.HELLO_RECEIVED)
    with pytest.raises(LocalProtocolError):  # never UnicodeEncodeError or another type
        server.send(Reject(reason=reason))
    assert server.state is State.HELLO_RECEIVED


# -- a whole exchange over an arbitrarily re-split byte stream --------------------------------

U16, U24 = st.integers(0, 0xFFFF), st.integers(0, (1 << 24) - 1)
QP_PARAMS = {"qp_num": U24, "psn": U24, "gid": st.binary(min_size=16, max_size=16),
             "lid": U16, "mtu": st.integers(1, 5), "data_slots": st.integers(1, 0xFFFF),
             "ctrl_slots": st.integers(1, 0xFFFF), "slot_size": st.integers(64, 1 << 20),
             "max_rd_atomic": st.integers(0, 255), "max_message": st.integers(0, 1 << 62)}
HELLOS = st.builds(Hello, **QP_PARAMS)
ACCEPTS = st.builds(Accept, **QP_PARAMS)
CLOSE_COUNTS = st.integers(0, (1 << 64) - 1)
_TCP = {"recv_buffer": st.integers(0, 1 << 62), "slots": st.integers(1, 0xFFFF),
        "eager_max": st.integers(0, 1 << 62), "max_message": st.integers(0, 1 << 62)}
ANY_EVENT = st.one_of(HELLOS, ACCEPTS, st.builds(Reject, reason=st.text(max_size=1024)),
                      st.just(Ready()), st.builds(Close, sent=CLOSE_COUNTS),
                      st.builds(TcpHello, **_TCP), st.builds(TcpAccept, **_TCP))


@given(event=ANY_EVENT)
def test_every_valid_event_round_trips(event: Event) -> None:
    data = handshake.encode(event)
    assert struct.unpack_from(">I", data)[0] == len(data) - 4 <= MAX_FRAME
    conn = drive(*WHERE[type(event).__name__])  # where the event is legal
    conn.receive_data(data)
    assert conn.next_event() == event
    assert conn.next_event() is NEED_DATA


class _Side:
    def __init__(self, role: Role) -> None:
        self.conn = ControlConnection(role)
        self.sent: list[Event] = []
        self.received: list[Event] = []
        self.out = bytearray()  # bytes sent, not yet delivered to the peer
        self.shut = False  # end of stream queued after ``out``
        self.shut_delivered = False

    def next_send(self, script: dict[State, Event]) -> Event | None:
        ev = script.get(self.conn.state)
        if isinstance(ev, Close) and any(isinstance(e, Close) for e in self.sent):
            return None
        return ev


def _chunk(data: st.DataObject, n: int) -> int:
    return data.draw(st.one_of(st.just(1), st.just(n), st.integers(1, n)), label="chunk")


@given(data=st.data(), hello=HELLOS, accept=ACCEPTS, c_sent=CLOSE_COUNTS, s_sent=CLOSE_COUNTS)
def test_exchange_survives_any_split_and_merge(data: st.DataObject, hello: Hello, accept: Accept,
                                               c_sent: int, s_sent: int) -> None:
    client, server = _Side(Role.CLIENT), _Side(Role.SERVER)
    scripts = {
        client: {State.START: hello, State.ACCEPTED: Ready(), State.OPEN: Close(sent=c_sent),
                 State.CLOSE_RECEIVED: Close(sent=c_sent)},
        server: {State.HELLO_RECEIVED: accept, State.OPEN: Close(sent=s_sent),
                 State.CLOSE_RECEIVED: Close(sent=s_sent)},
    }
    peer = {client: server, server: client}
    kinds = st.sampled_from([bytes, bytearray, memoryview])
    for _ in range(1000):
        actions = []
        for side in (client, server):
            if side.next_send(scripts[side]) is not None:
                actions.append(("send", side))
            if side.out:
                actions.append(("deliver", side))
            if not side.shut and any(isinstance(e, Close) for e in side.sent):
                actions.append(("shut", side))
            if side.shut and not side.out and not side.shut_delivered:
                actions.append(("deliver_eof", side))
        if not actions:
            break
        what, side = data.draw(st.sampled_from(actions), label="action")
        other = peer[side]
        if what == "send":
            ev = side.next_send(scripts[side])
            assert ev is not None
            side.out += side.conn.send(ev)
            side.sent.append(ev)
        elif what == "shut":
            side.shut = True
        elif what == "deliver":
            n = _chunk(data, len(side.out))
            other.conn.receive_data(data.draw(kinds)(bytes(side.out[:n])))
            del side.out[:n]
            other.received += pump(other.conn, 10)
        else:
            side.shut_delivered = True
            other.conn.receive_data(b"")
            other.received += pump(other.conn, 10)
    else:
        pytest.fail("the exchange did not finish")

    for side in (client, server):
        assert side.conn.state is State.CLOSED
        assert peer[side].received == [*side.sent, ConnectionClosed(graceful=True)]
        assert side.conn.next_event() is NEED_DATA  # end of stream is reported once
    assert [type(e) for e in client.sent] == [Hello, Ready, Close]
    assert [type(e) for e in server.sent] == [Accept, Close]
    assert server.conn.peer_params == hello and client.conn.peer_params == accept


def _reactive_server_gets(stream: bytes, cuts: list[int]) -> tuple[list[Event], bytes]:
    """Feed the client's whole byte stream to a server in the given pieces; the server answers
    Hello with Accept and Close with Close as soon as it sees them."""
    server = ControlConnection(Role.SERVER)
    got: list[Event] = []
    answer = b""
    bounds = [0, *sorted(set(cuts)), len(stream)]
    for lo, hi in itertools.pairwise(bounds):
        if lo == hi:
            continue
        server.receive_data(stream[lo:hi])
        for _ in range(10):  # react to each event before reading the next one
            ev = server.next_event()
            if ev is NEED_DATA:
                break
            got.append(ev)
            if isinstance(ev, Hello):
                answer += server.send(SAMPLES["Accept"])
            elif isinstance(ev, Close):
                answer += server.send(Close(sent=0))
        else:
            pytest.fail("no NEED_DATA")
    server.receive_data(b"")
    got += pump(server, 10)
    assert server.state is State.CLOSED
    return got, answer


CLIENT_STREAM = b"".join(handshake.encode(SAMPLES[n]) for n in ("Hello", "Ready", "Close"))
CLIENT_EVENTS = [SAMPLES[n] for n in ("Hello", "Ready", "Close")]


@pytest.mark.parametrize("cuts", [[], list(range(1, len(CLIENT_STREAM)))],
                         ids=["all-at-once", "one-byte-chunks"])
def test_extreme_splits(cuts: list[int]) -> None:
    got, answer = _reactive_server_gets(CLIENT_STREAM, cuts)
    assert got == [*CLIENT_EVENTS, ConnectionClosed(graceful=True)]
    # the client side reads the server's answer
    client = drive(Role.CLIENT, State.HELLO_SENT)
    client.receive_data(answer)
    assert client.next_event() == SAMPLES["Accept"]
    client.send(Ready())
    client.send(SAMPLES["Close"])
    assert client.next_event() == Close(sent=0)
    client.receive_data(b"")
    assert client.next_event() == ConnectionClosed(graceful=True)


@given(cuts=st.lists(st.integers(0, len(CLIENT_STREAM)), max_size=20))
def test_any_cut_points(cuts: list[int]) -> None:
    got, _ = _reactive_server_gets(CLIENT_STREAM, cuts)
    assert got == [*CLIENT_EVENTS, ConnectionClosed(graceful=True)]


def test_reject_then_eof() -> None:
    client = drive(Role.CLIENT, State.HELLO_SENT)
    server = drive(Role.SERVER, State.HELLO_RECEIVED)
    client.receive_data(server.send(Reject(reason="full")))
    assert client.next_event() == Reject(reason="full")
    assert client.state is server.state is State.CLOSED
    client.receive_data(b"")
    assert client.next_event() == ConnectionClosed(graceful=True)


@pytest.mark.parametrize("state", [State.START, State.HELLO_RECEIVED, State.ACCEPTED,
                                   State.OPEN, State.CLOSE_SENT])
def test_eof_before_the_peers_close_is_not_graceful(state: State) -> None:
    conn = drive(Role.SERVER, state)
    conn.receive_data(b"")
    assert conn.next_event() == ConnectionClosed(graceful=False)
    assert conn.next_event() is NEED_DATA


def test_data_after_eof_is_a_local_error() -> None:
    conn = ControlConnection(Role.SERVER)
    conn.receive_data(b"")
    conn.receive_data(b"")  # repeating end of stream is harmless
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"x")


# -- malformed input --------------------------------------------------------------------------

def assert_remote_error(data: bytes, where: tuple[Role, State] = WHERE["Hello"], *,
                        eof: bool = False, max_frame: int = MAX_FRAME) -> RemoteProtocolError:
    conn = drive(*where, max_frame=max_frame)
    conn.receive_data(data)
    if eof:
        conn.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as info:
        pump(conn, 10)
    assert type(info.value) is RemoteProtocolError
    return info.value


@pytest.mark.parametrize("name", list(WHERE))
def test_well_formed_samples_are_accepted(name: str) -> None:
    # the positive control for the malformed cases below: the same maps, unmodified, pass
    conn = drive(*WHERE[name])
    conn.receive_data(packed_frame(event_map(name)))
    if name == "Proof":  # well-formed, so it reaches the MAC check, which a sample fails
        with pytest.raises(AuthenticationError):
            conn.next_event()
        return
    assert conn.next_event() == SAMPLES[name]


@pytest.mark.parametrize(("name", "version"), [
    ("Hello", 0), ("Hello", PROTOCOL_VERSION), ("Hello", 0xFFFF), ("Accept", 0),
    ("Accept", PROTOCOL_VERSION), ("TcpHello", RDMA_VERSION), ("TcpHello", PROTOCOL_VERSION + 1),
    ("TcpAccept", RDMA_VERSION)])
def test_wrong_protocol_version(name: str, version: int) -> None:
    err = assert_remote_error(packed_frame(event_map(name, version=version)), WHERE[name])
    assert "version" in str(err)


OUT_OF_RANGE = [
    ("version", -1), ("version", 1 << 16), ("qp_num", 1 << 24), ("qp_num", -1),
    ("psn", 1 << 24), ("psn", -1), ("gid", b""), ("gid", b"x" * 15), ("gid", b"x" * 17),
    ("gid", b"x" * 65), ("gid", "x" * 16), ("gid", list(range(16))), ("lid", 1 << 16),
    ("lid", -1), ("mtu", 0), ("mtu", 6), ("mtu", -1), ("data_slots", 0),
    ("data_slots", 1 << 16), ("ctrl_slots", 0), ("ctrl_slots", 1 << 16), ("slot_size", 63),
    ("slot_size", (1 << 20) + 1), ("max_rd_atomic", 256), ("max_rd_atomic", -1),
    ("qp_num", True), ("qp_num", 1.0), ("qp_num", None), ("qp_num", "1"), ("qp_num", b"\x01"),
    ("mtu", [5]), ("mtu", {"v": 5}), ("qp_num", 1 << 63), ("qp_num", -(1 << 63)),
    ("max_message", -1), ("max_message", (1 << 62) + 1), ("max_message", 1.0),
    ("max_message", True), ("max_message", None),
]


@pytest.mark.parametrize("name", ["Hello", "Accept"])
@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE, ids=repr)
def test_out_of_range_fields(name: str, field: str, value: Any) -> None:
    assert_remote_error(packed_frame(event_map(name, **{field: value})), WHERE[name])


@pytest.mark.parametrize(("name", "field", "value"), [
    ("Reject", "reason", "x" * 1025), ("Reject", "reason", b"bytes"), ("Reject", "reason", 1),
    ("Close", "sent", -1), ("Close", "sent", 1.5), ("Close", "sent", None), ("Close", "sent", True),
], ids=repr)
def test_out_of_range_fields_of_other_events(name: str, field: str, value: Any) -> None:
    assert_remote_error(packed_frame(event_map(name, **{field: value})), WHERE[name])


OPTIONAL = {("Hello", "nonce"), ("Accept", "mac"), ("Reject", "category"),  # version 2
            ("Hello", "receive_pool"), ("Accept", "receive_pool"),  # the receive pool
            ("Accept", "pool_grant"), ("Hello", "pool_grant")}


@pytest.mark.parametrize("name", list(WHERE))
def test_missing_fields(name: str) -> None:
    for f in fields(SAMPLES[name]):
        if (name, f.name) in OPTIONAL:
            continue
        err = assert_remote_error(packed_frame(event_map(name, **{f.name: MISSING})), WHERE[name])
        assert f.name in str(err)


@pytest.mark.parametrize(("name", "field"), sorted(OPTIONAL))
def test_fields_added_since_version_2_may_be_left_out(name: str, field: str) -> None:
    conn = drive(*WHERE[name])
    conn.receive_data(packed_frame(event_map(name, **{field: MISSING})))
    ev = conn.next_event()
    assert isinstance(ev, type(SAMPLES[name]))
    assert getattr(ev, field) in (b"", 0)


@pytest.mark.parametrize("name", list(WHERE))
@pytest.mark.parametrize("extra", [{"extra": 1}, {"code": 1}, {"": None}, {b"bin-key": 1},
                                   {"qp_num_": 3}], ids=repr)
def test_unknown_fields(name: str, extra: dict[Any, Any]) -> None:
    assert_remote_error(packed_frame({**event_map(name), **extra}), WHERE[name])


@pytest.mark.parametrize("t", [0, 10, 11, -1, 99, 1 << 40, "1", "Hello", b"\x01", True, 1.0, None,
                               [1], MISSING], ids=stable_repr)
def test_unknown_or_missing_type_code(t: Any) -> None:
    assert_remote_error(packed_frame(event_map("Hello", t=t)))


EXT_BODIES = [
    msgpack.packb(msgpack.ExtType(1, b"x" * 16)),  # top-level ext
    msgpack.packb(msgpack.ExtType(3, b"")),  # an empty ext passes msgpack's length limit
    msgpack.packb({**event_map("Hello"), "gid": msgpack.ExtType(1, GID)}),
    msgpack.packb({**event_map("Hello"), "qp_num": msgpack.ExtType(3, b"")}),
    msgpack.packb({**event_map("Hello"), "t": msgpack.ExtType(3, b"")}),
    msgpack.packb({**event_map("Hello"), "psn": msgpack.Timestamp(1, 0)}),
    msgpack.packb({**event_map("Hello"), "x": msgpack.ExtType(3, b"")}),
]


@pytest.mark.parametrize("body", EXT_BODIES, ids=range(len(EXT_BODIES)))
def test_msgpack_ext_types(body: bytes) -> None:
    assert_remote_error(raw_frame(body))


HELLO_BODY = msgpack.packb(event_map("Hello"), use_bin_type=True)
NESTED = {
    "arrays": b"\x91" * (MAX_FRAME - 1) + b"\xc0",
    "maps": b"\x81\xa1a" * ((MAX_FRAME - 1) // 3) + b"\xc0",
    "inside-a-field": b"\x82\xa1t\x01\xa3gid" + b"\x91" * (MAX_FRAME - 9) + b"\xc0",
    "moderate": b"\x91" * 600 + b"\xc0",
}


@pytest.mark.parametrize("body", list(NESTED.values()), ids=list(NESTED))
def test_nesting_bomb(body: bytes) -> None:
    assert len(body) <= MAX_FRAME
    assert_remote_error(raw_frame(body))


@pytest.mark.parametrize("body", [
    b"", b"\xc0", b"\xc1", b"\x01", b"\x90", b"\x80", msgpack.packb([1, 2]), msgpack.packb("t"),
    msgpack.packb(b"bin"), msgpack.packb(1.5), msgpack.packb({1: 1}),
    msgpack.packb({None: 1}),
    HELLO_BODY + b"\x00",  # trailing bytes inside the frame
    HELLO_BODY + HELLO_BODY,
    HELLO_BODY[:-1],  # the map ends early
    b"\x81\xa1t\xa2\xff\xfe",  # invalid UTF-8 in a str
    b"\x81\xa2\xff\xfe\x01",  # invalid UTF-8 in a key
    msgpack.packb({"t": 3, "reason": "x" * 5000}),  # str beyond the decoder's limit
    msgpack.packb({"t": 1, "gid": list(range(17))}),  # array beyond the limit
    msgpack.packb({"t": 1, **{f"k{i}": i for i in range(40)}}),  # map beyond the limit
    msgpack.packb({"t": 1, "gid": b"x" * 100}),  # bin beyond the limit
], ids=repr)
def test_malformed_bodies(body: bytes) -> None:
    assert_remote_error(raw_frame(body))


@pytest.mark.parametrize("declared", [MAX_FRAME + 1, 1 << 20, 1 << 31, (1 << 32) - 1])
def test_oversized_declared_length_is_refused_from_the_prefix(declared: int) -> None:
    err = assert_remote_error(struct.pack(">I", declared))
    assert str(declared) in str(err)


@given(max_frame=st.integers(1, 4096), declared=st.integers(1, (1 << 32) - 1))
def test_max_frame_boundary(max_frame: int, declared: int) -> None:
    conn = ControlConnection(Role.SERVER, max_frame=max_frame)
    conn.receive_data(struct.pack(">I", declared))
    if declared > max_frame:
        with pytest.raises(RemoteProtocolError):
            conn.next_event()
    else:
        assert conn.next_event() is NEED_DATA  # incomplete, not (yet) wrong


def test_a_4_gib_declared_length_raises_at_once_without_buffering() -> None:
    prefix = b"\xff\xff\xff\xff"  # 4 GiB - 1, the largest a u32 prefix can declare
    conn = ControlConnection(Role.SERVER)
    for b in prefix[:-1]:
        conn.receive_data(bytes([b]))
        assert conn.next_event() is NEED_DATA  # fewer than 4 bytes: just incomplete
    tracemalloc.start()
    try:
        conn.receive_data(prefix[-1:])
        with pytest.raises(RemoteProtocolError):
            conn.next_event()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing of the declared size was ever allocated
    with pytest.raises(RemoteProtocolError):  # and it stays an error
        conn.next_event()


def test_every_truncation_is_incomplete_then_an_error_at_eof() -> None:
    frame = handshake.encode(SAMPLES["Hello"])
    for k in range(1, len(frame)):
        conn = ControlConnection(Role.SERVER)
        conn.receive_data(frame[:k])
        assert conn.next_event() is NEED_DATA, k
        assert conn.next_event() is NEED_DATA, k  # asking again changes nothing
        conn.receive_data(b"")
        with pytest.raises(RemoteProtocolError):
            conn.next_event()
    # the whole frame, then end of stream: the event, then a non-graceful close
    conn = ControlConnection(Role.SERVER)
    conn.receive_data(frame)
    conn.receive_data(b"")
    assert conn.next_event() == SAMPLES["Hello"]
    assert conn.next_event() == ConnectionClosed(graceful=False)


def test_eof_inside_a_second_frame() -> None:
    stream = handshake.encode(SAMPLES["Ready"]) + handshake.encode(SAMPLES["Close"])[:3]
    err = assert_remote_error(stream, WHERE["Ready"], eof=True)
    assert "ended inside" in str(err)


# -- fuzzing ----------------------------------------------------------------------------------

MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=8,
)
FIELD_NAMES = sorted({f.name for c in WIRE_EVENTS.values() for f in fields(c)} | {"t"})
FIELD_VALUES = st.one_of(st.integers(-2, 8), st.integers(0, (1 << 24) + 1),
                         st.binary(min_size=15, max_size=17), MSGPACK_VALUES)
MAPS = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=4), FIELD_VALUES,
                       max_size=12)
BODIES = st.one_of(
    st.binary(max_size=64),
    MAPS.map(lambda m: msgpack.packb(m, use_bin_type=True)),
    st.builds(lambda name, over: msgpack.packb(event_map(name, **over), use_bin_type=True),
              st.sampled_from(list(WHERE)), st.dictionaries(st.sampled_from(FIELD_NAMES),
                                                            FIELD_VALUES, max_size=2)),
)
FRAMES = st.one_of(BODIES.map(raw_frame), st.binary(max_size=24),
                   st.sampled_from(list(SAMPLES.values())).map(handshake.encode))


def check_outcomes(conn: ControlConnection, stream: bytes, cuts: list[int], eof: bool) -> None:
    """Feed ``stream`` in pieces: only wire events, NEED_DATA, or a RemoteProtocolError."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(stream)}), len(stream)]
    try:
        for lo, hi in itertools.pairwise(bounds):
            if lo == hi:
                continue  # b"" would mean end of stream
            conn.receive_data(stream[lo:hi])
            for ev in pump(conn, len(stream) + 2):
                assert type(ev) in WIRE_EVENTS.values(), ev
                handshake.encode(ev)  # whatever is accepted is also valid to send
                if isinstance(ev, (Hello, Accept)):
                    assert ev.version == RDMA_VERSION
                    assert conn.peer_params is ev
                if isinstance(ev, (TcpHello, TcpAccept)):
                    assert ev.version == PROTOCOL_VERSION
                    assert conn.peer_params is ev
        if eof:
            conn.receive_data(b"")
            events = pump(conn, 2)
            assert len(events) == 1 and isinstance(events[0], ConnectionClosed)
    except AuthenticationError:  # a peer without the secret: only Reject may follow
        with pytest.raises(LocalProtocolError):
            conn.send(Ready())
    except RemoteProtocolError:
        pass
    except ProtocolError as exc:  # a LocalProtocolError here would be a bug in the receiver
        pytest.fail(f"receiving raised {exc!r}")


STARTS = st.sampled_from(REACHABLE)


@given(where=STARTS, stream=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200)),
       eof=st.booleans())
def test_arbitrary_bytes(where: tuple[Role, State], stream: bytes, cuts: list[int],
                         eof: bool) -> None:
    check_outcomes(drive(*where), stream, cuts, eof)


@given(where=STARTS, frames=st.lists(FRAMES, max_size=5), cuts=st.lists(st.integers(0, 400)),
       eof=st.booleans())
def test_arbitrary_frames(where: tuple[Role, State], frames: list[bytes], cuts: list[int],
                          eof: bool) -> None:
    check_outcomes(drive(*where), b"".join(frames), cuts, eof)


@given(data=st.data(), where=st.sampled_from(list(WHERE.items())))
def test_mutated_valid_frames(data: st.DataObject, where: tuple[str, tuple[Role, State]]) -> None:
    name, (role, state) = where
    frame = bytearray(handshake.encode(SAMPLES[name]))
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        i = data.draw(st.integers(0, len(frame)), label="at")
        op = data.draw(st.sampled_from(["set", "insert", "delete"]), label="op")
        byte = data.draw(st.integers(0, 255), label="byte")
        if op == "insert":
            frame.insert(i, byte)
        elif frame and i < len(frame):
            if op == "set":
                frame[i] = byte
            else:
                del frame[i]
    check_outcomes(drive(role, state), bytes(frame), data.draw(st.lists(st.integers(0, 200))),
                   data.draw(st.booleans(), label="eof"))


# -- the shared secret: challenge-response ------------------------------------------------------

SECRETS = st.binary(min_size=16, max_size=64)


def set_up(client: ControlConnection, server: ControlConnection, *, hello: Any = None,
           accept: Any = None, tamper: Any = None, tcp: bool = False) -> list[Event]:
    """Run set-up to OPEN (``tcp``: the TCP transport's, with TcpHello and TcpAccept, to
    TCP_OPEN); ``tamper(name, bytes) -> bytes`` may alter what travels. Returns what the
    client received. Authentication failures propagate."""
    def carry(name: str, data: bytes, to: ControlConnection) -> Event:
        to.receive_data(tamper(name, data) if tamper else data)
        ev = to.next_event()
        assert isinstance(ev, Event)
        return ev

    first, answer = ("TcpHello", "TcpAccept") if tcp else ("Hello", "Accept")
    got = []
    ev = carry(first, client.send(hello or SAMPLES[first]), server)
    assert type(ev).__name__ == first
    if server.uses_secret:
        got.append(carry("Challenge", server.send(Challenge()), client))
        carry("Proof", client.send(Proof()), server)
    got.append(carry(answer, server.send(accept or SAMPLES[answer]), client))
    carry("Ready", client.send(Ready()), server)
    assert client.state is server.state is (State.TCP_OPEN if tcp else State.OPEN)
    return got


@given(secret=SECRETS, hello=HELLOS, accept=ACCEPTS)
def test_the_same_secret_connects_and_authenticates_both_ways(secret: bytes, hello: Hello,
                                                               accept: Accept) -> None:
    client = ControlConnection(Role.CLIENT, secret=secret)
    server = ControlConnection(Role.SERVER, secret=secret)
    got = set_up(client, server, hello=hello, accept=accept)
    assert client.authenticated and server.authenticated
    assert [type(e) for e in got] == [Challenge, Accept]
    # the parameters arrive unchanged, with the authentication fields filled in
    assert server.peer_params is not None and client.peer_params is not None
    assert {f: getattr(server.peer_params, f) for f in handshake._PARAM_FIELDS} == \
        {f: getattr(hello, f) for f in handshake._PARAM_FIELDS}
    assert len(server.peer_params.nonce) == NONCE_SIZE  # type: ignore[attr-defined]
    assert len(client.peer_params.mac) == NONCE_SIZE  # type: ignore[attr-defined]


@given(a=SECRETS, b=SECRETS)
def test_a_different_secret_fails_at_the_server_before_anything_is_accepted(a: bytes,
                                                                             b: bytes) -> None:
    client = ControlConnection(Role.CLIENT, secret=a)
    server = ControlConnection(Role.SERVER, secret=b)
    if a == b:
        set_up(client, server)
        return
    with pytest.raises(AuthenticationError, match="proof does not match"):
        set_up(client, server)
    assert server.state is State.PROOF_RECEIVED and not server.authenticated
    with pytest.raises(LocalProtocolError):  # no Accept after a failed check
        server.send(SAMPLES["Accept"])
    reject = server.send(Reject(reason="no", category=RejectCategory.AUTHENTICATION))
    client.receive_data(reject)
    ev = client.next_event()
    assert ev == Reject(reason="no", category=RejectCategory.AUTHENTICATION)
    assert client.state is server.state is State.CLOSED


@pytest.mark.parametrize(("client_secret", "server_secret", "words"), [
    (SECRET, None, "this listener has none"), (None, SECRET, "the client offered none")])
def test_one_side_without_a_secret_fails_cleanly_with_a_clear_message(
        client_secret: bytes | None, server_secret: bytes | None, words: str) -> None:
    client = ControlConnection(Role.CLIENT, secret=client_secret)
    server = ControlConnection(Role.SERVER, secret=server_secret)
    server.receive_data(client.send(SAMPLES["Hello"]))
    with pytest.raises(AuthenticationError, match=words):
        server.next_event()
    for refused in (SAMPLES["Accept"], Challenge()):
        with pytest.raises(LocalProtocolError):
            server.send(refused)
    client.receive_data(server.send(Reject(reason=words,
                                           category=RejectCategory.AUTHENTICATION)))
    ev = client.next_event()
    assert isinstance(ev, Reject) and ev.category == RejectCategory.AUTHENTICATION
    assert client.state is State.CLOSED


def _replace_field(data: bytes, **changes: Any) -> bytes:
    obj = msgpack.unpackb(data[4:], raw=False)
    obj.update(changes)
    return raw_frame(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize(("name", "field", "value"), [
    ("Hello", "qp_num", 0x999), ("Hello", "psn", 1), ("Hello", "gid", bytes(16)),
    ("Hello", "max_rd_atomic", 1), ("Accept", "qp_num", 0x999), ("Accept", "psn", 1),
    ("Accept", "gid", bytes(16)), ("Accept", "data_slots", 1)])
def test_a_man_in_the_middle_cannot_splice_in_other_queue_pair_parameters(
        name: str, field: str, value: Any) -> None:
    def tamper(n: str, data: bytes) -> bytes:
        return _replace_field(data, **{field: value}) if n == name else data

    client = ControlConnection(Role.CLIENT, secret=SECRET)
    server = ControlConnection(Role.SERVER, secret=SECRET)
    with pytest.raises(AuthenticationError):
        set_up(client, server, tamper=tamper)
    victim = server if name == "Hello" else client  # who notices
    assert not victim.authenticated
    with pytest.raises(LocalProtocolError):
        victim.send(SAMPLES["Accept"] if victim is server else Ready())


def test_a_replayed_proof_fails_against_a_fresh_challenge() -> None:
    recorded: dict[str, bytes] = {}

    def record(n: str, data: bytes) -> bytes:
        recorded[n] = data
        return data

    set_up(ControlConnection(Role.CLIENT, secret=SECRET),
           ControlConnection(Role.SERVER, secret=SECRET), tamper=record)
    # an eavesdropper replays the whole client side of that session to the server
    server = ControlConnection(Role.SERVER, secret=SECRET)
    server.receive_data(recorded["Hello"])
    assert isinstance(server.next_event(), Hello)
    server.send(Challenge())  # a fresh nonce
    server.receive_data(recorded["Proof"])
    with pytest.raises(AuthenticationError):
        server.next_event()


def test_a_servers_proof_cannot_be_reflected_as_a_clients_proof() -> None:
    # the attacker opens two sessions with nonces of its choosing and replays the server's
    # answer as its own proof: the labels differ per role, so it fails
    attacker_hello = Hello(**qp_fields(), nonce=b"a" * NONCE_SIZE)
    server = ControlConnection(Role.SERVER, secret=SECRET, nonce=b"b" * NONCE_SIZE)
    server.receive_data(handshake.encode(attacker_hello))
    server.next_event()
    server.send(Challenge())
    mac = handshake._mac(SECRET, handshake._SERVER_LABEL, b"a" * NONCE_SIZE, b"b" * NONCE_SIZE,
                         handshake._params_bytes(attacker_hello))
    server.receive_data(handshake.encode(Proof(mac=mac)))
    with pytest.raises(AuthenticationError):
        server.next_event()


def test_a_client_with_a_secret_refuses_an_accept_that_skipped_the_challenge() -> None:
    client = ControlConnection(Role.CLIENT, secret=SECRET)
    client.send(SAMPLES["Hello"])
    client.receive_data(handshake.encode(SAMPLES["Accept"]))  # a downgrade attempt
    with pytest.raises(RemoteProtocolError, match="AUTH_HELLO_SENT"):
        client.next_event()


def test_an_accept_with_a_proof_nobody_asked_for_is_a_protocol_error() -> None:
    client = drive(Role.CLIENT, State.HELLO_SENT)
    client.receive_data(handshake.encode(Accept(**qp_fields(), mac=b"m" * NONCE_SIZE)))
    with pytest.raises(RemoteProtocolError, match="not asked for"):
        client.next_event()


@pytest.mark.parametrize("secret", [b"", b"short", "a str secret of 32 characters....", 16])
def test_unusable_secrets_are_local_errors(secret: Any) -> None:
    with pytest.raises(LocalProtocolError):
        ControlConnection(Role.CLIENT, secret=secret)


def test_authentication_fields_are_the_connections_to_fill_in() -> None:
    client = ControlConnection(Role.CLIENT, secret=SECRET)
    with pytest.raises(LocalProtocolError):
        client.send(Hello(**qp_fields(), nonce=b"x" * NONCE_SIZE))
    plain = ControlConnection(Role.CLIENT)
    with pytest.raises(LocalProtocolError):
        plain.send(Hello(**qp_fields(), nonce=b"x" * NONCE_SIZE))
    assert client.state is State.AUTH_START and plain.state is State.START  # unchanged


@pytest.mark.parametrize(("name", "field", "length"), [
    ("Hello", "nonce", 1), ("Hello", "nonce", 31), ("Hello", "nonce", 33),
    ("Accept", "mac", 16), ("Challenge", "nonce", 0), ("Challenge", "nonce", 31),
    ("Proof", "mac", 0), ("Proof", "mac", 33)])
def test_nonce_and_proof_lengths_are_exact(name: str, field: str, length: int) -> None:
    assert_remote_error(packed_frame(event_map(name, **{field: b"x" * length})), WHERE[name])


@given(category=st.integers(0, 255), reason=st.text(max_size=64))
def test_reject_categories_round_trip(category: int, reason: str) -> None:
    server = drive(Role.SERVER, State.HELLO_RECEIVED)
    client = drive(Role.CLIENT, State.HELLO_SENT)
    client.receive_data(server.send(Reject(reason=reason, category=category)))
    ev = client.next_event()
    assert isinstance(ev, Reject) and ev.category == category and ev.reason == reason


@given(data=st.data(), secret=SECRETS, hello=HELLOS, accept=ACCEPTS)
def test_authenticated_exchange_survives_any_split_and_merge(data: st.DataObject, secret: bytes,
                                                             hello: Hello,
                                                             accept: Accept) -> None:
    client = ControlConnection(Role.CLIENT, secret=secret)
    server = ControlConnection(Role.SERVER, secret=secret)
    c_script = [hello, Proof(), Ready()]
    s_script = [Challenge(), accept]
    c_bytes = b""
    s_bytes = b""
    received: dict[Role, list[Event]] = {Role.CLIENT: [], Role.SERVER: []}
    # each side sends its next message as soon as the state allows; bytes arrive in pieces
    for _ in range(2000):  # 1-byte pieces: about 400 rounds
        if c_script and (client.state in (State.AUTH_START, State.CHALLENGED, State.ACCEPTED)):
            c_bytes += client.send(c_script.pop(0))
        if s_script and server.state in (State.AUTH_HELLO_RECEIVED, State.PROOF_RECEIVED):
            s_bytes += server.send(s_script.pop(0))
        if not (c_bytes or s_bytes):
            break
        if c_bytes:
            n = _chunk(data, len(c_bytes))
            server.receive_data(c_bytes[:n])
            c_bytes = c_bytes[n:]
            received[Role.SERVER] += pump(server, 10)
        if s_bytes:
            n = _chunk(data, len(s_bytes))
            client.receive_data(s_bytes[:n])
            s_bytes = s_bytes[n:]
            received[Role.CLIENT] += pump(client, 10)
    assert client.state is server.state is State.OPEN
    assert client.authenticated and server.authenticated
    assert [type(e) for e in received[Role.SERVER]] == [Hello, Proof, Ready]
    assert [type(e) for e in received[Role.CLIENT]] == [Challenge, Accept]


# -- the TCP transport's set-up (version 4) --------------------------------------------------------

TCP_PARAMS = _TCP
TCP_HELLOS = st.builds(TcpHello, **TCP_PARAMS)
TCP_ACCEPTS = st.builds(TcpAccept, **TCP_PARAMS)


@given(secret=st.none() | SECRETS, hello=TCP_HELLOS, accept=TCP_ACCEPTS)
def test_a_tcp_set_up_carries_both_sides_parameters(secret: bytes | None, hello: TcpHello,
                                                     accept: TcpAccept) -> None:
    client = ControlConnection(Role.CLIENT, secret=secret)
    server = ControlConnection(Role.SERVER, secret=secret)
    got = set_up(client, server, hello=hello, accept=accept, tcp=True)
    assert [type(e) for e in got] == ([Challenge, TcpAccept] if secret else [TcpAccept])
    assert client.authenticated is server.authenticated is (secret is not None)
    assert isinstance(server.peer_params, TcpHello) and isinstance(client.peer_params, TcpAccept)
    assert {f: getattr(server.peer_params, f) for f in handshake._TCP_FIELDS} == \
        {f: getattr(hello, f) for f in handshake._TCP_FIELDS}
    assert {f: getattr(client.peer_params, f) for f in handshake._TCP_FIELDS} == \
        {f: getattr(accept, f) for f in handshake._TCP_FIELDS}
    assert hello.version == accept.version == PROTOCOL_VERSION == 4


@pytest.mark.parametrize(("name", "field", "value"), [
    ("TcpHello", "recv_buffer", 0), ("TcpHello", "slots", 7), ("TcpHello", "max_message", 1),
    ("TcpAccept", "eager_max", 5), ("TcpAccept", "recv_buffer", 1 << 40)])
def test_a_man_in_the_middle_cannot_change_tcp_parameters(name: str, field: str,
                                                          value: Any) -> None:
    def tamper(n: str, data: bytes) -> bytes:
        return _replace_field(data, **{field: value}) if n == name else data

    client = ControlConnection(Role.CLIENT, secret=SECRET)
    server = ControlConnection(Role.SERVER, secret=SECRET)
    with pytest.raises(AuthenticationError):
        set_up(client, server, tamper=tamper, tcp=True)
    victim = server if name == "TcpHello" else client
    assert not victim.authenticated


def test_a_proof_for_one_transport_does_not_pass_for_the_other() -> None:
    """The labels differ per transport: an RDMA-set-up proof over the same nonces and
    parameter bytes is refused in a TCP set-up."""
    hello = TcpHello(**{**{f: 1 for f in TCP_PARAMS}, "recv_buffer": 0}, nonce=b"a" * NONCE_SIZE)
    server = ControlConnection(Role.SERVER, secret=SECRET, nonce=b"b" * NONCE_SIZE)
    server.receive_data(handshake.encode(hello))
    assert isinstance(server.next_event(), TcpHello)
    server.send(Challenge())
    mac = handshake._mac(SECRET, handshake._CLIENT_LABEL, b"a" * NONCE_SIZE, b"b" * NONCE_SIZE,
                         handshake._params_bytes(hello))
    server.receive_data(handshake.encode(Proof(mac=mac)))
    with pytest.raises(AuthenticationError):
        server.next_event()


@pytest.mark.parametrize(("hello", "answer"), [("TcpHello", "Accept"), ("Hello", "TcpAccept")])
def test_an_answer_for_the_other_transport_is_a_protocol_error(hello: str, answer: str) -> None:
    client = ControlConnection(Role.CLIENT)
    client.send(SAMPLES[hello])
    client.receive_data(handshake.encode(SAMPLES[answer]))
    with pytest.raises(RemoteProtocolError, match=answer):
        client.next_event()


def test_the_bytes_after_a_tcp_set_up_are_trailing_data() -> None:
    """Whatever follows the Ready (the first message frames) is not read as a control message:
    it is handed on as trailing data."""
    client, server = ControlConnection(Role.CLIENT), ControlConnection(Role.SERVER)
    server.receive_data(client.send(SAMPLES["TcpHello"]))
    server.next_event()
    client.receive_data(server.send(SAMPLES["TcpAccept"]))
    assert isinstance(client.next_event(), TcpAccept)
    assert client.trailing_data == (b"", False)
    server.receive_data(client.send(Ready()) + b"\x01frames that follow")
    assert isinstance(server.next_event(), Ready) and server.state is State.TCP_OPEN
    assert server.trailing_data == (b"\x01frames that follow", False)


def test_a_transport_reject_is_a_category_of_its_own() -> None:
    server = drive(Role.SERVER, State.TCP_HELLO_RECEIVED)
    client = drive(Role.CLIENT, State.TCP_HELLO_SENT)
    client.receive_data(server.send(Reject(reason="RDMA only",
                                           category=RejectCategory.TRANSPORT)))
    ev = client.next_event()
    assert isinstance(ev, Reject) and ev.category == RejectCategory.TRANSPORT == 4


# -- the receive pool's negotiation (aiordma.protocols.receive_pool) ---------------------------


def _pool_set_up(hello_pool: int, accept_pool: int, grant: int = 0,
                 secret: bytes | None = None,
                 hello_grant: int = 0) -> tuple[Event, Event, bytes, bytes]:
    """A whole set-up; returns what each side received and the Hello's and Accept's bytes."""
    client = ControlConnection(Role.CLIENT, secret=secret)
    server = ControlConnection(Role.SERVER, secret=secret)
    hello_bytes = client.send(Hello(**qp_fields(), receive_pool=hello_pool,
                                    pool_grant=hello_grant))
    server.receive_data(hello_bytes)
    hello = server.next_event()
    if secret is not None:
        client.receive_data(server.send(Challenge()))
        assert isinstance(client.next_event(), Challenge)
        server.receive_data(client.send(Proof()))
        assert isinstance(server.next_event(), Proof)
    accept_bytes = server.send(Accept(**qp_fields(), receive_pool=accept_pool,
                                      pool_grant=grant))
    client.receive_data(accept_bytes)
    return hello, client.next_event(), hello_bytes, accept_bytes


def test_without_the_pool_the_bytes_are_version_3s() -> None:
    """A Hello and an Accept without the pool carry no pool field: a peer of before the pool
    (which refuses unknown fields) reads them as ever."""
    hello, accept, hello_bytes, accept_bytes = _pool_set_up(0, 0)
    for data in (hello_bytes, accept_bytes):
        assert b"receive_pool" not in data and b"pool_grant" not in data
    assert isinstance(hello, Hello) and hello.receive_pool == 0
    assert isinstance(accept, Accept) and (accept.receive_pool, accept.pool_grant) == (0, 0)


def test_a_client_of_before_the_pool_gets_per_connection_slots() -> None:
    old_hello = msgpack.unpackb(_pool_set_up(0, 0)[2][4:])  # no receive_pool field at all
    assert "receive_pool" not in old_hello
    server = drive(*WHERE["Hello"])
    server.receive_data(packed_frame(old_hello))
    hello = server.next_event()
    assert isinstance(hello, Hello)
    assert not handshake.server_uses_pool(hello, pool=True)
    assert not handshake.server_uses_pool(hello, pool=False)


@pytest.mark.parametrize("secret", [None, b"s" * 16])
def test_a_client_that_offers_the_pool_gets_it_where_the_server_uses_one(
        secret: bytes | None) -> None:
    hello, accept, hello_bytes, _ = _pool_set_up(1, 1, grant=2, secret=secret)
    assert b"receive_pool" in hello_bytes
    assert isinstance(hello, Hello) and handshake.server_uses_pool(hello, pool=True)
    assert not handshake.server_uses_pool(hello, pool=False)  # the server's Config decides
    assert isinstance(accept, Accept) and (accept.receive_pool, accept.pool_grant) == (1, 2)


def test_a_server_of_before_the_pool_refuses_a_hello_that_offers_it() -> None:
    """What a version-3 server does with the field (it refuses unknown fields): why the pool
    is a client's opt-in (see the module documentation)."""
    body = msgpack.unpackb(_pool_set_up(1, 0)[2][4:])
    del body["receive_pool"]
    body["an_unknown_field"] = 1  # as an old server sees receive_pool
    err = assert_remote_error(packed_frame(body), WHERE["Hello"])
    assert "unknown fields" in str(err)


@pytest.mark.parametrize(("hello_pool", "accept_pool", "grant", "message"), [
    (0, 1, 0, "did not offer"), (0, 0, 1, "without a receive pool"),
    (1, 1, 10_000, "more than its share"),
])
def test_an_accept_that_breaks_the_pool_rules_is_a_remote_error(
        hello_pool: int, accept_pool: int, grant: int, message: str) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        _pool_set_up(hello_pool, accept_pool, grant)


@pytest.mark.parametrize("secret", [None, b"s" * 16])
def test_a_client_whose_receives_come_from_its_pool_says_so_and_grants(
        secret: bytes | None) -> None:
    """receive_pool=2: the client follows a pool's grants and the server follows its pool's
    (receives_from_pool, for each side's view of the other), with the Hello's grant."""
    hello, accept, hello_bytes, _ = _pool_set_up(2, 1, grant=2, secret=secret, hello_grant=3)
    assert b"pool_grant" in hello_bytes
    assert isinstance(hello, Hello) and (hello.receive_pool, hello.pool_grant) == (2, 3)
    assert handshake.server_uses_pool(hello, pool=True)
    assert handshake.receives_from_pool(hello) and handshake.receives_from_pool(accept)
    hello, accept, _, _ = _pool_set_up(2, 0, secret=secret)  # a server without a pool
    assert handshake.receives_from_pool(hello) and not handshake.receives_from_pool(accept)
    hello, accept, _, _ = _pool_set_up(1, 1, grant=1)  # only the server's receives
    assert not handshake.receives_from_pool(hello) and handshake.receives_from_pool(accept)


@pytest.mark.parametrize(("hello_pool", "grant", "message"), [
    (1, 1, "without a receive pool"), (0, 2, "without a receive pool"),
    (2, 10_000, "more than its share"),
])
def test_a_hello_that_breaks_the_pool_rules_is_a_remote_error(
        hello_pool: int, grant: int, message: str) -> None:
    err = assert_remote_error(packed_frame(event_map("Hello", receive_pool=hello_pool,
                                                     pool_grant=grant)))
    assert message in str(err)


def test_an_accept_of_a_clients_kind_of_pool_is_a_remote_error() -> None:
    with pytest.raises(RemoteProtocolError, match="0 or 1"):
        _pool_set_up(2, 2)


def test_a_listener_of_before_clients_pools_refuses_receive_pool_2() -> None:
    """What a listener that knew only its own pool does with a pooled client's Hello: the
    value out of its range (0..1), and pool_grant an unknown field: why a client's pool, too,
    is an opt-in of its Config (see the module documentation)."""
    body = msgpack.unpackb(_pool_set_up(2, 1, hello_grant=1)[2][4:])
    assert (body["receive_pool"], body["pool_grant"]) == (2, 1)
    del body["pool_grant"]
    body["an_unknown_field"] = 1  # as that listener sees pool_grant
    assert "unknown fields" in str(assert_remote_error(packed_frame(body), WHERE["Hello"]))


def test_the_macs_cover_the_pool_fields() -> None:
    """With a secret, a man in the middle cannot turn the pool on or off unnoticed."""
    secret = b"s" * 16
    client = ControlConnection(Role.CLIENT, secret=secret)
    server = ControlConnection(Role.SERVER, secret=secret)
    server.receive_data(client.send(Hello(**qp_fields(), receive_pool=1)))
    server.next_event()
    client.receive_data(server.send(Challenge()))
    client.next_event()
    server.receive_data(client.send(Proof()))
    server.next_event()
    accept = msgpack.unpackb(server.send(Accept(**qp_fields(), receive_pool=1,
                                                pool_grant=1))[4:])
    accept["pool_grant"] = 2  # tampered
    client.receive_data(packed_frame(accept))
    with pytest.raises(AuthenticationError):
        client.next_event()


def test_the_macs_cover_a_clients_pool_grant() -> None:
    secret = b"s" * 16
    client = ControlConnection(Role.CLIENT, secret=secret)
    server = ControlConnection(Role.SERVER, secret=secret)
    hello = msgpack.unpackb(client.send(Hello(**qp_fields(), receive_pool=2,
                                              pool_grant=1))[4:])
    hello["pool_grant"] = 3  # tampered on the way
    server.receive_data(packed_frame(hello))
    server.next_event()
    client.receive_data(server.send(Challenge()))
    client.next_event()
    server.receive_data(client.send(Proof()))
    with pytest.raises(AuthenticationError):
        server.next_event()
