"""A connection's TCP side channel on a bare asyncio ``Protocol``: the set-up's handshake, then
the endpoint's control messages.

Every connection starts as a TCP connection on which the handshake
(:mod:`aiordma.protocols.handshake`, sans-I/O) runs: the set-up reads with :meth:`SideChannel.read`
and writes with :meth:`SideChannel.write`. Once the endpoint exists it takes the channel over
(:meth:`SideChannel.attach`): from then what arrives goes to its callbacks in the loop's own
callback (its peer's Close, the connection's end), with no task of its own; what arrived and was
not read yet goes to them first. A TCP transport's channel (:mod:`aiordma._tcp.channel`) takes
the transport itself over instead.

asyncio's streams did this before, at a cost: a stream reader, its protocol and a writer per
connection, and a task per endpoint reading the control messages. The floor of a set-up's three
messages (512 connections, 16 in flight, server in another process, in the test VM) was 1.9 ms
(server) + 2.4 ms (client) of CPU with streams and 1.5 + 2.3 with a bare protocol on asyncio,
0.86 + 1.1 and 0.35 + 0.85 on uvloop (docs/reports/2026-11-26-connections-at-scale.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["SideChannel"]

_HIGH = 1 << 16  # unread bytes at which the transport stops reading (as asyncio's streams)


class SideChannel(asyncio.Protocol):
    """One TCP connection's side channel (see the module documentation).

    ``made``: called with the channel once the connection is made (a listener starts the
    set-up's task there).
    """

    def __init__(self, made: Callable[[SideChannel], None] | None = None) -> None:
        # (connection_made sets it, before the set-up or anything else sees the channel)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._made = made
        self._data = bytearray()  # arrived, not read yet
        self._eof = False
        self._lost: Exception | None = None  # the connection broke (not a clean end)
        self._gone = False  # connection_lost came
        self._waiter: asyncio.Future[None] | None = None  # a read() waiting for data
        self._paused = False
        self._reading_paused = False
        self._drainers: list[asyncio.Future[None]] = []
        self._on_data: Callable[[bytes], None] | None = None  # the endpoint's, once attached
        self._on_end: Callable[[Exception | None], None] | None = None
        self._detached = False

    # -- asyncio's side ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._made is not None:
            made, self._made = self._made, None
            made(self)

    def data_received(self, data: bytes) -> None:
        if self._on_data is not None:
            self._on_data(data)
            return
        self._data += data
        if len(self._data) > _HIGH and not self._reading_paused:
            self._reading_paused = True  # (a peer that floods the set-up waits, as with streams)
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        if self._on_end is not None:
            self._on_end(None)
        else:
            self._wake()
        return False  # (the transport closes itself)

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone = True
        if exc is not None:
            self._lost = exc
        was_eof, self._eof = self._eof, True
        if self._on_end is not None:
            if exc is not None or not was_eof:
                self._on_end(exc)
        else:
            self._wake()
        drainers, self._drainers = self._drainers, []
        for fut in drainers:
            if not fut.done():
                fut.set_exception(ConnectionResetError("the connection was lost"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        drainers, self._drainers = self._drainers, []
        for fut in drainers:
            if not fut.done():
                fut.set_result(None)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the set-up's side ------------------------------------------------------------------

    async def read(self) -> bytes:
        """What arrived since the last call (waiting for something), or ``b""`` at the end of
        the stream.

        Raises:
            ConnectionError: the connection broke.
        """
        while not self._data:
            if self._lost is not None:
                raise ConnectionResetError(f"the connection broke: {self._lost}")
            if self._eof:
                return b""
            if self._waiter is not None:
                raise RuntimeError("two readers of one side channel")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> bytes:
        """What arrived and was not read yet (the transport reads on if it was held back)."""
        data, self._data = bytes(self._data), bytearray()
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark.

        Raises:
            ConnectionError: the connection was lost meanwhile.
        """
        if self._lost is not None:
            raise ConnectionResetError(f"the connection broke: {self._lost}")
        if self._paused:
            fut = asyncio.get_running_loop().create_future()
            self._drainers.append(fut)
            await fut

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def abort(self) -> None:
        self.transport.abort()

    # -- the endpoint's side ----------------------------------------------------------------

    def attach(self, on_data: Callable[[bytes], None],
               on_end: Callable[[Exception | None], None]) -> None:
        """From the next turn of the loop on, what arrives goes to ``on_data``, and the
        stream's end to ``on_end`` (None: the peer ended it; else why it broke); what arrived
        until then goes to them first, in order."""
        self._made = None
        asyncio.get_running_loop().call_soon(self._switch, on_data, on_end)

    def _switch(self, on_data: Callable[[bytes], None],
                on_end: Callable[[Exception | None], None]) -> None:
        if self._detached:
            return
        self._on_data, self._on_end = on_data, on_end
        data = self._take()
        if data:
            on_data(data)
        if self._eof and self._on_end is not None:  # (not detached by on_data)
            on_end(self._lost)

    def hand_over(self, protocol: asyncio.Protocol) -> None:
        """The transport is ``protocol``'s from now on; what arrived and was not read yet goes
        to it at once, before anything the transport brings later (a TCP transport's channel
        takes it so)."""
        self.transport.set_protocol(protocol)
        data = self._take()
        if data:
            protocol.data_received(data)
        if self._gone:  # (else the transport tells the protocol itself)
            protocol.connection_lost(self._lost)

    def detach(self) -> None:
        """Nothing more goes to the endpoint (it is being torn down)."""
        self._detached = True
        self._on_data = self._on_end = None
