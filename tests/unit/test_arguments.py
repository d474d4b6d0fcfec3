"""The one rule for arguments, at the public entry points that take them before any I/O:
whatever is passed, a bad argument raises LocalProtocolError (a ValueError) and nothing else
escapes; nothing is connected or opened. No device: each call gets one bad argument (drawn
from wrong types, negative, huge, NaN, infinite, empty) with the others valid, and the
check happens before a socket or a device is touched."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

import aiordma
from aiordma import Config, LocalProtocolError, RemoteBuffer
from aiordma import rpc as aiordma_rpc
from aiordma.services import kv
from aiordma.testing import channel_pair

ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(), max_size=2),
    st.just(object()),
)


def is_port(v: Any, zero_ok: bool) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (0 if zero_ok else 1) <= v < 65536


def is_seconds(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0)


def is_optional_count(v: Any, low: int = 1) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= low)


GOOD_CONNECT = {"host": "127.0.0.1", "port": 9, "timeout": 1.0, "config": None, "device": None,
                "gid_index": None, "secret": None}
CONNECT_VALID = {
    "host": lambda v: isinstance(v, str) and v != "" and "\x00" not in v,
    "port": lambda v: is_port(v, False),
    "timeout": is_seconds,
    "config": lambda v: v is None,
    "device": lambda v: v is None or isinstance(v, str),
    "gid_index": lambda v: is_optional_count(v, 0),
    "secret": lambda v: v is None,
}


def refused(coro: Any) -> None:
    """The call raises LocalProtocolError (and only that) before doing anything."""
    with pytest.raises(LocalProtocolError):
        asyncio.run(coro)


@given(which=st.sampled_from(sorted(CONNECT_VALID)), value=ANYTHING)
def test_connect_refuses_every_bad_argument(which: str, value: Any) -> None:
    assume(not CONNECT_VALID[which](value))
    kw = {**GOOD_CONNECT, which: value}
    host, port = kw.pop("host"), kw.pop("port")
    refused(aiordma.connect(host, port, **kw))


LISTEN_VALID = {
    "host": lambda v: isinstance(v, str) and "\x00" not in v,
    "port": lambda v: is_port(v, True),
    "backlog": lambda v: is_optional_count(v) and v is not None,
    "max_connections": is_optional_count,
    "max_connections_per_peer": is_optional_count,
    "config": lambda v: v is None,
    "gid_index": lambda v: is_optional_count(v, 0),
}


@given(which=st.sampled_from(sorted(LISTEN_VALID)), value=ANYTHING)
def test_listen_refuses_every_bad_argument(which: str, value: Any) -> None:
    assume(not LISTEN_VALID[which](value))

    async def handler(ep: Any) -> None:
        pass

    kw: dict[str, Any] = {"host": "127.0.0.1", "port": 0, which: value}
    refused(aiordma.listen(handler, **kw))


@pytest.mark.parametrize("field", ["data_slots", "ctrl_slots", "slot_size", "send_slots",
                                   "signal_every", "recv_buffer", "max_message", "max_onesided",
                                   "max_rd_atomic", "close_timeout", "handshake_timeout",
                                   "keepalive_idle"])
@given(value=ANYTHING)
def test_config_refuses_bad_fields(field: str, value: Any) -> None:
    try:
        Config(**{field: value}).validate()
    except LocalProtocolError:
        return  # refused, by the rule
    # accepted: then it is a sane value of the right type
    assert isinstance(value, (int, float)) and not isinstance(value, bool)
    assert math.isfinite(value) and value >= 0


@given(address=ANYTHING, rkey=ANYTHING, length=ANYTHING)
def test_remote_buffers_take_only_integers_in_range(address: Any, rkey: Any, length: Any) -> None:
    try:
        rb = RemoteBuffer(address=address, rkey=rkey, length=length)
    except LocalProtocolError:
        return
    assert 0 <= rb.address < 2**64 and 0 <= rb.rkey < 2**32 and 0 <= rb.length < 2**64
    with pytest.raises(LocalProtocolError):
        rb["a":]  # type: ignore[misc]


@given(wire=ANYTHING)
@example(wire=b"\x00\x00\x00\x00")  # four bytes unpack into four ints: found by hypothesis
@example(wire="abcd")
def test_descriptors_from_the_wire_are_checked(wire: Any) -> None:
    with pytest.raises(LocalProtocolError):
        RemoteBuffer.from_wire(wire if not isinstance(wire, list) else [*wire, "x"])


@given(name=ANYTHING, timeout=ANYTHING)
def test_rpc_calls_refuse_bad_names_and_timeouts(name: Any, timeout: Any) -> None:
    zero = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout == 0
    assume(not (isinstance(name, str) and (timeout is None or zero or is_seconds(timeout))))

    async def call() -> None:
        a, _b = channel_pair()
        client = aiordma_rpc.RpcClient(a, max_in_flight=1)
        try:
            await client.call(name, timeout=timeout)
        finally:
            client.abort()

    refused(call())


@given(max_in_flight=ANYTHING, grace=ANYTHING)
def test_rpc_servers_and_clients_refuse_bad_limits(max_in_flight: Any, grace: Any) -> None:
    count = isinstance(max_in_flight, int) and not isinstance(max_in_flight, bool) \
        and max_in_flight >= 1
    client_ok = count and max_in_flight <= aiordma_rpc.MAX_CALLS  # a server has no upper limit
    assume(not (client_ok and is_seconds(grace)))
    if not (count and is_seconds(grace)):
        with pytest.raises(LocalProtocolError):
            aiordma_rpc.RpcServer(kv.KvStore(slots=8, slot_size=64, window=1),
                                  max_in_flight=max_in_flight, grace=grace)
    if not client_ok:
        refused(aiordma_rpc.connect("127.0.0.1", 9, max_in_flight=max_in_flight))
