"""The RPC wire protocol (aiordma.protocols.rpc, its _codec and _state): sans-I/O, no device.

* every event kind round-trips between a client and a server, with hypothesis-generated values;
  big binaries travel out of band as the very objects given (no copy) and never in the frame;
* arrays round-trip through ``ext 2`` (real numpy if installed, else a stand-in module), and an
  array from the peer without numpy is a RemoteProtocolError;
* a stateful machine runs random interleavings of calls, answers and crossing cancels against a
  model: every event is delivered exactly once, ids are unique, in-flight sets agree;
* every (role, state, direction, event) missing from the transition table is a typed error
  (derived from ``TRANSITIONS``, so a new state or event is covered automatically);
* malformed input of any kind is a RemoteProtocolError, never another exception nor a hang.

That protocols/rpc/ imports no I/O module is checked, with every other file of protocols/, by
tests/unit/test_protocols_are_sans_io.py.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import types
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
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
    EXT_BUFFER,
    EXT_CODES,
    EXT_NDARRAY,
    NEED_DATA,
    PROTOCOL_VERSION,
    Cancel,
    Error,
    Request,
    Response,
    Role,
    RpcConnection,
    RpcEvent,
)
from aiordma.protocols.rpc import _frame as rpc_frame
from aiordma.protocols.rpc import _receive as rpc_receive
from aiordma.protocols.rpc._frame import F_DEADLINE, F_KWARGS, F_NAMED, F_WALK
from aiordma.protocols.rpc._state import (
    EVENTS,
    IGNORED,
    TRANSITIONS,
    Calls,
    CallState,
    Direction,
    next_state,
)
from aiordma.protocols.rpc._stream import STREAM_EVENTS

from .param_ids import stable_repr
from .rpc_builds import rpc_build  # noqa: F401  # (each test with both builds)
from .transition_paths import shortest_paths

THRESHOLD = 32  # small, so out-of-band values stay cheap to generate

# -- helpers ---------------------------------------------------------------------------------


def conn(role: Role, **kw: Any) -> RpcConnection:
    kw.setdefault("oob_threshold", THRESHOLD)
    return RpcConnection(role, **kw)


def sample(name: str, call_id: int = 0) -> RpcEvent:
    return {"Request": lambda: Request(id=call_id, method="m", args=(1, b"x" * 40), kwargs={},
                                       deadline_ms=None),
            "Response": lambda: Response(id=call_id, result=[b"y" * 40, 2]),
            "Error": lambda: Error(id=call_id, type="ValueError", message="bad"),
            "Cancel": lambda: Cancel(id=call_id)}[name]()


def enc(event: RpcEvent, **kw: Any) -> list[bytes | memoryview]:
    kw.setdefault("oob_threshold", THRESHOLD)
    return rpc.encode(event, **kw)


def enc_to(receiver: RpcConnection, event: RpcEvent, **kw: Any) -> list[bytes | memoryview]:
    """``event`` encoded as a peer of ``receiver`` sends it: a Request names its method the
    first time (binding the next index), later ones carry the index alone."""
    if isinstance(event, Request) and isinstance(event.method, str):
        names = receiver.methods if receiver.role is Role.SERVER else ()
        if event.method in names:
            return enc(event, method_index=names.index(event.method), bind=False, **kw)
        return enc(event, method_index=len(names), **kw)
    return enc(event, **kw)


def feed(c: RpcConnection, messages: list[Any]) -> list[RpcEvent]:
    """Feed every message, then take events until NEED_DATA (bounded)."""
    for m in messages:
        c.receive_message(m)
    return pump(c)


def pump(c: RpcConnection, limit: int = 1000) -> list[RpcEvent]:
    events = []
    for _ in range(limit):
        ev = c.next_event()
        if ev is NEED_DATA:
            return events
        assert isinstance(ev, RpcEvent), ev
        events.append(ev)
    pytest.fail(f"next_event() did not return NEED_DATA within {limit} calls")


V = PROTOCOL_VERSION


def packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def frame(kind: int, call_id: int = 0, body: Any = None, *, raw: bytes | None = None,
          **header: Any) -> bytes:
    """A frame as a peer could send it: ``body`` packed (or ``raw`` bytes as the body)."""
    data = raw if raw is not None else b"" if body is None and kind == 4 else packb(body)
    return rpc_frame.frame(kind, call_id, data, **header)


def named(call_id: int, name: Any, args: Any, kwargs: Any = None, *, flags: int = 0,
          **header: Any) -> bytes:
    """A Request that binds ``name`` (to index 0, on a fresh server, unless told)."""
    return frame(1, call_id, [name, args, {} if kwargs is None else kwargs],
                 flags=F_NAMED | flags, **header)


def old_frame(*items: Any) -> bytes:
    """A frame of versions 1 and 2: a msgpack array that starts with the version."""
    return packb(list(items))


class Header(NamedTuple):
    version: int
    kind: int
    flags: int
    nbufs: int
    method: int
    size: int
    id: int
    deadline: int


def header(data: bytes | memoryview) -> Header:
    return Header(*rpc_frame.HEADER.unpack_from(data))


def raw_values(data: bytes | memoryview) -> Any:
    """A frame's body unpacked with ext types kept as ExtType."""
    return msgpack.unpackb(data[rpc_frame.HEADER_SIZE:], raw=False, ext_hook=msgpack.ExtType,
                           strict_map_key=False)


def walk(value: Any) -> list[Any]:
    """Every object inside ``value`` (iterative)."""
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        out.append(v)
        if isinstance(v, (list, tuple)) and not isinstance(v, msgpack.ExtType):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return out


# -- the transition table ---------------------------------------------------------------------


PATHS = {role: shortest_paths(TRANSITIONS, role, CallState.NONE) for role in Role}
REACHABLE = [(role, state) for role in Role for state in PATHS[role]]


def drive(role: Role, state: CallState) -> RpcConnection:
    """A connection whose call 0 was brought into ``state`` by legal sends and receives."""
    c = conn(role)
    for direction, name, expected in PATHS[role][state]:
        ev = sample(name)
        if direction is Direction.SEND:
            assert c.send(ev)[0] == enc(ev)[0]
        else:
            assert feed(c, enc_to(c, ev)) == [ev]
        assert c.call_state(0) is expected
    assert c.call_state(0) is state
    return c


