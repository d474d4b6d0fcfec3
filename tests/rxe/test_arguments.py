"""The one rule for arguments at the entry points that need a live endpoint or device: every
``Endpoint`` call (send, send_nowait, recv_into, register, write, read, fetch_add,
compare_swap, expose), ``MemoryRegion`` on a real device, and a key-value client connected to
a served store. Hypothesis draws one bad argument per call (wrong types, negative, huge, NaN,
infinite, empty, a bool for an int) with the others valid: only ``LocalProtocolError``
escapes (or ``ClosedResourceError`` for what this process closed), nothing is posted or sent
(the reactor's count of posted work requests and the endpoint's count of sent messages stay
put; the key-value server sees no call), and the endpoint stays usable: a message and a
one-sided WRITE still go through afterwards. Both loops, as every device test. The
device-free entry points are tests/unit/test_arguments.py."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

import aiordma
from aiordma import ClosedResourceError, LocalProtocolError, LocalSlice, MemoryRegion
from aiordma.rpc import serve
from aiordma.services import kv

from ..bounds import STEP
from .conftest import Connected

ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.sampled_from([math.nan, math.inf, -1, 2**64, -(2**63) - 1]), st.text(max_size=8),
    st.lists(st.integers(), max_size=2), st.just(object()), st.just({}),
)
NOT_BYTES = ANYTHING.filter(lambda v: not isinstance(v, (bytes, bytearray)))


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Guard:
    """Checks that a refused call left the endpoint as it was: nothing posted, nothing sent,
    not broken."""

    def __init__(self, ep: aiordma.Endpoint) -> None:
        self.ep = ep
        self.posted = ep._reactor.pending
        self.sent = ep.stats().sent

    async def refused(self, call: Any, *also: type[BaseException]) -> None:
        with pytest.raises((LocalProtocolError, *also)):
            result = call()
            if asyncio.iscoroutine(result):
                await asyncio.wait_for(result, STEP)
        ep = self.ep
        assert ep._reactor.pending == self.posted, "something was posted"
        assert ep.stats().sent == self.sent, "something was sent"
        assert not ep.broken and not ep.closed


async def still_works(c: Connected) -> None:
    """A message each way and a one-sided WRITE + READ through the same endpoints."""
    await asyncio.wait_for(c.client.send(b"still there?"), STEP)
    assert await asyncio.wait_for(c.server.recv(), STEP) == b"still there?"
    await asyncio.wait_for(c.server.send(b"yes"), STEP)
    assert await asyncio.wait_for(c.client.recv(), STEP) == b"yes"
    theirs = c.server.register(bytearray(64))
    mine = c.client.register(bytearray(b"x" * 64))
    desc = theirs.expose(read=True, write=True)
    await asyncio.wait_for(c.client.write(mine[0:64], desc), STEP)
    assert bytes(theirs.view) == b"x" * 64
    theirs.close()
    mine.close()


@given(data=NOT_BYTES)
@example(data=memoryview(bytearray(8))[::2])  # not contiguous
@example(data="text")
@example(data=12)
async def test_send_and_send_nowait_refuse_what_is_not_bytes(connected: Connected,
                                                             data: Any) -> None:
    guard = Guard(connected.client)
    await guard.refused(lambda: connected.client.send(data))
    await guard.refused(lambda: connected.client.send_nowait(data))
    await still_works(connected)


@given(buffer=ANYTHING)
@example(buffer=b"read-only bytes")  # issue 14: not writable
@example(buffer="text")
@example(buffer=42)  # issue 14: a raw TypeError once
async def test_recv_into_refuses_what_is_not_a_writable_buffer(connected: Connected,
                                                               buffer: Any) -> None:
    guard = Guard(connected.client)
    await guard.refused(lambda: connected.client.recv_into(buffer))
    await still_works(connected)  # and nothing was taken from the inbox


async def test_recv_into_refuses_slices_of_closed_or_read_only_regions(
        connected: Connected) -> None:
    ep = connected.client
    closed = ep.register(bytearray(64))
    closed.close()
    readonly = ep.register(b"\x00" * 64)
    guard = Guard(ep)
    await guard.refused(lambda: ep.recv_into(closed[0:64]), ClosedResourceError)
    await guard.refused(lambda: ep.recv_into(readonly[0:64]))
    await still_works(connected)


REGISTER_VALID = {"buffer": lambda v: isinstance(v, (bytes, bytearray)),
                  "remote_read": lambda v: isinstance(v, bool),
                  "remote_write": lambda v: isinstance(v, bool),
                  "atomic": lambda v: isinstance(v, bool)}


@given(which=st.sampled_from(sorted(REGISTER_VALID)), value=ANYTHING)
@example(which="remote_read", value=1)
@example(which="buffer", value=memoryview(bytearray(8))[::2])
async def test_register_and_memory_regions_refuse_bad_arguments(connected: Connected,
                                                                which: str, value: Any) -> None:
    assume(not REGISTER_VALID[which](value))
    ep = connected.client
    kw: dict[str, Any] = {"buffer": bytearray(64), which: value}
    buffer = kw.pop("buffer")
    guard = Guard(ep)
    await guard.refused(lambda: ep.register(buffer, **kw))
    await guard.refused(lambda: MemoryRegion(ep.device, buffer, **kw))
    await still_works(connected)


@given(which=st.sampled_from(["local", "remote"]), value=ANYTHING)
@example(which="remote", value=(0, 1, 64, 3))  # issue 14: an AttributeError once
@example(which="remote", value="descriptor")
@example(which="local", value=bytearray(64))  # not registered
async def test_write_and_read_refuse_what_is_not_a_slice_and_a_descriptor(
        connected: Connected, which: str, value: Any) -> None:
    ep = connected.client
    mine = ep.register(bytearray(64))
    desc = connected.server.register(bytearray(64)).expose(read=True, write=True)
    local, remote = (value, desc) if which == "local" else (mine[0:64], value)
    guard = Guard(ep)
    await guard.refused(lambda: ep.write(local, remote))
    await guard.refused(lambda: ep.read(local, remote))
    mine.close()
    await still_works(connected)


@given(op=st.sampled_from(["fetch_add", "compare_swap"]),
       which=st.sampled_from(["target", "add", "expected", "new"]), value=ANYTHING)
@example(op="fetch_add", which="add", value=1.5)  # a raw TypeError once
@example(op="fetch_add", which="add", value=True)
@example(op="fetch_add", which="add", value=2**64)  # silently taken mod 2**64 once
@example(op="compare_swap", which="new", value=-(2**63) - 1)
@example(op="compare_swap", which="target", value=None)
async def test_atomics_refuse_bad_targets_and_operands(connected: Connected, op: str,
                                                       which: str, value: Any) -> None:
    word_ok = is_int(value) and -(2**63) <= value < 2**64
    assume(not (which != "target" and word_ok))
    assume(not (op == "fetch_add" and which in ("expected", "new")))
    assume(not (op == "compare_swap" and which == "add"))
    ep = connected.client
    desc = connected.server.register(bytearray(64)).expose(atomic=True)
    kw: dict[str, Any] = {"target": desc[0:8], "add": 1, "expected": 0, "new": 1, which: value}
    guard = Guard(ep)
    if op == "fetch_add":
        await guard.refused(lambda: ep.fetch_add(kw["target"], kw["add"]))
    else:
        await guard.refused(lambda: ep.compare_swap(kw["target"], expected=kw["expected"],
                                                    new=kw["new"]))
    await still_works(connected)


EXPOSE_VALID = {"local": lambda v: False, "read": lambda v: isinstance(v, bool),
                "write": lambda v: isinstance(v, bool), "atomic": lambda v: isinstance(v, bool),
                "mechanism": lambda v: v is None or v in ("window", "registration")}


@given(which=st.sampled_from(sorted(EXPOSE_VALID)), value=ANYTHING)
@example(which="read", value="yes")
@example(which="mechanism", value="windows")
@example(which="mechanism", value=["window"])
@example(which="local", value=bytearray(64))
async def test_expose_refuses_bad_arguments(connected: Connected, which: str,
                                            value: Any) -> None:
    assume(not EXPOSE_VALID[which](value))
    ep = connected.client
    region = ep.register(bytearray(64))
    kw: dict[str, Any] = {"local": region[0:64], "read": True, which: value}
    local = kw.pop("local")
    guard = Guard(ep)
    await guard.refused(lambda: ep.expose(local, **kw))
    region.close()
    await still_works(connected)


async def test_a_hand_made_local_slice_is_checked_like_a_sliced_one(
        connected: Connected) -> None:
    ep = connected.client
    region = ep.register(bytearray(64))
    desc = connected.server.register(bytearray(128)).expose(write=True)
    guard = Guard(ep)
    for offset, length in ((-8, 16), (56, 16), (0, 65), (True, 8)):
        # before: a write from region.address - 8 reached the device and broke the endpoint
        await guard.refused(lambda o=offset, n=length: ep.write(LocalSlice(region, o, n),
                                                                desc[0:16]))
    await still_works(connected)


KV_CALLS: dict[str, Any] = {
    "get": lambda c, key=b"k", one_sided=True, timeout=None: c.get(key, one_sided=one_sided,
                                                                   timeout=timeout),
    "put": lambda c, key=b"k", value=b"v", timeout=None: c.put(key, value, timeout=timeout),
    "delete": lambda c, key=b"k", timeout=None: c.delete(key, timeout=timeout),
}
KV_VALID = {"key": lambda v: isinstance(v, (bytes, str)), "value": lambda v: False,
            "one_sided": lambda v: isinstance(v, bool),
            "timeout": lambda v: v is None or (isinstance(v, (int, float))
                                               and not isinstance(v, bool)
                                               and 0 <= v <= aiordma.rpc.MAX_TIMEOUT)}


@pytest.fixture
async def kv_pair(rdma_device: Any) -> Any:
    store = kv.KvStore(slots=8, slot_size=128, window=2)
    async with await serve(store, "127.0.0.1", 0, device=rdma_device) as server:  # noqa: SIM117
        async with await kv.connect("127.0.0.1", server.port, timeout=STEP,
                                    device=rdma_device) as client:
            yield store, client


@given(call=st.sampled_from(sorted(KV_CALLS)), which=st.sampled_from(sorted(KV_VALID)),
       value=NOT_BYTES)
@example(call="put", which="value", value=42)  # a RemoteError TypeError from the server once
@example(call="get", which="timeout", value=-1)  # an OperationTimeout at once
@example(call="get", which="key", value=None)
async def test_kv_client_calls_refuse_bad_arguments_and_send_nothing(kv_pair: Any, call: str,
                                                                     which: str,
                                                                     value: Any) -> None:
    store, client = kv_pair
    fn = KV_CALLS[call]
    assume(which in fn.__code__.co_varnames and not KV_VALID[which](value))
    before = (dict(store.counters), dict(client.counters), client.rpc.endpoint.stats().sent)
    with pytest.raises(LocalProtocolError):
        await asyncio.wait_for(fn(client, **{which: value}), STEP)
    assert (dict(store.counters), dict(client.counters),
            client.rpc.endpoint.stats().sent) == before
    await asyncio.wait_for(client.put(b"k", b"v"), STEP)  # still serves
    assert await asyncio.wait_for(client.get(b"k"), STEP) == b"v"
