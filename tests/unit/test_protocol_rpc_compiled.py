"""The RPC protocol's compiled frames against the Python reference, differentially (no device).

``protocols/rpc/_plain_c.pyx`` replaces the connection's receive and its plain request and
response with C (the headers read from the buffer, the call table's common steps inline, the
frames written into one ``bytes``). Two pairs of connections, one of each class, get the same
hypothesis-drawn conversation: requests and answers of plain and other values, with and
without keyword arguments, metadata, deadlines and out-of-band buffers, batched or not, and
then the same messages garbled on the way (a byte changed, cut short, bytes added), so that
the error paths are compared too. After every message both must agree on everything
observable: the bytes each sends, the events each delivers, every error by type and message,
the calls in flight, whether buffers are awaited, and a failed connection's reason. (Every
test of the protocol also runs with both classes: ``rpc_builds.py``.)
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiordma._verbs.compiled as _fast
from aiordma.protocols import rpc
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.rpc import NEED_DATA, Role, RpcConnection, join

from .test_protocol_rpc import SCALARS, THRESHOLD, VALUES


@pytest.fixture(scope="module")
def compiled() -> type[RpcConnection]:
    cls = _fast._load_rpc()
    if cls is None:
        pytest.fail(f"the RPC protocol's compiled frames are missing: {_fast.describe()} "
                    f"(scripts/setup.sh builds them)")
    return cls


def _plain_value(v: Any) -> Any:
    if isinstance(v, (bytearray, memoryview)):
        return ("buffer", bytes(v))
    if isinstance(v, list):
        return [_plain_value(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_plain_value(x) for x in v)
    if isinstance(v, dict):
        return {k: _plain_value(x) for k, x in v.items()}
    return v


def _event(ev: Any) -> Any:
    fields = {name: _plain_value(getattr(ev, name)) for name in ev.__slots__}
    return type(ev).__name__, sorted(fields.items(), key=lambda kv: kv[0])


def _messages(msgs: list[Any]) -> list[bytes]:
    return [bytes(m) for m in msgs]


def _do(fn: Any) -> Any:
    """``fn()``'s result, or its error by type and message."""
    try:
        return ("ok", fn())
    except (ProtocolError, ValueError, TypeError) as exc:
        return ("error", type(exc).__name__, str(exc))


def _feed(c: RpcConnection, msg: bytes) -> Any:
    def take() -> list[Any]:
        c.receive_message(msg)
        out = []
        while (ev := c.next_event()) is not NEED_DATA:
            out.append(_event(ev))
        return out

    return _do(take)


def _state(c: RpcConnection) -> Any:
    failed = c._failed
    return (sorted(c.in_flight), c.expecting_buffers, c.methods,
            None if failed is None else (type(failed).__name__, str(failed)))


ARGS = st.lists(SCALARS, max_size=3) | st.lists(VALUES, max_size=2)
CALLS = st.lists(st.tuples(
    st.sampled_from(["echo", "get", "put"]),  # method
    ARGS,  # args
    st.none() | st.dictionaries(st.sampled_from(["k", "n"]), SCALARS, max_size=2),  # kwargs
    st.none() | st.integers(0, 10_000),  # deadline
    st.none() | st.dictionaries(st.sampled_from(["rid", "who"]),
                                st.text("abc", max_size=3) | st.binary(max_size=3),
                                max_size=2),  # metadata
    SCALARS | VALUES,  # the server's result
    st.booleans(),  # answered with an error
), min_size=1, max_size=6)
EXAMPLES = int(os.environ.get("RPC_COMPILED_EXAMPLES", "150"))  # (cheap: ~10 ms each)
GARBLE = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3), st.binary(max_size=3)),
                  max_size=3)