def test_table_names_only_wire_events_and_every_one_is_used() -> None:
    assert {name for (_, _, _, name) in TRANSITIONS} == set(EVENTS)
    # (the stream calls' own events have their table: tests/unit/test_protocol_rpc_stream.py)
    assert {c.__name__ for c in RpcEvent.__subclasses__()} == set(EVENTS) | set(STREAM_EVENTS)
    assert {c.kind for c in RpcEvent.__subclasses__()} == {1, 2, 3, 4, 5, 6, 7}
    assert IGNORED <= set(TRANSITIONS)
    assert EXT_CODES == {EXT_BUFFER: "BUFFER", EXT_NDARRAY: "NDARRAY"}


def test_every_state_is_reachable_by_its_role() -> None:
    assert set(PATHS[Role.CLIENT]) == {CallState.NONE, CallState.WAITING, CallState.CANCEL_SENT,
                                       CallState.DONE}
    assert set(PATHS[Role.SERVER]) == {CallState.NONE, CallState.RUNNING, CallState.CANCELLED,
                                       CallState.DONE}


@pytest.mark.parametrize(("key", "nxt"), list(TRANSITIONS.items()),
                         ids=[f"{r.name}-{s.name}-{d.name}-{n}" for r, s, d, n in TRANSITIONS])
def test_every_legal_transition_works_through_a_connection(key: tuple, nxt: CallState) -> None:
    role, state, direction, name = key
    c = drive(role, state)
    ev = sample(name)
    if direction is Direction.SEND:
        c.send(ev)
    else:
        delivered = feed(c, enc_to(c, ev))
        assert delivered == ([] if key in IGNORED else [ev])
    assert c.call_state(0) is nxt


ILLEGAL = [(role, state, direction, name)
           for role, state in REACHABLE for direction in Direction for name in EVENTS
           if (role, state, direction, name) not in TRANSITIONS]


def test_illegal_combinations_are_numerous() -> None:
    n_all = sum(len(PATHS[r]) for r in Role) * len(Direction) * len(EVENTS)
    assert len(ILLEGAL) == n_all - len(TRANSITIONS) > 40


@pytest.mark.parametrize(("role", "state", "direction", "name"), ILLEGAL,
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_illegal_transition_is_a_typed_error(role: Role, state: CallState,
                                                   direction: Direction, name: str) -> None:
    c = drive(role, state)
    before = (c.in_flight, c.next_id)
    ev = sample(name)
    if direction is Direction.SEND:
        with pytest.raises(LocalProtocolError) as info:
            c.send(ev)
        assert type(info.value) is LocalProtocolError
    else:
        with pytest.raises(RemoteProtocolError) as info:
            feed(c, enc_to(c, ev))
        assert type(info.value) is RemoteProtocolError
        with pytest.raises(RemoteProtocolError):  # a failed connection keeps refusing
            c.receive_message(enc(sample("Cancel"))[0])
    assert name in str(info.value) and state.name in str(info.value)
    assert c.call_state(0) is state and (c.in_flight, c.next_id) == before
    with pytest.raises(LocalProtocolError if direction is Direction.SEND else RemoteProtocolError):
        next_state(role, state, direction, name)


def test_duplicate_request_ids_are_refused_while_running_and_after() -> None:
    s = conn(Role.SERVER)
    feed(s, enc_to(s, sample("Request", 5)))
    with pytest.raises(RemoteProtocolError, match="RUNNING"):
        feed(s, enc_to(s, sample("Request", 5)))
    s = conn(Role.SERVER)
    feed(s, enc_to(s, sample("Request", 5)))
    s.send_response(5, None)
    with pytest.raises(RemoteProtocolError, match="increase"):  # 5 again, or anything lower
        feed(s, enc_to(s, sample("Request", 3)))


def test_answers_for_calls_never_sent_or_already_answered_are_refused() -> None:
    c = conn(Role.CLIENT)
    with pytest.raises(RemoteProtocolError, match="NONE"):
        feed(c, enc_to(c, sample("Response", 0)))
    c = conn(Role.CLIENT)
    call_id, _ = c.send_request("f")
    feed(c, enc_to(c, Response(id=call_id, result=1)))
    with pytest.raises(RemoteProtocolError, match="DONE"):
        feed(c, enc_to(c, Error(id=call_id, type="E", message="")))


def test_cancel_crossing_the_answer_is_ignored_and_counted() -> None:
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    call_id, msgs = c.send_request("slow")
    assert feed(s, msgs) == [Request(id=call_id, method="slow", args=(), kwargs={},
                                     deadline_ms=None)]
    answer = s.send_response(call_id, "late")  # the server answers ...
    cancel = c.send_cancel(call_id)  # ... while the client cancels
    assert c.call_state(call_id) is CallState.CANCEL_SENT and c.in_flight == {call_id}
    assert feed(s, cancel) == []  # crossed: silently ignored
    assert (s.cancels_after_answer, s.unknown_cancels) == (1, 0)
    assert feed(c, answer) == [Response(id=call_id, result="late")]
    assert c.in_flight == frozenset() and c.call_state(call_id) is CallState.DONE


def test_cancel_before_the_answer_is_delivered_and_the_server_still_answers() -> None:
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    call_id, msgs = c.send_request("slow", deadline_ms=250)
    assert feed(s, msgs)[0].deadline_ms == 250
    assert feed(s, c.send_cancel(call_id)) == [Cancel(id=call_id)]
    assert s.call_state(call_id) is CallState.CANCELLED and s.in_flight == {call_id}
    with pytest.raises(LocalProtocolError):  # a second cancel is a caller bug
        c.send_cancel(call_id)
    assert feed(c, s.send_error(call_id, "CancelledError", "")) == [
        Error(id=call_id, type="CancelledError", message="")]
    assert s.in_flight == c.in_flight == frozenset()


def test_a_cancel_for_an_id_never_seen_is_ignored_and_counted() -> None:
    s = conn(Role.SERVER)
    assert feed(s, enc_to(s, Cancel(id=7))) == []
    assert (s.cancels_after_answer, s.unknown_cancels) == (0, 1)
    assert s.call_state(7) is CallState.NONE
    assert len(feed(s, enc_to(s, sample("Request", 7)))) == 1  # the id is still free


def test_in_flight_limits() -> None:
    c = conn(Role.CLIENT, peer_max_in_flight=2)
    s = conn(Role.SERVER, max_in_flight=2)
    ids = []
    for _ in range(2):
        call_id, msgs = c.send_request("f")
        ids.append(call_id)
        feed(s, msgs)
    with pytest.raises(LocalProtocolError, match="in flight"):
        c.send_request("f")
    assert c.next_id == 2 and c.in_flight == set(ids)
    with pytest.raises(RemoteProtocolError, match="in flight"):  # a misbehaving client
        feed(s, enc_to(s, sample("Request", 9)))
    # an answer frees a slot on both sides; the client's count never drops below the server's
    s = conn(Role.SERVER, max_in_flight=2)
    for call_id in ids:
        feed(s, enc_to(s, sample("Request", call_id)))
    answer = s.send_response(ids[0], None)
    with pytest.raises(LocalProtocolError):
        c.send_request("f")  # not yet: the answer has not arrived
    feed(c, answer)
    call_id, msgs = c.send_request("f")
    feed(s, msgs)
    assert s.in_flight == {ids[1], call_id}


def test_the_calls_table_alone() -> None:
    calls = Calls(Role.CLIENT, 1)
    assert calls.apply(3, Direction.SEND, "Request")  # gaps are allowed
    assert calls.next_id == 4 and calls.state(0) is CallState.DONE
    assert calls.state(4) is CallState.NONE
    with pytest.raises(LocalProtocolError):
        calls.check(4, Direction.SEND, "Request")  # the limit
    with pytest.raises(LocalProtocolError):
        Calls(Role.CLIENT, 1).check(rpc.MAX_ID + 1, Direction.SEND, "Request")


# -- values round-trip --------------------------------------------------------------------------

SMALL_BYTES = st.binary(max_size=THRESHOLD - 1)
BIG_BYTES = st.binary(min_size=THRESHOLD, max_size=3 * THRESHOLD)
BYTESLIKE = st.one_of(
    SMALL_BYTES, BIG_BYTES, BIG_BYTES.map(bytearray), (SMALL_BYTES | BIG_BYTES).map(memoryview),
    BIG_BYTES.map(lambda b: memoryview(bytearray(b))[1:]))
SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
           | st.floats(allow_nan=False) | st.text(max_size=20) | BYTESLIKE)
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
METHODS = st.text(min_size=1, max_size=rpc.MAX_NAME)
IDS = st.integers(0, rpc.MAX_ID)
DEADLINES = st.none() | st.integers(0, rpc.MAX_ID)


