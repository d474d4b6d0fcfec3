"""The RPC baseline: an echo RPC over asyncio TCP streams with msgpack, length-prefixed frames.

What an asyncio developer would write without RDMA: one TCP connection (``TCP_NODELAY``),
frames of a 4-byte little-endian length then a msgpack body ``[call_id, method, args]``
(request) or ``[call_id, result]`` (answer); many calls in flight on one connection,
matched by id; a server task per call, answers written under the stream's own ordering.
Nothing here is tuned beyond that; it is the yardstick for ``aiordma.rpc``.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
from typing import Any

import msgpack

__all__ = ["TcpEchoClient", "serve_tcp_echo"]

_LEN = struct.Struct("<I")


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (n,) = _LEN.unpack(await reader.readexactly(4))
    return msgpack.unpackb(await reader.readexactly(n))


def _frame(obj: Any) -> bytes:
    body = msgpack.packb(obj)
    return _LEN.pack(len(body)) + body


async def serve_tcp_echo(host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """A server whose ``echo(value)`` returns ``value``; one task per call."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        tasks: set[asyncio.Task[None]] = set()

        async def answer(call_id: int, method: str, args: list[Any]) -> None:
            result = args[0] if method == "echo" else None
            writer.write(_frame([call_id, result]))
            await writer.drain()

        try:
            while True:
                call_id, method, args = await _read_frame(reader)
                t = asyncio.ensure_future(answer(call_id, method, args))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            writer.close()

    return await asyncio.start_server(handle, host, port)


class TcpEchoClient:
    """One connection; ``await client.call("echo", value)``, many at once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._task = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, host: str, port: int) -> TcpEchoClient:
        reader, writer = await asyncio.open_connection(host, port)
        _nodelay(writer)
        return cls(reader, writer)

    async def call(self, method: str, *args: Any) -> Any:
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = fut
        self._writer.write(_frame([call_id, method, list(args)]))
        await self._writer.drain()
        return await fut

    async def _read(self) -> None:
        try:
            while True:
                call_id, result = await _read_frame(self._reader)
                fut = self._waiting.pop(call_id)
                if not fut.done():
                    fut.set_result(result)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"the server went away: {exc!r}"))

    async def aclose(self) -> None:
        self._task.cancel()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass
