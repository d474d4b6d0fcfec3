"""The one rule for arguments, at every public entry point that checks them before any device
use: a bad argument (a wrong type, negative, huge, NaN, infinite, empty, a bool for an int)
raises LocalProtocolError (a ValueError) and nothing else escapes; nothing is connected,
opened, registered or sent. No device: each call gets one bad argument (drawn by hypothesis,
plus the cases issue 14 named, as explicit examples so that every profile runs them) with the
others valid. Where a call's valid arguments would go on to use a device or a peer, the
stand-in it gets (a closed Device, a port nobody listens on, a client without a connection)
would fail it another way, so a bad argument that slipped through shows. The calls that need
a live endpoint or device are tests/rxe/test_arguments.py."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

import aiordma
from aiordma import (
    ClosedResourceError,
    Config,
    LocalProtocolError,
    LocalSlice,
    MemoryRegion,
    RemoteBuffer,
)
from aiordma import rpc as aiordma_rpc
from aiordma.lowlevel import Device
from aiordma.services import kv
from aiordma.services.kv import KvClient
from aiordma.testing import channel_pair

from ..rpc_services import Calc

ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 2**64, -1, 0, 2**31, 2**63]),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1), st.just(object()),
)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_port(v: Any, zero_ok: bool) -> bool:
    return is_int(v) and (0 if zero_ok else 1) <= v < 65536


def is_seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def is_optional_count(v: Any, low: int = 1) -> bool:
    return v is None or (is_int(v) and v >= low)


def refused(coro: Any) -> None:
    """The call raises LocalProtocolError (and only that) before doing anything."""
    with pytest.raises(LocalProtocolError):
        asyncio.run(coro)


def closed_device() -> Device:
    """A Device that was never opened: what a call reaches once its arguments pass."""
    dev = Device.__new__(Device)
    dev._closed, dev.name = True, "never-opened"
    return dev


# -- aiordma.connect, aiordma.listen ---------------------------------------------------------

GOOD_CONNECT = {"host": "127.0.0.1", "port": 9, "timeout": 1.0, "config": None, "device": None,
                "gid_index": None, "secret": None}
CONNECT_VALID = {
    "host": lambda v: isinstance(v, str) and v != "" and "\x00" not in v,
    "port": lambda v: is_port(v, False),
    "timeout": is_seconds,
    "config": lambda v: v is None,
    "device": lambda v: v is None or (isinstance(v, str) and v != "" and "\x00" not in v),
    "gid_index": lambda v: is_optional_count(v, 0),
    "secret": lambda v: v is None,
    "transport": lambda v: isinstance(v, str) and v in ("auto", "rdma", "tcp"),
}


@given(which=st.sampled_from(sorted(CONNECT_VALID)), value=ANYTHING)
@example(which="port", value=-1)  # issue 14: a raw OverflowError once
@example(which="port", value=70000)
@example(which="port", value="abc")  # issue 14: a BrokenResourceError once
@example(which="port", value=True)
@example(which="host", value=123)  # issue 14: "argument of type 'int' is not iterable"
@example(which="host", value="")
@example(which="timeout", value=-1)  # issue 14: an OperationTimeout once
@example(which="timeout", value=math.nan)
@example(which="timeout", value=math.inf)
@example(which="gid_index", value=True)
@example(which="secret", value=b"too short")
@example(which="secret", value="a str secret of 32 characters..")
@example(which="config", value={"data_slots": 1})
@example(which="transport", value="TCP")
@example(which="transport", value=None)
def test_connect_refuses_every_bad_argument(which: str, value: Any) -> None:
    assume(not CONNECT_VALID[which](value))
    kw = {**GOOD_CONNECT, which: value}
    host, port = kw.pop("host"), kw.pop("port")
    refused(aiordma.connect(host, port, **kw))


LISTEN_VALID = {
    "handler": callable,
    "host": lambda v: isinstance(v, str) and "\x00" not in v,
    "port": lambda v: is_port(v, True),
    "backlog": lambda v: is_optional_count(v) and v is not None,
    "max_connections": is_optional_count,
    "max_connections_per_peer": is_optional_count,
    "config": lambda v: v is None,
    # (a name is looked up at once: DeviceError here, where there is none)
    "device": CONNECT_VALID["device"],
    "gid_index": lambda v: is_optional_count(v, 0),
    "secret": lambda v: v is None,
    "transport": CONNECT_VALID["transport"],
}


async def _handler(ep: Any) -> None:
    pass


@given(which=st.sampled_from(sorted(LISTEN_VALID)), value=ANYTHING)
@example(which="max_connections", value=0)  # issue 14: ValueError here, another type there
@example(which="port", value=65536)
@example(which="backlog", value=True)
@example(which="handler", value="not callable")
def test_listen_refuses_every_bad_argument(which: str, value: Any) -> None:
    assume(not LISTEN_VALID[which](value))
    kw: dict[str, Any] = {"handler": _handler, "host": "127.0.0.1", "port": 0, which: value}
    refused(aiordma.listen(**kw))


# -- Config -------------------------------------------------------------------------------------

CONFIG_BOUNDS = {  # field -> (low, high) of the integers it takes
    "data_slots": (1, 0xFFFF), "ctrl_slots": (3, 0xFFFF), "slot_size": (64, 1 << 20),
    "send_slots": (2, 0xFFFF), "send_reserve": (2, 0xFFFF), "signal_every": (1, 0xFFFF),
    "recv_buffer": (0, 1 << 62),
    "max_message": (1, 1 << 62), "max_onesided": (1, 0xFFFF), "max_rd_atomic": (1, 255),
    "keepalive_idle": (1, 32767), "keepalive_interval": (1, 32767),
    "keepalive_probes": (1, 127),
    "pool_buffers": (8, 1 << 20), "setup_stock": (0, 1024),
}
CONFIG_SECONDS = ("close_timeout", "handshake_timeout")
CONFIG_FLAGS = ("receive_pool", "client_pool", "immediates")


def test_every_config_field_is_checked() -> None:
    from dataclasses import fields

    assert {f.name for f in fields(Config)} == (set(CONFIG_BOUNDS) | set(CONFIG_SECONDS)
                                                 | set(CONFIG_FLAGS))


@pytest.mark.parametrize("flag", CONFIG_FLAGS)
@given(value=ANYTHING)
def test_config_flags_are_bools(flag: str, value: Any) -> None:
    if value is True or value is False:
        assert getattr(Config(**{flag: value}), flag) is value
        return
    with pytest.raises(LocalProtocolError, match=flag):
        Config(**{flag: value})


@pytest.mark.parametrize("field", sorted(CONFIG_BOUNDS) + list(CONFIG_SECONDS))
@given(value=ANYTHING)
def test_config_refuses_bad_fields(field: str, value: Any) -> None:
    if field in CONFIG_BOUNDS:
        low, high = CONFIG_BOUNDS[field]
        valid = is_int(value) and low <= value <= high
        if field == "slot_size" and valid:  # at most 4 GiB of slots each way
            valid = value * (Config().data_slots + Config().ctrl_slots) <= 4 << 30
        if field == "pool_buffers" and valid:  # (the pool's slots too)
            valid = value * Config().slot_size <= 4 << 30
    else:
        valid = is_seconds(value)
    if valid:
        Config(**{field: value}).validate()
        return
    with pytest.raises(LocalProtocolError, match=field):
        Config(**{field: value})  # refused as it is made: a Config that exists is valid


@pytest.mark.parametrize(("field", "bad", "good"), [
    ("data_slots", 0x10000, 0xFFFF), ("ctrl_slots", 0x10000, 0xFFFF),
    ("max_rd_atomic", 256, 255), ("max_message", (1 << 62) + 1, 1 << 62),
    ("max_message", 2**64, 1), ("recv_buffer", 2**70, 0), ("keepalive_idle", 32768, 32767),
    ("keepalive_interval", 32768, 1), ("keepalive_probes", 128, 127),
    ("max_onesided", 0x10000, 0xFFFF), ("close_timeout", math.inf, 1e9),
    ("handshake_timeout", math.nan, 0.001), ("send_slots", True, 2),
])
def test_config_upper_bounds(field: str, bad: Any, good: Any) -> None:
    with pytest.raises(LocalProtocolError, match=field):
        Config(**{field: bad})
    Config(**{field: good})


def test_config_bounds_the_slot_memory() -> None:
    with pytest.raises(LocalProtocolError, match="GiB"):
        Config(data_slots=0xFFFF, slot_size=1 << 20)  # 64 GiB of receive slots
    Config(data_slots=4000, ctrl_slots=8, slot_size=1 << 20)  # 3.9 GiB


# -- RemoteBuffer, MemoryRegion, LocalSlice -----------------------------------------------------

@given(address=ANYTHING, rkey=ANYTHING, length=ANYTHING)
@example(address=-1, rkey=0, length=1)  # issue 14: pyverbs' OverflowError once
def test_remote_buffers_take_only_integers_in_range(address: Any, rkey: Any, length: Any) -> None:
    try:
        rb = RemoteBuffer(address=address, rkey=rkey, length=length)
    except LocalProtocolError:
        return
    assert 0 <= rb.address < 2**64 and 0 <= rb.rkey < 2**32 and 0 <= rb.length < 2**64
    with pytest.raises(LocalProtocolError):
        rb["a":]  # type: ignore[misc]


@given(which=st.sampled_from(["readable", "writable", "atomic"]), value=ANYTHING)
@example(which="readable", value=1)
def test_remote_buffer_flags_are_bools(which: str, value: Any) -> None:
    assume(not isinstance(value, bool))
    with pytest.raises(LocalProtocolError, match=which):
        RemoteBuffer(address=0, rkey=1, length=8, **{which: value})


@given(wire=ANYTHING)
@example(wire=b"\x00\x00\x00\x00")  # four bytes unpack into four ints: found by hypothesis
@example(wire="abcd")
def test_descriptors_from_the_wire_are_checked(wire: Any) -> None:
    with pytest.raises(LocalProtocolError):
        RemoteBuffer.from_wire(wire if not isinstance(wire, list) else [*wire, "x"])


MR_VALID = {"device": lambda v: False,  # (a real Device is not drawn)
            "buffer": lambda v: isinstance(v, (bytes, bytearray)),
            "remote_read": lambda v: isinstance(v, bool),
            "remote_write": lambda v: isinstance(v, bool),
            "atomic": lambda v: isinstance(v, bool)}


@given(which=st.sampled_from(sorted(MR_VALID)), value=ANYTHING)
@example(which="buffer", value=memoryview(bytearray(8))[::2])  # not contiguous
@example(which="buffer", value=12)
@example(which="remote_write", value=1)
@example(which="device", value="rxe0")
def test_memory_regions_refuse_bad_arguments_before_the_device(which: str, value: Any) -> None:
    assume(not MR_VALID[which](value))
    kw: dict[str, Any] = {"device": closed_device(), "buffer": bytearray(64), which: value}
    device, buffer = kw.pop("device"), kw.pop("buffer")
    with pytest.raises(LocalProtocolError):
        MemoryRegion(device, buffer, **kw)


def test_a_memory_region_with_good_arguments_reaches_the_device() -> None:
    # the positive control: the stand-in device is closed, so good arguments get that far
    with pytest.raises(ClosedResourceError):
        MemoryRegion(closed_device(), bytearray(64), remote_read=True)


def unregistered_region(length: int) -> MemoryRegion:
    """A MemoryRegion object with a length and no registration (slicing needs no device)."""
    region = MemoryRegion.__new__(MemoryRegion)
    region.length = length
    return region


@given(offset=ANYTHING, length=ANYTHING)
@example(offset=-5, length=10)
@example(offset=0, length=65)
@example(offset=True, length=1)
def test_local_slices_stay_inside_their_region(offset: Any, length: Any) -> None:
    region = unregistered_region(64)
    ok = is_int(offset) and is_int(length) and offset >= 0 and length >= 0 \
        and offset + length <= 64
    if ok:
        assert LocalSlice(region, offset, length).length == length
        return
    with pytest.raises(LocalProtocolError):
        LocalSlice(region, offset, length)


@given(key=ANYTHING)
@example(key=slice(0, 65))
@example(key=slice(-1, None))
@example(key=slice(0, 8, 2))
def test_region_slicing_is_checked(key: Any) -> None:
    region = unregistered_region(64)
    try:
        s = region[key]
    except LocalProtocolError:
        return
    assert 0 <= s.offset and s.offset + s.length <= 64


def test_a_local_slice_is_of_a_region() -> None:
    with pytest.raises(LocalProtocolError):
        LocalSlice(bytearray(8), 0, 8)  # type: ignore[arg-type]


# -- aiordma.rpc ---------------------------------------------------------------------------------

@given(name=ANYTHING, timeout=ANYTHING)
@example(name="add", timeout=1e16)  # its deadline would not fit the wire
@example(name="add", timeout=-1)
@example(name="add", timeout=True)
@example(name="", timeout=None)
def test_rpc_calls_refuse_bad_names_and_timeouts(name: Any, timeout: Any) -> None:
    zero = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout == 0
    good_timeout = timeout is None or zero or (is_seconds(timeout)
                                               and timeout <= aiordma_rpc.MAX_TIMEOUT)
    assume(not (isinstance(name, str) and name and good_timeout))

    async def call() -> None:
        a, _b = channel_pair()
        client = aiordma_rpc.RpcClient(a, max_in_flight=1)
        try:
            await client.call(name, timeout=timeout)
        finally:
            client.abort()

    refused(call())


@given(value=st.one_of(st.just(object()), st.sets(st.integers(), min_size=1, max_size=2),
                       st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
                       st.complex_numbers(), st.just(2**64), st.just(-(2**63) - 1)))
def test_rpc_calls_refuse_arguments_that_cannot_travel(value: Any) -> None:
    async def call() -> None:
        a, _b = channel_pair()
        client = aiordma_rpc.RpcClient(a, max_in_flight=1)
        try:
            await client.call("add", value, 1)
        finally:
            client.abort()

    refused(call())


def is_metadata(v: Any) -> bool:
    from aiordma.protocols.rpc import _meta as _rpc_meta

    try:
        _rpc_meta.check(v)
    except ValueError:
        return v is None
    return True


BAD_METADATA = st.one_of(
    ANYTHING, st.dictionaries(st.text(max_size=4), st.text(max_size=4) | st.binary(max_size=4)
                              | ANYTHING, min_size=1, max_size=3),
    st.sampled_from([{"Upper": "v"}, {"k": "\ud800"}, {"k": "v" * 4097},
                     {f"k{i}": "" for i in range(65)}, {1: "v"}, {"k": bytearray(b"v")}]))


@given(metadata=BAD_METADATA, how=st.sampled_from(["call", "call_with_metadata", "stream",
                                                    "stream_call"]))
@example(metadata={"k": 1}, how="call")
@example(metadata=[("k", "v")], how="stream")
def test_rpc_calls_refuse_bad_metadata_before_sending(metadata: Any, how: str) -> None:
    assume(not is_metadata(metadata))

    async def call() -> None:
        a, _b = channel_pair()
        client = aiordma_rpc.RpcClient(a, max_in_flight=1)
        try:
            if how in ("stream", "stream_call"):
                getattr(client, how)("m", metadata=metadata)
            else:  # (nobody answers: a call that slipped through times out, and fails)
                await asyncio.wait_for(getattr(client, how)("m", metadata=metadata), 5)
        finally:
            client.abort()

    refused(call())


@given(value=ANYTHING)
@example(value=0)
@example(value=True)
def test_rpc_methods_and_drains_refuse_bad_limits(value: Any) -> None:
    if not is_optional_count(value):
        with pytest.raises(LocalProtocolError):
            aiordma_rpc.method(max_concurrency=value)
    if not (is_seconds(value) or (not isinstance(value, bool) and value == 0)):
        refused(aiordma_rpc.RpcServer(Calc(), max_in_flight=1, grace=1.0).drain(value))


@given(max_in_flight=ANYTHING, grace=ANYTHING)
def test_rpc_servers_and_clients_refuse_bad_limits(max_in_flight: Any, grace: Any) -> None:
    count = is_int(max_in_flight) and max_in_flight >= 1
    client_ok = count and max_in_flight <= aiordma_rpc.MAX_CALLS  # a server has no upper limit
    assume(not (client_ok and is_seconds(grace)))
    if not (count and is_seconds(grace)):
        with pytest.raises(LocalProtocolError):
            aiordma_rpc.RpcServer(Calc(), max_in_flight=max_in_flight, grace=grace)
    if not client_ok:
        refused(aiordma_rpc.connect("127.0.0.1", 9, max_in_flight=max_in_flight))


@given(ep=ANYTHING)
def test_rpc_clients_and_servers_take_a_message_channel(ep: Any) -> None:
    async def serve_it() -> None:
        await aiordma_rpc.RpcServer(Calc(), max_in_flight=1, grace=1.0).serve_connection(ep)

    async def client_for_it() -> None:
        aiordma_rpc.RpcClient(ep, max_in_flight=1)

    refused(serve_it())
    refused(client_for_it())


def test_an_rpc_server_made_directly_has_no_port() -> None:
    with pytest.raises(LocalProtocolError, match="serve"):
        _ = aiordma_rpc.RpcServer(Calc(), max_in_flight=1, grace=1.0).port


def is_interceptors(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(callable(i) for i in v)


SERVE_VALID = {"service": lambda v: False, "host": lambda v: isinstance(v, str) and "\x00" not in v,
               "port": lambda v: is_port(v, True), "max_in_flight": lambda v: is_int(v) and v >= 1,
               "grace": is_seconds, "config": lambda v: v is None,
               "device": CONNECT_VALID["device"],
               "secret": lambda v: v is None, "max_connections": is_optional_count,
               "max_connections_per_peer": is_optional_count, "interceptors": is_interceptors,
               "transport": CONNECT_VALID["transport"]}


@given(which=st.sampled_from(sorted(SERVE_VALID)), value=ANYTHING)
@example(which="port", value=-1)
@example(which="service", value=Calc)  # the class, not an instance
def test_rpc_serve_refuses_every_bad_argument(which: str, value: Any) -> None:
    assume(not SERVE_VALID[which](value))
    kw: dict[str, Any] = {"service": Calc(), "host": "127.0.0.1", "port": 0, which: value}
    refused(aiordma_rpc.serve(**kw))


RPC_CONNECT_VALID = {**CONNECT_VALID, "max_in_flight": lambda v: is_int(v)
                     and 1 <= v <= aiordma_rpc.MAX_CALLS, "interceptors": is_interceptors}
del RPC_CONNECT_VALID["gid_index"]  # (rpc.connect has none)


@given(which=st.sampled_from(sorted(RPC_CONNECT_VALID)), value=ANYTHING)
@example(which="max_in_flight", value=0)  # issue 14: ValueError here, another type in listen
@example(which="port", value=-1)
def test_rpc_connect_refuses_every_bad_argument(which: str, value: Any) -> None:
    assume(not RPC_CONNECT_VALID[which](value))
    kw = {**{k: v for k, v in GOOD_CONNECT.items() if k != "gid_index"}, which: value}
    host, port = kw.pop("host"), kw.pop("port")
    refused(aiordma_rpc.connect(host, port, **kw))


def is_number(v: Any, low: float, high: float) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and low <= v <= high)


POOL_VALID = {
    "timeout": is_seconds, "health_interval": is_seconds, "health_timeout": is_seconds,
    "connect_timeout": is_seconds, "wait_for_replica": is_seconds,
    "resolve_interval": is_seconds, "resolve_timeout": is_seconds,
    "max_in_flight": lambda v: is_int(v) and 2 <= v <= aiordma_rpc.MAX_CALLS,
    "max_attempts": lambda v: is_int(v) and 1 <= v <= 100,
    "max_replicas": lambda v: is_int(v) and 1 <= v <= 4096,
    "reconnect_base": lambda v: is_seconds(v) and v <= 5.0,  # (at most the default cap)
    "reconnect_cap": lambda v: is_seconds(v) and v >= 0.1,  # (at least the default base)
    "retry_ratio": lambda v: is_number(v, 0, 1), "retry_burst": lambda v: is_number(v, 0, 1e9),
    "config": lambda v: v is None, "device": CONNECT_VALID["device"],
    "secret": lambda v: v is None, "connector": lambda v: v is None or callable(v),
    "seed": lambda v: v is None or (is_int(v) and v >= 0),
    "transport": CONNECT_VALID["transport"],
}


@given(which=st.sampled_from(sorted(POOL_VALID)), value=ANYTHING)
@example(which="max_in_flight", value=1)  # one place: none left beside the health checks
@example(which="reconnect_cap", value=0.01)  # below the base
@example(which="retry_ratio", value=1.5)
@example(which="health_timeout", value=math.inf)
@example(which="connector", value="not callable")
def test_connect_pool_refuses_every_bad_argument(which: str, value: Any) -> None:
    assume(not POOL_VALID[which](value))
    asked: list[Any] = []

    async def connector(*args: Any) -> Any:
        asked.append(args)
        raise AssertionError("connected despite a bad argument")

    kw: dict[str, Any] = {"connector": connector, which: value}
    refused(aiordma_rpc.connect_pool("127.0.0.1:9", **kw))
    assert asked == []


@given(name=ANYTHING, timeout=ANYTHING)
@example(name="price", timeout=1e16)
@example(name="price", timeout=math.nan)
@example(name=b"price", timeout=None)
def test_pool_calls_refuse_bad_names_and_timeouts(name: Any, timeout: Any) -> None:
    from .memory_cluster import MemoryCluster

    zero = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout == 0
    good_timeout = timeout is None or zero or (is_seconds(timeout)
                                               and timeout <= aiordma_rpc.MAX_TIMEOUT)
    assume(not (isinstance(name, str) and good_timeout))

    async def call() -> None:
        cluster = MemoryCluster(1)
        pool = await aiordma_rpc.connect_pool(cluster.addresses, connector=cluster.connect)
        try:
            await pool.call(name, "rid", "x", timeout=timeout)
        finally:
            assert pool.stats().replicas[0].calls == 0  # nothing sent
            await pool.aclose()
            await cluster.aclose()

    refused(call())


@pytest.mark.parametrize("target", [
    123, "", "host", "host:", "host:99999", "host:-1", "host:0x10", ":80", ("h", "1"),
    ("h", True), ("h", 70000), [], ["ok:1", 5], b"h:1", {"h": 1}, ("a:1", "b"), None,
])
def test_connect_pool_refuses_bad_addresses(target: Any) -> None:
    refused(aiordma_rpc.connect_pool(target))


def test_a_resolver_that_returns_garbage_fails_the_pool_typed() -> None:
    async def garbage() -> Any:
        return "h:1"  # a str, not a list of them

    with pytest.raises(aiordma_rpc.NoReplicaError):
        asyncio.run(aiordma_rpc.connect_pool(garbage, timeout=5))


# -- aiordma.services.kv -------------------------------------------------------------------------

@given(slots=ANYTHING | st.integers(1, 64), slot_size=ANYTHING | st.sampled_from([32, 64, 100]),
       window=ANYTHING | st.integers(1, 8), max_value=ANYTHING | st.integers(0, 1 << 20))
@example(slots="a", slot_size=64, window=1, max_value=10)  # a raw TypeError once
@example(slots=-1, slot_size=64, window=1, max_value=10)
@example(slots=2**40, slot_size=64, window=1, max_value=10)  # a 64 TiB table
@example(slots=8, slot_size=64, window=1, max_value=-1)
def test_kv_stores_refuse_bad_geometry(slots: Any, slot_size: Any, window: Any,
                                       max_value: Any) -> None:
    ok = (all(is_int(v) for v in (slots, slot_size, window, max_value))
          and 32 <= slot_size <= 1 << 20 and slot_size % 8 == 0 and 1 <= window <= slots
          and slots * slot_size <= 4 << 30 and window * slot_size <= 1 << 20
          and 0 <= max_value <= 1 << 62)
    if not ok:
        with pytest.raises(LocalProtocolError):
            kv.KvStore(slots=slots, slot_size=slot_size, window=window, max_value=max_value)
    elif slots * slot_size <= 1 << 20:  # (a valid big table is not allocated here)
        kv.KvStore(slots=slots, slot_size=slot_size, window=window, max_value=max_value)


def disconnected_kv_client() -> KvClient:
    """A KvClient with no connection: its checks come before any use of one (a call that got
    past them would fail on the missing attributes, not with LocalProtocolError)."""
    return KvClient.__new__(KvClient)


KV_CALLS: dict[str, Any] = {
    "get": lambda c, key=b"k", one_sided=True, timeout=None: c.get(key, one_sided=one_sided,
                                                                   timeout=timeout),
    "put": lambda c, key=b"k", value=b"v", timeout=None: c.put(key, value, timeout=timeout),
    "delete": lambda c, key=b"k", timeout=None: c.delete(key, timeout=timeout),
}
KV_VALID = {"key": lambda v: isinstance(v, (bytes, str)),
            "value": lambda v: isinstance(v, bytes),
            "one_sided": lambda v: isinstance(v, bool),
            "timeout": lambda v: v is None or (isinstance(v, (int, float))
                                               and not isinstance(v, bool)
                                               and 0 <= v <= aiordma_rpc.MAX_TIMEOUT)}


@given(call=st.sampled_from(sorted(KV_CALLS)), which=st.sampled_from(sorted(KV_VALID)),
       value=ANYTHING)
@example(call="get", which="key", value=None)
@example(call="put", which="value", value=42)  # a RemoteError TypeError from the server once
@example(call="get", which="timeout", value=-1)  # an OperationTimeout at once
@example(call="get", which="one_sided", value="no")
@example(call="get", which="key", value="\ud800")  # a str UTF-8 cannot encode
def test_kv_client_calls_refuse_bad_arguments(call: str, which: str, value: Any) -> None:
    fn = KV_CALLS[call]
    assume(which in fn.__code__.co_varnames and not KV_VALID[which](value))

    async def go() -> None:
        await fn(disconnected_kv_client(), **{which: value})

    refused(go())


@given(readers=ANYTHING)
@example(readers=0)
@example(readers=True)
@example(readers=10**9)  # a buffer per reader
def test_kv_connect_refuses_bad_readers(readers: Any) -> None:
    assume(not (is_int(readers) and 1 <= readers <= 1024))
    refused(kv.connect("127.0.0.1", 9, readers=readers))


def test_kv_keys_and_values() -> None:
    from aiordma.services.kv._store import as_key, as_value

    assert as_key("k") == b"k" and as_key(bytearray(b"k")) == b"k"
    released = memoryview(b"x")
    released.release()
    bad_keys: list[Any] = [None, 1, "\ud800", released]
    for bad in bad_keys:
        with pytest.raises(LocalProtocolError):
            as_key(bad)
    bad_values: list[Any] = [None, "v", [1], released]
    for bad in bad_values:
        with pytest.raises(LocalProtocolError):
            as_value(bad)
    with pytest.raises(LocalProtocolError):
        as_value(b"12345", 4)


# -- aiordma.testing ------------------------------------------------------------------------------

@given(which=st.sampled_from(["eager_max", "max_message", "recv_buffer", "slots",
                              "close_timeout"]), value=ANYTHING)
def test_channel_pairs_refuse_bad_sizes(which: str, value: Any) -> None:
    valid = is_seconds(value) if which == "close_timeout" else (
        is_int(value) and value >= (1 if which == "slots" else 0))
    assume(not valid)
    with pytest.raises(LocalProtocolError):
        channel_pair(**{which: value})


def test_a_channel_made_alone_refuses_typed() -> None:
    from aiordma.testing import MemoryChannel

    alone = MemoryChannel(eager_max=8, max_message=64, recv_buffer=64, slots=4,
                          close_timeout=1.0)

    async def use() -> None:
        with pytest.raises(LocalProtocolError, match="channel_pair"):
            await alone.send(b"x")
        with pytest.raises(LocalProtocolError, match="channel_pair"):
            alone.send_nowait(b"x")
        with pytest.raises(LocalProtocolError, match="channel_pair"):
            await alone.recv()

    asyncio.run(use())