def big_originals(value: Any) -> list[Any]:
    return [v for v in walk(value) if isinstance(v, (bytes, bytearray, memoryview))
            and memoryview(v).nbytes >= THRESHOLD]


def check_round_trip(event: RpcEvent, sender: RpcConnection, receiver: RpcConnection) -> RpcEvent:
    msgs = sender.send(event)
    head, bufs = msgs[0], msgs[1:]
    assert isinstance(head, bytes) and len(head) <= sender.max_message
    # nothing big inside the frame: big values are ext 1 placeholders
    h = header(head)
    assert h.version == PROTOCOL_VERSION and h.nbufs == len(bufs)
    assert h.size == len(head) - rpc_frame.HEADER_SIZE
    for v in walk(raw_values(head) if h.size else None):
        assert not (isinstance(v, bytes) and len(v) >= THRESHOLD)
    # the buffers are the very objects given, in order, not copies
    fields = [getattr(event, n) for n in ("args", "kwargs", "result") if hasattr(event, n)]
    originals = big_originals(fields)
    assert sorted(map(id, (b if isinstance(b, bytes) or b.obj is None else
                           (b if any(b is o for o in originals) else b.obj) for b in bufs))) \
        == sorted(map(id, originals))
    received = feed(receiver, msgs)
    assert received == [event]
    # received big values are views of the fed messages (no copy)
    fed = {id(m) for m in bufs} | {id(m.obj) for m in bufs if isinstance(m, memoryview)}
    got = [v for v in walk([getattr(received[0], n) for n in ("args", "kwargs", "result")
                            if hasattr(received[0], n)]) if isinstance(v, memoryview)]
    assert len(got) == len(bufs) and all(id(v) in fed or id(v.obj) in fed for v in got)
    return received[0]


@given(method=METHODS, args=st.lists(VALUES, max_size=4).map(tuple),
       kwargs=st.dictionaries(st.text(max_size=8), VALUES, max_size=3), deadline=DEADLINES,
       call_id=IDS)
def test_requests_round_trip(method: str, args: tuple, kwargs: dict, deadline: int | None,
                             call_id: int) -> None:
    ev = Request(id=call_id, method=method, args=args, kwargs=kwargs, deadline_ms=deadline)
    got = check_round_trip(ev, conn(Role.CLIENT), conn(Role.SERVER))
    assert isinstance(got, Request) and type(got.args) is tuple


@given(result=VALUES, call_id=IDS)
def test_responses_round_trip(result: Any, call_id: int) -> None:
    server = conn(Role.SERVER)
    client = conn(Role.CLIENT)
    feed(server, client.send(sample("Request", call_id)))
    check_round_trip(Response(id=call_id, result=result), server, client)


@given(type_=st.text(max_size=rpc.MAX_NAME), message=st.text(max_size=200), call_id=IDS,
       cancelled=st.booleans())
def test_errors_and_cancels_round_trip(type_: str, message: str, call_id: int,
                                       cancelled: bool) -> None:
    client, server = conn(Role.CLIENT), conn(Role.SERVER)
    feed(server, client.send(sample("Request", call_id)))
    if cancelled:
        check_round_trip(Cancel(id=call_id), client, server)
    check_round_trip(Error(id=call_id, type=type_, message=message), server, client)
    assert client.in_flight == server.in_flight == frozenset()


def test_out_of_band_values_are_the_original_objects() -> None:
    big, ba, mv = b"a" * 100, bytearray(b"b" * 100), memoryview(b"c" * 200)[10:110]
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    _, msgs = c.send_request("f", (big, [ba]), {"k": mv, "small": b"s"})
    assert len(msgs) == 4
    assert msgs[1] is big and msgs[2].obj is ba and msgs[3] is mv
    ev = feed(s, msgs)[0]
    assert ev.args[0].obj is big and ev.args[1][0].obj is ba and ev.kwargs["k"] is mv
    assert ev.kwargs["small"] == b"s" and type(ev.kwargs["small"]) is bytes
    ba[0] = ord("z")  # the same memory: a change shows through
    assert ev.args[1][0][0] == ord("z")


# -- arrays -------------------------------------------------------------------------------------


def test_numpy_arrays_round_trip() -> None:
    np = pytest.importorskip("numpy")
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    big = np.arange(24, dtype="<f8").reshape(2, 3, 4)
    small = np.array([1, 2], dtype="<i2")
    cplx = np.ones(8, dtype="<c16")
    _, msgs = c.send_request("f", (big, small, cplx, np.zeros((0, 5), dtype="u1")))
    assert len(msgs) == 3 and msgs[1].obj is big
    ev = feed(s, msgs)[0]
    for sent, got in zip((big, small, cplx), ev.args, strict=False):
        assert got.dtype == sent.dtype and got.shape == sent.shape and (got == sent).all()
    assert ev.args[3].shape == (0, 5)
    with pytest.raises(LocalProtocolError):
        c.send_request("f", (big[:, ::2],))  # not C-contiguous
    with pytest.raises(LocalProtocolError):
        c.send_request("f", (np.array(["a"], dtype=object),))


