"""The key-value client: GETs by one-sided RDMA READ of the server's table, validated, with RPC
as the fallback (and the only way over a connection that is not RDMA: TCP); PUT and DELETE by
RPC."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Self

import aiordma
from aiordma import LocalProtocolError, OperationTimeout, RemoteBuffer, RemoteProtocolError
from aiordma import rpc as _rpc
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.kv import MISSING, Layout, lookup

from ._store import as_key

MAX_READERS = 1024
"""The most one-sided GETs a client has in flight (each has a window-sized buffer)."""


def _check_timeout(timeout: Any) -> None:
    # (NaN fails the range test: every comparison with it is false)
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                or not 0 <= timeout <= _rpc.MAX_TIMEOUT):
        raise LocalProtocolError(f"timeout must be None or a non-negative, finite number of "
                                 f"seconds of at most {_rpc.MAX_TIMEOUT:g}, not {timeout!r:.80}")

__all__ = ["KvClient", "connect"]


class KvClient:
    """A connection to a :class:`~aiordma.services.kv.KvStore`.

    ``get`` reads the key's window of the table with one RDMA READ and checks it
    (:func:`aiordma.protocols.kv.lookup`): a valid entry is returned without the server's CPU; an
    absent key (an EMPTY slot before it) gives ``None``; a torn, large or overflowed entry is
    fetched by RPC instead. Over a connection without RDMA (``transport="tcp"``, or ``"auto"``
    where a side has no device) there is no table to read: every GET goes by RPC
    (``counters["fallback_no_rdma"]``). ``counters`` says which path each GET took.

    Use as ``async with``; :attr:`rpc` is the underlying :class:`aiordma.rpc.RpcClient`.
    """

    def __init__(self, rpc: _rpc.RpcClient, layout: Layout, table: RemoteBuffer | None,
                 readers: int) -> None:
        self.rpc = rpc
        self.layout = layout
        self._table = table  # None: no one-sided GETs (the connection is not over RDMA)
        size = layout.window_bytes
        self._free: asyncio.Queue[int] = asyncio.Queue()
        self._fences: set[asyncio.Task[None]] = set()  # (see _fence)
        if table is not None:
            self._scratch = rpc.endpoint.register(bytearray(readers * size))
            for i in range(readers):
                self._free.put_nowait(i)
        self.counters: Counter[str] = Counter()

    async def get(self, key: bytes | str, *, one_sided: bool = True,
                  timeout: float | None = None) -> bytes | None:
        """The value of ``key``, or ``None``.

        Args:
            one_sided: read the table by RDMA READ first (default); False asks by RPC only.
            timeout: bound on the whole GET (``OperationTimeout``); 0 is over before the
                GET starts: it raises, and nothing is sent.

        Raises:
            LocalProtocolError: ``key`` is not bytes or str, ``one_sided`` not a bool, or
                ``timeout`` not None or a non-negative, finite number of seconds.
        """
        k = as_key(key)
        if not isinstance(one_sided, bool):
            raise LocalProtocolError(f"one_sided must be True or False, not {one_sided!r:.80}")
        _check_timeout(timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if deadline is not None and loop.time() >= deadline:  # (a READ may end in its post,
            # with no loop turn for the bound to fire in)
            raise OperationTimeout(f"GET took longer than {timeout} s")
        if one_sided and self._table is None:
            self.counters["fallback_no_rdma"] += 1  # (over TCP: no table to read)
        elif one_sided and len(k) <= self.layout.inline_max:  # longer keys are not in the table
            try:
                async with asyncio.timeout_at(deadline):
                    found = await self._read(k)
            except TimeoutError:
                raise OperationTimeout(f"GET took longer than {timeout} s") from None
            if isinstance(found, bytes):
                self.counters["one_sided_hit"] += 1
                return found
            if found is MISSING:
                self.counters["one_sided_missing"] += 1
                return None
            self.counters[f"fallback_{found.value}"] += 1
        self.counters["rpc_get"] += 1
        left = None if deadline is None else max(0.0, deadline - loop.time())
        value = await self.rpc.call("get", k, timeout=left)  # what is left of the bound
        return None if value is None else bytes(value)

    async def put(self, key: bytes | str, value: bytes | bytearray | memoryview, *,
                  timeout: float | None = None) -> None:
        """Store ``value`` under ``key`` (returns once the server has it).

        Raises:
            LocalProtocolError: ``key`` is not bytes or str, ``value`` not bytes, a bytearray
                or a memoryview, or ``timeout`` not as for :meth:`get`.
            RemoteError: the server refused it (e.g. a value larger than its ``max_value``).
        """
        k = as_key(key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise LocalProtocolError(f"a value is bytes, not {type(value).__name__}")
        _check_timeout(timeout)
        await self.rpc.call("put", k, value, timeout=timeout)

    async def delete(self, key: bytes | str, *, timeout: float | None = None) -> bool:
        """Remove ``key``; whether it was there. Raises as :meth:`get`."""
        k = as_key(key)
        _check_timeout(timeout)
        return bool(await self.rpc.call("delete", k, timeout=timeout))

    async def stats(self) -> dict[str, int]:
        """The server's counters."""
        return dict(await self.rpc.call("stats"))

    async def _read(self, key: bytes) -> Any:
        home = self.layout.home(key)
        size = self.layout.window_bytes
        src = self._table[home * self.layout.slot_size:home * self.layout.slot_size + size]
        i = await self._free.get()
        dst = self._scratch[i * size:(i + 1) * size]
        try:
            await self.rpc.endpoint.read(dst, src)  # (in this task: no task, no shield)
        except asyncio.CancelledError:
            self._fence(i, src)  # the device may still write into dst
            raise
        except BaseException:
            self._free.put_nowait(i)  # the READ failed: nothing writes into dst any more
            raise
        try:
            return lookup(self.layout, dst.memoryview(), key)
        finally:
            self._free.put_nowait(i)

    def _fence(self, i: int, src: RemoteBuffer) -> None:
        """Read buffer ``i``'s READ (of ``src``) was left: give the buffer back once a later
        READ on this connection has completed (a reliable connection completes its work
        requests in order, so by then the one left is over, its data placed or its failure
        reported)."""
        at = i * self.layout.window_bytes

        async def fence() -> None:
            try:
                await self.rpc.endpoint.read(self._scratch[at:at + 8], src[0:8])
            except Exception:  # noqa: BLE001, S110  (broken or closed: nothing writes any more)
                pass
            finally:
                self._free.put_nowait(i)

        task = asyncio.ensure_future(fence())
        self._fences.add(task)
        task.add_done_callback(self._fences.discard)

    async def aclose(self) -> None:
        await self.rpc.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def connect(host: str, port: int, *, timeout: float = 10.0, readers: int = 16,
                  **kwargs: Any) -> KvClient:
    """Connect to a served :class:`~aiordma.services.kv.KvStore`; ``readers`` (1..1024)
    one-sided GETs may be in flight at once (each has its own window-sized buffer). Other
    arguments go to :func:`aiordma.rpc.connect` (``transport="tcp"``, or ``"auto"`` where a
    side has no RDMA device: every GET by RPC).

    Raises:
        LocalProtocolError: a bad argument (here or as :func:`aiordma.rpc.connect` checks).
        RemoteProtocolError: the server described its table badly.
        AiordmaError: what :func:`aiordma.rpc.connect` raises.
    """
    if not isinstance(readers, int) or isinstance(readers, bool) \
            or not 1 <= readers <= MAX_READERS:
        raise LocalProtocolError(f"readers must be an integer in 1..{MAX_READERS}, not "
                                 f"{readers!r:.80}")
    rpc = await _rpc.connect(host, port, timeout=timeout, **kwargs)
    try:
        info = await rpc.call("table", timeout=timeout)
        try:
            layout = Layout.from_wire(info["layout"])
            rdma = rpc.transport == "rdma"
            table = RemoteBuffer.from_wire(info["table"]) if rdma else None
        except (ProtocolError, aiordma.LocalProtocolError, KeyError, TypeError) as exc:
            raise RemoteProtocolError(f"the server described its table badly: {exc}") from exc
        if table is not None and (len(table) < layout.table_bytes or not table.readable):
            raise RemoteProtocolError("the server's table descriptor does not cover its layout")
        return KvClient(rpc, layout, table, readers)
    except BaseException:
        await rpc.aclose()
        raise
