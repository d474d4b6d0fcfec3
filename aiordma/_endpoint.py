"""Connected endpoints: messages both ways, one-sided access to the peer's memory.

An :class:`Endpoint` is one RC queue pair plus the TCP connection that set it up, which stays
open as the liveness channel. It is created by :func:`aiordma.connect` or handed to a
listener's handler; see :mod:`aiordma._connect`.

The endpoint is a driver: every rule of its messages (order, slots, credits, rendezvous
tokens, the receive budget, close counts, the lifecycle) lives in the sans-I/O
:class:`aiordma.protocols.messages.MessageProtocol`. The endpoint feeds it work completions and
application calls, carries out the actions it emits (post a SEND, repost a receive slot,
READ a rendezvous message into a buffer), and wakes the callers that wait. One-sided
operations are :mod:`aiordma._onesided`.

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
import contextlib
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Self

from aiordma.protocols import handshake as hs
from aiordma.protocols import messages as msgs
from aiordma.protocols.errors import LocalProtocolError as _ProtoLocalError
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.framing import HEADER_SIZE

from ._args import byte_view, check_int, check_seconds, check_word
from ._device import Device
from ._errors import (
    WC_WR_FLUSH_ERR,
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    CompletionError,
    LocalProtocolError,
    RemoteProtocolError,
    error_from_status,
    from_protocol_error,
)
from ._fast import message_protocol
from ._memory import LocalSlice, MemoryRegion, RegistrationCache, RemoteBuffer
from ._onesided import OneSided
from ._places import wake_first
from ._qp import QueuePair, _check_remote, opcode
from ._reactor import CompletionReactor, release_shared, resolve_future
from ._resources import count_resource
from ._window import Exposure, Exposures

__all__ = ["BUFFER_READS", "Config", "Endpoint", "EndpointStats"]

_U16 = 0xFFFF
_SLOT_MEMORY = 4 << 30  # bytes of receive (or send) slots an endpoint may have
BUFFER_READS = 8
"""Rendezvous READs into the endpoint's own buffers in flight at once (send-queue entries the
queue pair reserves for them)."""
_ids = itertools.count(1)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as retrieved (asyncio logs unretrieved ones)."""
    if not fut.cancelled():
        fut.exception()