NUMPY_DTYPES = ["<b1", "|i1", "<i2", ">i4", "<i8", "|u1", "<u2", ">u4", "<u8", "<f2", "<f4",
                ">f8", "<c8", ">c16"]


def _arrays() -> st.SearchStrategy[Any]:
    np = pytest.importorskip("numpy")
    from hypothesis.extra import numpy as hnp

    return hnp.arrays(dtype=st.sampled_from([np.dtype(d) for d in NUMPY_DTYPES]),
                      shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
                      elements={"allow_nan": False})


@given(data=st.data())
def test_real_numpy_arrays_round_trip(data: st.DataObject) -> None:
    """Real numpy, any plain dtype (both byte orders), 0-d to 4-d, empty sides, inline and out of
    band (threshold 32 B), as arguments, keyword arguments and results; the received message is
    a bytearray, as Endpoint.recv() gives."""
    np = pytest.importorskip("numpy")
    arrays = data.draw(st.lists(_arrays(), min_size=1, max_size=4))
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    call_id, msgs = c.send_request("f", tuple(arrays), {"k": arrays[0]})
    ev = feed(s, [bytearray(m) for m in msgs])[0]
    assert isinstance(ev, Request)
    big = [a for a in arrays if a.nbytes >= THRESHOLD]
    assert len(msgs) == 1 + len(big) + (arrays[0].nbytes >= THRESHOLD)
    for sent, got in zip((*arrays, arrays[0]), (*ev.args, ev.kwargs["k"]), strict=True):
        assert type(got) is np.ndarray
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert got.tobytes() == sent.tobytes()  # bit for bit (no NaN, but -0.0 stays -0.0)
        # out of band: a view of the received (writable) message; inline: of the frame's bytes
        assert got.flags.writeable == (sent.nbytes >= THRESHOLD)
    answer = feed(c, s.send_response(call_id, {"r": arrays}))[0]
    assert isinstance(answer, Response)
    for sent, got in zip(arrays, answer.result["r"], strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert got.tobytes() == sent.tobytes()


def test_real_numpy_scalars_and_views() -> None:
    """numpy scalars arrive as 0-d arrays (float64 excepted: np.float64 is a float
    subclass, sent as a float); non-contiguous views are refused (nothing is copied silently)
    and round-trip once made contiguous; a contiguous slice of a bigger array goes out of band
    as a view of it."""
    np = pytest.importorskip("numpy")
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    base = np.arange(60, dtype="<i4").reshape(6, 10)
    scalars = (np.int8(-3), np.uint64(2**64 - 1), np.float32(1.5), np.complex128(1 - 2j),
               np.array(7.25), np.float64(2.5))
    _, msgs = c.send_request("f", (*scalars, base[2:5]))
    assert np.shares_memory(msgs[1].obj, base)  # rows 2..4 are contiguous: a view, no copy
    ev = feed(s, [bytearray(m) for m in msgs])[0]
    for sent, got in zip(scalars[:5], ev.args, strict=False):
        assert type(got) is np.ndarray and got.shape == () and got.dtype == sent.dtype
        assert got[()] == sent
    assert type(ev.args[5]) is float and ev.args[5] == 2.5
    assert (ev.args[6] == base[2:5]).all()
    for view in (base[:, ::2], base.T, np.asfortranarray(base), base[::-1]):
        with pytest.raises(LocalProtocolError, match="C-contiguous"):
            c.send_request("f", (view,))
        _, msgs = c.send_request("f", (np.ascontiguousarray(view),))
        got = feed(s, msgs)[0].args[0]
        assert got.shape == view.shape and (got == view).all()
    for bad in (np.array(["text"]), np.array([1], dtype="M8[ns]"), np.array([None]),
                np.zeros(2, dtype=[("a", "<i4")])):
        with pytest.raises(LocalProtocolError):
            c.send_request("f", (bad,))


class FakeArray(bytearray):
    """Exposes numpy's array protocol and the buffer protocol, without numpy."""

    def __init__(self, data: bytes, typestr: str, shape: tuple[int, ...]) -> None:
        super().__init__(data)
        self.__array_interface__ = {"typestr": typestr, "shape": shape, "strides": None,
                                    "version": 3}


def fake_numpy() -> types.ModuleType:
    mod = types.ModuleType("numpy")

    class Built:
        def __init__(self, data: Any, dtype: str) -> None:
            self.data, self.dtype, self.shape = data, dtype, None

        def reshape(self, shape: tuple[int, ...]) -> Built:
            self.shape = shape
            return self

    mod.frombuffer = Built  # type: ignore[attr-defined]
    return mod


def test_arrays_without_numpy_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    big = FakeArray(bytes(range(48)), "<u2", (4, 6))
    small = FakeArray(b"\x01\x00\x02\x00", "<i2", (2,))
    c = conn(Role.CLIENT)
    _, msgs = c.send_request("f", (big, small))
    assert len(msgs) == 2 and msgs[1].obj is big  # zero-copy, cast to bytes
    # a receiver with numpy (a stand-in here) rebuilds them ...
    monkeypatch.setitem(sys.modules, "numpy", fake_numpy())
    ev = feed(conn(Role.SERVER), msgs)[0]
    assert (ev.args[0].dtype, ev.args[0].shape) == ("<u2", (4, 6))
    assert ev.args[0].data.obj is big and ev.args[1].data == bytes(small)
    # ... one without numpy refuses them, as a protocol error
    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(RemoteProtocolError, match="numpy"):
        feed(conn(Role.SERVER), msgs)
    for bad in (FakeArray(b"x" * 8, "|O8", (1,)), FakeArray(b"x" * 8, "<f8", (2,)),
                FakeArray(b"x" * 8, "<f8", (-1,))):
        with pytest.raises(LocalProtocolError):
            c.send_request("f", (bad,))


def test_numpy_is_not_imported_by_the_protocol_module() -> None:
    probe = "import sys, aiordma.protocols.rpc; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True, cwd=Path(rpc.__file__).parent.parent)
    assert out.stdout.strip() == "False"


# -- a client and a server, randomly interleaved --------------------------------------------------

LIMIT = 4


class CallsMachine(RuleBasedStateMachine):
    """Random calls, answers, errors and cancels (crossing answers) over two ordered queues."""

    def __init__(self) -> None:
        super().__init__()
        self.client = conn(Role.CLIENT, peer_max_in_flight=LIMIT)
        self.server = conn(Role.SERVER, max_in_flight=LIMIT)
        self.to_server: deque[Any] = deque()
        self.to_client: deque[Any] = deque()
        self.sent: dict[int, Request] = {}  # every request, by id
        self.waiting: dict[int, bool] = {}  # client model: id -> cancel sent
        self.running: dict[int, bool] = {}  # server app's model: id -> cancel received
        self.answered: set[int] = set()  # server: answered ids
        self.answers: dict[int, RpcEvent] = {}  # what the server sent
        self.got_requests: list[int] = []
        self.got_answers: list[int] = []
        self.crossed = 0

    @precondition(lambda self: len(self.waiting) < LIMIT)
    @rule(args=st.lists(VALUES, max_size=2), deadline=DEADLINES)
    def call(self, args: list, deadline: int | None) -> None:
        call_id, msgs = self.client.send_request("f", tuple(args), deadline_ms=deadline)
        assert call_id not in self.sent and all(call_id > i for i in self.sent)
        self.sent[call_id] = Request(id=call_id, method="f", args=tuple(args), kwargs={},
                                     deadline_ms=deadline)
        self.waiting[call_id] = False
        self.to_server.extend(msgs)

    @precondition(lambda self: len(self.waiting) >= LIMIT)
    @rule()
    def call_over_the_limit(self) -> None:
        with pytest.raises(LocalProtocolError):
            self.client.send_request("f")

    @precondition(lambda self: any(not c for c in self.waiting.values()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        call_id = data.draw(st.sampled_from(sorted(i for i, c in self.waiting.items() if not c)))
        self.to_server.extend(self.client.send_cancel(call_id))
        self.waiting[call_id] = True

    @precondition(lambda self: self.running)
    @rule(data=st.data(), result=VALUES, error=st.booleans())
    def answer(self, data: st.DataObject, result: Any, error: bool) -> None:
        call_id = data.draw(st.sampled_from(sorted(self.running)))
        ev: RpcEvent = (Error(id=call_id, type="E", message=str(call_id)) if error
                        else Response(id=call_id, result=result))
        self.to_client.extend(self.server.send(ev))
        del self.running[call_id]
        self.answered.add(call_id)
        self.answers[call_id] = ev

    @precondition(lambda self: self.to_server)
    @rule()
    def deliver_to_server(self) -> None:
        msg = self.to_server.popleft()
        is_cancel = header(msg).kind == Cancel.kind if not self.server.expecting_buffers \
            else False
        before = self.server.cancels_after_answer
        for ev in feed(self.server, [msg]):
            if isinstance(ev, Request):
                assert ev == self.sent[ev.id] and ev.id not in self.got_requests
                self.got_requests.append(ev.id)
                self.running[ev.id] = False
            else:
                assert isinstance(ev, Cancel) and self.running[ev.id] is False
                self.running[ev.id] = True
                is_cancel = False
        if is_cancel:  # a cancel that produced no event crossed the answer
            call_id = header(msg).id
            assert call_id in self.answered
            assert self.server.cancels_after_answer == before + 1
            self.crossed += 1

    @precondition(lambda self: self.to_client)
    @rule()
    def deliver_to_client(self) -> None:
        for ev in feed(self.client, [self.to_client.popleft()]):
            assert ev == self.answers[ev.id] and ev.id not in self.got_answers
            self.got_answers.append(ev.id)
            del self.waiting[ev.id]

    @invariant()
    def sides_agree_with_the_model(self) -> None:
        assert self.client.in_flight == set(self.waiting)
        assert self.server.in_flight == set(self.running)
        assert self.server.in_flight <= self.client.in_flight  # why the limit is safe
        assert self.server.unknown_cancels == 0
        assert self.server.cancels_after_answer == self.crossed

    def teardown(self) -> None:
        for _ in range(8 * LIMIT + len(self.to_server) + len(self.to_client)):
            if self.to_server:
                self.deliver_to_server()
            elif self.running:
                call_id = min(self.running)
                self.to_client.extend(self.server.send_response(call_id, None))
                del self.running[call_id]
                self.answered.add(call_id)
                self.answers[call_id] = Response(id=call_id, result=None)
            elif self.to_client:
                self.deliver_to_client()
            else:
                break
        assert not (self.to_server or self.to_client or self.running or self.waiting)
        assert sorted(self.got_requests) == sorted(self.sent) == sorted(self.got_answers)
        assert self.client.in_flight == self.server.in_flight == frozenset()


def test_random_interleavings() -> None:
    run_state_machine_as_test(CallsMachine)


# -- sending invalid things -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"method": ""}, {"method": "m" * 257}, {"method": 7}, {"args": [set()]},
    {"args": [object()]}, {"args": [msgpack.ExtType(1, b"\0\0\0\0")]}, {"args": ["\ud800"]},
    {"args": [1 << 64]}, {"args": [-(1 << 63) - 1]}, {"kwargs": {1: 2}}, {"kwargs": {"a": {2: 1}}},
    {"deadline_ms": -1}, {"deadline_ms": 1.5}, {"deadline_ms": True}, {"args": [b"x" * 40] * 5},
    {"args": [b"x" * 300]}, {"args": ["x" * 300]}, {"args": [[[[[1]]]]]},
    {"args": [memoryview(bytes(80)).cast("B", (8, 10))[::2]]},
], ids=stable_repr)
def test_invalid_requests_are_local_errors_and_change_nothing(bad: dict[str, Any]) -> None:
    c = conn(Role.CLIENT, max_buffers=4, max_message=256, max_depth=3)
    fields = {"method": "m", "args": (), "kwargs": {}, "deadline_ms": None, **bad}
    with pytest.raises(LocalProtocolError) as info:
        c.send(Request(id=0, **fields))
    assert type(info.value) is LocalProtocolError
    assert c.next_id == 0 and c.in_flight == frozenset()


def test_values_up_to_max_depth_pass_and_deeper_do_not() -> None:
    c, s = conn(Role.CLIENT, max_depth=3), conn(Role.SERVER, max_depth=3)
    assert feed(s, c.send_request("f", ([[[1]]], {"a": {"b": {"c": 1}}}))[1])
    with pytest.raises(LocalProtocolError):
        c.send_request("f", ([[[[1]]]],))
    # what a more lenient peer sends is refused
    with pytest.raises(RemoteProtocolError, match="deeper"):
        feed(s, [frame(1, 5, [[[[[1]]]]], flags=F_WALK)])  # ("f" is bound to index 0)


def test_other_invalid_sends() -> None:
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    with pytest.raises(LocalProtocolError):
        s.send_request("f")  # only the client calls
    with pytest.raises(LocalProtocolError):
        c.send(Cancel(id=True))  # ids are ints, not bools
    with pytest.raises(LocalProtocolError):
        c.send(RpcEvent(id=0))
    feed(s, c.send_request("f")[1])
    for bad in ({"type": "t" * 257}, {"message": 1}, {"type": None}):
        with pytest.raises(LocalProtocolError):
            s.send(Error(id=0, **{"type": "E", "message": "", **bad}))
    assert s.in_flight == {0}
    with pytest.raises(ValueError):
        RpcConnection(Role.CLIENT, max_depth=100000)


# -- receiving malformed input ---------------------------------------------------------------------

GOOD = enc(sample("Request", 3))  # a frame and one buffer


def expect_remote(messages: list[Any], role: Role = Role.SERVER, **kw: Any) -> str:
    c = conn(role, **kw)
    with pytest.raises(RemoteProtocolError) as info:
        feed(c, messages)
    assert type(info.value) is RemoteProtocolError
    with pytest.raises(RemoteProtocolError):
        c.receive_message(GOOD[0])  # and it stays refused
    return str(info.value)


def test_good_sample_is_good() -> None:
    assert feed(conn(Role.SERVER), GOOD) == [sample("Request", 3)]


@pytest.mark.parametrize("depth", [33, 1000, 1023, 1025, 100000])
@pytest.mark.parametrize("kind", ["list", "map"])
def test_nesting_bombs(depth: int, kind: str) -> None:
    head = b"\x91" if kind == "list" else b"\x81\xa1k"
    bomb = head * depth + b"\xc0"
    # as the result of a Response, where any value is allowed (flagged for the walk, or not)
    for flags in (F_WALK, 0):
        expect_remote([frame(2, 0, raw=bomb, flags=flags)], Role.CLIENT, max_message=1 << 20)


@pytest.mark.parametrize("code", [0, 3, 5, 127, -1, -128])
def test_unknown_ext_types(code: int) -> None:
    data = b"\xd6" + struct.pack("b", code) + b"\0\0\0\0"  # fixext 4 (-1: a timestamp)
    for flags in (F_WALK, 0):
        assert expect_remote([frame(1, 0, raw=b"\x93\xa1m\x91" + data + b"\x80",
                                    flags=F_NAMED | flags)])


def test_wrong_version_names_both() -> None:
    err = expect_remote([old_frame(1, 1, 0, "m", [], {}, None, 0)])  # version 1: no batches
    assert "version 1," in err and f"this side {PROTOCOL_VERSION}" in err
    err = expect_remote([old_frame(2, 1, 0, "m", [], {}, None, 0)])  # version 2: msgpack frames
    assert "version 2," in err
    err = expect_remote([packb([[2, 1, 0, "m", [], {}, None, 0]] * 2)])  # a version-2 batch
    assert "version 2," in err
    assert "version 0," in expect_remote([old_frame(0)])
    assert "version 7," in expect_remote([old_frame(7, "anything")])
    assert "version 3," in expect_remote([frame(1, 0, [], version=3)])  # the same header layout
    assert "version 4," in expect_remote([frame(1, 0, [], version=4)])  # the same, no F_META
    assert "version 6," in expect_remote([frame(1, 0, [], version=6)])
    cancel = enc(sample("Cancel", 3))[0]
    assert "version 9," in expect_remote([cancel + bytes([9])])  # a second frame, in a batch
    assert "version" in expect_remote([b""])


BOUND = named(0, "m", [])  # binds "m" to index 0; the cases below follow it (as call 1)


@pytest.mark.parametrize("messages", [
    [frame(9, 0, [])], [frame(0, 0, [])], [frame(255, 0, [])],  # kinds
    [named(1 << 63, "m", [])], [named((1 << 64) - 1, "m", [])],  # ids
    [named(0, "", [])], [named(0, "m" * 257, [])], [named(0, b"m", [])], [named(0, 7, [])],
    [named(0, None, [])],  # method names
    [named(0, "m", [], method=1)], [BOUND, named(1, "n", [], method=0)],  # bound out of order
    [frame(1, 0, [])], [BOUND, frame(1, 1, [], method=1)],  # an index not bound
    [named(0, "m", {})], [named(0, "m", "a")], [BOUND, frame(1, 1, {})],  # args
    [BOUND, frame(1, 1, 5)], [named(0, "m", [], [])], [named(0, "m", [], {"k": 1}, flags=F_KWARGS)],
    [named(0, "m", [], {b"k": 1})], [BOUND, frame(1, 1, [[], {1: 2}], flags=F_KWARGS)],  # kwargs
    [BOUND, frame(1, 1, [[]], flags=F_KWARGS)], [BOUND, frame(1, 1, [[], {}, 1], flags=F_KWARGS)],
    [named(0, "m", [], deadline=1 << 63, flags=F_DEADLINE)], [named(0, "m", [], deadline=5)],
    [frame(1, 0, ["m", [], {}])],  # a named body without F_NAMED (index 0 is not bound)
    [frame(1, 0, ["m", []], flags=F_NAMED)], [frame(1, 0, "m", flags=F_NAMED)],  # named shapes
    [named(0, "m", [], flags=0x40)], [named(0, "m", [], flags=0x8000)],  # unknown flags
    [named(0, "m", [], nbufs=65, flags=F_WALK)], [named(0, "m", [], nbufs=1 << 32 - 1)],
    [named(0, "m", [], nbufs=1)],  # announced, never used
    [named(0, "m", [[1]])], [named(0, "m", [], {"k": [1]})],  # containers without F_WALK
    [named(0, "m", [{"a": {1: 2}}], flags=F_WALK)],  # a nested non-str key
    [frame(4, 0, raw=b"\xc0")], [frame(4, 0, flags=F_WALK)], [frame(4, 0, method=1)],  # cancels
    [frame(4, 0, deadline=1)], [frame(4, 0, nbufs=1)],
    [frame(1, 0, raw=b"")], [frame(1, 0, raw=b"\x93\xa1m\x90\x80\xc0", flags=F_NAMED)],
], ids=lambda m: repr(m)[:60])
def test_wrong_fields_to_a_server(messages: list[bytes]) -> None:
    expect_remote(messages)


@pytest.mark.parametrize("message", [
    frame(2, 0, 5, flags=F_NAMED), frame(2, 0, 5, flags=F_DEADLINE), frame(2, 0, 5, method=1),
    frame(2, 0, 5, deadline=1), frame(2, 0, [5]), frame(2, 0, {"a": 1}), frame(2, 0, raw=b""),
    frame(2, 0, 5, nbufs=1), frame(3, 0, [5, "x"]), frame(3, 0, ["E", None]), frame(3, 0, "E"),
    frame(3, 0, ["E"]), frame(3, 0, ["E", "m", 1]), frame(3, 0, ["t" * 257, ""]),
    frame(3, 0, ["E", ""], flags=F_WALK), frame(3, 0, ["E", ""], nbufs=1),
    frame(1, 0, []),  # a frame only clients send
], ids=lambda m: repr(m)[:60])
def test_wrong_fields_to_a_client(message: bytes) -> None:
    c = conn(Role.CLIENT)
    c.send(sample("Request", 0))
    with pytest.raises(RemoteProtocolError):
        feed(c, [message])


def test_buffer_counts_and_indexes() -> None:
    ext = msgpack.ExtType
    idx = [ext(EXT_BUFFER, struct.pack("<I", i)) for i in range(4)]
    blob = b"z" * 40

    def req(args: list, nbufs: int, kwargs: Any = None) -> bytes:
        return named(0, "m", args, kwargs, flags=F_WALK, nbufs=nbufs)

    cases = [
        [req([idx[0]], 65), *[blob] * 65],  # above max_buffers
        [req([idx[1]], 1), blob],  # index outside
        [req([idx[0], idx[0]], 2), blob, blob],  # used twice
        [req([idx[0]], 2), blob, blob],  # one never used
        [req([], 1), blob],  # none used
        [req([ext(EXT_BUFFER, b"\0\0\0")], 1), blob],  # bad ext size
        [req([ext(EXT_NDARRAY, b"\xc1")], 0)],  # bad ext 2
        [req([ext(EXT_NDARRAY, packb(["|O8", [1], b"x" * 8]))], 0)],
        [frame(1, 0, [idx[0], [], {}], flags=F_NAMED | F_WALK, nbufs=1), blob],  # as the name
        [req([], 1, {ext(EXT_BUFFER, b"\0\0\0\0"): 1}), blob],  # as a key
        [frame(2, 0, idx[0], flags=F_WALK, nbufs=1), blob],  # (a server receives no answer)
    ]
    for messages in cases:
        expect_remote(messages)


def test_array_ext_shapes_and_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numpy", fake_numpy())
    ext = msgpack.ExtType
    for payload, bufs in [
        (["<f8", [2], b"x" * 8], []),  # 16 B needed
        (["<f8", [1 << 62, 1 << 62], b""], []),
        (["<f8", [2], 0], [b"x" * 9]),
        (["<f8", [-1], b""], []), (["<f8", "2", b""], []), (["<f8", [2]], []),
        (["<f8", [1] * 33, b"x" * 8], []), (["<f8", [2], 1.5], []), (["f8", [1], b"x" * 8], []),
    ]:
        msg = named(0, "m", [ext(EXT_NDARRAY, packb(payload))], flags=F_WALK, nbufs=len(bufs))
        expect_remote([msg, *bufs])
    good = named(0, "m", [ext(EXT_NDARRAY, packb(["<f8", [0, 5], b""]))], flags=F_WALK)
    assert feed(conn(Role.SERVER), [good])[0].args[0].shape == (0, 5)


def test_size_limits() -> None:
    small = {"max_message": 64}
    expect_remote([named(0, "m" * 30, [])], **small)
    expect_remote([named(0, "m", [msgpack.ExtType(EXT_BUFFER, b"\0\0\0\0")], flags=F_WALK,
                         nbufs=1), b"x" * 65], **small)
    # declared sizes beyond the message are refused before anything is allocated
    expect_remote([frame(1, 0, raw=b"\x93\xa1m\xdd\xff\xff\xff\xff", flags=F_NAMED)])
    expect_remote([frame(1, 0, raw=b"\x93\xa1m\x91\xc6\xff\xff\xff\xff", flags=F_NAMED)])
    expect_remote([rpc_frame.HEADER.pack(V, 1, F_NAMED, 0, 0, 1 << 31, 0, 0)])  # a long body
    expect_remote([b""])
    expect_remote([GOOD[0] + b"\xc0"])  # trailing bytes: not a frame
    h = header(GOOD[0])
    expect_remote([rpc_frame.HEADER.pack(*h[:5], h.size + 1, *h[6:]) + GOOD[0][32:] + b"\xc0",
                   *GOOD[1:]])  # trailing bytes inside a body


def test_every_truncation_of_a_frame_is_refused() -> None:
    for k in range(len(GOOD[0])):
        expect_remote([GOOD[0][:k]])


def test_a_frame_while_buffers_are_expected_is_taken_as_a_buffer() -> None:
    s = conn(Role.SERVER)
    other = enc(sample("Cancel", 3))[0]
    assert feed(s, [GOOD[0], other]) == [Request(id=3, method="m", args=(1, other), kwargs={},
                                                 deadline_ms=None)]
    # and a buffer where a frame is expected is (normally) malformed
    expect_remote([GOOD[1]])


def check_only_remote_errors(c: RpcConnection, messages: list[bytes]) -> None:
    try:
        for m in messages:
            for ev in feed(c, [m]):
                assert type(ev) in (Request, Response, Error, Cancel)
    except RemoteProtocolError:
        pass
    except ProtocolError as exc:
        pytest.fail(f"receiving raised {exc!r}")


ROLES = st.sampled_from(list(Role))


@given(role=ROLES, messages=st.lists(st.binary(max_size=64), max_size=4))
def test_arbitrary_bytes(role: Role, messages: list[bytes]) -> None:
    check_only_remote_errors(conn(role), messages)


HEADERS = st.fixed_dictionaries({
    "kind": st.integers(0, 5), "call_id": st.integers(0, 3) | st.integers(0, (1 << 64) - 1),
    "flags": st.integers(0, 15) | st.integers(0, 0xFFFF), "nbufs": st.integers(0, 2),
    "method": st.integers(0, 2), "deadline": st.integers(0, 2) | st.integers(0, (1 << 64) - 1)})


@given(role=ROLES, frames=st.lists(st.tuples(HEADERS, VALUES), max_size=4),
       batch=st.booleans())
def test_arbitrary_frames(role: Role, frames: list[tuple[dict, Any]], batch: bool) -> None:
    try:
        msgs = [frame(h.pop("kind"), h.pop("call_id"), v, **h) for h, v in frames]
    except (TypeError, ValueError):  # a value msgpack cannot pack (a memoryview, a bytearray)
        msgs = [frame(h["kind"], 0, None) for h, _ in frames]
    check_only_remote_errors(conn(role), [b"".join(msgs)] if batch else msgs)


@given(data=st.data(), name=st.sampled_from(EVENTS))
def test_mutated_valid_frames(data: st.DataObject, name: str) -> None:
    role = Role.SERVER if name in ("Request", "Cancel") else Role.CLIENT
    c = conn(role)
    if role is Role.CLIENT:
        c.send(sample("Request", 0))
    msgs = [bytearray(m) for m in enc(sample(name, 0))]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        m = msgs[data.draw(st.integers(0, len(msgs) - 1), label="message")]
        i = data.draw(st.integers(0, len(m)), label="at")
        op = data.draw(st.sampled_from(["set", "insert", "delete"]), label="op")
        byte = data.draw(st.integers(0, 255), label="byte")
        if op == "insert":
            m.insert(i, byte)
        elif m and i < len(m):
            if op == "set":
                m[i] = byte
            else:
                del m[i]
    check_only_remote_errors(c, [bytes(m) for m in msgs])


# -- the lean wire path: method table, flags, fast paths ------------------------------------------


def test_a_method_name_travels_once_per_connection() -> None:
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    first = c.send_request("compute", (1,))[1][0]
    again = c.send_request("compute", (2,))[1][0]
    other = c.send_request("other", (3,))[1][0]
    assert b"compute" in first and b"compute" not in again
    assert [header(m).flags & F_NAMED for m in (first, again, other)] == [F_NAMED, 0, F_NAMED]
    assert [header(m).method for m in (first, again, other)] == [0, 0, 1]
    assert [e.method for e in feed(s, [first, again, other])] == [  # type: ignore[attr-defined]
        "compute", "compute", "other"]
    assert c.methods == s.methods == ("compute", "other")
    # a refused request binds nothing
    with pytest.raises(LocalProtocolError):
        c.send_request("third", (object(),))
    assert c.methods == ("compute", "other")


def test_the_method_table_is_bounded_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc, "MAX_METHODS", 3)  # the sending half's bound
    monkeypatch.setattr(rpc_receive, "MAX_METHODS", 3)  # the receiving half's
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    feed(s, [c.send_request(name)[1][0] for name in "abc"])
    with pytest.raises(LocalProtocolError, match="more than 3"):
        c.send_request("d")
    c.send_request("a")  # a bound name still works
    with pytest.raises(RemoteProtocolError, match="at most 3"):
        feed(s, [named(3, "d", [], method=3)])