def _garble(msg: bytes, how: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray(msg)
    for at, kind, extra in how:
        if kind == 0 and out:
            out[at % len(out)] ^= 1 + (at % 255)
        elif kind == 1:
            del out[at % (len(out) + 1):]
        elif kind == 2:
            out += extra
        elif out:  # a header field: the first 32 bytes of the message
            out[at % min(32, len(out))] = (extra or b"\xff")[0]
    return bytes(out)


def _pairs(compiled: type[RpcConnection]) -> list[tuple[RpcConnection, RpcConnection]]:
    return [(cls(Role.CLIENT, oob_threshold=THRESHOLD), cls(Role.SERVER,
                                                           oob_threshold=THRESHOLD))
            for cls in (RpcConnection, compiled)]


@settings(max_examples=EXAMPLES)
@given(calls=CALLS, batch=st.booleans(), garble=GARBLE, which=st.integers(0, 100))
def test_the_compiled_frames_do_what_the_python_connection_does(
        compiled: type[RpcConnection], calls: list[tuple[Any, ...]], batch: bool,
        garble: list[tuple[int, int, bytes]], which: int) -> None:
    pairs = _pairs(compiled)
    sent: list[list[Any]] = [[], []]
    requests: list[Any] = []
    for name, args, kwargs, deadline, md, _, _ in calls:
        out = [_do(lambda c=c: c.send_request(name, tuple(args), kwargs, deadline, False, md))
               for c, _ in pairs]
        assert _plain_value(out[0]) == _plain_value(out[1])
        requests.append(out[0])
        for i, (c, _) in enumerate(pairs):
            if out[i][0] == "ok":
                sent[i].extend(out[i][1][1])
    assert [_messages(s) for s in sent][0] == _messages(sent[1])
    assert _state(pairs[0][0]) == _state(pairs[1][0])
    messages = _messages(sent[0])
    if batch and messages:
        # (what an Outbox makes of them: frames joined; a frame with buffers and its buffers
        # stay as they are, so join only runs of frames without buffers)
        messages = _batched(messages)
    if messages:
        k = which % len(messages)
        messages[k] = _garble(messages[k], garble)
    for msg in messages:
        got = [_feed(s, msg) for _, s in pairs]
        assert got[0] == got[1]
        assert _state(pairs[0][1]) == _state(pairs[1][1])
    # the answers, from each server, to each client (garbled the same way)
    answers: list[list[bytes]] = [[], []]
    for (call_id, *_), (*_, result, error) in zip(
            (r[1] for r in requests if r[0] == "ok"), calls, strict=False):
        for i, (_, s) in enumerate(pairs):
            if error:
                out = _do(lambda s=s: s.send_error(call_id, "ValueError", "no"))
            else:
                out = _do(lambda s=s: s.send_response(call_id, result, {"t": "1"}
                                                      if which % 2 else None))
            assert i == 0 or _plain_value(out) == _plain_value(last)
            last = out
            if out[0] == "ok":
                answers[i].extend(_messages(out[1]))
    assert answers[0] == answers[1]
    replies = answers[0]
    if replies:
        k = which % len(replies)
        replies[k] = _garble(replies[k], garble[::-1])
    for msg in replies:
        got = [_feed(c, msg) for c, _ in pairs]
        assert got[0] == got[1]
        assert _state(pairs[0][0]) == _state(pairs[1][0])


def _batched(messages: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    run: list[bytes] = []
    for m in messages:
        h = rpc._frame.HEADER.unpack_from(m) if len(m) >= rpc._frame.HEADER_SIZE else None
        if h is not None and h[0] == rpc.PROTOCOL_VERSION and not h[3]:
            run.append(m)
            continue
        if run:
            out.append(join(run))
            run = []
        out.append(m)
    if run:
        out.append(join(run))
    return out


def test_a_message_of_another_type_and_one_past_the_limit_go_the_python_way(
        compiled: type[RpcConnection]) -> None:
    for cls_msg in (bytearray, memoryview):
        pairs = _pairs(compiled)
        _, frames = pairs[0][0].send_request("echo", (b"x",))
        for _, s in pairs:
            assert _feed(s, cls_msg(frames[0]))[0] == "ok"  # type: ignore[operator]
        assert _state(pairs[0][1]) == _state(pairs[1][1])
    small = [cls(Role.SERVER, max_message=64) for cls in (RpcConnection, compiled)]
    got = [_feed(s, bytes(100)) for s in small]
    assert got[0] == got[1] and got[0][0] == "error"
    assert "exceeds 64 B" in got[0][2]
    assert _state(small[0]) == _state(small[1])


def test_the_compiled_frames_keep_nothing_of_the_calls_they_carried(
        compiled: type[RpcConnection]) -> None:
    """C code owns its references by hand: 20,000 calls (with metadata and without) may not
    leave memory behind. (A uint64 call id deleted from the call table by Cython's generic
    item deletion leaked a Python int per answer: 28 B a call.)"""
    import gc
    import tracemalloc

    client, server = compiled(Role.CLIENT), compiled(Role.SERVER)
    value = b"x" * 64

    def calls(n: int) -> None:
        for i in range(n):
            _, request = client.send_request("echo", (value, i), None, 1000 if i % 2 else None)
            for m in request:
                server.receive_message(m)
            ev = server.next_event()
            assert server.next_event() is NEED_DATA
            for m in server.send_response(ev.id, ev.args[0], {"k": "v"} if i % 2 else None):
                client.receive_message(m)
            assert client.next_event().result == value
            assert client.next_event() is NEED_DATA

    calls(1000)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        calls(20_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} B left behind by 20,000 calls"


# An outbox's work: frames (bytes of any size, alone or with out-of-band buffers behind them),
# taken at any point.
OUTBOX_STEPS = st.lists(
    st.one_of(st.tuples(st.just("add"), st.binary(max_size=90),
                        st.lists(st.binary(max_size=20), max_size=2)),
              st.just(("take",))),
    max_size=40)


@given(limit=st.integers(1, 200), steps=OUTBOX_STEPS)
def test_the_compiled_outbox_batches_as_the_reference(limit: int,
                                                      steps: list[tuple[Any, ...]]) -> None:
    """The same frames added and taken at the same points bring the same messages (bytes,
    types and order) from both outboxes, and they agree on whether something waits."""
    _fast._load_rpc()  # (as the fixture above: whatever AIORDMA_FASTPATH says)
    cls = _fast._rpc_outbox
    assert cls is not None, f"the compiled outbox is missing: {_fast.describe()}"
    ref, fast = rpc.Outbox(limit), cls(limit)
    assert fast.limit == ref.limit == limit
    for step in [*steps, ("take",)]:
        if step[0] == "add":
            msgs = [step[1], *(memoryview(b) for b in step[2])]
            ref.add(msgs)
            fast.add(list(msgs))
        else:
            want, got = ref.take(), fast.take()
            assert [(type(m), bytes(m)) for m in got] == [(type(m), bytes(m)) for m in want]
        assert bool(fast) == bool(ref)
    with pytest.raises(ValueError, match="at least 1 byte"):
        cls(0)
