"""The TCP side channel (aiordma._endpoint.side) over loopback TCP, no device: reads, the end
of the stream, a flood held back, and the hand-overs to an endpoint and to another protocol,
with nothing that arrived before lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from aiordma._endpoint.side import SideChannel

from ..bounds import STEP


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[SideChannel, SideChannel]]:
    """A client's side channel and the server's, connected over loopback."""
    loop = asyncio.get_running_loop()
    made: asyncio.Future[SideChannel] = loop.create_future()
    server = await loop.create_server(lambda: SideChannel(made.set_result), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, client = await loop.create_connection(SideChannel, "127.0.0.1", port)
    there = await asyncio.wait_for(made, STEP)
    try:
        yield client, there
    finally:
        client.abort()
        there.abort()
        server.close()
        await server.wait_closed()


async def read_all(side: SideChannel, n: int) -> bytes:
    got = b""
    while len(got) < n:
        more = await asyncio.wait_for(side.read(), STEP)
        assert more, "the stream ended early"
        got += more
    return got


async def test_what_is_written_is_read_then_the_end() -> None:
    async with pair() as (a, b):
        assert b.get_extra_info("peername") == a.get_extra_info("sockname")
        a.write(b"hello")
        await a.drain()
        assert await read_all(b, 5) == b"hello"
        a.transport.write_eof()
        assert await asyncio.wait_for(b.read(), STEP) == b""
        assert await asyncio.wait_for(b.read(), STEP) == b""  # (and stays ended)


async def test_a_flood_unread_stops_the_transport_reading_until_it_is_read() -> None:
    async with pair() as (a, b):
        a.write(bytes(300_000))
        for _ in range(200):  # until the server side held back
            if not b.transport.is_reading():
                break
            await asyncio.sleep(0.01)
        assert not b.transport.is_reading()
        assert await read_all(b, 300_000) == bytes(300_000)
        assert b.transport.is_reading()


async def test_an_endpoint_attached_gets_what_came_before_then_the_end() -> None:
    async with pair() as (a, b):
        a.write(b"early")
        a.transport.write_eof()
        for _ in range(200):
            if b._eof:  # (both arrived, unread)
                break
            await asyncio.sleep(0.01)
        got: list[bytes] = []
        ends: list[Exception | None] = []
        b.attach(got.append, ends.append)
        assert got == [] and ends == []  # (in the next turn of the loop, not inside attach)
        await asyncio.sleep(0.05)
        assert got == [b"early"] and ends == [None]


async def test_a_protocol_handed_over_gets_what_came_unread() -> None:
    class Sink(asyncio.Protocol):
        def __init__(self) -> None:
            self.data = b""

        def data_received(self, data: bytes) -> None:
            self.data += data

    async with pair() as (a, b):
        a.write(b"first ")
        for _ in range(200):
            if b._data:
                break
            await asyncio.sleep(0.01)
        sink = Sink()
        b.hand_over(sink)
        a.write(b"second")
        for _ in range(200):
            if sink.data == b"first second":
                break
            await asyncio.sleep(0.01)
        assert sink.data == b"first second"


@pytest.mark.parametrize("broken", [False, True])
async def test_a_reader_learns_that_the_connection_ended_or_broke(broken: bool) -> None:
    async with pair() as (a, b):
        waiting = asyncio.ensure_future(b.read())
        await asyncio.sleep(0.01)
        if broken:
            b.connection_lost(ConnectionResetError("reset"))  # (as the transport reports it)
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(waiting, STEP)
        else:
            a.transport.write_eof()
            assert await asyncio.wait_for(waiting, STEP) == b""
