"""Connections whose messages travel over TCP: :class:`TcpChannel`.

The TCP transport serves where RDMA cannot: a host without a usable device (a developer's
laptop, a node of a cluster without RDMA NICs). A channel is made by :func:`aiordma.connect`
(``transport="tcp"``, or ``"auto"`` where a side has no device) or handed to a listener's
handler; the set-up is the same handshake as an endpoint's, on the same TCP connection
(:mod:`aiordma._endpoint.connect`), which then carries the messages.

The channel keeps an endpoint's semantics (:mod:`aiordma.transport`'s contract; the checks of
:data:`aiordma.testing.CONTRACT` pass on it): message boundaries and order, ``eager_max`` and
``peer_max_message``, a bounded receive buffer with backpressure that holds a writer of large
messages until its reader reads, ``send_nowait``, end of stream, graceful close and abort, and
the same typed errors. Every rule is the sans-I/O :class:`aiordma.protocols.tcp.StreamMessages`;
the channel drives it: it hands it what the socket received and what its application asks, writes
out what it produces and wakes the callers it names.

It takes the connection's transport over from the set-up's side channel
(:meth:`~aiordma._endpoint.side.SideChannel.hand_over`): received bytes reach the protocol in
the loop's own callback, not through a reader's task, so a message costs no extra task
switch; what the side channel holds unread is handed over with it. The set-up makes sure no
message frame arrives before that: the server sends none before the
client's Ready, which the client sends only once the channel reads the connection; the server's
channel reads from before its TcpAccept, and takes the Ready itself (its handshake's last
message) before the frames behind it.

One-sided operations (``register``, ``read``, ``write``, ``post_write``, ``fetch_add``,
``compare_swap``, ``expose``) raise :class:`~aiordma.UnsupportedOperationError`: they need RDMA
(:mod:`.onesided`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from aiordma._args import byte_view
from aiordma._endpoint.config import Config, EndpointStats
from aiordma._endpoint.lifecycle import ChannelLife
from aiordma._endpoint.side import SideChannel
from aiordma._errors import (
    AiordmaError,
    AuthenticationError,
    BrokenResourceError,
    ClosedResourceError,
    LocalProtocolError,
    RemoteProtocolError,
    from_protocol_error,
)
from aiordma._places import Notify, wake_first
from aiordma._resources import count_resource
from aiordma._tcp.onesided import OneSidedNeedsRdma
from aiordma.protocols import handshake as hs
from aiordma.protocols.errors import LocalProtocolError as _ProtoLocalError
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.messages import Lifecycle
from aiordma.protocols.tcp import StreamMessages

__all__ = ["TcpChannel"]

_ids = itertools.count(1)
_L = Lifecycle
_LIVE = frozenset({_L.OPEN, _L.CLOSING, _L.CLOSE_SENT, _L.PEER_CLOSED, _L.CLOSED})


def _settle(fut: asyncio.Future[None], exc: BaseException | None = None) -> None:
    """Complete ``fut`` (with ``exc``, if given) unless it is done already (its waiter left)."""
    if not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as retrieved (asyncio logs unretrieved ones)."""
    if not fut.cancelled():
        fut.exception()


class _Wire(asyncio.Protocol):
    """The connection's asyncio protocol once the channel took it over: everything goes to
    the channel."""

    __slots__ = ("_channel",)

    def __init__(self, channel: TcpChannel) -> None:
        self._channel = channel

    def data_received(self, data: bytes) -> None:
        self._channel._on_data(data)

    def eof_received(self) -> None:
        return None  # the transport closes; connection_lost says the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self._channel._on_lost(exc)

    def pause_writing(self) -> None:
        self._channel._paused = True

    def resume_writing(self) -> None:
        self._channel._resume_writing()


