"""Call metadata on the RPC wire (version 5, ``F_META``; aiordma.protocols.rpc._meta): sans-I/O,
no device.

* metadata round-trips on Requests (unary and stream), Responses and Errors, with hypothesis
  keys and values of every allowed kind and size, next to any values the call carries;
* a frame with metadata is the frame without it plus ``F_META``, its body ``[metadata, body]``,
  and a frame without metadata has no flag and no map (an empty mapping is none): what calls
  without metadata send did not change; the fast paths send and take what the general path
  sends and takes, metadata or not;
* the sender refuses (LocalProtocolError, nothing sent, nothing changed) exactly what the
  receiver refuses (RemoteProtocolError): hypothesis draws metadata inside and outside the
  limits, sends it when the sender takes it and crafts the frame by hand when it does not;
* every kind of bad metadata has an explicit example on both sides, and each kind is asserted
  to have run; malformed maps and mutated frames give only RemoteProtocolError.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError
from aiordma.protocols.rpc import Error, Request, Response, Role, RpcConnection
from aiordma.protocols.rpc import _frame as rpc_frame
from aiordma.protocols.rpc import _meta as meta
from aiordma.protocols.rpc._frame import F_DEADLINE, F_KWARGS, F_META, F_NAMED, F_STREAM, F_WALK

from .param_ids import stable_repr
from .test_protocol_rpc import (
    IDS,
    SCALARS,
    THRESHOLD,
    VALUES,
    _GeneralOnly,
    _outcome,
    check_only_remote_errors,
    conn,
    enc,
    expect_remote,
    feed,
    header,
    packb,
)
from .rpc_builds import rpc_build  # noqa: F401  # (each test with both builds)

KEY_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz_.-"
KEYS = st.text(KEY_CHARS, min_size=1, max_size=meta.MAX_KEY)
META_VALUES = (st.text(max_size=40) | st.binary(max_size=40)
               | st.text(min_size=meta.MAX_VALUE - 2, max_size=meta.MAX_VALUE)
               | st.binary(min_size=meta.MAX_VALUE - 2, max_size=meta.MAX_VALUE))
# within every limit: few entries when the values may be long (at most 16 KiB together)
METADATA = (st.dictionaries(KEYS, st.text(max_size=40) | st.binary(max_size=40), min_size=1,
                            max_size=meta.MAX_ENTRIES)
            | st.dictionaries(KEYS, META_VALUES, min_size=1, max_size=3))


def no_surrogates(md: dict[str, Any]) -> bool:
    try:
        msgpack.packb(md, use_bin_type=True)
    except (TypeError, ValueError, UnicodeEncodeError):
        return False
    return True


def fresh_server_with_call(call_id: int) -> tuple[RpcConnection, RpcConnection]:
    client, server = conn(Role.CLIENT), conn(Role.SERVER)
    feed(server, client.send(Request(id=call_id, method="m", args=(), kwargs={})))
    return client, server


# -- round trips ------------------------------------------------------------------------------


@given(md=METADATA.filter(no_surrogates), args=st.lists(VALUES, max_size=3).map(tuple),
       kwargs=st.dictionaries(st.text(max_size=8), VALUES, max_size=2),
       deadline=st.none() | st.integers(0, 10**6), stream=st.booleans(), call_id=IDS)
def test_request_metadata_round_trips(md: dict[str, Any], args: tuple, kwargs: dict,
                                      deadline: int | None, stream: bool, call_id: int) -> None:
    ev = Request(id=call_id, method="m", args=args, kwargs=kwargs, deadline_ms=deadline,
                 stream=stream, metadata=md)
    msgs = conn(Role.CLIENT).send(ev)
    assert header(msgs[0]).flags & F_META
    (got,) = feed(conn(Role.SERVER), msgs)
    assert got == ev and got.metadata == md  # type: ignore[attr-defined]
    # the map travels beside the body the frame has without it: [metadata, body]
    plain = conn(Role.CLIENT).send(Request(id=call_id, method="m", args=args, kwargs=kwargs,
                                           deadline_ms=deadline, stream=stream))
    with_meta, without = header(msgs[0]), header(plain[0])
    assert with_meta._replace(flags=with_meta.flags & ~F_META, size=without.size) == without
    assert not without.flags & F_META
    assert bytes(msgs[0][32:]) == b"\x92" + packb(md) + bytes(plain[0][32:])
    assert len(msgs) == len(plain)


@given(md=METADATA.filter(no_surrogates), result=VALUES, call_id=IDS, error=st.booleans())
def test_answer_metadata_round_trips(md: dict[str, Any], result: Any, call_id: int,
                                     error: bool) -> None:
    client, server = fresh_server_with_call(call_id)
    if error:
        msgs = server.send_error(call_id, "ValueError", "bad", md)
        expected: Any = Error(id=call_id, type="ValueError", message="bad", metadata=md)
    else:
        msgs = server.send_response(call_id, result, md)
        expected = Response(id=call_id, result=result, metadata=md)
    assert header(msgs[0]).flags & F_META
    (got,) = feed(client, msgs)
    assert got == expected
    assert client.in_flight == server.in_flight == frozenset()


@pytest.mark.parametrize("md", [None, {}])
def test_no_metadata_is_no_flag_and_no_map(md: Any) -> None:
    """What calls without metadata send is what they sent before metadata existed: an empty
    mapping is none (it arrives as None)."""
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    first = c.send_request("m", (1,), metadata=md)[1]
    assert first == conn(Role.CLIENT).send_request("m", (1,))[1]
    assert not header(first[0]).flags & F_META
    (ev,) = feed(s, first)
    assert ev.metadata is None  # type: ignore[attr-defined]
    answer = s.send_response(0, 5, md)
    assert answer == conn_with_call(Role.SERVER).send_response(0, 5)
    assert not header(answer[0]).flags & F_META
    assert feed(c, answer) == [Response(id=0, result=5)]
    _, msgs = c.send_request("m", (3,), metadata={"k": "v"})  # (a bound name: the index)
    assert header(msgs[0]).flags & F_META and header(msgs[0]).flags & F_NAMED == 0


def conn_with_call(role: Role) -> RpcConnection:
    """A server that received call 0."""
    c = conn(role)
    feed(c, conn(Role.CLIENT).send_request("m", (1,))[1])
    return c


def test_the_limits_edges_pass_on_both_sides() -> None:
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    edges: list[dict[str, Any]] = [
        {f"k{i}": "" for i in range(meta.MAX_ENTRIES)},
        {"k" * meta.MAX_KEY: "v"},
        {"s": "v" * meta.MAX_VALUE, "b": b"\xff" * meta.MAX_VALUE},
        {"utf8": "é" * meta.MAX_VALUE},  # 4096 characters, 8 KiB packed
        {KEY_CHARS: "all the key characters"},
    ]
    for md in edges:
        _, msgs = c.send_request("m", (), metadata=md)
        (ev,) = feed(s, msgs)
        assert ev.metadata == md  # type: ignore[attr-defined]
    # keys and values of exactly MAX_SIZE together pass; one more does not, on either side
    for make in (str, lambda n: b"\xff" * n):
        md = exact_size(meta.MAX_SIZE, make)
        assert sum(len(k) + len(v) for k, v in md.items()) == meta.MAX_SIZE
        feed(s, c.send_request("m", (), metadata=md)[1])
        bigger = exact_size(meta.MAX_SIZE + 1, make)
        with pytest.raises(LocalProtocolError, match="at most 16384"):
            c.send_request("m", (), metadata=bigger)
        expect_remote([named(0, "m", [], raw_meta=packb(bigger))])


def exact_size(n: int, make: Any) -> dict[str, Any]:
    """Metadata whose keys and values are ``n`` long together (n around MAX_SIZE)."""
    md = {f"k{i:02}": make("v" * 4000) if make is str else make(4000) for i in range(4)}
    rest = n - 4 * 4003 - 3  # the last entry's key: 3
    assert 0 <= rest <= meta.MAX_VALUE
    md["kzz"] = "w" * rest if make is str else make(rest)
    return md


# -- what each side refuses ------------------------------------------------------------------


def named(call_id: int, name: str, args: Any, *, raw_meta: bytes, flags: int = 0,
          body: Any = None) -> bytes:
    """A Request binding ``name`` whose body is ``[metadata, body]``: ``raw_meta`` (packed) and
    the usual named body (or ``body``, packed, in its place)."""
    rest = packb([name, args, {}]) if body is None else body
    return rpc_frame.frame(1, call_id, b"\x92" + raw_meta + rest, flags=F_NAMED | F_META | flags)


BAD_SENDS: dict[str, list[Any]] = {
    "not a mapping": [[("k", "v")], "k=v", 5, b"k", True],
    "too many entries": [{f"k{i}": "" for i in range(meta.MAX_ENTRIES + 1)}],
    "bad key": [{"": "v"}, {"K": "v"}, {"a b": "v"}, {"k" * (meta.MAX_KEY + 1): "v"},
                {"é": "v"}, {"k/": "v"}, {"k\n": "v"}, {b"k": "v"}, {1: "v"}, {None: "v"}],
    "bad value": [{"k": 1}, {"k": None}, {"k": True}, {"k": 1.5}, {"k": ["v"]}, {"k": {"a": "b"}},
                  {"k": bytearray(b"v")}, {"k": memoryview(b"v")}],
    "value too long": [{"k": "v" * (meta.MAX_VALUE + 1)}, {"k": b"v" * (meta.MAX_VALUE + 1)}],
    "too large": [{f"k{i}": "é" * meta.MAX_VALUE for i in range(5)},
                  {f"k{i}": b"v" * meta.MAX_VALUE for i in range(4)}],
    "unpackable": [{"k": "\ud800"}],
}


@pytest.mark.parametrize(("kind", "md"), [(k, md) for k, mds in BAD_SENDS.items() for md in mds],
                         ids=lambda v: stable_repr(v)[:40])
@pytest.mark.parametrize("what", ["request", "stream request", "response", "error"])
def test_bad_metadata_is_a_local_error_and_changes_nothing(kind: str, md: Any, what: str) -> None:
    client, server = fresh_server_with_call(0)
    before = (client.next_id, client.methods, client.in_flight, server.in_flight)
    with pytest.raises(LocalProtocolError) as info:
        if what == "request":
            client.send_request("n", (1,), metadata=md)
        elif what == "stream request":
            client.send_request("n", (1,), stream=True, metadata=md)
        elif what == "response":
            server.send_response(0, 1, md)
        else:
            server.send_error(0, "E", "m", md)
    assert type(info.value) is LocalProtocolError
    assert (client.next_id, client.methods, client.in_flight, server.in_flight) == before
    # and both still work
    feed(server, client.send_request("n", (1,), metadata={"ok": "yes"})[1])
    feed(client, server.send_response(0, 1, {"ok": "yes"}))


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")


BAD_RECEIPTS: dict[str, list[bytes]] = {
    "empty map": [packb({})],
    "not a map": [packb([["k", "v"]]), packb("k"), packb(5), packb(None), packb(b"k")],
    "too many entries": [packb({f"k{i}": "" for i in range(meta.MAX_ENTRIES + 1)}),
                         _map_header(65535)],  # declared, never there
    "bad key": [packb({"K": "v"}), packb({"": "v"}), packb({"k" * 129: "v"}),
                packb({"é": "v"}), b"\x81\xc4\x01k\xa1v", b"\x81\x01\xa1v", b"\x81\xc0\xa1v"],
    "bad value": [packb({"k": 1}), packb({"k": None}), packb({"k": [1]}), packb({"k": {"a": 1}}),
                  packb({"k": True}), packb({"k": 1.5}), b"\x81\xa1k\xd6\x01\0\0\0\0",
                  b"\x81\xa1k\xd6\xff\0\0\0\0"],  # ext 1, a timestamp
    "value too long": [packb({"k": "v" * 4097}), packb({"k": b"v" * 4097})],
    "too large": [packb({f"k{i}": "v" * 4000 for i in range(5)}),
                  b"\x81\xa1k\xdb\xff\xff\xff\xff"],  # a str of 4 GiB declared
    "nesting bomb": [b"\x81\xa1k" + b"\x91" * 2000 + b"\xc0", b"\x81\xa1k" * 3000 + b"\xc0"],
    "malformed": [b"\xc1", b"\x81\xa1k\xc1"],
}


@pytest.mark.parametrize(("kind", "raw"), [(k, r) for k, rs in BAD_RECEIPTS.items() for r in rs],
                         ids=lambda v: stable_repr(v)[:40])
def test_bad_metadata_received_is_a_remote_error(kind: str, raw: bytes) -> None:
    expect_remote([named(0, "m", [], raw_meta=raw)])  # a Request
    for answer in (packb(5), packb(["E", "m"])):  # a Response, an Error
        c = conn(Role.CLIENT)
        c.send_request("m")
        kind_ = 2 if answer == packb(5) else 3
        with pytest.raises(RemoteProtocolError):
            feed(c, [rpc_frame.frame(kind_, 0, b"\x92" + raw + answer, flags=F_META)])


@pytest.mark.parametrize("kind", [4, 5, 6, 7])
def test_only_requests_and_answers_carry_metadata(kind: int) -> None:
    """F_META on a Cancel, a Data, a Credit or an End is an unknown flag there."""
    c = conn(Role.CLIENT)
    cid, _ = c.send_request("m", stream=True)
    c.send_credit(cid, 4)
    body = packb({"k": "v"}) + (packb(1) if kind == 5 else b"")
    for role, conn_ in ((Role.CLIENT, c), (Role.SERVER, None)):
        target = conn_ if conn_ is not None else conn(role)
        if conn_ is None:
            feed(target, [rpc_frame.frame(1, 0, packb(["m", [], {}]), flags=F_NAMED | F_STREAM)])
        with pytest.raises(RemoteProtocolError, match="flags"):
            feed(target, [rpc_frame.frame(kind, 0, body, flags=F_META,
                                          method=1 if kind == 6 else 0)])


def test_a_body_with_metadata_is_a_pair() -> None:
    md = packb({"k": "v"})
    body = packb(["m", [], {}])
    expect_remote([named(0, "m", [], raw_meta=md, body=b"")])  # an array of 2, one given
    expect_remote([named(0, "m", [], raw_meta=md, body=packb(["m", []]))])  # a bad body
    for raw in (md + body, b"\x93" + md + body + b"\xc0", b"\x91" + md, packb({"k": "v"})):
        expect_remote([rpc_frame.frame(1, 0, raw, flags=F_NAMED | F_META)])
    c = conn(Role.CLIENT)
    c.send_request("m")
    for raw in (md + packb(5), b"\x93" + md + packb(5) + b"\xc0", packb(5)):
        with pytest.raises(RemoteProtocolError):
            feed(conn_with_request(), [rpc_frame.frame(2, 0, raw, flags=F_META)])


def conn_with_request() -> RpcConnection:
    """A client that sent call 0."""
    c = conn(Role.CLIENT)
    c.send_request("m")
    return c


# -- the sender takes exactly what the receiver takes -------------------------------------------


ANY_KEYS = (KEYS | st.text(max_size=meta.MAX_KEY + 2) | st.binary(max_size=3)
            | st.integers(-2, 2))
ANY_VALUES = (META_VALUES | st.integers() | st.none() | st.booleans() | st.lists(st.text(),
                                                                                  max_size=2)
              | st.text(min_size=meta.MAX_VALUE + 1, max_size=meta.MAX_VALUE + 2)
              | st.binary(min_size=meta.MAX_VALUE + 1, max_size=meta.MAX_VALUE + 2))


@given(md=st.dictionaries(ANY_KEYS, ANY_VALUES, max_size=5)
       | st.dictionaries(KEYS, st.just(""), min_size=60, max_size=70)
       | st.dictionaries(KEYS, META_VALUES, min_size=3, max_size=6))
@example(md={"a": "x" * 4096, "b": "x" * 4096, "c": "x" * 4096, "d": "x" * 4096})  # 16 KiB + 1
@example(md={"a": "x" * 4096, "b": "x" * 4096, "c": "x" * 4096, "d": "x" * 4070})
def test_the_sender_refuses_exactly_what_the_receiver_refuses(md: dict[Any, Any]) -> None:
    try:
        raw = msgpack.packb(md, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):  # (what msgpack cannot pack: not sent)
        raw = None
    c, s = conn(Role.CLIENT), conn(Role.SERVER)
    try:
        _, msgs = c.send_request("m", (1,), metadata=md)
    except LocalProtocolError:
        if raw is None or not md:  # (unpackable: there is nothing to receive)
            assume(False)
        expect_remote([named(0, "m", [1], raw_meta=raw)])
        return
    if not md:
        assert not header(msgs[0]).flags & F_META
        return
    (ev,) = feed(s, msgs)
    assert ev.metadata == md  # type: ignore[attr-defined]


# -- hostile input ------------------------------------------------------------------------------


SAMPLE = enc(Request(id=0, method="m", args=(b"x" * (THRESHOLD + 1),), kwargs={},
                     metadata={"trace-id": "abc", "token": b"\x00\x01"}))


@given(data=st.data())
def test_mutated_frames_with_metadata_are_only_remote_errors(data: st.DataObject) -> None:
    msgs = [bytearray(m) for m in SAMPLE]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        m = msgs[data.draw(st.integers(0, len(msgs) - 1), label="message")]
        i = data.draw(st.integers(0, max(0, len(m) - 1)), label="at")
        op = data.draw(st.sampled_from(["set", "insert", "delete"]), label="op")
        byte = data.draw(st.integers(0, 255), label="byte")
        if op == "insert":
            m.insert(i, byte)
        elif m:
            if op == "set":
                m[i] = byte
            else:
                del m[i]
    check_only_remote_errors(conn(Role.SERVER), [bytes(m) for m in msgs])


def test_the_sample_is_good() -> None:
    (ev,) = feed(conn(Role.SERVER), SAMPLE)
    assert ev.metadata == {"trace-id": "abc", "token": b"\x00\x01"}  # type: ignore[attr-defined]
    assert header(SAMPLE[0]).flags == F_NAMED | F_WALK | F_META


def test_a_bad_map_is_refused_before_the_buffers_are_awaited() -> None:
    c = conn(Role.SERVER)
    bad = named(0, "m", [msgpack.ExtType(1, b"\0\0\0\0")], raw_meta=packb({"K": "v"}),
                flags=F_WALK)
    bad = rpc_frame.HEADER.pack(*rpc_frame.HEADER.unpack_from(bad)[:3], 1,
                                *rpc_frame.HEADER.unpack_from(bad)[4:]) + bad[32:]
    with pytest.raises(RemoteProtocolError):
        c.receive_message(bad)
    assert c.expecting_buffers == 0


# -- the fast paths ---------------------------------------------------------------------------


@given(calls=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(SCALARS, max_size=3),
                                st.none() | st.integers(0, 10**6),
                                st.none() | st.just({}) | METADATA.filter(no_surrogates)),
                      min_size=1, max_size=5),
       answer_md=st.none() | st.just({}) | METADATA.filter(no_surrogates), result=SCALARS)
def test_the_sending_fast_paths_send_what_the_general_path_sends(
        calls: list[tuple[str, list, int | None, Any]], answer_md: Any, result: Any) -> None:
    c = conn(Role.CLIENT)
    names: list[str] = []
    for name, args, deadline, md in calls:
        call_id, msgs = c.send_request(name, tuple(args), deadline_ms=deadline, metadata=md)
        bind = name not in names
        if bind:
            names.append(name)
        ev = Request(id=call_id, method=name, args=tuple(args), kwargs={}, deadline_ms=deadline,
                     metadata=md)
        assert msgs == enc(ev, method_index=names.index(name), bind=bind)
    s = conn_with_call(Role.SERVER)
    assert s.send_response(0, result, answer_md) == enc(Response(id=0, result=result,
                                                                 metadata=answer_md))


ANY_MD = st.dictionaries(ANY_KEYS, ANY_VALUES, max_size=3) | METADATA | st.just({}) | VALUES


@given(md=ANY_MD, body=VALUES, kind=st.sampled_from([1, 2]), flags=st.sampled_from(
    [F_META, F_META | F_KWARGS, F_META | F_WALK, F_META | F_DEADLINE]), pair=st.booleans())
def test_the_receiving_fast_path_takes_what_the_general_path_takes(
        md: Any, body: Any, kind: int, flags: int, pair: bool) -> None:
    try:
        raw = packb([md, body] if pair else md)
    except (TypeError, ValueError, OverflowError):
        assume(False)
    role = Role.SERVER if kind == 1 else Role.CLIENT
    frames = [rpc_frame.frame(1, 0, packb(["m", [], {}]), flags=F_NAMED)] if kind == 1 else []
    frames.append(rpc_frame.frame(kind, 1 if kind == 1 else 0, raw, flags=flags,
                                  deadline=5 if flags & F_DEADLINE else 0))

    def fresh(cls: type[RpcConnection]) -> RpcConnection:
        c = cls(role, oob_threshold=THRESHOLD)
        if role is Role.CLIENT:
            c.send_request("m")
        return c

    assert _outcome(fresh(RpcConnection), frames) == _outcome(fresh(_GeneralOnly), frames)
