"""RPC batches: several frames back to back in one message. Pure protocol logic, no device.

The property: whatever a side sends, put through an :class:`Outbox` (any batch limit, taken
at any points) and fed to the peer message by message, brings the peer exactly the events
that feeding each frame and buffer as its own message brings; and every batch respects the
limit and the rule that only its last frame announces buffers.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocols import rpc
from aiordma.protocols.errors import RemoteProtocolError
from aiordma.protocols.rpc import NEED_DATA, Outbox, Role, RpcConnection, RpcEvent, join
from aiordma.protocols.rpc._frame import F_NAMED, F_WALK, HEADER, HEADER_SIZE, frame

from .rpc_builds import rpc_build  # noqa: F401  # (each test with both builds)

THRESHOLD = 32  # small, so out-of-band values stay cheap to generate

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
    | st.binary(max_size=64),  # 32 B and more go out of band
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=6)
CALLS = st.lists(st.tuples(st.lists(VALUES, max_size=3).map(tuple),
                           st.booleans(),  # cancel it too
                           st.booleans()),  # take the outbox after it
                 min_size=1, max_size=12)


def pump(c: RpcConnection) -> list[RpcEvent]:
    events = []
    for _ in range(1000):
        ev = c.next_event()
        if ev is NEED_DATA:
            return events
        assert isinstance(ev, RpcEvent)
        events.append(ev)
    pytest.fail("next_event() did not return NEED_DATA")


def plain(event: RpcEvent) -> Any:
    """An event with out-of-band views as bytes, for comparison."""
    def norm(v: Any) -> Any:
        if isinstance(v, memoryview):
            return bytes(v)
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return (type(event).__name__, event.id,
            {k: norm(getattr(event, k)) for k in event.__slots__ if k != "id"})


def batch_frames(msg: bytes | memoryview) -> int:
    """How many frames a message carries (1 for a lone frame), from their headers."""
    at, n = 0, 0
    while at < len(msg):
        size = HEADER.unpack_from(msg, at)[5]
        at += HEADER_SIZE + size
        n += 1
    assert at == len(msg)
    return n


@given(calls=CALLS, limit=st.integers(1, 400))
def test_batched_requests_bring_the_same_events_as_one_frame_per_message(
        calls: list[tuple[tuple[Any, ...], bool, bool]], limit: int) -> None:
    client = RpcConnection(Role.CLIENT, oob_threshold=THRESHOLD)
    alone, batched = (RpcConnection(Role.SERVER, oob_threshold=THRESHOLD) for _ in range(2))
    outbox = Outbox(limit)
    sent: list[bytes | memoryview] = []
    for args, cancel, take in calls:
        groups = [client.send_request("m", args)[1]]
        if cancel:
            groups.append(client.send_cancel(client.next_id - 1))
        for msgs in groups:
            for m in msgs:
                alone.receive_message(m)
            outbox.add(msgs)
        if take:
            sent += outbox.take()
    sent += outbox.take()
    assert not outbox
    for m in sent:
        if not batched.expecting_buffers and batch_frames(m) > 1:
            assert len(m) <= limit  # a batch keeps the limit (a lone frame may exceed it)
        batched.receive_message(m)
    assert [plain(e) for e in pump(batched)] == [plain(e) for e in pump(alone)]
    assert batched.in_flight == alone.in_flight


@given(results=st.lists(VALUES, min_size=1, max_size=10), limit=st.integers(1, 400))
def test_batched_answers_bring_the_same_events(results: list[Any], limit: int) -> None:
    client = RpcConnection(Role.CLIENT, oob_threshold=THRESHOLD)
    server = RpcConnection(Role.SERVER, oob_threshold=THRESHOLD)
    for _ in results:
        for m in client.send_request("m")[1]:
            server.receive_message(m)
    pump(server)
    outbox = Outbox(limit)
    expected = []
    for call_id, result in enumerate(results):
        msgs = (server.send_error(call_id, "E", "x") if result is None
                else server.send_response(call_id, result))
        expected.append(msgs)
        outbox.add(msgs)
    reference = RpcConnection(Role.CLIENT, oob_threshold=THRESHOLD)
    for _ in results:
        reference.send_request("m")
    for msgs in expected:
        for m in msgs:
            reference.receive_message(m)
    for m in outbox.take():
        client.receive_message(m)
    assert [plain(e) for e in pump(client)] == [plain(e) for e in pump(reference)]
    assert client.in_flight == frozenset()


def test_sixty_four_small_requests_make_one_message() -> None:
    client = RpcConnection(Role.CLIENT)
    outbox = Outbox(4096)
    for i in range(64):
        outbox.add(client.send_request("echo", (i,))[1])
    (msg,) = outbox.take()
    assert batch_frames(msg) == 64
    server = RpcConnection(Role.SERVER)
    server.receive_message(msg)
    assert [e.args for e in pump(server)] == [(i,) for i in range(64)]  # type: ignore[attr-defined]


def test_a_frame_with_buffers_ends_its_batch_and_its_buffers_follow() -> None:
    client = RpcConnection(Role.CLIENT, oob_threshold=THRESHOLD)
    outbox = Outbox(4096)
    outbox.add(client.send_request("a", (1,))[1])
    outbox.add(client.send_request("b", (b"x" * 40, b"y" * 50))[1])
    outbox.add(client.send_request("c", (3,))[1])
    msgs = outbox.take()
    assert [batch_frames(msgs[0]), bytes(msgs[1]), bytes(msgs[2]), batch_frames(msgs[3])] == [
        2, b"x" * 40, b"y" * 50, 1]


V = rpc.PROTOCOL_VERSION


def req(call_id: int, *, bind: bool = False, **header: Any) -> bytes:
    """A request for method index 0 (binding "m" to it with ``bind``)."""
    body = msgpack.packb(["m", [], {}] if bind else [])
    return frame(1, call_id, body, flags=F_NAMED if bind else 0, **header)


BUFFER_REF = msgpack.packb(["m", [msgpack.ExtType(rpc.EXT_BUFFER, b"\0\0\0\0")], {}])


@pytest.mark.parametrize(("message", "words"), [
    (join([frame(1, 0, BUFFER_REF, flags=F_NAMED | F_WALK, nbufs=1), req(1)]), "only the last"),
    (join([req(0, bind=True), req(0)]), "0"),  # an id again
    (join([req(0, bind=True), req(1, version=1)]), "version 1"),
    (join([req(0, bind=True), frame(9, 1, b"")]), "kind"),
    (join([req(0, bind=True), req(1)[:-1]]), "longer than"),  # the second cut short
    (join([req(0, bind=True), req(1)[:20]]), "header"),
])
def test_a_bad_batch_is_a_remote_protocol_error(message: bytes, words: str) -> None:
    server = RpcConnection(Role.SERVER)
    with pytest.raises(RemoteProtocolError, match=words):
        server.receive_message(message)
    with pytest.raises(RemoteProtocolError):  # and the connection keeps refusing
        server.receive_message(req(5, bind=True))


def test_a_batch_of_one_frame_and_a_lone_frame_are_the_same() -> None:
    a, b = RpcConnection(Role.SERVER), RpcConnection(Role.SERVER)
    f = req(0, bind=True)
    a.receive_message(join([f]))
    b.receive_message(f)
    assert pump(a) == pump(b)


def test_a_batch_larger_than_max_message_is_refused() -> None:
    client = RpcConnection(Role.CLIENT)
    outbox = Outbox(1 << 20)
    for _ in range(3):
        outbox.add(client.send_request("m", ("z" * 30,))[1])
    (msg,) = outbox.take()
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        RpcConnection(Role.SERVER, max_message=64).receive_message(msg)


@pytest.mark.parametrize("n", [1, 2, 16, 1000])
def test_join_concatenates(n: int) -> None:
    frames = [req(i) for i in range(n)]
    assert join(frames) == b"".join(frames)
    assert batch_frames(join(frames)) == n


def test_an_outbox_limit_is_at_least_one_byte() -> None:
    with pytest.raises(ValueError, match="at least"):
        Outbox(0)