class TcpChannel(ChannelLife, OneSidedNeedsRdma):
    """One end of a connection whose messages travel over TCP (see the module documentation).

    Use as ``async with channel:`` (closes gracefully on exit). ``aclose()`` and ``abort()``
    are idempotent; every operation pending when the channel closes or breaks fails with
    :class:`~aiordma.ClosedResourceError` (this side closed it) or
    :class:`~aiordma.BrokenResourceError` (the peer or the network did).

    Attributes:
        transport: ``"tcp"`` (an :class:`~aiordma.Endpoint`'s is ``"rdma"``).
        config: the :class:`~aiordma.Config` it was made with (``recv_buffer``,
            ``data_slots``, ``slot_size``, ``max_message``, ``close_timeout`` and the
            keepalive apply; the rest is RDMA's).
        local_address, peer_address: the TCP connection's addresses.
    """

    transport = "tcp"

    def __init__(self, *, config: Config, peer: hs.TcpHello | hs.TcpAccept,
                 side: SideChannel, control: hs.ControlConnection | None = None) -> None:
        # Built by the set-up (aiordma._endpoint.connect, .listener), users do not call this:
        # the client's once the TcpAccept came (before its Ready goes out), the server's
        # before its TcpAccept goes out, with ``control`` to take the client's Ready.
        try:
            self._proto = StreamMessages(
                recv_budget=config.recv_buffer, slots=config.data_slots,
                eager_max=config.eager_max, max_message=config.max_message,
                peer_budget=peer.recv_buffer, peer_slots=peer.slots,
                peer_eager_max=peer.eager_max, peer_max_message=peer.max_message)
        except ProtocolError as exc:
            raise from_protocol_error(exc, "handshake") from exc
        self.config = config
        self.id = next(_ids)
        self._loop = asyncio.get_running_loop()
        self._transport = transport = side.transport
        self.local_address = transport.get_extra_info("sockname")
        self.peer_address = transport.get_extra_info("peername")
        self._waiting: dict[int, asyncio.Future[None]] = {}  # ticket -> a send that waits
        self._recv_waiters: deque[asyncio.Future[None]] = deque()
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._paused = False
        self._flush_waiter: asyncio.Future[None] | None = None
        self._peer_close = asyncio.Event()  # the closing exchange is over (or broke)
        self._error: BaseException | None = None  # the peer/network broke it: why
        self._close_task: asyncio.Task[None] | None = None
        self._control = control
        self._ready: asyncio.Future[None] | None = None  # the server's: the client's Ready
        if control is not None:
            self._ready = self._loop.create_future()
            self._ready.add_done_callback(_retrieve)  # (a listener that gave up awaits none)
        side.hand_over(_Wire(self))
        count_resource("tcp_channels", 1)

    # -- the contract ------------------------------------------------------------------------

    @property
    def eager_max(self) -> int:
        """The largest message ``send`` returns from without the peer reading it, even when
        its receive buffer is full (``Config.slot_size`` less 12, as an endpoint's)."""
        return self._proto.eager_max

    @property
    def peer_max_message(self) -> int:
        """The largest message the peer accepts (``send()`` refuses larger ones)."""
        return self._proto.peer_max_message

    def stats(self) -> EndpointStats:
        """How many messages went each way, and what waits (as :meth:`Endpoint.stats`;
        ``buffered_reads`` is always 0)."""
        p = self._proto
        return EndpointStats(sent=p.sent, queued=p.queued, received=p.received,
                             delivered=p.delivered, inbox=len(p.inbox), inbox_bytes=p.buffered,
                             buffered_reads=0)

    async def send(self, data: Any) -> None:
        """Send one message (any contiguous bytes-like object, empty included).

        Returns once its frame is written (``data`` may be reused at once), except for a
        message larger than :attr:`eager_max` that the peer's receive buffer had no room for:
        that one returns once the peer's application took it. Waits while the peer has no
        room (backpressure) and while the connection's write buffer is full.

        Raises:
            ClosedResourceError: this channel is closing or closed.
            BrokenResourceError: the peer closed or died, or the connection broke.
            LocalProtocolError: ``data`` is not a contiguous buffer, or is larger than the
                peer accepts (:attr:`peer_max_message`); nothing was sent.
        """
        proto = self._proto
        if proto.state is not _L.OPEN:
            raise self._send_error()
        t = type(data)
        view: Any = data if t is bytes or t is bytearray else byte_view(data, "send()")
        try:
            ticket = proto.send(view)
        except _ProtoLocalError as exc:
            raise LocalProtocolError(str(exc)) from None
        if ticket:
            fut: asyncio.Future[None] = self._loop.create_future()
            self._waiting[ticket] = fut
            self._write()
            try:
                await fut
            except asyncio.CancelledError:
                if self._waiting.pop(ticket, None) is not None and proto.withdraw(ticket):
                    self._write()  # the messages behind it may have gone in its place:
                    self._settle_sends()  # their senders are done
                raise
        else:
            self._write()
        if self._paused:
            await self._drain()

    def send_nowait(self, data: Any) -> bool:
        """Send a message of at most :attr:`eager_max` bytes now if nothing is queued before
        it and the peer has room, without suspending; ``False``: nothing was sent (call
        ``send()``). Raises as ``send()``."""
        proto = self._proto
        if proto.state is not _L.OPEN:
            raise self._send_error()
        t = type(data)
        view: Any = data if t is bytes or t is bytearray else byte_view(data, "send_nowait()")
        if len(view) > proto.peer_max_message:
            raise LocalProtocolError(f"a {len(view)} B message exceeds the peer's limit of "
                                     f"{proto.peer_max_message} B")
        if proto.try_send(view):
            self._write()
            return True
        return False

    async def recv(self) -> bytearray | None:
        """The next message as a new ``bytearray``, or ``None`` at a graceful end of stream.

        Raises:
            ClosedResourceError: this channel was closed.
            BrokenResourceError: the peer died or the connection broke (after every message
                that had arrived was delivered).
            RemoteProtocolError: the peer broke the protocol (the channel is then broken).
        """
        proto = self._proto
        while True:
            if proto.state is _L.RELEASED:
                raise ClosedResourceError("the channel is closed")
            if proto.inbox:
                msg = proto.pop()
                self._after_pop()
                return msg
            if proto.peer_total is not None:
                return None
            await self._wait_inbound()

    def recv_nowait(self) -> bytearray | None:
        """The next message if one arrived (taken now), else None (see
        :class:`~aiordma.transport.ReadyChannel`)."""
        proto = self._proto
        if proto.inbox and proto.state is not _L.RELEASED:
            msg = proto.pop()
            self._after_pop()
            return msg
        return None

    def call_when_readable(self, callback: Callable[[], object]) -> bool:
        """Call ``callback()`` once something may have changed for receivers (from the
        connection's ``data_received``, as a waiting receiver would be woken); False (and
        nothing arranged) if something is there already (see
        :class:`~aiordma.transport.ReadyChannel`)."""
        proto = self._proto
        if (proto.inbox or proto.peer_total is not None or self._error is not None
                or proto.state is _L.RELEASED):
            return False
        self._recv_waiters.append(Notify(callback))  # type: ignore[arg-type]
        return True

    async def recv_into(self, buffer: Any) -> int:
        """Receive the next message into ``buffer`` (writable, contiguous); return its size,
        or ``-1`` at a graceful end of stream. A message larger than ``buffer`` is not
        consumed: :class:`LocalProtocolError` is raised and the next call may pass a larger
        buffer.

        Raises:
            LocalProtocolError: ``buffer`` is not a writable, contiguous buffer, or the next
                message does not fit it.
            ClosedResourceError, BrokenResourceError: as :meth:`recv`.
        """
        view = byte_view(buffer, "recv_into()")
        if view.readonly:
            raise LocalProtocolError("recv_into() needs a writable buffer")
        proto = self._proto
        while True:
            if proto.state is _L.RELEASED:
                raise ClosedResourceError("the channel is closed")
            if proto.inbox:
                size = proto.head_size
                if size > view.nbytes:
                    raise LocalProtocolError(f"the next message has {size} B; the buffer "
                                             f"holds {view.nbytes} B (the message stays queued)")
                view[:size] = proto.pop()
                self._after_pop()
                return size
            if proto.peer_total is not None:
                return -1
            await self._wait_inbound()

    def abort(self) -> None:
        """Release everything now (the connection is reset); every pending operation fails
        with :class:`ClosedResourceError`. Idempotent."""
        self._release(ClosedResourceError("the channel was closed"), graceful=False)

    def __repr__(self) -> str:
        return (f"<TcpChannel #{self.id} {self._proto.state.name.lower()} "
                f"{self.local_address}->{self.peer_address}>")

    # -- internals: driving the protocol -------------------------------------------------------

    def _write(self) -> None:
        """Write what the protocol produced, in order (one write: one send() when the socket
        takes it all)."""
        out = self._proto.outgoing
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if not self._transport.is_closing():  # (else the peer is gone: news to nobody)
            self._transport.write(data)

    def _on_data(self, data: bytes) -> None:
        if self._control is not None:
            self._before_ready(data)
            return
        proto = self._proto
        if proto.state not in _LIVE:
            return  # released or broken: nothing more is read
        try:
            proto.receive_data(data)
        except ProtocolError as exc:
            self._fail(from_protocol_error(exc, "tcp"))
            return
        self._after_input()

    def _after_input(self) -> None:
        """The protocol took bytes: write what it answers, complete the sends it names, wake
        receivers if a message (or the end) is there."""
        proto = self._proto
        if proto.outgoing:
            self._write()
        if proto.done or proto.dropped:
            self._settle_sends()
        if proto.peer_total is not None:
            self._peer_close.set()
            self._wake_all_receivers()
        elif self._recv_waiters and proto.inbox:
            wake_first(self._recv_waiters)
        if self._flush_waiter is not None and proto.flushed:
            _settle(self._flush_waiter)

    def _settle_sends(self) -> None:
        """Complete the sends the protocol says are done, and fail those it dropped."""
        proto, waiting = self._proto, self._waiting
        for ticket in proto.done:
            fut = waiting.pop(ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        proto.done.clear()
        for ticket in proto.dropped:
            fut = waiting.pop(ticket, None)
            if fut is not None:
                _settle(fut, BrokenResourceError("the peer closed the connection"))
        proto.dropped.clear()

    def _after_pop(self) -> None:
        """A receiver took a message: send the credit it freed, and pass the turn on if
        another message is there for another waiting receiver."""
        proto = self._proto
        if proto.outgoing:
            self._write()
        if self._recv_waiters and proto.inbox:
            wake_first(self._recv_waiters)

    async def _wait_inbound(self) -> None:
        """Wait until something may have changed for receivers (raises if broken)."""
        if self._error is not None:
            raise self._error_for_pending()
        w: asyncio.Future[None] = self._loop.create_future()
        self._recv_waiters.append(w)
        try:
            await w
        except BaseException:
            if w.done() and not w.cancelled() and self._proto.inbox:
                wake_first(self._recv_waiters)  # pass the wake-up on to another receiver
            raise

    def _wake_all_receivers(self) -> None:
        waiters, self._recv_waiters = self._recv_waiters, deque()
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _drain(self) -> None:
        """Wait until the connection's write buffer is below its high-water mark (raises if
        the channel closes or breaks meanwhile)."""
        fut: asyncio.Future[None] = self._loop.create_future()
        self._drain_waiters.append(fut)
        await fut

    def _resume_writing(self) -> None:
        self._paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            _settle(fut)

    # -- internals: set-up, closing and failure ------------------------------------------------

    def _before_ready(self, data: bytes) -> None:
        """The server's channel, before the client's Ready: the bytes are the handshake's."""
        control = self._control
        assert control is not None and self._ready is not None
        try:
            control.receive_data(data)
            ev = control.next_event()
        except ProtocolError as exc:
            self._set_up_failed(from_protocol_error(exc, "handshake"))
            return
        if ev is hs.NEED_DATA:
            return
        if not isinstance(ev, hs.Ready):
            if isinstance(ev, hs.Reject) and ev.category == hs.RejectCategory.AUTHENTICATION:
                self._set_up_failed(AuthenticationError(f"the client refused: {ev.reason}",
                                                        reason=ev.reason))
            else:
                self._set_up_failed(BrokenResourceError("the client did not confirm the "
                                                        "connection"))
            return
        self._control = None
        trailing, _eof = control.trailing_data
        _settle(self._ready)
        if trailing:
            self._on_data(trailing)

    def _set_up_failed(self, exc: AiordmaError) -> None:
        if self._ready is not None:
            _settle(self._ready, exc)
        self._control = None
        self._fail(exc)

    def _on_lost(self, exc: Exception | None) -> None:
        proto = self._proto
        control = self._control
        if control is not None:  # the client left before its Ready: in a message, or not
            try:
                control.receive_data(b"")
                control.next_event()
            except ProtocolError as perr:
                self._set_up_failed(from_protocol_error(perr, "handshake"))
                return
            self._set_up_failed(BrokenResourceError("the client left during set-up"))
            return
        if proto.state is _L.RELEASED or self._error is not None:
            return
        if proto.peer_total is not None:
            self._peer_close.set()  # after a graceful close: nothing is lost
            return
        why = f": {exc}" if exc else ""
        self._fail(BrokenResourceError(f"the peer disconnected{why}"))

    def _send_error(self) -> BaseException:
        """Why ``send()`` is refused in the current state."""
        state = self._proto.state
        if state is _L.RELEASED:
            return ClosedResourceError("the channel is closed")
        if self._error is not None:
            return self._error_for_pending()
        if state is _L.PEER_CLOSED or (state is _L.CLOSED and self._close_task is None):
            return BrokenResourceError("the peer closed the connection")
        return ClosedResourceError("the channel is closing")

    def _error_for_pending(self) -> BaseException:
        """The exception for an operation that finds the channel closed or broken."""
        if self._proto.state is _L.RELEASED:
            return ClosedResourceError("the channel was closed")
        err = self._error
        new: AiordmaError = (RemoteProtocolError(str(err)) if isinstance(err, RemoteProtocolError)
                             else BrokenResourceError(str(err)))
        new.__cause__ = err
        return new

    def _fail(self, exc: BaseException) -> None:
        """The peer or the network broke the channel: fail every waiter; messages that
        arrived are still delivered."""
        proto = self._proto
        if proto.state is _L.RELEASED or self._error is not None:
            return
        self._error = exc
        proto.fail()
        self._wake_everyone(self._error_for_pending())
        self._peer_close.set()
        self._transport.abort()

    def _wake_everyone(self, exc: BaseException) -> None:
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            _settle(fut, exc)
        self._wake_all_receivers()
        if self._flush_waiter is not None:
            _settle(self._flush_waiter, exc)
        drains, self._drain_waiters = self._drain_waiters, []
        for fut in drains:
            _settle(fut, exc)

    async def _graceful_close(self) -> None:
        proto = self._proto
        graceful = False
        try:
            if proto.state in (_L.BROKEN, _L.RELEASED):
                return
            proto.close()
            async with asyncio.timeout(self.config.close_timeout):
                if not proto.flushed:
                    self._flush_waiter = self._loop.create_future()
                    await self._flush_waiter
                if proto.state is _L.CLOSING:
                    proto.send_close()
                    self._write()
                # (PEER_CLOSED or CLOSED: the answer went out when the peer's CLOSE came)
                await self._peer_close.wait()
            graceful = self._error is None
        except (TimeoutError, OSError, AiordmaError, ProtocolError):
            pass
        finally:
            self._release(ClosedResourceError("the channel was closed"), graceful=graceful)

    def _release(self, exc: BaseException, *, graceful: bool) -> None:
        """Release everything. After a graceful close the connection is closed (what is
        still written goes first: the last CLOSE), else reset."""
        proto = self._proto
        if proto.state is _L.RELEASED:
            return
        proto.release()
        count_resource("tcp_channels", -1)
        self._control = None
        if self._ready is not None:
            _settle(self._ready, exc)
        self._wake_everyone(exc)
        self._peer_close.set()
        transport = self._transport
        if graceful and transport.get_write_buffer_size():
            transport.close()
            # bounded: a peer that stopped reading does not keep the socket for ever
            self._loop.call_later(self.config.close_timeout, transport.abort)
        elif graceful:
            transport.close()
        else:
            transport.abort()