_L = msgs.Lifecycle
_READY, _UNREAD = msgs.READY, msgs.UNREAD
_PostRecv, _PostSend = msgs.PostRecv, msgs.PostSend


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Tunables of an endpoint (both sides may differ; each tells the other its window).

    Attributes:
        data_slots: receive slots for messages (the peer's message window).
        ctrl_slots: receive slots for control frames (acknowledgements, credit returns); at
            least 3.
        slot_size: bytes per receive/send slot, 12-byte frame header included.
        send_slots: pre-registered send slots (messages posted and not yet known complete).
        signal_every: request a send completion every N posts.
        recv_buffer: bytes of received messages the endpoint holds for the application
            outside its receive slots (like ``SO_RCVBUF``; each message counts 64 bytes more
            than its size). 0: messages stay in their slots until read.
        max_message: the largest message accepted from the peer, in bytes (the peer learns it
            at set-up, and ``send()`` refuses larger ones before sending anything).
        max_onesided: one-sided operations in flight per endpoint (READs and atomics are
            further bounded by the device's initiator depth).
        max_rd_atomic: RDMA READs/atomics in flight, each way.
        close_timeout: seconds ``aclose()`` waits for the peer before releasing anyway.
        handshake_timeout: seconds a listener gives a client's set-up once the TCP
            connection exists, up to its Accept; the client's Ready then has as long again.
        keepalive_idle, keepalive_interval, keepalive_probes: TCP keepalive of the connection
            that set the endpoint up and stays open as its liveness channel: a peer host that
            vanishes (no FIN, no RST) is declared dead after about idle + interval x probes
            seconds, and every pending operation fails with :class:`BrokenResourceError`. A
            killed process is noticed at once (its kernel closes the socket).
    """

    data_slots: int = 64
    ctrl_slots: int = 8
    slot_size: int = 8192
    send_slots: int = 64
    signal_every: int = 16
    recv_buffer: int = 4 << 20
    max_message: int = 1 << 30
    max_onesided: int = 64
    max_rd_atomic: int = 16
    close_timeout: float = 5.0
    handshake_timeout: float = 10.0
    keepalive_idle: int = 1
    keepalive_interval: int = 1
    keepalive_probes: int = 2

    @property
    def eager_max(self) -> int:
        """Largest message sent eagerly with these slots (the peer's slots may lower it)."""
        return self.slot_size - HEADER_SIZE

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (``Config(...)`` does, so a ``Config`` that exists is valid).

        The upper bounds are what the wire carries (slots and credits are 16-bit,
        ``max_rd_atomic`` 8-bit, ``max_message`` at most 2**62), what Linux accepts for TCP
        keepalive (32767 s, 127 probes), and at most 4 GiB of slot memory each way.

        Raises:
            LocalProtocolError: naming the first unusable field.
        """
        check_int(self.slot_size, name="slot_size", low=64, high=1 << 20)
        check_int(self.data_slots, name="data_slots", low=1, high=_U16)
        check_int(self.ctrl_slots, name="ctrl_slots", low=3, high=_U16)
        check_int(self.send_slots, name="send_slots", low=2, high=_U16)
        for name in ("signal_every", "max_onesided"):
            check_int(getattr(self, name), name=name, low=1, high=_U16)
        check_int(self.max_rd_atomic, name="max_rd_atomic", low=1, high=255)
        check_int(self.max_message, name="max_message", low=1, high=1 << 62)
        check_int(self.recv_buffer, name="recv_buffer", low=0, high=1 << 62)
        for name in ("keepalive_idle", "keepalive_interval"):
            check_int(getattr(self, name), name=name, low=1, high=32767)
        check_int(self.keepalive_probes, name="keepalive_probes", low=1, high=127)
        for name in ("close_timeout", "handshake_timeout"):
            check_seconds(getattr(self, name), name=name)
        for what, slots in (("receive", self.data_slots + self.ctrl_slots),
                            ("send", self.send_slots)):
            if slots * self.slot_size > _SLOT_MEMORY:
                raise LocalProtocolError(f"{slots} {what} slots of {self.slot_size} B exceed "
                                         f"{_SLOT_MEMORY >> 30} GiB")


@dataclass(frozen=True, slots=True)
class EndpointStats:
    """A snapshot of an endpoint's messages (:meth:`Endpoint.stats`).

    Attributes:
        sent: messages posted to the peer.
        queued: messages waiting for a send slot or a credit (their ``send()`` waits).
        received: messages that arrived from the peer.
        delivered: messages handed to the application (``recv()``, ``recv_into()``).
        inbox: messages arrived and not yet delivered.
        inbox_bytes: bytes held for the application, counted against ``Config.recv_buffer``.
        buffered_reads: rendezvous messages the endpoint READ into its own buffer (the others
            went straight into a waiting receiver's buffer).
    """

    sent: int
    queued: int
    received: int
    delivered: int
    inbox: int
    inbox_bytes: int
    buffered_reads: int


class Endpoint:
    """One end of a connection: messages both ways, one-sided access to the peer's memory.

    Use as ``async with endpoint:`` (closes gracefully on exit). ``aclose()`` and ``abort()``
    are idempotent; every operation pending when the endpoint closes or breaks fails with
    :class:`ClosedResourceError` (this side closed it) or :class:`BrokenResourceError` (the
    peer or the network did).
    """

    def __init__(self, *, device: Device, config: Config, control: hs.ControlConnection,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 peer: hs._QPParams, qp: QueuePair, reactor: CompletionReactor,
                 entries: int, recv_mr: MemoryRegion, send_mr: MemoryRegion,
                 established: bool = True) -> None:
        # Built by _connect.py as the handshake ends, users do not call this: on the server
        # before its Accept goes out (established=False: the control channel is read from
        # :meth:`_established` on, once the client's Ready came), on the client before its
        # Ready goes out; either way the receive slots are posted before the peer may send.
        self._proto = message_protocol()(
            send_region=send_mr.view, recv_region=recv_mr.view, slot_size=config.slot_size,
            send_slots=config.send_slots, data_slots=config.data_slots,
            ctrl_slots=config.ctrl_slots, peer_slot_size=peer.slot_size,
            peer_data_slots=peer.data_slots, peer_ctrl_slots=peer.ctrl_slots,
            peer_max_message=peer.max_message, max_message=config.max_message,
            recv_budget=config.recv_buffer, signal_every=config.signal_every,
            max_reads=BUFFER_READS)
        self.device = device
        self.config = config
        self.id = next(_ids)
        self._loop = asyncio.get_running_loop()
        self._control = control
        self._reader, self._writer = reader, writer
        self._peer = peer
        self._qp = qp
        self._reactor = reactor
        self._entries = entries
        self._route = reactor.add_route(self._on_completion)
        self._wr_base = self._route << 32
        self._recv_mr, self._send_mr = recv_mr, send_mr
        self._send_address, self._send_lkey = send_mr.address, send_mr.lkey
        self._op_send = opcode("SEND")
        self._posted: dict[int, asyncio.Future[None]] = {}  # ticket -> queued eager send
        self._rdv_out: dict[int, tuple[MemoryRegion | None, asyncio.Future[None]]] = {}
        self._recv_waiters: deque[asyncio.Future[None]] = deque()
        self._flush_waiter: asyncio.Future[None] | None = None
        self._peer_close = asyncio.Event()  # the closing exchange is over (or broke)
        self._error: BaseException | None = None  # the peer/network broke it: why
        self._inbound_error: CompletionError | None = None  # a buffering READ's own failure
        self._close_task: asyncio.Task[None] | None = None
        self._regions: list[MemoryRegion] = []
        self._reg_cache = RegistrationCache(device)
        self._exposures = Exposures()  # revoked before the queue pair is destroyed
        self._onesided = OneSided(device, qp, config.max_onesided, check_open=self._check_open,
                                  failure=self._onesided_failure)
        self.local_address = writer.get_extra_info("sockname")
        self.peer_address = writer.get_extra_info("peername")
        nslots = config.data_slots + config.ctrl_slots
        qp.prepare_slots(self._wr_base, recv_mr.address, config.slot_size, recv_mr.lkey, nslots)
        self._run()  # posts every receive slot
        self._control_task: asyncio.Task[None] | None = None
        if established:
            self._established()
        count_resource("endpoints", 1)

    def _established(self) -> None:
        """The handshake is over: read the control channel (the peer's Close, its death)."""
        self._control_task = self._loop.create_task(self._control_loop())

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

        Returns once an eager message is posted (``data`` may be reused at once), or once the
        peer has read a rendezvous message (into its receive buffer, or a receiver's).

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
            if not ticket:  # posted
                self._run()
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
        proto = self._proto
        while True:
            if proto.state is _L.RELEASED:
                raise ClosedResourceError("the endpoint is closed")
            head = proto.head
            if head is _READY or head is _UNREAD:
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

    async def post_write(self, src: LocalSlice, dst: RemoteBuffer, *,
                         notify: Any = None) -> asyncio.Future[None]:
        """Post an RDMA WRITE of ``src`` into the peer's ``dst`` and return as soon as it is
        posted (a place among ``Config.max_onesided`` may have to free up first), without
        waiting for the peer's acknowledgement: several WRITEs can be on the wire at once.

        With ``notify`` (a message, as for :meth:`send`), the message is sent right behind the
        WRITE on the same queue pair: the peer's ``recv()`` returns it only once the written
        data is in its memory (a reliable connection executes them in order), so the peer
        needs no acknowledgement round trip to know the data has arrived. The call returns once
        the message is posted too.

        Returns:
            A future that completes once the peer acknowledged the WRITE; ``src`` must not
            change before then (the device may still read it). It fails with what
            :meth:`write` would raise (e.g. ``RemoteAccessError``); nobody has to await it,
            and cancelling it does not stop the WRITE.

        Raises:
            AiordmaError: as :meth:`write` for the posting, and as :meth:`send` for
                ``notify``.
        """
        _check_remote(src, dst, "write")
        done = await self._onesided.start("rdma write", opcode("RDMA_WRITE"), src, dst)
        done.add_done_callback(_retrieve)  # a caller that never awaits it is not an error
        if notify is not None:
            await self.send(notify)
        return done

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

    # -- revocable exposure (the logic is in aiordma/_window.py) -------------------------------

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
            self._check_open()
            wr_id = self._reactor.next_wr_id()
            wr.wr_id = wr_id
            fut = self._reactor.expect(wr_id, what, wr)
            try:
                self._qp.raw.post_send(wr)
            except Exception as exc:
                from ._errors import DeviceError

                self._reactor.unwatch(wr_id)
                raise DeviceError(f"ibv_post_send ({what}) failed: {exc}") from exc
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

    @property
    def closed(self) -> bool:
        """This side closed (and released) the endpoint."""
        return self._proto.state is _L.RELEASED

    @property
    def broken(self) -> bool:
        """The peer, the network or the device broke the endpoint."""
        return self._error is not None

    @property
    def state(self) -> str:
        """The lifecycle state's name (``aiordma.protocols._messages_state.Lifecycle``): ``OPEN``,
        ``CLOSING``, ``CLOSE_SENT``, ``PEER_CLOSED``, ``CLOSED``, ``BROKEN`` or ``RELEASED``."""
        return self._proto.state.name

    async def _wait_gone(self) -> BaseException | None:
        """Return once the endpoint is no longer usable: the peer broke it (then its error is
        returned), or it was closed (by either side: None). For aiordma's own services that
        must notice a link breaking while they wait on others (the collectives' group)."""
        await self._peer_close.wait()
        return self._error

    async def aclose(self) -> None:
        """Close gracefully: flush queued messages, wait until the peer has read every
        rendezvous message, tell the peer (with how many messages were sent), wait up to
        ``Config.close_timeout`` in all for the peer to confirm it received them, then release
        everything (always, even if the graceful part fails)."""
        if self._close_task is None:
            self._close_task = self._loop.create_task(self._graceful_close())
        await asyncio.shield(self._close_task)

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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (f"<Endpoint #{self.id} {self._proto.state.name.lower()} "
                f"{self.local_address}->{self.peer_address}>")

    # -- internals: the driver -----------------------------------------------------------------

    def _run(self) -> None:
        """Carry out the protocol's actions, in order (reposts before the credits they
        grant). The SENDs of one call go to the device as one chain, posted before any
        action that is not a SEND or a receive repost, and at the end."""
        proto = self._proto
        qp, base, address, lkey = self._qp, self._wr_base, self._send_address, self._send_lkey
        sends: list[tuple[int, int, int, int, bool]] = []  # posted as one chain, see below
        while proto.actions:
            for a in proto.take_actions():
                t = type(a)
                try:
                    if t is _PostSend:
                        sends.append((base | a.wr_id, address + a.offset, a.length, lkey,
                                      a.signaled))
                        continue
                    if t is _PostRecv:  # (a receive posted before SENDs queued here: earlier
                        qp.post_slot(a.slot)  # than the order asks, which is always safe)
                        continue
                    if sends:  # any other action: the SENDs before it go first
                        batch, sends = sends, []
                        qp.post_sends(batch)
                    if t is msgs.SendPosted:
                        fut = self._posted.pop(a.ticket, None)
                        if fut is not None and not fut.done():
                            fut.set_result(None)
                    elif t is msgs.SendDone:
                        self._rendezvous_done(a.token)
                    elif t is msgs.StartRead:
                        self._start_read(a.message)
                    elif t is msgs.SendDropped:
                        self._dropped(a)
                except AiordmaError as exc:
                    self._posting_failed(exc)
                    return
        if sends:  # the SENDs of this turn, one chain: one doorbell instead of one per frame
            try:
                qp.post_sends(sends)
            except AiordmaError as exc:
                self._posting_failed(exc)

    def _posting_failed(self, exc: AiordmaError) -> None:
        if self._proto.state not in (_L.BROKEN, _L.RELEASED):
            self._fail(BrokenResourceError(f"posting failed: {exc}"))

    def _on_completion(self, wc: Any) -> None:
        """Reactor route: completions of this endpoint's receive slots and sends."""
        if isinstance(wc, BaseException):  # the reactor closed under us
            self._fail(wc if isinstance(wc, BrokenResourceError)  # e.g. the device was lost
                       else BrokenResourceError("the completion reactor was closed"))
            return
        proto = self._proto
        if wc.status:
            if proto.state is not _L.RELEASED:
                self._fail(error_from_status(wc.status, opcode=wc.opcode,
                                             vendor_err=wc.vendor_err, what="message transfer"))
            return
        if proto.state is _L.BROKEN or proto.state is _L.RELEASED:
            return
        try:
            proto.on_completion(wc.wr_id & 0xFFFF_FFFF, wc.byte_len)
        except ProtocolError as exc:
            self._fail(from_protocol_error(exc))
            return
        self._after_input()

    def _after_input(self) -> None:
        """The protocol took an input (a completion, a finished READ, the peer's Close): carry
        out its actions, then wake whoever that concerns: a receiver if a message (or the end)
        may be there, the peer's Close answered once due, ``aclose()`` once flushed."""
        proto = self._proto
        if proto.actions:
            self._run()
        if self._recv_waiters and (proto.inbox or proto.peer_total is not None):
            self._wake_one()  # it looks again (and sleeps again if it is not for it)
        if proto.peer_total is not None:
            self._check_peer_done()
        if self._flush_waiter is not None and proto.flushed:
            resolve_future(self._flush_waiter, None)

    def _wake_one(self) -> None:
        wake_first(self._recv_waiters)

    def _wake_all_receivers(self) -> None:
        while self._recv_waiters:
            w = self._recv_waiters.popleft()
            if not w.done():
                w.set_result(None)

    def _rendezvous_done(self, token: int) -> None:
        entry = self._rdv_out.pop(token, None)
        if entry is None:
            return
        mr, fut = entry
        if mr is not None:
            mr.close()
        if not fut.done():
            fut.set_result(None)

    def _dropped(self, a: msgs.SendDropped) -> None:
        """A queued message will never go: the peer closed."""
        exc = BrokenResourceError("the peer closed the connection")
        if a.rendezvous:
            entry = self._rdv_out.pop(a.ticket, None)
            if entry is not None:
                if entry[0] is not None:
                    entry[0].close()
                resolve_future(entry[1], exc)
        else:
            fut = self._posted.pop(a.ticket, None)
            if fut is not None:
                resolve_future(fut, exc)

    def _start_read(self, item: msgs.Incoming) -> None:
        """READ a rendezvous message into a buffer of the endpoint's (the receive buffer)."""
        buf = bytearray(item.size)
        if not item.size:
            self._proto.read_done(item, buf)
            return
        mr = MemoryRegion(self.device, buf)
        remote = RemoteBuffer(address=item.address, rkey=item.rkey, length=item.size,
                              readable=True)
        wr_id, fut = self._qp.post_future("rendezvous read", opcode("RDMA_READ"), mr.whole(),
                                          remote=remote)
        self._onesided.track(wr_id, fut)

        def finished(f: asyncio.Future[Any]) -> None:
            mr.close()
            proto = self._proto
            if f.cancelled():
                return
            # Retrieved even when nobody needs it (a READ flushed because the endpoint closed
            # or broke is no news), or asyncio logs "Future exception was never retrieved".
            exc = f.exception()
            if proto.state in (_L.BROKEN, _L.RELEASED):
                return
            if exc is not None:
                if isinstance(exc, CompletionError) and exc.status != WC_WR_FLUSH_ERR:
                    self._inbound_error = exc  # the receiver of this message gets it
                self._fail(exc)
                return
            proto.read_done(item, buf)
            self._after_input()

        fut.add_done_callback(finished)

    # -- internals: state, control channel and failure -----------------------------------------

    def _check_open(self) -> None:
        if self._proto.state is _L.RELEASED:
            raise ClosedResourceError("the endpoint is closed")
        if self._error is not None:
            raise self._error_for_pending()

    def _send_error(self) -> BaseException:
        """Why ``send()`` is refused in the current state."""
        state = self._proto.state
        if state is _L.RELEASED:
            return ClosedResourceError("the endpoint is closed")
        if self._error is not None:
            return self._error_for_pending()
        if state is _L.PEER_CLOSED or (state is _L.CLOSED and self._close_task is None):
            return BrokenResourceError("the peer closed the connection")
        return ClosedResourceError("the endpoint is closing")

    def _send_close(self) -> None:
        self._writer.write(self._control.send(hs.Close(sent=self._proto.close_sent())))
        if self._proto.state is _L.CLOSED:
            self._peer_close.set()

    def _check_peer_done(self) -> None:
        """Answer the peer's Close once every message it sent has arrived; wake receivers at
        the end of the stream."""
        proto = self._proto
        if proto.answer_due:
            with contextlib.suppress(Exception):
                self._send_close()
        if proto.at_eof:
            self._wake_all_receivers()

    async def _control_loop(self) -> None:
        reader, control = self._reader, self._control
        eof = False
        try:
            while True:
                # Events first, then the socket: what came in the same read as the
                # handshake's last message (a Close sent right after connecting) is already
                # in the control connection's buffer.
                while True:
                    ev = control.next_event()
                    if ev is hs.NEED_DATA:
                        break
                    if isinstance(ev, hs.Close):
                        self._proto.peer_closed(ev.sent)
                        if self._proto.state is _L.CLOSED:
                            self._peer_close.set()
                        self._after_input()
                    elif isinstance(ev, hs.ConnectionClosed):
                        if self._proto.peer_total is None:
                            self._fail(BrokenResourceError("the peer disconnected"))
                        else:
                            self._peer_close.set()
                        return
                if eof:
                    return
                data = await reader.read(65536)
                eof = not data
                control.receive_data(data)
        except ProtocolError as exc:
            self._fail(RemoteProtocolError(f"control channel: {exc}"))
        except (ConnectionError, OSError) as exc:
            self._fail(BrokenResourceError(f"control channel: {exc}"))
        except asyncio.CancelledError:
            raise

    def _error_for_pending(self) -> BaseException:
        """The exception for an operation that finds the endpoint closed or broken."""
        if self._proto.state is _L.RELEASED:
            return ClosedResourceError("the endpoint was closed")
        err = self._error
        new: AiordmaError = (RemoteProtocolError(str(err)) if isinstance(err, RemoteProtocolError)
                             else BrokenResourceError(str(err)))
        new.__cause__ = err
        return new

    def _receive_error(self) -> BaseException:
        """What a receiver gets once the messages that arrived are delivered: the precise
        failure of the READ that was to bring the next one (e.g. ``RemoteAccessError``: the
        peer announced memory it does not let us read), else the endpoint's error."""
        err = self._inbound_error
        if err is None or self._proto.state is _L.RELEASED:
            return self._error_for_pending()
        new = error_from_status(err.status, opcode=err.opcode, vendor_err=err.vendor_err,
                                what="receiving a rendezvous message")
        new.__cause__ = err
        return new

    def _onesided_failure(self, exc: CompletionError) -> BaseException:
        """What a one-sided operation that completed with ``exc`` raises."""
        if self._proto.state is not _L.RELEASED and (
                self._error is None or exc.status != WC_WR_FLUSH_ERR):
            # This operation's own failure (not a flush caused by another): the precise
            # cause, e.g. RemoteAccessError. The queue pair is now in the error state.
            self._fail(exc)
            return exc
        return self._error_for_pending()

    def _fail(self, exc: BaseException) -> None:
        """The peer or the network broke the endpoint: flush everything, wake every waiter."""
        proto = self._proto
        if proto.state is _L.RELEASED:
            return
        if self._error is not None:
            # A flush often arrives before the completion that caused it: keep the cause.
            if (isinstance(self._error, CompletionError) and self._error.status == WC_WR_FLUSH_ERR
                    and isinstance(exc, CompletionError) and exc.status != WC_WR_FLUSH_ERR):
                self._error = exc
            return
        self._error = exc
        proto.fail(salvage=not self._recv_mr.closed)
        self._qp.to_error()  # outstanding work requests complete now, flushed
        self._wake_everyone(self._error_for_pending())
        self._peer_close.set()

    def _wake_everyone(self, exc: BaseException) -> None:
        for fut in self._posted.values():
            resolve_future(fut, exc)
        self._posted.clear()
        self._wake_all_receivers()
        for _mr, fut in self._rdv_out.values():
            resolve_future(fut, exc)
        if self._flush_waiter is not None:
            resolve_future(self._flush_waiter, exc)

    def _teardown(self, exc: BaseException) -> None:
        """Release everything: queue pair first (the device stops touching memory), then the
        waiters, the route, the memory and the TCP connection."""
        count_resource("endpoints", -1)  # once: abort() runs this only the first time
        self._exposures.release()  # memory windows hold the queue pair: release them first
        self._qp.close()
        self._wake_everyone(exc)
        self._onesided.teardown(exc, self._reactor)
        self._reactor.remove_route(self._route)
        release_shared(self._reactor, self._entries)
        for mr, _fut in self._rdv_out.values():
            if mr is not None:  # (None: the caller's own region)
                mr.close()
        self._rdv_out.clear()
        self._reg_cache.close()
        for mr in (*self._regions, self._recv_mr, self._send_mr):
            mr.close()
        self._regions.clear()
        if self._control_task is not None:
            self._control_task.cancel()
        self._writer.transport.abort()
        self._peer_close.set()
