"""Testing without a device: an in-memory :class:`~aiordma.transport.MessageChannel` pair, and
the channel contract as executable checks.

``channel_pair()`` returns two connected :class:`MemoryChannel` objects with an endpoint's
semantics (see :mod:`aiordma.transport`): ordered messages, a receive buffer with backpressure,
eager and held ("rendezvous") sends, graceful close with end of stream, abort seen by the peer
as :class:`~aiordma.BrokenResourceError`, the same typed errors. Use it to test code built on
the RPC layer or on channels without RDMA::

    a, b = aiordma.testing.channel_pair()
    server = aiordma.rpc.RpcServer(MyService(), max_in_flight=8, grace=1.0)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = aiordma.rpc.RpcClient(a, max_in_flight=8)

``CONTRACT`` maps a name to an ``async`` check taking a pair factory (an async context manager
``make_pair(**options)`` yielding two connected channels; options: ``max_message``,
``recv_buffer``). The project runs every check against the in-memory pair and the TCP
transport's channels over loopback (:func:`tcp_pairs`; ``tests/unit/test_channel_contract.py``)
and against real endpoints over rxe (``tests/rxe/test_channel_contract.py``); a channel of your
own can be checked the same way.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Self

from aiordma._args import byte_view, check_int, check_seconds
from aiordma._contract import CONTRACT, STEP, PairFactory
from aiordma._errors import BrokenResourceError, ClosedResourceError, LocalProtocolError
from aiordma._places import Notify, wake_first

__all__ = ["CONTRACT", "MemoryChannel", "PairFactory", "channel_pair", "memory_pairs",
           "tcp_pairs"]

COST = 64
"""What a held message costs the receive buffer beyond its bytes (as an endpoint counts it)."""
_ids = itertools.count(1)


class _Message:
    __slots__ = ("data", "in_slot", "taken")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.in_slot = False  # past the receive budget: held like a message left in its slot
        self.taken: asyncio.Future[None] | None = None  # a held send waits for this


class MemoryChannel:
    """One end of an in-memory channel (made by :func:`channel_pair`); its ``transport`` is
    ``"memory"``."""

    transport = "memory"

    def __init__(self, *, eager_max: int, max_message: int, recv_buffer: int, slots: int,
                 close_timeout: float) -> None:
        self.id = next(_ids)
        self.peer_address = ("memory", self.id)
        self._eager_max = eager_max
        self._max_message = max_message
        self._budget = recv_buffer
        self._slots = slots
        self._close_timeout = close_timeout
        self._peer: MemoryChannel | None = None
        self._inbox: deque[_Message] = deque()
        self._buffered = 0  # bytes (+ COST each) of inbox messages inside the budget
        self._held = 0  # inbox messages past the budget ("in their slots")
        self._queue: deque[tuple[_Message, asyncio.Future[None]]] = deque()  # not yet accepted
        self._recv_waiters: deque[asyncio.Future[None]] = deque()
        self._released = False
        self._error: BaseException | None = None  # the peer aborted or died
        self._peer_done = False  # the peer closed gracefully: end of stream after the inbox
        self._closing = False

    # -- the contract ----------------------------------------------------------------------

    @property
    def eager_max(self) -> int:
        return self._eager_max

    @property
    def peer_max_message(self) -> int:
        return self._other()._max_message

    def _other(self) -> MemoryChannel:
        """The other end (raises for a channel made alone: it has none)."""
        peer = self._peer
        if peer is None:
            raise LocalProtocolError("this MemoryChannel is not connected: channel_pair() "
                                     "makes connected ones")
        return peer

    @property
    def closed(self) -> bool:
        return self._released

    @property
    def broken(self) -> bool:
        return self._error is not None

    async def send(self, data: Any) -> None:
        view = self._check_send(data, "send()")
        msg = _Message(bytes(view))
        peer = self._other()
        if not self._queue and peer._accept(msg):
            if msg.taken is not None:
                await self._wait_taken(msg)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((msg, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if any(m is msg for m, _ in self._queue):  # not accepted yet: take it back
                self._queue = deque((m, f) for m, f in self._queue if m is not msg)
                peer._accepted_more()  # the next one may fit now
            raise
        if msg.taken is not None:
            await self._wait_taken(msg)

    def send_nowait(self, data: Any) -> bool:
        view = self._check_send(data, "send_nowait()")
        if self._queue or view.nbytes > self._eager_max:
            return False
        return self._other()._accept(_Message(bytes(view)), nowait=True)

    async def recv(self) -> bytearray | None:
        while True:
            self._check_receive()
            if self._inbox:
                return bytearray(self._pop().data)
            if self._peer_done:
                return None
            if self._error is not None:
                raise self._broken_error()
            await self._wait_inbound()

    def recv_nowait(self) -> bytearray | None:  # (see aiordma.transport.ReadyChannel)
        if self._released or not self._inbox or self._peer is None:
            return None
        return bytearray(self._pop().data)

    def call_when_readable(self, callback: Callable[[], object]) -> bool:
        """(See :class:`~aiordma.transport.ReadyChannel`.) ``callback`` is called soon after a
        change (``loop.call_soon``, as a transport's wake-up would)."""
        if (self._released or self._inbox or self._peer_done or self._error is not None
                or self._peer is None):
            return False
        soon = asyncio.get_running_loop().call_soon
        self._recv_waiters.append(Notify(lambda: soon(callback)))  # type: ignore[arg-type]
        return True

    async def recv_into(self, buffer: Any) -> int:
        view = byte_view(buffer, "recv_into()")
        if view.readonly:
            raise LocalProtocolError("recv_into() needs a writable buffer")
        while True:
            self._check_receive()
            if self._inbox:
                size = len(self._inbox[0].data)
                if size > view.nbytes:
                    raise LocalProtocolError(f"the next message has {size} B; the buffer holds "
                                             f"{view.nbytes} B (the message stays queued)")
                view[:size] = self._pop().data
                return size
            if self._peer_done:
                return -1
            if self._error is not None:
                raise self._broken_error()
            await self._wait_inbound()

    async def aclose(self) -> None:
        if self._released:
            return
        self._closing = True
        try:
            async with asyncio.timeout(self._close_timeout):
                while self._queue:  # flush: what was sent goes first
                    await asyncio.shield(self._queue[-1][1])
        except (TimeoutError, BrokenResourceError, ClosedResourceError):
            pass
        if self._released:
            return
        peer = self._peer
        self._release(ClosedResourceError("the channel was closed"))
        if peer is not None and not peer._released:
            peer._peer_closed(graceful=True)

    def abort(self) -> None:
        if self._released:
            return
        peer = self._peer
        self._release(ClosedResourceError("the channel was closed"))
        if peer is not None and not peer._released:
            peer._peer_closed(graceful=False)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._released else "broken" if self._error else "open"
        return f"<MemoryChannel #{self.id} {state}, {len(self._inbox)} in the inbox>"

    # -- the receiving side ------------------------------------------------------------------

    def _accept(self, msg: _Message, *, nowait: bool = False) -> bool:
        """The peer sends ``msg``: take it into the inbox if there is room."""
        if self._released or self._error is not None:
            return True  # dropped silently (the sender learns of it by its own state)
        cost = len(msg.data) + COST
        if self._buffered + cost <= self._budget:
            self._buffered += cost
        elif self._held < self._slots:
            if nowait and len(msg.data) > self._eager_max:
                return False
            msg.in_slot = True
            self._held += 1
            if len(msg.data) > self._eager_max:  # a held rendezvous message: sender waits
                msg.taken = asyncio.get_running_loop().create_future()
        else:
            return False
        self._inbox.append(msg)
        if self._recv_waiters:
            self._wake_one()
        return True

    def _pop(self) -> _Message:
        msg = self._inbox.popleft()
        if msg.in_slot:
            self._held -= 1
        else:
            self._buffered -= len(msg.data) + COST
        if msg.taken is not None and not msg.taken.done():
            msg.taken.set_result(None)
        self._accepted_more()
        if self._inbox and self._recv_waiters:
            self._wake_one()
        return msg

    def _accepted_more(self) -> None:
        """Room was made: move the peer's queued sends in, in order."""
        peer = self._peer
        if peer is None:
            return
        while peer._queue:
            msg, fut = peer._queue[0]
            if fut.done():
                peer._queue.popleft()
                continue
            if not self._accept(msg):
                return
            peer._queue.popleft()
            fut.set_result(None)

    def _peer_closed(self, *, graceful: bool) -> None:
        if graceful:
            self._peer_done = True
        else:
            self._error = BrokenResourceError("the peer disconnected")
        self._fail_sends(BrokenResourceError("the peer closed the connection"))
        while self._recv_waiters:
            w = self._recv_waiters.popleft()
            if not w.done():
                w.set_result(None)

    # -- internals ---------------------------------------------------------------------------

    def _check_send(self, data: Any, what: str) -> memoryview:
        if self._released:
            raise ClosedResourceError("the channel is closed")
        if self._error is not None or self._peer_done:
            raise BrokenResourceError("the peer closed the connection")
        if self._closing:
            raise ClosedResourceError("the channel is closing")
        view = byte_view(data, what)
        if view.nbytes > self.peer_max_message:
            raise LocalProtocolError(f"a {view.nbytes} B message exceeds the peer's limit of "
                                     f"{self.peer_max_message} B")
        return view

    def _check_receive(self) -> None:
        if self._released:
            raise ClosedResourceError("the channel is closed")
        self._other()  # a channel made alone would wait for ever

    def _broken_error(self) -> BrokenResourceError:
        err = BrokenResourceError(str(self._error))
        err.__cause__ = self._error
        return err

    async def _wait_taken(self, msg: _Message) -> None:
        assert msg.taken is not None
        # shielded: a cancelled sender leaves, the message stays announced (as an endpoint's)
        await asyncio.shield(msg.taken)

    async def _wait_inbound(self) -> None:
        w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._recv_waiters.append(w)
        try:
            await w
        except BaseException:
            if w.done() and not w.cancelled() and self._inbox:
                self._wake_one()  # pass the wake-up on
            raise

    def _wake_one(self) -> None:
        wake_first(self._recv_waiters)

    def _fail_sends(self, exc: BaseException) -> None:
        queue, self._queue = self._queue, deque()
        for msg, fut in queue:
            if not fut.done():
                fut.set_exception(type(exc)(str(exc)))
        for msg in self._peer._inbox if self._peer is not None else ():
            if msg.taken is not None and not msg.taken.done():
                msg.taken.set_exception(type(exc)(str(exc)))

    def _release(self, exc: BaseException) -> None:
        self._released = True
        self._fail_sends(exc)
        # held sends of the peer into our inbox: nobody will take them
        for msg in self._inbox:
            if msg.taken is not None and not msg.taken.done():
                msg.taken.set_exception(BrokenResourceError("the peer closed the connection"))
        while self._recv_waiters:
            w = self._recv_waiters.popleft()
            if not w.done():
                w.set_result(None)


def channel_pair(*, eager_max: int = 8180, max_message: int = 1 << 30,
                 recv_buffer: int = 4 << 20, slots: int = 64,
                 close_timeout: float = 5.0) -> tuple[MemoryChannel, MemoryChannel]:
    """Two connected in-memory channels, each with an endpoint's defaults (``Config``'s
    ``slot_size`` less the header, ``max_message``, ``recv_buffer``, ``data_slots``).

    Raises:
        LocalProtocolError: a size or count that is not a non-negative integer (``slots``: at
            least 1), or a ``close_timeout`` that is not a positive, finite number.
    """
    for name, value, low in (("eager_max", eager_max, 0), ("max_message", max_message, 0),
                             ("recv_buffer", recv_buffer, 0), ("slots", slots, 1)):
        check_int(value, name=name, low=low)
    check_seconds(close_timeout, name="close_timeout")
    kw: dict[str, Any] = {"eager_max": eager_max, "max_message": max_message,
                          "recv_buffer": recv_buffer, "slots": slots,
                          "close_timeout": close_timeout}
    a, b = MemoryChannel(**kw), MemoryChannel(**kw)
    a._peer, b._peer = b, a
    return a, b


@asynccontextmanager
async def memory_pairs(**options: Any) -> AsyncIterator[tuple[MemoryChannel, MemoryChannel]]:
    """The in-memory :data:`PairFactory`: a pair, aborted on exit."""
    a, b = channel_pair(**options)
    try:
        yield a, b
    finally:
        a.abort()
        b.abort()


@asynccontextmanager
async def tcp_pairs(**options: Any) -> AsyncIterator[tuple[Any, Any]]:
    """The TCP transport's :data:`PairFactory`: a client and a server channel over loopback
    sockets (``transport="tcp"``), no device; ``options`` are :class:`~aiordma.Config`
    fields. Aborted on exit."""
    from aiordma._endpoint.config import Config
    from aiordma._endpoint.connect import connect
    from aiordma._endpoint.listener import listen

    config = Config(**options)
    accepted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done = asyncio.Event()

    async def handler(channel: Any) -> None:
        if not accepted.done():
            accepted.set_result(channel)
        await done.wait()

    async with await listen(handler, "127.0.0.1", 0, config=config, transport="tcp") as lst:
        client = await connect("127.0.0.1", lst.port, timeout=STEP, config=config,
                               transport="tcp")
        try:
            server = await asyncio.wait_for(accepted, STEP)
            try:
                yield client, server
            finally:
                server.abort()
        finally:
            client.abort()
            done.set()
