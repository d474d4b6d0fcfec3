"""Connected endpoints: messages both ways, one-sided access to the peer's memory.

An :class:`Endpoint` is one RC queue pair plus the TCP connection that set it up, which stays
open as the liveness channel. It is created by :func:`aiordma.connect` or handed to a
listener's handler; see :mod:`aiordma._endpoint.connect`.

The endpoint is a driver: every rule of its messages (order, slots, credits, rendezvous
tokens, the receive budget, close counts, the lifecycle) lives in the sans-I/O
:class:`aiordma.protocols.messages.MessageProtocol`. The endpoint feeds it work completions and
application calls, carries out the actions it emits (post a SEND, repost a receive slot,
READ a rendezvous message into a buffer), and wakes the callers that wait. One-sided
operations are :mod:`aiordma._endpoint.onesided`.

Messages
    ``send()`` keeps message boundaries and order. A message of at most
    :attr:`Endpoint.eager_max` bytes is copied into a pre-registered send slot and SENT into
    one of the peer's pre-posted receive slots (eager); a larger one is exposed read-only and
    announced, and the receiver RDMA-READs it (rendezvous). Credits make sure no SEND ever
    finds the peer without a posted receive.

Receive buffer
    Like a socket's receive buffer, a message that arrives while nobody reads is taken out of
    its slot at once, up to ``Config.recv_buffer`` bytes: copied (eager) or READ into a buffer
    the endpoint owns (rendezvous, after which the sender's ``send()`` returns). Only past the
    budget do messages stay in their slots, and only once every slot is held does the peer's
    ``send()`` wait. A ``recv_into()`` already waiting when a rendezvous message arrives gets
    it READ straight into its own buffer.

Wake-ups
    Sends are unsignaled except every ``Config.signal_every``-th one (and whenever send slots
    run low), so a message costs the sender no completion event. ``send()`` of an eager
    message returns once it is posted (the caller's buffer is free at once); a rendezvous
    ``send()`` returns when the peer has read the message.

End of stream
    ``recv()`` returns ``None`` once the peer closed gracefully and every message it sent
    has been received. If the peer dies or the connection breaks, messages already taken out
    of their slots are still delivered, then ``recv()`` raises :class:`BrokenResourceError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiordma._args import byte_view, check_word
from aiordma._endpoint.config import Config, EndpointStats
from aiordma._endpoint.driver import EndpointDriver
from aiordma._endpoint.immediate import imm_ahead, post_write_imm, recv_event, single
from aiordma._endpoint.immediate import retrieve as _retrieve
from aiordma._endpoint.lifecycle import ChannelLife
from aiordma._endpoint.qp import _check_remote, opcode
from aiordma._errors import (
    AiordmaError,
    ClosedResourceError,
    CompletionError,
    DeviceError,
    LocalProtocolError,
)
from aiordma._memory.region import LocalSlice, MemoryRegion, RemoteBuffer
from aiordma._memory.window import Exposure
from aiordma._places import Notify
from aiordma.protocols import messages as msgs
from aiordma.protocols.errors import LocalProtocolError as _ProtoLocalError
from aiordma.protocols.errors import ProtocolError

__all__ = ["Config", "Endpoint", "EndpointStats"]

_L = msgs.Lifecycle
_READY, _UNREAD = msgs.READY, msgs.UNREAD


class Endpoint(ChannelLife, EndpointDriver):
    """One end of a connection: messages both ways, one-sided access to the peer's memory.

    Use as ``async with endpoint:`` (closes gracefully on exit). ``aclose()`` and ``abort()``
    are idempotent; every operation pending when the endpoint closes or breaks fails with
    :class:`ClosedResourceError` (this side closed it) or :class:`BrokenResourceError` (the
    peer or the network did).

    Attributes:
        transport: ``"rdma"`` (a connection over TCP is a
            :class:`~aiordma._tcp.channel.TcpChannel`, whose ``transport`` is ``"tcp"``).
    """

    transport = "rdma"

    @property
    def eager_max(self) -> int:
        """The largest message sent eagerly (copied into a slot); larger ones go by
        rendezvous."""
        return self._proto.eager_max

    def stats(self) -> EndpointStats:
        """How many messages went each way, and what waits (see :class:`EndpointStats`)."""
        p = self._proto
        return EndpointStats(sent=p.sent, queued=p.queued, received=p.received,
                             delivered=p.delivered, inbox=p.received - p.delivered,
                             inbox_bytes=p.buffered, buffered_reads=p.reads_started)

    @property
    def peer_max_message(self) -> int:
        """The largest message the peer accepts (``send()`` refuses larger ones)."""
        return self._proto.peer_max_message

    # -- public: messages ----------------------------------------------------------------------

    async def send(self, data: Any) -> None:
        """Send one message (any contiguous bytes-like object, empty included, or a
        :class:`LocalSlice` of a region registered on this endpoint's device).

        Returns once an eager message is copied into a send slot (``data`` may be reused at
        once; the first send of a loop tick is posted at once, later ones of the same tick at
        its end, chained: one doorbell), or once the peer has read a rendezvous message (into
        its receive buffer, or a receiver's).

        A large message is registered for the peer to read, and deregistered once it has read
        it. A :class:`LocalSlice` is read from its region's registration instead (no
        registration per message, which costs as much as moving some megabytes on rxe): the
        peer is then given a key to the region's read access (``region.expose(read=True)``),
        valid until the region closes. Use a region that holds nothing else the peer should
        not read.

        Raises:
            ClosedResourceError: this endpoint is closing or closed, or the region is.
            BrokenResourceError: the peer closed or died, or the connection broke.
            LocalProtocolError: ``data`` is not a contiguous buffer, or is larger than the
                peer accepts (:attr:`peer_max_message`); nothing was sent.
        """
        proto = self._proto
        if proto.state is not _L.OPEN:
            raise self._send_error()
        t = type(data)
        if t is bytes or t is bytearray:  # the common case: no memoryview needed
            view: Any = data
            n = len(data)
        elif isinstance(data, LocalSlice):
            await self._send_registered(data)
            return
        else:
            view = byte_view(data, "send()")
            n = view.nbytes
        if n <= proto.eager_max:
            try:
                ticket = proto.send_data(view)
            except _ProtoLocalError as exc:
                raise LocalProtocolError(str(exc)) from None
            if not ticket:  # copied into a slot, its credit taken: posted this tick
                self._post_soon()
                return
            fut: asyncio.Future[None] = self._loop.create_future()
            self._posted[ticket] = fut  # before _run(): that may already post it
            self._run()
            try:
                await fut
            except asyncio.CancelledError:
                if self._posted.pop(ticket, None) is not None:  # not posted yet: take it back
                    proto.withdraw(ticket)
                raise
            return
        await self._send_rendezvous(data, n)

    def send_nowait(self, data: Any) -> bool:
        """Post an eager message now if nothing is queued before it and a slot and a credit
        are free, without suspending; ``False``: nothing was sent (call ``send()``).

        For callers that must not suspend halfway (the RPC layer posts requests this way
        instead of in a task of their own). Raises as ``send()``.
        """
        proto = self._proto
        if proto.state is not _L.OPEN:
            raise self._send_error()
        view = byte_view(data, "send_nowait()")
        if view.nbytes > proto.peer_max_message:
            raise LocalProtocolError(f"a {view.nbytes} B message exceeds the peer's limit of "
                                     f"{proto.peer_max_message} B")
        if proto.try_send_data(view):
            self._run()
            return True
        return False

    async def _send_registered(self, src: LocalSlice) -> None:
        if src.region.device is not self.device:
            raise LocalProtocolError("the buffer is registered on another device")
        if src.region.closed:
            raise ClosedResourceError("the region is deregistered")
        n = len(src)
        if n <= self._proto.eager_max:
            await self.send(src.memoryview())
            return
        desc = src.region.expose(read=True)
        await self._send_rendezvous(None, n, address=src.address, rkey=desc.rkey)

    async def _send_rendezvous(self, data: Any, n: int, *, address: int = 0,
                               rkey: int = 0) -> None:
        """Announce ``n`` bytes for the peer to READ: ``data``, registered here for it and
        deregistered after, or (``data`` None) ``address``/``rkey`` of the caller's region."""
        proto = self._proto
        if n > proto.peer_max_message:
            raise LocalProtocolError(f"a {n} B message exceeds the peer's limit of "
                                     f"{proto.peer_max_message} B")
        mr = None
        if data is not None:
            mr = MemoryRegion(self.device, data, remote_read=True)
            desc = mr.expose(read=True)
            address, rkey = desc.address, desc.rkey
        try:
            token = proto.send_rts(n, address, rkey)
        except _ProtoLocalError as exc:
            if mr is not None:
                mr.close()
            raise LocalProtocolError(str(exc)) from None
        done: asyncio.Future[None] = self._loop.create_future()
        self._rdv_out[token] = (mr, done)
        self._run()
        try:
            await done
        except asyncio.CancelledError:
            # Not announced yet: take it back. Announced: the peer may be reading it, so the
            # memory stays registered until its DONE (or the teardown) releases it.
            if proto.withdraw(token, rendezvous=True):
                self._rdv_out.pop(token, None)
                if mr is not None:
                    mr.close()
            raise

    async def recv(self) -> bytearray | None:
        """The next message as a new ``bytearray``, or ``None`` at a graceful end of stream.

        Raises:
            ClosedResourceError: this endpoint was closed.
            BrokenResourceError: the peer died or the connection broke (after every message
                that had been received was delivered).
            RemoteProtocolError: the peer broke the protocol (the endpoint is then broken).
        """
        proto = self._proto
        while True:
            if proto.state is _L.RELEASED:
                raise ClosedResourceError("the endpoint is closed")
            inbox = proto.inbox
            if inbox:
                # a buffered bytearray is the common case: no need for the general look
                head = _READY if type(inbox[0]) is bytearray else proto.head
                if head is _READY:
                    if type(inbox[0]) is msgs.Immediate:
                        raise imm_ahead("recv()")
                    out = proto.pop()
                    self._after_pop()
                    return out  # type: ignore[return-value]
                if head is _UNREAD:
                    item = proto.pop()
                    assert isinstance(item, msgs.Incoming)
                    self._after_pop()
                    buf = bytearray(item.size)
                    mr = MemoryRegion(self.device, buf)
                    await self._read_shielded(mr.whole(), item, mr)
                    return buf
            if proto.at_eof:
                return None
            await self._wait_inbound()

    async def recv_event(self) -> bytearray | msgs.Immediate | None:
        """:meth:`recv` with ``Config(immediates=True)``: the next message, or
        :class:`~aiordma.Immediate` (``value``, ``nbytes``) of the peer's ``post_write(imm=)``
        (its data in place), in the peer's order; None at the end. Raises as :meth:`recv`."""
        return await recv_event(self)

    def recv_nowait(self) -> bytearray | None:
        """The next message if it is buffered (taken now), else None: nothing arrived, or
        what is next needs :meth:`recv` (see :class:`~aiordma.transport.ReadyChannel`)."""
        proto = self._proto
        inbox = proto.inbox
        if inbox and type(inbox[0]) is bytearray and proto.state is not _L.RELEASED:
            out = proto.pop()
            self._after_pop()
            return out  # type: ignore[return-value]
        return None

    def call_when_readable(self, callback: Callable[[], object]) -> bool:
        """Call ``callback()`` once something may have changed for receivers (woken by the
        completion's route as a waiting receiver would be, it runs when the completion queue's
        drain is over, so it finds every message of the poll batch); False (and nothing
        arranged) if something is there already (see :class:`~aiordma.transport.ReadyChannel`)."""
        proto = self._proto
        if (proto.inbox or proto.at_eof or self._error is not None
                or proto.state is _L.RELEASED):
            return False
        self._recv_waiters.append(Notify(callback, self._reactor.batch))  # type: ignore[arg-type]
        return True

    async def recv_into(self, buffer: Any) -> int:
        """Receive the next message into ``buffer`` (writable, contiguous); return its size.

        A rendezvous message that a waiting ``recv_into()`` takes unread is RDMA-READ straight
        into ``buffer`` (no copy; the buffer's registration is cached for later calls, which
        keeps the buffer alive and, for a ``bytearray``, unresizable until the endpoint
        closes); a message the endpoint already buffered is copied. A message larger than
        ``buffer`` is not consumed: :class:`LocalProtocolError` is raised and the next call
        may pass a larger buffer. At a graceful end of stream, returns ``-1``.

        Raises:
            LocalProtocolError: ``buffer`` is not a writable, contiguous buffer (or a slice of
                a region on this endpoint's device), or the next message does not fit it.
            ClosedResourceError: this endpoint (or the slice's region) is closed.
            BrokenResourceError: the peer died or the connection broke.
        """
        proto = self._proto
        inbox = proto.inbox
        if (inbox and type(buffer) is bytearray and type(inbox[0]) is bytearray
                and proto.state is not _L.RELEASED):
            # The common case, a buffered message into a bytearray: no need for the general look
            size = len(inbox[0])
            if size <= len(buffer):
                item = proto.pop()
                self._after_pop()
                buffer[:size] = item
                return size
        if isinstance(buffer, LocalSlice):
            if buffer.region.closed:
                raise ClosedResourceError("recv_into(): the region is deregistered")
            if buffer.region.device is not self.device:
                raise LocalProtocolError("recv_into(): the region is registered on another "
                                         "device")
            target: Any = buffer.memoryview()
        else:
            target = buffer
        view = byte_view(target, "recv_into()")
        if view.readonly:
            raise LocalProtocolError("recv_into() needs a writable buffer")
        while True:
            if proto.state is _L.RELEASED:
                raise ClosedResourceError("the endpoint is closed")
            head = proto.head
            if head is _READY or head is _UNREAD:
                if type(proto.inbox[0]) is msgs.Immediate:
                    raise imm_ahead("recv_into()")
                size = proto.head_size
                if size > view.nbytes:
                    proto.receiver_left()  # it stays queued (and may now be buffered)
                    self._run()
                    raise LocalProtocolError(f"the next message has {size} B; the buffer "
                                             f"holds {view.nbytes} B (the message stays queued)")
                item = proto.pop()
                self._after_pop()
                if not isinstance(item, msgs.Incoming):
                    view[:size] = item
                    return size
                if isinstance(buffer, LocalSlice):
                    await self._read_shielded(LocalSlice(buffer.region, buffer.offset, size), item)
                else:
                    mr = self._reg_cache.get(buffer)  # registered once, reused by later calls
                    await self._read_shielded(mr[0:size], item)
                return size
            if proto.at_eof:
                return -1
            await self._wait_inbound()

    def _after_pop(self) -> None:
        """A receiver took the head: carry out what that caused, and pass the turn on if
        another message is there for another waiting receiver."""
        proto = self._proto
        if proto.actions:
            self._run()
        if self._recv_waiters and proto.inbox:
            self._wake_one()

    async def _wait_inbound(self) -> None:
        """Wait until something may have changed for receivers (raises if closed/broken)."""
        if self._error is not None:
            raise self._receive_error()
        w: asyncio.Future[None] = self._loop.create_future()
        self._recv_waiters.append(w)
        proto = self._proto
        proto.receivers_waiting += 1
        try:
            await w
        except BaseException:
            proto.receivers_waiting -= 1
            if proto.state is not _L.RELEASED:
                proto.receiver_left()  # a message left to this receiver may be buffered now
                self._run()
            if w.done() and not w.cancelled():
                self._wake_one()  # pass the wake-up on to another receiver
            raise
        proto.receivers_waiting -= 1

    async def _read_shielded(self, dst: LocalSlice, item: msgs.Incoming,
                             owned: MemoryRegion | None = None) -> None:
        """A receiver's rendezvous READ, carried on if the caller is cancelled: the device may
        still write into ``dst``, so ``owned`` (the region made for it) is closed only when
        the READ is over, and the peer still gets its DONE. The cancelled caller loses the
        message."""
        read = self._loop.create_task(self._rendezvous_read(dst, item))

        def over(t: asyncio.Task[None]) -> None:
            if owned is not None:
                owned.close()
            if not t.cancelled():
                t.exception()  # retrieved: the caller (if still there) gets it

        read.add_done_callback(over)
        await asyncio.shield(read)

    async def _rendezvous_read(self, dst: LocalSlice, item: msgs.Incoming) -> None:
        remote = RemoteBuffer(address=item.address, rkey=item.rkey, length=item.size,
                              readable=True)
        if item.size:
            await self._onesided.run("rendezvous read", opcode("RDMA_READ"), dst, remote)
        if self._proto.state is not _L.RELEASED:
            self._proto.read_done(item)
            self._run()

    # -- public: one-sided ---------------------------------------------------------------------

    def register(self, buffer: Any, *, remote_read: bool = False, remote_write: bool = False,
                 atomic: bool = False) -> MemoryRegion:
        """Register ``buffer`` on this endpoint's device; the endpoint closes it on close.

        ``expose()`` on the result grants the peer access (registering again if needed).
        """
        self._check_open()
        mr = MemoryRegion(self.device, buffer, remote_read=remote_read,
                          remote_write=remote_write, atomic=atomic)
        self._regions = [r for r in self._regions if not r.closed]  # closed by their owner
        self._regions.append(mr)
        return mr

    async def write(self, src: LocalSlice, dst: RemoteBuffer) -> None:
        """RDMA WRITE ``src`` into the peer's ``dst``; returns when the peer acknowledged it
        (the data is in the peer's memory). Lengths must match."""
        _check_remote(src, dst, "write")
        await self._onesided.run("rdma write", opcode("RDMA_WRITE"), src, dst)

    async def post_write(self, src: LocalSlice | tuple[LocalSlice, LocalSlice],
                         dst: RemoteBuffer, *, notify: Any = None,
                         imm: int | None = None) -> asyncio.Future[None]:
        """Post an RDMA WRITE of ``src`` into the peer's ``dst`` and return as soon as it is
        posted (a place among ``Config.max_onesided`` may have to free up first), without
        waiting for the peer's acknowledgement: several WRITEs can be on the wire at once.

        With ``notify`` (a message, as for :meth:`send`), the message is sent right behind the
        WRITE on the same queue pair: the peer's ``recv()`` returns it only once the written
        data is in its memory (a reliable connection executes them in order), so the peer
        needs no acknowledgement round trip to know the data has arrived. The call returns once
        the message is posted too. When ``notify`` is ``bytes`` or ``bytearray`` and can go at
        once (a credit and a send slot free, nothing queued before it), the WRITE and the
        message are posted as one chain: one ``ibv_post_send``, one doorbell.

        With ``imm`` (0..2**32-1; not with ``notify``): a WRITE with immediate data, which
        the peer's :meth:`recv_event` returns in order among the messages (see the one-sided
        guide); ``src`` may then be two slices, gathered into ``dst`` in order.

        Returns:
            A future that completes once the peer acknowledged the WRITE; ``src`` must not
            change before then (the device may still read it). It fails with what
            :meth:`write` would raise (e.g. ``RemoteAccessError``); nobody has to await it,
            and cancelling it does not stop the WRITE.

        Raises:
            AiordmaError: as :meth:`write` for the posting, and as :meth:`send` for
                ``notify`` and ``imm``; ``LocalProtocolError`` for a bad ``imm``, or both.
        """
        if imm is not None:
            if notify is not None:
                raise LocalProtocolError("post_write(): notify= or imm=, not both")
            return await post_write_imm(self, src, dst, imm)
        src = single(src, dst)
        if notify is None:
            done = await self._onesided.start("rdma write", opcode("RDMA_WRITE"), src, dst)
            done.add_done_callback(_retrieve)  # a caller that never awaits it is not an error
            return done
        chained = False

        def post(*wr: Any) -> None:
            nonlocal chained
            chained = self._post_led(notify, wr)

        done = await self._onesided.start("rdma write", opcode("RDMA_WRITE"), src, dst,
                                          post=post)
        done.add_done_callback(_retrieve)
        if not chained:
            await self.send(notify)
        return done

    def _post_led(self, notify: Any, wr: tuple[Any, ...]) -> bool:
        """Post RDMA work request ``wr`` (as :meth:`QueuePair.led_runner`'s runner takes it)
        with the SEND of eager message ``notify`` behind it in one chain, if ``notify`` can
        go now; else the work request alone. True if ``notify`` went.

        Raises:
            DeviceError: the post failed (after the message was taken, the endpoint fails).
        """
        proto = self._proto
        t = type(notify)
        chained = ((t is bytes or t is bytearray) and proto.state is _L.OPEN
                   and len(notify) <= proto.peer_max_message and proto.try_send_data(notify))
        try:
            rest = self._run_led(proto.take_actions() if chained else [], *wr)
        except OSError as exc:
            err = DeviceError(f"ibv_post_send failed: {exc.strerror or exc}")
            if chained:
                self._posting_failed(err)
            raise err from None
        if rest is not None and not self._carry_out(rest):
            return chained
        if proto.actions:
            self._run()
        return chained

    async def read(self, dst: LocalSlice, src: RemoteBuffer) -> None:
        """RDMA READ the peer's ``src`` into ``dst``; returns when the data is in ``dst``."""
        _check_remote(dst, src, "read")
        if dst.region.readonly:
            raise LocalProtocolError("read() needs a writable destination")
        await self._onesided.run("rdma read", opcode("RDMA_READ"), dst, src)

    async def fetch_add(self, target: RemoteBuffer, add: int) -> int:
        """Atomically add ``add`` (mod 2**64; an integer in -2**63..2**64-1) to the 8 aligned
        bytes at ``target``; return the value before (unsigned)."""
        word = check_word(add, name="add")
        return await self._onesided.atomic(opcode("ATOMIC_FETCH_AND_ADD"), target, word, 0)

    async def compare_swap(self, target: RemoteBuffer, *, expected: int, new: int) -> int:
        """Atomically set the 8 aligned bytes at ``target`` to ``new`` if they equal
        ``expected`` (each an integer in -2**63..2**64-1, taken mod 2**64); return the value
        before (unsigned; equal to ``expected`` mod 2**64 iff swapped)."""
        return await self._onesided.atomic(opcode("ATOMIC_CMP_AND_SWP"), target,
                                           check_word(expected, name="expected"),
                                           check_word(new, name="new"))

    # -- revocable exposure (the logic is in aiordma/_memory/window.py) -------------------------------

    async def expose(self, local: LocalSlice, *, read: bool = False, write: bool = False,
                     atomic: bool = False, mechanism: str | None = None) -> Exposure:
        """Let this endpoint's peer reach ``local`` with exactly the access asked for, until
        the returned :class:`~aiordma.Exposure` is revoked (or this endpoint closes).

        ``local`` is a slice of a region registered on this endpoint's device
        (``region[a:b]``). Where the device has type-2 memory windows (rxe does), the rkey is a
        window bound to this endpoint's queue pair, usable by this peer only; elsewhere it is a
        registration of exactly the range. Send ``exposure.remote.to_wire()`` to the peer.
        ``mechanism="window"`` or ``"registration"`` forces one (default: a window where the
        device has them).

        Raises:
            LocalProtocolError: not such a slice, an empty range, no access asked for,
                write/atomic on read-only memory, or ``"window"`` on a device without them.
            ClosedResourceError, BrokenResourceError: the endpoint is closed or broken.
            DeviceError: a verbs call failed.
        """
        self._check_open()

        def post(wr: Any, what: str) -> asyncio.Future[Any]:
            # One memory-window work request on this queue pair, now; abort() fails its future.
            self._before_post()
            wr_id = self._reactor.next_wr_id()
            wr.wr_id = wr_id
            fut = self._reactor.expect(wr_id, what, wr)
            try:
                self._qp.post_request(wr, what)
            except BaseException:
                self._reactor.unwatch(wr_id)
                raise
            self._onesided.track(wr_id, fut)

            def done(f: asyncio.Future[Any]) -> None:
                exc = None if f.cancelled() else f.exception()
                if isinstance(exc, CompletionError):
                    self._fail(exc)  # the bind failed: the queue pair is in the error state

            fut.add_done_callback(done)
            return fut

        return await Exposure.create(self, local, read=read, write=write, atomic=atomic,
                                     post=post, owner=self._exposures,
                                     mechanism=mechanism)  # type: ignore[arg-type]

    # -- lifecycle -----------------------------------------------------------------------------

    async def _graceful_close(self) -> None:
        proto = self._proto
        try:
            if proto.state in (_L.BROKEN, _L.RELEASED):
                return
            proto.close()
            async with asyncio.timeout(self.config.close_timeout):
                if not proto.flushed:
                    self._flush_waiter = self._loop.create_future()
                    await self._flush_waiter
                if proto.state is _L.CLOSING:
                    self._send_close()
                # (PEER_CLOSED: the answer goes out by itself once all the peer's messages
                # have arrived; see _check_peer_done)
                await self._peer_close.wait()
        except (TimeoutError, OSError, AiordmaError, ProtocolError):
            pass
        finally:
            self.abort()

    def abort(self) -> None:
        """Release everything now; every pending operation fails with
        :class:`ClosedResourceError`. Idempotent."""
        if self._proto.state is _L.RELEASED:
            return
        self._proto.release()
        self._teardown(ClosedResourceError("the endpoint was closed"))

    def __repr__(self) -> str:
        return (f"<Endpoint #{self.id} {self._proto.state.name.lower()} "
                f"{self.local_address}->{self.peer_address}>")