@pytest.mark.parametrize(("args", "kwargs", "flags"), [
    ((1, "x", b"y", None, 2.5, True), {}, 0),
    ((1,), {"k": "v"}, F_KWARGS),
    (([1],), {}, F_WALK),
    ((), {"k": {"n": 1}}, F_KWARGS | F_WALK),
    ((b"z" * THRESHOLD,), {}, F_WALK),  # out of band
])
def test_values_are_walked_only_when_flagged(args: tuple, kwargs: dict, flags: int) -> None:
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    feed(s, c.send_request("m")[1])
    call_id, msgs = c.send_request("m", args, kwargs)
    assert header(msgs[0]).flags == flags
    (ev,) = feed(s, msgs)
    assert ev == Request(id=call_id, method="m", args=args, kwargs=kwargs, deadline_ms=None)
    answer = s.send_response(call_id, args[0] if args else kwargs["k"])
    assert header(answer[0]).flags == flags & F_WALK


@pytest.mark.parametrize("role", list(Role))
def test_the_state_shortcuts_agree_with_the_table(role: Role) -> None:
    """Calls.request and Calls.answer (the hot paths) against step + commit, in every state of
    every reachable call, both directions, and ids around the horizon."""
    for state in PATHS[role]:
        for direction in Direction:
            for event in ("Request", "Response", "Error"):
                for call_id in (0, 1, 5):
                    outcomes = []
                    for shortcut in (True, False):
                        c = drive(role, state)
                        calls = c._calls
                        try:
                            if not shortcut:
                                calls.apply(call_id, direction, event)
                            elif event == "Request":
                                calls.request(call_id, direction)
                            else:
                                calls.answer(call_id, direction, event)
                        except ProtocolError as exc:
                            outcomes.append(type(exc))
                        else:
                            outcomes.append(None)
                        outcomes.append((calls.in_flight, calls.next_id,
                                         [calls.state(i) for i in range(7)]))
                    assert outcomes[:2] == outcomes[2:], (role, state, direction, event, call_id)


