"""The key-value service: a dictionary served by RPC, mirrored into a table that clients may
read with one-sided RDMA READs (layout and validation: :mod:`aiordma.protocols.kv`)."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

from aiordma import Endpoint, LocalProtocolError, RemoteBuffer
from aiordma.protocols.errors import LocalProtocolError as WireLocalProtocolError
from aiordma.protocols.kv import Layout, TableWriter
from aiordma.rpc import Service, current_endpoint, method

__all__ = ["KvStore", "as_key", "as_value"]


def as_key(key: Any) -> bytes:
    """Keys are bytes (or a bytes-like object); a ``str`` is taken as its UTF-8 encoding.

    Raises:
        LocalProtocolError: anything else, or a ``str`` that UTF-8 cannot encode.
    """
    if isinstance(key, str):
        try:
            return key.encode()
        except UnicodeEncodeError:
            raise LocalProtocolError(f"a key is bytes or encodable str, not {key!r:.80}") \
                from None
    if isinstance(key, (bytes, bytearray, memoryview)):
        try:
            return bytes(key)
        except (TypeError, ValueError) as exc:  # e.g. a released memoryview
            raise LocalProtocolError(f"a key is bytes or str: {exc}") from None
    raise LocalProtocolError(f"a key is bytes or str, not {type(key).__name__}")


def as_value(value: Any, limit: int | None = None) -> bytes | bytearray:
    """A value as bytes (a ``memoryview`` is copied).

    Raises:
        LocalProtocolError: not bytes-like, or longer than ``limit``.
    """
    if isinstance(value, memoryview):
        try:
            value = value.tobytes()
        except ValueError as exc:  # released
            raise LocalProtocolError(f"a value is bytes: {exc}") from None
    if not isinstance(value, (bytes, bytearray)):
        raise LocalProtocolError(f"a value is bytes, not {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise LocalProtocolError(f"a value is at most {limit} bytes, not {len(value)}")
    return value


class KvStore(Service):
    """``put``/``get``/``delete`` by RPC; ``table()`` exposes the one-sided table.

    Args:
        slots, slot_size, window: the table's geometry (:class:`aiordma.protocols.kv.Layout`): a key
            and value of up to ``slot_size - 24`` bytes together are readable one-sided;
            larger values, and keys whose window is full, are served by RPC only.
        max_value: the largest value accepted (bytes).

    Raises:
        LocalProtocolError: a geometry :class:`~aiordma.protocols.kv.Layout` refuses, or
            ``max_value`` is not an integer in 0..2**62.

    The dictionary is the truth; the table mirrors it. Each client connection over RDMA gets
    its own read-only registration of the table (:func:`aiordma.rpc.current_endpoint`),
    released when that connection closes, so a departed client's rkey no longer reaches it; a
    connection over TCP gets none (its client's GETs go by RPC).
    """

    def __init__(self, *, slots: int = 4096, slot_size: int = 512, window: int = 4,
                 max_value: int = 16 << 20) -> None:
        try:
            self.layout = Layout(slots=slots, slot_size=slot_size, window=window)
        except WireLocalProtocolError as exc:
            raise LocalProtocolError(str(exc)) from None
        if not isinstance(max_value, int) or isinstance(max_value, bool) \
                or not 0 <= max_value <= 1 << 62:
            raise LocalProtocolError(f"max_value must be an integer in 0..2**62, not "
                                     f"{max_value!r:.80}")
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
        """The table's layout and a read-only descriptor of it, for the calling client; no
        descriptor (``None``) for a client whose connection is not over RDMA (TCP): its GETs
        go by RPC."""
        ep = current_endpoint()
        if not isinstance(ep, Endpoint):  # (a TCP channel: no one-sided READ reaches us)
            self.counters["table_without_rdma"] += 1
            return {"layout": self.layout.to_wire(), "table": None}
        desc = self._exposed.get(ep)
        if desc is None:
            mr = ep.register(self._table, remote_read=True)  # closed with the connection
            desc = self._exposed[ep] = mr.expose(read=True)
            self.counters["table"] += 1
        return {"layout": self.layout.to_wire(), "table": desc.to_wire()}

    @method
    def put(self, key: Any, value: Any) -> None:
        k, v = as_key(key), as_value(value, self.max_value)
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
