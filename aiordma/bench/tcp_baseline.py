"""The RPC baseline: an echo RPC over asyncio TCP streams with msgpack, length-prefixed frames.

What an asyncio developer would write without RDMA: one TCP connection (``TCP_NODELAY``),
frames of a 4-byte little-endian length then a msgpack body ``[call_id, method, args]``
(request) or ``[call_id, result]`` (answer); many calls in flight on one connection,
matched by id; a server task per call, answers written under the stream's own ordering.
Nothing here is tuned beyond that; it is the yardstick for ``aiordma.rpc``.

The same streams without msgpack are the yardstick for a message round trip: the server
answers each length-prefixed frame with itself (:func:`serve_tcp_frames`, :class:`TcpFrames`).
``python -m aiordma.bench.tcp_baseline --loop uvloop`` serves both on 127.0.0.1 in a process
of their own, prints ``READY rpc=<port> frames=<port>`` and serves until terminated (the
host-side CPU rows' server in another process).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import socket
import struct
from typing import Any

import msgpack

__all__ = ["TcpEchoClient", "TcpFrames", "serve_tcp_echo", "serve_tcp_frames"]

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


async def serve_tcp_frames(host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """A server that answers every length-prefixed frame with itself."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        try:
            while True:
                head = await reader.readexactly(4)
                writer.write(head + await reader.readexactly(_LEN.unpack(head)[0]))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


class TcpFrames:
    """One connection to :func:`serve_tcp_frames`; ``await frames.round_trip(data)``, one at
    a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, host: str, port: int) -> TcpFrames:
        reader, writer = await asyncio.open_connection(host, port)
        _nodelay(writer)
        return cls(reader, writer)

    async def round_trip(self, data: bytes) -> bytes:
        self._writer.write(_LEN.pack(len(data)) + data)
        await self._writer.drain()
        (n,) = _LEN.unpack(await self._reader.readexactly(4))
        return await self._reader.readexactly(n)

    async def aclose(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass


async def _serve_both() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    rpc, frames = await serve_tcp_echo(), await serve_tcp_frames()
    ports = [s.sockets[0].getsockname()[1] for s in (rpc, frames)]
    print(f"READY rpc={ports[0]} frames={ports[1]}", flush=True)
    await stop.wait()
    for server in (rpc, frames):
        server.close()


def main() -> int:
    p = argparse.ArgumentParser(description="The asyncio TCP baselines' servers, on "
                                            "127.0.0.1, until terminated.")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    a = p.parse_args()
    if a.loop == "uvloop":
        import uvloop

        uvloop.run(_serve_both())
    else:
        asyncio.run(_serve_both())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