class _GeneralOnly(RpcConnection):
    """A connection without the receiving fast path: every frame through the general one."""

    def _take_plain(self, *args: Any) -> bool:
        return False


def _outcome(c: RpcConnection, messages: list[bytes]) -> Any:
    out: list[Any] = []
    for m in messages:
        try:
            out.append(feed(c, [m]))
        except ProtocolError as exc:
            out.append(type(exc))
            break
    return out, c.in_flight, c.methods, c.expecting_buffers


@given(role=ROLES, frames=st.lists(st.tuples(HEADERS, VALUES), max_size=4), batch=st.booleans(),
       bind=st.booleans())
def test_the_receiving_fast_path_takes_what_the_general_path_takes(
        role: Role, frames: list[tuple[dict, Any]], batch: bool, bind: bool) -> None:
    msgs = [named(0, "m", [], flags=F_NAMED)] if bind and role is Role.SERVER else []
    for h, v in frames:
        h = dict(h)
        try:
            msgs.append(frame(h.pop("kind"), h.pop("call_id"), v, **h))
        except (TypeError, ValueError):  # a value msgpack cannot pack
            continue
    messages = [b"".join(msgs)] if batch else msgs
    assert _outcome(conn(role), messages) == _outcome(_GeneralOnly(role, oob_threshold=THRESHOLD),
                                                      messages)


@given(calls=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(SCALARS, max_size=3),
                                DEADLINES), min_size=1, max_size=6))
def test_the_sending_fast_paths_send_what_the_general_path_sends(
        calls: list[tuple[str, list, int | None]]) -> None:
    c = conn(Role.CLIENT)
    names: list[str] = []
    for name, args, deadline in calls:
        call_id, msgs = c.send_request(name, tuple(args), deadline_ms=deadline)
        bind = name not in names
        if bind:
            names.append(name)
        ev = Request(id=call_id, method=name, args=tuple(args), kwargs={}, deadline_ms=deadline)
        assert msgs == enc(ev, method_index=names.index(name), bind=bind)
    s = conn(Role.SERVER)
    s._calls.request(0, Direction.RECV)
    for result in (None, 1, "x", b"y" * (THRESHOLD - 1), b"z" * THRESHOLD, [1]):
        c2 = conn(Role.SERVER)
        c2._calls.request(0, Direction.RECV)
        assert c2.send_response(0, result) == enc(Response(id=0, result=result))
