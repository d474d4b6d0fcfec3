"""The key-value service: a dictionary served by RPC, mirrored into a table that clients may
read with one-sided RDMA READs (layout and validation: :mod:`aiordma.protocols.kv`)."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

from aiordma import Endpoint, RemoteBuffer
from aiordma.protocols.kv import Layout, TableWriter
from aiordma.rpc import Service, current_endpoint, method

__all__ = ["KvStore", "as_key"]


def as_key(key: Any) -> bytes:
    """Keys are bytes; a ``str`` is taken as its UTF-8 encoding."""
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise TypeError(f"a key is bytes or str, not {type(key).__name__}")


def _as_value(value: Any, limit: int) -> bytes | bytearray:
    if isinstance(value, memoryview):
        value = bytes(value)
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"a value is bytes, not {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"a value is at most {limit} bytes, not {len(value)}")
    return value


class KvStore(Service):
    """``put``/``get``/``delete`` by RPC; ``table()`` exposes the one-sided table.

    Args:
        slots, slot_size, window: the table's geometry (:class:`aiordma.protocols.kv.Layout`): a key
            and value of up to ``slot_size - 24`` bytes together are readable one-sided;
            larger values, and keys whose window is full, are served by RPC only.
        max_value: the largest value accepted (bytes).

    The dictionary is the truth; the table mirrors it. Each client connection gets its own
    read-only registration of the table (:func:`aiordma.rpc.current_endpoint`), released when
    that connection closes, so a departed client's rkey no longer reaches it.
    """

    def __init__(self, *, slots: int = 4096, slot_size: int = 512, window: int = 4,
                 max_value: int = 16 << 20) -> None:
        self.layout = Layout(slots=slots, slot_size=slot_size, window=window)
        self.max_value = max_value
        self._table = bytearray(self.layout.table_bytes)
        self._writer = TableWriter(self.layout, self._table)
        self._data: dict[bytes, bytes | bytearray] = {}
        self._exposed: weakref.WeakKeyDictionary[Endpoint, RemoteBuffer] = (
            weakref.WeakKeyDictionary())  # one registration per connection, however often asked
        self.counters: Counter[str] = Counter()

    def table_view(self) -> memoryview:
        """The table's bytes as a one-sided reader sees them (read-only; not callable
        remotely)."""
        return memoryview(self._table).toreadonly()

    @method
    def table(self) -> dict[str, Any]:
        """The table's layout and a read-only descriptor of it, for the calling client."""
        ep = current_endpoint()
        desc = self._exposed.get(ep)
        if desc is None:
            mr = ep.register(self._table, remote_read=True)  # closed with the connection
            desc = self._exposed[ep] = mr.expose(read=True)
            self.counters["table"] += 1
        return {"layout": self.layout.to_wire(), "table": desc.to_wire()}

    @method
    def put(self, key: Any, value: Any) -> None:
        k, v = as_key(key), _as_value(value, self.max_value)
        self._data[k] = v
        self._writer.put(k, v)  # False: the window is full; the dictionary serves it
        self.counters["put"] += 1

    @method
    def get(self, key: Any) -> bytes | bytearray | None:
        self.counters["get"] += 1
        return self._data.get(as_key(key))

    @method
    def delete(self, key: Any) -> bool:
        k = as_key(key)
        self._writer.delete(k)
        self.counters["delete"] += 1
        return self._data.pop(k, None) is not None

    @method
    def stats(self) -> dict[str, int]:
        """Calls served, keys held, and how many of them overflowed the table (RPC only)."""
        return {**self.counters, "keys": len(self._data),
                "overflow": len(self._data) - len(self._writer)}
