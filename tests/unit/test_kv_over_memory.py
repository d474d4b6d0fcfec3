"""The key-value service over the in-memory channel pair (aiordma.testing): PUT, GET, DELETE
and stats by RPC, typed errors for bad keys and values, and which path a client's GET takes
for each kind of entry (one-sided hit, absent, large value or full window: RPC), decided by
aiordma.protocols.kv.lookup on the served store's own table, exactly the bytes a one-sided READ
returns. No device; the one-sided READ itself is tested over rxe in tests/rxe/test_kv.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from aiordma.protocols.kv import BIG, MISSING, UNKNOWN, lookup
from aiordma.rpc import RemoteError, RpcClient
from aiordma.services.kv import KvStore

from ..bounds import STEP
from ..rpc_services import served_over_memory


@contextlib.asynccontextmanager
async def store_and_client(**options: Any) -> AsyncIterator[tuple[KvStore, RpcClient]]:
    store = KvStore(**options)
    async with served_over_memory(store, server_limit=16, client_limit=16, grace=1.0) as (
            client, _server):
        yield store, client


def one_sided(store: KvStore, key: bytes) -> Any:
    """What a client's one-sided GET concludes from one READ of the key's window."""
    layout = store.layout
    start = layout.home(key) * layout.slot_size
    return lookup(layout, store.table_view()[start:start + layout.window_bytes], key)


@pytest.mark.usefixtures("over")
async def test_put_get_delete_and_the_path_each_get_takes() -> None:
    async with store_and_client(slots=64, slot_size=256, window=4) as (store, kv):
        small = {f"k{i}".encode(): os.urandom(i * 7 % 200) for i in range(20)}
        large = {b"big": os.urandom(10_000)}
        for k, v in {**small, **large}.items():
            await asyncio.wait_for(kv.put(k, v), STEP)
        for k, v in small.items():
            assert one_sided(store, k) == v  # served without the server's CPU
            assert bytes(await asyncio.wait_for(kv.get(k), STEP)) == v
        assert one_sided(store, b"big") is BIG  # the client falls back to RPC ...
        assert bytes(await asyncio.wait_for(kv.get(b"big"), STEP)) == large[b"big"]
        assert await asyncio.wait_for(kv.delete(b"k3"), STEP) is True
        assert await asyncio.wait_for(kv.delete(b"k3"), STEP) is False
        assert one_sided(store, b"k3") in (MISSING, UNKNOWN)  # ... and RPC says absent
        assert await asyncio.wait_for(kv.get(b"k3"), STEP) is None
        assert one_sided(store, b"never") in (MISSING, UNKNOWN)
        stats = await asyncio.wait_for(kv.stats(), STEP)
        assert stats["keys"] == len(small) + len(large) - 1 and stats["put"] == 21


@pytest.mark.usefixtures("over")
async def test_a_full_window_is_served_by_rpc() -> None:
    """With windows of one slot in a small table, colliding keys overflow the table: their
    GET cannot be answered one-sided (UNKNOWN) and RPC serves them; stats count them."""
    async with store_and_client(slots=8, slot_size=128, window=1) as (store, kv):
        values = {f"key-{i}".encode(): f"value-{i}".encode() for i in range(40)}
        for k, v in values.items():
            await asyncio.wait_for(kv.put(k, v), STEP)
        verdicts = {k: one_sided(store, k) for k in values}
        overflowed = [k for k, r in verdicts.items() if r is UNKNOWN]
        assert all(r == values[k] for k, r in verdicts.items() if r is not UNKNOWN)
        assert len(overflowed) >= 40 - 8  # at most one key per slot
        for k in overflowed:
            assert bytes(await asyncio.wait_for(kv.get(k), STEP)) == values[k]
        assert (await asyncio.wait_for(kv.stats(), STEP))["overflow"] == len(overflowed)


@pytest.mark.usefixtures("over")
@pytest.mark.parametrize("call", [("put", 12, b"v"), ("put", b"k", 3.5), ("get", None),
                                  ("put", b"k", bytes(1001)), ("delete", [1, 2])])
async def test_bad_keys_and_values_are_typed_remote_errors(call: tuple[Any, ...]) -> None:
    async with store_and_client(max_value=1000) as (_store, kv):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(kv.call(*call), STEP)
        assert info.value.type_name == "LocalProtocolError"  # the one rule, on the server
        assert await asyncio.wait_for(kv.call("put", b"ok", b"fine"), STEP) is None  # serving
