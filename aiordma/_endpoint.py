"""Connected endpoints: messages (eager and rendezvous) and one-sided operations.

An :class:`Endpoint` is one RC queue pair plus the TCP connection that set it up, which stays
open as the liveness channel. It is created by :func:`aiordma.connect` or handed to a
listener's handler; see :mod:`aiordma._connect`.

Messages
    ``send()`` keeps message boundaries and order. A message of at most
    ``Config.eager_max`` bytes is copied into a pre-registered send slot and SENT into one of
    the peer's pre-posted receive slots (eager). A larger one is exposed read-only and
    announced with an RTS frame; the receiver RDMA-READs it straight into the destination and
    answers DONE, upon which the sender deregisters it (rendezvous). Credits
    (:mod:`protocols.credits`) make sure no SEND ever finds the peer without a posted receive.

Wake-ups
    Sends are unsignaled except every ``Config.signal_every``-th one (and whenever send slots
    run low), so a message costs the sender no completion event; a signaled completion frees
    every slot posted before it. ``send()`` of an eager message returns once the message is
    posted; the caller's buffer is free at once. A rendezvous ``send()`` returns when the peer
    has read the message.

End of stream
    ``recv()`` returns ``None`` once the peer closed gracefully and every message it sent
    has been received. If the peer dies or the connection breaks, messages already received
    are still delivered, then ``recv()`` raises :class:`BrokenResourceError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Self

from protocols import credits as _credits
from protocols import framing
from protocols import handshake as hs
from protocols.errors import ProtocolError

from ._device import Device, count_resource
from ._errors import (
    WC_WR_FLUSH_ERR,
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    CompletionError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ._memory import LocalSlice, MemoryRegion, RegistrationCache, RemoteBuffer
from ._qp import QueuePair, _check_atomic, _check_remote
from ._reactor import CompletionReactor, release_shared, resolve_future
from ._window import Exposure, release_exposures

__all__ = ["Config", "Endpoint"]

_SEND_BIT = 0x8000_0000
_SEQ_MASK = 0x7FFF_FFFF
_U64 = (1 << 64) - 1
_ids = itertools.count(1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Tunables of an endpoint (both sides may differ; each tells the other its window).

    Attributes:
        data_slots: receive slots for messages (the peer's message window).
        ctrl_slots: receive slots for credit frames.
        slot_size: bytes per receive/send slot, 12-byte frame header included.
        send_slots: pre-registered send slots (messages posted and not yet known complete).
        signal_every: request a send completion every N posts.
        max_message: the largest message accepted from the peer, in bytes.
        max_onesided: one-sided operations in flight per endpoint (READs and atomics are
            further bounded by the device's initiator depth).
        max_rd_atomic: RDMA READs/atomics in flight, each way.
        close_timeout: seconds ``aclose()`` waits for the peer before releasing anyway.
        handshake_timeout: seconds the set-up may take once the TCP connection exists.
        keepalive_idle, keepalive_interval, keepalive_probes: TCP keepalive of the connection
            that set the endpoint up and stays open as its liveness channel: a peer host that
            vanishes (no FIN, no RST) is declared dead after about idle + interval x probes
            seconds, and every pending operation fails with :class:`BrokenResourceError`. A
            killed process is noticed at once (its kernel closes the socket).
    """

    data_slots: int = 64
    ctrl_slots: int = 4
    slot_size: int = 8192
    send_slots: int = 64
    signal_every: int = 16
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
        """Largest message sent eagerly; larger ones go by rendezvous."""
        return self.slot_size - framing.HEADER_SIZE

    def validate(self) -> None:
        if self.slot_size < 64 or self.slot_size > (1 << 20):
            raise LocalProtocolError("slot_size must be within 64 B .. 1 MiB")
        for name in ("data_slots", "ctrl_slots", "send_slots", "signal_every", "max_onesided",
                     "max_rd_atomic", "keepalive_idle", "keepalive_interval", "keepalive_probes"):
            if getattr(self, name) < 1:
                raise LocalProtocolError(f"{name} must be at least 1")
        if self.send_slots < 2:
            raise LocalProtocolError("send_slots must be at least 2")


@dataclass(slots=True)
class _Outgoing:
    """A frame waiting for a send slot and a credit."""

    kind: framing.Kind
    payload: memoryview | None = None  # DATA
    token: int = 0  # RTS, DONE
    size: int = 0  # RTS
    address: int = 0  # RTS
    rkey: int = 0  # RTS
    waiter: asyncio.Future[None] | None = None  # resolved once posted (DATA)


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
                 entries: int, recv_mr: MemoryRegion, send_mr: MemoryRegion) -> None:
        # Built by _connect.py once the handshake is done; users do not call this.
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
        self._slot = config.slot_size
        self._peer_eager_max = peer.slot_size - framing.HEADER_SIZE
        self._credits = _credits.CreditWindow(
            local_data_slots=config.data_slots, local_ctrl_slots=config.ctrl_slots,
            peer_data_slots=peer.data_slots, peer_ctrl_slots=peer.ctrl_slots)
        self._free_send = list(range(config.send_slots))
        self._inflight: deque[tuple[int, int]] = deque()  # (seq, send slot) posted, not known done
        self._seq = 0
        self._sendq: deque[_Outgoing] = deque()
        self._inbox: deque[tuple[int, framing.Frame]] = deque()  # (recv slot, DATA/RTS frame)
        self._recv_waiters: deque[asyncio.Future[None]] = deque()
        self._rdv_out: dict[int, tuple[MemoryRegion | None, asyncio.Future[None]]] = {}
        self._rdv_tokens = itertools.count(1)
        self._onesided_ops: dict[int, asyncio.Future[Any]] = {}
        self._onesided_slots = asyncio.Semaphore(config.max_onesided)
        self._scratch = MemoryRegion(device, bytearray(8 * config.max_onesided))
        self._scratch_free = list(range(config.max_onesided))
        self._msgs_sent = 0
        self._msgs_received = 0
        self._peer_sent_total: int | None = None  # from the peer's Close
        self._close_sent = False
        self._peer_close = asyncio.Event()
        self._closed = False  # this side closed it (aclose/abort)
        self._closing = False  # aclose() started: no new sends
        self._error: BaseException | None = None  # peer/network broke it
        self._close_task: asyncio.Task[None] | None = None
        self._regions: list[MemoryRegion] = []
        self._reg_cache = RegistrationCache(device)
        self.local_address = writer.get_extra_info("sockname")
        self.peer_address = writer.get_extra_info("peername")
        nslots = config.data_slots + config.ctrl_slots
        self._recv_wrs = [qp.prepare_recv(self._wr_base | i, recv_mr.address + i * self._slot,
                                          self._slot, recv_mr.lkey) for i in range(nslots)]
        for slot in range(nslots):
            self._post_slot(slot)
        self._control_task = self._loop.create_task(self._control_loop())
        count_resource("endpoints", 1)

    # -- public: messages ----------------------------------------------------------------------

    async def send(self, data: Any) -> None:
        """Send one message (any contiguous bytes-like object, empty included, or a
        :class:`LocalSlice` of a region registered on this endpoint's device).

        Returns once an eager message is posted (``data`` may be reused at once), or once the
        peer has read a rendezvous message.

        A large message is registered for the peer to read, and deregistered once it has read
        it. A :class:`LocalSlice` is read from its region's registration instead (no
        registration per message, which costs as much as moving some megabytes on rxe): the
        peer is then given a key to the region's read access (``region.expose(read=True)``),
        valid until the region closes. Use a region that holds nothing else the peer should
        not read.

        Raises:
            ClosedResourceError: this endpoint is closing or closed, or the region is.
            BrokenResourceError: the peer closed or died, or the connection broke.
            LocalProtocolError: ``data`` is not a contiguous buffer or exceeds the peer's limit.
        """
        self._check_send()
        if isinstance(data, LocalSlice):
            await self._send_registered(data)
            return
        try:
            view = memoryview(data)
        except TypeError as exc:
            raise LocalProtocolError(f"send() takes a bytes-like object, not "
                                     f"{type(data).__name__}") from exc
        if not view.contiguous:
            raise LocalProtocolError("send() needs a contiguous buffer")
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        if n <= self._peer_eager_max:
            if self._post_eager_now(view):  # fast path
                return
            fut: asyncio.Future[None] = self._loop.create_future()
            self._sendq.append(_Outgoing(framing.Kind.DATA, payload=view, waiter=fut))
            self._msgs_sent += 1
            self._pump()
            await fut
            return
        await self._send_rendezvous(data, n)

    def _send_now(self, data: bytes | memoryview) -> bool:
        """Post an eager message at once if nothing is queued and a slot and a credit are
        free (what ``send()`` would do without suspending); False: nothing was done.

        For callers that must not suspend halfway (the RPC layer sends a request this way
        instead of in a task of its own). Raises as ``send()``.
        """
        self._check_send()
        view = memoryview(data)
        if view.nbytes > self._peer_eager_max or not view.contiguous:
            return False
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        return self._post_eager_now(view)

    def _post_eager_now(self, view: memoryview) -> bool:
        """Post ``view`` (an eager message) if nothing is queued before it and a send slot
        and a credit are free; False: nothing was done."""
        if self._sendq or not self._free_send or not self._credits.can_send_data():
            return False
        self._post_frame(_Outgoing(framing.Kind.DATA, payload=view))
        self._msgs_sent += 1
        return True

    async def _send_registered(self, src: LocalSlice) -> None:
        if src.region.device is not self.device:
            raise LocalProtocolError("the buffer is registered on another device")
        if src.region.closed:
            raise ClosedResourceError("the region is deregistered")
        n = len(src)
        if n <= self._peer_eager_max:
            await self.send(src.memoryview())
            return
        desc = src.region.expose(read=True)
        await self._send_rendezvous(None, n, address=src.address, rkey=desc.rkey)

    async def _send_rendezvous(self, data: Any, n: int, *, address: int = 0,
                               rkey: int = 0) -> None:
        """Announce ``n`` bytes for the peer to READ: ``data``, registered here for it and
        deregistered after, or (``data`` None) ``address``/``rkey`` of the caller's region."""
        mr = None
        if data is not None:
            mr = MemoryRegion(self.device, data, remote_read=True)
            desc = mr.expose(read=True)
            address, rkey = desc.address, desc.rkey
        token = next(self._rdv_tokens) & 0xFFFF_FFFF
        done: asyncio.Future[None] = self._loop.create_future()
        self._rdv_out[token] = (mr, done)
        self._sendq.append(_Outgoing(framing.Kind.RTS, token=token, size=n,
                                     address=address, rkey=rkey))
        self._msgs_sent += 1
        self._pump()
        try:
            await done
        finally:
            # Deregister only when the peer can no longer read it: after DONE, or after the
            # queue pair is gone. A cancelled send (its ``done`` cancelled with it) leaves the
            # region until then: the DONE handler or the teardown closes it.
            if done.done() and not done.cancelled():
                self._rdv_out.pop(token, None)
                if mr is not None:
                    mr.close()

    async def recv(self) -> bytearray | None:
        """The next message as a new ``bytearray``, or ``None`` at a graceful end of stream.

        Raises:
            ClosedResourceError: this endpoint was closed.
            BrokenResourceError: the peer died or the connection broke (after every message
                that had arrived was delivered).
            RemoteProtocolError: the peer broke the protocol (the endpoint is then broken).
        """
        item = await self._next_inbound()
        if item is None:
            return None
        slot, frame = item
        if isinstance(frame, framing.DataFrame):
            base = frame.offset  # parse() gives the offset in the whole receive region
            out = bytearray(self._recv_mr.view[base:base + frame.length])
            self._inbox.popleft()
            self._release_slot(slot)
            return out
        assert isinstance(frame, framing.RtsFrame)
        self._inbox.popleft()
        self._release_slot(slot)
        buf = bytearray(frame.size)
        mr = MemoryRegion(self.device, buf)
        await self._read_shielded(mr.whole(), frame, mr)
        return buf

    async def recv_into(self, buffer: Any) -> int:
        """Receive the next message into ``buffer`` (writable, contiguous); return its size.

        A rendezvous message is RDMA-READ straight into ``buffer`` (no copy; the buffer's
        registration is cached for later calls, which keeps the buffer alive and, for a
        ``bytearray``, unresizable until the endpoint closes). A message larger
        than ``buffer`` is not consumed: :class:`LocalProtocolError` is raised and the next
        call may pass a larger buffer. At a graceful end of stream, returns ``-1``.
        """
        target = buffer.memoryview() if isinstance(buffer, LocalSlice) else buffer
        view = memoryview(target)
        if view.readonly:
            raise LocalProtocolError("recv_into() needs a writable buffer")
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        item = await self._next_inbound()
        if item is None:
            return -1
        slot, frame = item
        size = frame.length if isinstance(frame, framing.DataFrame) else frame.size  # type: ignore[attr-defined]
        if size > view.nbytes:
            raise LocalProtocolError(f"the next message has {size} B; the buffer holds "
                                     f"{view.nbytes} B (the message stays queued)")
        self._inbox.popleft()
        if isinstance(frame, framing.DataFrame):
            base = frame.offset  # parse() gives the offset in the whole receive region
            view[:size] = self._recv_mr.view[base:base + size]
            self._release_slot(slot)
            return size
        assert isinstance(frame, framing.RtsFrame)
        self._release_slot(slot)
        if isinstance(buffer, LocalSlice):
            await self._read_shielded(LocalSlice(buffer.region, buffer.offset, size), frame)
        else:
            mr = self._reg_cache.get(buffer)  # registered once, reused by later calls
            await self._read_shielded(mr[0:size], frame)
        return size

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
        await self._onesided("rdma write", self._qp._e.IBV_WR_RDMA_WRITE, src, dst)

    async def read(self, dst: LocalSlice, src: RemoteBuffer) -> None:
        """RDMA READ the peer's ``src`` into ``dst``; returns when the data is in ``dst``."""
        _check_remote(dst, src, "read")
        if dst.region.readonly:
            raise LocalProtocolError("read() needs a writable destination")
        await self._onesided("rdma read", self._qp._e.IBV_WR_RDMA_READ, dst, src)

    async def fetch_add(self, target: RemoteBuffer, add: int) -> int:
        """Atomically add ``add`` (mod 2**64) to the 8 aligned bytes at ``target``; return the
        value before."""
        return await self._atomic(self._qp._e.IBV_WR_ATOMIC_FETCH_AND_ADD, target, add & _U64, 0)

    async def compare_swap(self, target: RemoteBuffer, *, expected: int, new: int) -> int:
        """Atomically set the 8 aligned bytes at ``target`` to ``new`` if they equal
        ``expected``; return the value before (equal to ``expected`` iff swapped)."""
        return await self._atomic(self._qp._e.IBV_WR_ATOMIC_CMP_AND_SWP, target,
                                  expected & _U64, new & _U64)

    async def _atomic(self, opcode: int, target: RemoteBuffer, compare_add: int,
                      swap: int) -> int:
        self._check_open()
        await self._onesided_slots.acquire()
        i = self._scratch_free.pop()
        local = self._scratch[8 * i:8 * i + 8]
        try:
            _check_atomic(local, target)
        except BaseException:
            self._scratch_free.append(i)
            self._onesided_slots.release()
            raise
        value = await self._onesided("atomic", opcode, local, target, compare_add, swap,
                                     scratch=i)
        assert value is not None
        return value

    async def _onesided(self, what: str, opcode: int, local: LocalSlice, remote: RemoteBuffer,
                        compare_add: int = 0, swap: int = 0, *,
                        scratch: int | None = None) -> int | None:
        """Post one READ/WRITE/atomic and wait for it. ``scratch``: an atomic's 8-byte scratch
        slot (its ``max_onesided`` place already taken); its old value is returned.

        The place among ``max_onesided`` (and the scratch slot) is given back when the work
        request completes, not when a cancelled caller leaves: until then the device may
        still write into the scratch bytes, and the work request occupies the send queue.
        """
        try:
            self._check_open()
            if local.region.device is not self.device:
                raise LocalProtocolError("the local buffer is registered on another device")
            if local.region.closed:  # its lkey would dereference a freed MR (a pyverbs segfault)
                raise ClosedResourceError("the local buffer's memory region is deregistered")
        except BaseException:
            if scratch is not None:
                self._scratch_free.append(scratch)
                self._onesided_slots.release()
            raise
        if scratch is None:
            await self._onesided_slots.acquire()
        fut: asyncio.Future[Any] | None = None

        def completed() -> None:  # the reactor: the work request is over
            self._onesided_slots.release()
            if scratch is not None and fut is not None and fut.cancelled():
                self._scratch_free.append(scratch)  # its caller left: nobody reads it

        try:
            self._check_open()
            wr_id, fut = self._qp.post_future(what, opcode, local, remote=remote,
                                              compare_add=compare_add, swap=swap,
                                              done=completed)
        except BaseException:
            self._onesided_slots.release()
            if scratch is not None:
                self._scratch_free.append(scratch)
            raise
        self._onesided_ops[wr_id] = fut  # abort() fails it if the queue pair goes first
        try:
            await fut
            if scratch is not None:
                return int.from_bytes(local.memoryview(), "little")
            return None
        except CompletionError as exc:
            if not self._closed and (self._error is None or exc.status != WC_WR_FLUSH_ERR):
                # This operation's own failure (not a flush caused by another): the precise
                # cause, e.g. RemoteAccessError. The queue pair is now in the error state.
                self._fail(exc)
                raise
            raise self._error_for_pending() from exc
        finally:
            self._onesided_ops.pop(wr_id, None)
            if scratch is not None and not fut.cancelled():
                self._scratch_free.append(scratch)  # read (or failed): free for the next

    # -- revocable exposure (the logic is in aiordma/_window.py) -------------------------------

    async def expose(self, local: LocalSlice, *, read: bool = False, write: bool = False,
                     atomic: bool = False) -> Exposure:
        """Let this endpoint's peer reach ``local`` with exactly the access asked for, until
        the returned :class:`~aiordma.Exposure` is revoked (or this endpoint closes).

        ``local`` is a slice of a region registered on this endpoint's device
        (``region[a:b]``). Where the device has type-2 memory windows (rxe does), the rkey is a
        window bound to this endpoint's queue pair, usable by this peer only; elsewhere it is a
        registration of exactly the range. Send ``exposure.remote.to_wire()`` to the peer.

        Raises:
            LocalProtocolError: not such a slice, an empty range, no access asked for, or
                write/atomic on read-only memory.
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
            self._onesided_ops[wr_id] = fut

            def done(f: asyncio.Future[Any]) -> None:
                self._onesided_ops.pop(wr_id, None)
                exc = None if f.cancelled() else f.exception()
                if isinstance(exc, CompletionError):
                    self._fail(exc)  # the bind failed: the queue pair is in the error state

            fut.add_done_callback(done)
            return fut

        return await Exposure.create(self, local, read=read, write=write, atomic=atomic,
                                     post=post)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        return self._error is not None

    async def aclose(self) -> None:
        """Close gracefully: flush queued messages, tell the peer (with how many messages were
        sent), wait up to ``Config.close_timeout`` for the peer to confirm it received them,
        then release everything (always, even if the graceful part fails)."""
        if self._close_task is None:
            self._close_task = self._loop.create_task(self._graceful_close())
        await asyncio.shield(self._close_task)

    async def _graceful_close(self) -> None:
        try:
            if self._closed or self._error is not None:
                return
            self._closing = True
            async with asyncio.timeout(self.config.close_timeout):
                while (self._sendq or self._rdv_out) and self._error is None:
                    await asyncio.sleep(0.001)
                if self._error is None:
                    self._send_close()
                    await self._peer_close.wait()
        except (TimeoutError, OSError, BrokenResourceError, ClosedResourceError):
            pass
        finally:
            self.abort()

    def abort(self) -> None:
        """Release everything now; every pending operation fails with
        :class:`ClosedResourceError`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._teardown(ClosedResourceError("the endpoint was closed"))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = ("closed" if self._closed else "broken" if self._error else
                 "closing" if self._closing else "open")
        return f"<Endpoint #{self.id} {state} {self.local_address}->{self.peer_address}>"

    # -- internals: sending --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the endpoint is closed")
        if self._error is not None:
            raise self._error_for_pending()

    def _check_send(self) -> None:
        self._check_open()
        if self._closing:
            raise ClosedResourceError("the endpoint is closing")
        if self._peer_sent_total is not None:
            raise BrokenResourceError("the peer closed the connection")

    def _pump(self) -> None:
        """Post queued frames, in order, while there are send slots and credits."""
        q, cr = self._sendq, self._credits
        while q and self._free_send and cr.can_send_data() and self._error is None:
            item = q.popleft()
            if item.waiter is not None and item.waiter.done():  # cancelled before posting
                self._msgs_sent -= 1
                continue
            self._post_frame(item)
            if item.waiter is not None:
                item.waiter.set_result(None)
        self._maybe_send_credit()

    def _maybe_send_credit(self) -> None:
        cr = self._credits
        while cr.credit_frame_needed() and self._free_send and self._error is None:
            self._post_frame(None)

    def _post_frame(self, item: _Outgoing | None) -> None:
        """Build a frame in a free send slot and post it (``None``: a CREDIT frame)."""
        slot = self._free_send.pop()
        base = slot * self._slot
        view = self._send_mr.view
        if item is None:
            c, k = self._credits.send_credit()
            n = framing.pack_credit(view, base, credits=c, ctrl=k)
        else:
            c, k = self._credits.send_data()
            if item.kind is framing.Kind.DATA:
                assert item.payload is not None
                length = item.payload.nbytes
                view[base + framing.HEADER_SIZE:base + framing.HEADER_SIZE + length] = item.payload
                n = framing.pack_data_header(view, base, length, c, k)
            elif item.kind is framing.Kind.RTS:
                n = framing.pack_rts(view, base, size=item.size, address=item.address,
                                     rkey=item.rkey, token=item.token, credits=c, ctrl=k)
            else:
                n = framing.pack_done(view, base, token=item.token, credits=c, ctrl=k)
        self._seq += 1
        seq = self._seq
        self._inflight.append((seq, slot))
        # Ask for a completion now and then, and whenever slots run short, so that a
        # completion always comes to free the slots of the unsignaled posts before it.
        signaled = seq % self.config.signal_every == 0 or len(self._free_send) < 2
        try:
            self._qp.post_send(self._wr_base | _SEND_BIT | (seq & _SEQ_MASK),
                               self._qp._e.IBV_WR_SEND, self._send_mr.address + base, n,
                               self._send_mr.lkey, signaled=signaled)
        except Exception as exc:
            self._fail(BrokenResourceError(f"posting a send failed: {exc}"))
            raise self._error_for_pending() from exc

    # -- internals: receiving ------------------------------------------------------------------

    def _post_slot(self, slot: int) -> None:
        self._qp.post_prepared_recv(self._recv_wrs[slot])

    def _release_slot(self, slot: int, control: bool = False) -> None:
        if self._closed or self._error is not None:
            return
        self._post_slot(slot)
        self._credits.release(control=control)
        self._maybe_send_credit()

    def _on_completion(self, wc: Any) -> None:
        """Reactor route: completions of this endpoint's receive slots and sends."""
        if isinstance(wc, BaseException):  # the reactor closed under us
            self._fail(wc if isinstance(wc, BrokenResourceError)  # e.g. the device was lost
                       else BrokenResourceError("the completion reactor was closed"))
            return
        if wc.status:
            if not self._closed:
                from ._errors import error_from_status

                self._fail(error_from_status(wc.status, opcode=wc.opcode,
                                             vendor_err=wc.vendor_err, what="message transfer"))
            return
        low = wc.wr_id & 0xFFFF_FFFF
        if low & _SEND_BIT:
            seq = low & _SEQ_MASK
            inflight, free = self._inflight, self._free_send
            while inflight:
                s, slot = inflight.popleft()
                free.append(slot)
                if s & _SEQ_MASK == seq:
                    break
            self._pump()
            return
        try:
            frame = framing.parse(self._recv_mr.view, low * self._slot, wc.byte_len)
            control = isinstance(frame, framing.CreditFrame)
            self._credits.received(control=control, credits=frame.credits,
                                   ctrl_credits=frame.ctrl_credits)
            if isinstance(frame, (framing.DataFrame, framing.RtsFrame)):
                if isinstance(frame, framing.RtsFrame) and frame.size > self.config.max_message:
                    raise RemoteProtocolError(f"peer announced a {frame.size} B message; the "
                                              f"limit is {self.config.max_message} B")
                self._msgs_received += 1
                self._inbox.append((low, frame))
                self._wake_receivers()
            elif isinstance(frame, framing.DoneFrame):
                self._release_slot(low)
                entry = self._rdv_out.get(frame.token)
                if entry is None:
                    raise RemoteProtocolError(f"DONE for unknown rendezvous token {frame.token}")
                if not entry[1].done():
                    entry[1].set_result(None)
                else:  # its sender was cancelled: nobody else will deregister it
                    self._rdv_out.pop(frame.token, None)
                    if entry[0] is not None:
                        entry[0].close()
            else:
                self._release_slot(low, control=True)
        except ProtocolError as exc:
            self._fail(RemoteProtocolError(str(exc)))
            return
        except RemoteProtocolError as exc:
            self._fail(exc)
            return
        self._pump()
        self._check_peer_done()

    def _wake_receivers(self) -> None:
        while self._recv_waiters:
            w = self._recv_waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def _next_inbound(self) -> tuple[int, framing.Frame] | None:
        """Wait until a message is at the head of the inbox (not removed), or the end."""
        while True:
            if self._closed:
                raise ClosedResourceError("the endpoint is closed")
            if self._inbox:
                if self._recv_mr.closed:  # the device was lost: the slots' memory is gone
                    self._inbox.clear()
                    raise self._error_for_pending()
                return self._inbox[0]
            if self._error is not None:
                raise self._error_for_pending()
            if self._peer_sent_total is not None and self._msgs_received >= self._peer_sent_total:
                return None
            w: asyncio.Future[None] = self._loop.create_future()
            self._recv_waiters.append(w)
            try:
                await w
            except asyncio.CancelledError:
                if w.done() and not w.cancelled():
                    self._wake_receivers()  # pass the wake-up on to another receiver
                raise

    async def _read_shielded(self, dst: LocalSlice, frame: framing.RtsFrame,
                             owned: MemoryRegion | None = None) -> None:
        """The rendezvous READ, carried on if the caller is cancelled: the device may still
        write into ``dst``, so ``owned`` (the region made for it) is closed only when the READ
        is over, and the peer still gets its DONE. The cancelled caller loses the message."""
        read = self._loop.create_task(self._rendezvous_read(dst, frame))

        def over(t: asyncio.Task[None]) -> None:
            if owned is not None:
                owned.close()
            if not t.cancelled():
                t.exception()  # retrieved: the caller (if still there) gets it

        read.add_done_callback(over)
        await asyncio.shield(read)

    async def _rendezvous_read(self, dst: LocalSlice, frame: framing.RtsFrame) -> None:
        remote = RemoteBuffer(address=frame.address, rkey=frame.rkey, length=frame.size,
                              readable=True)
        if frame.size:
            await self._onesided("rendezvous read", self._qp._e.IBV_WR_RDMA_READ, dst, remote)
        self._sendq.append(_Outgoing(framing.Kind.DONE, token=frame.token))
        self._pump()

    # -- internals: control channel and failure ------------------------------------------------

    def _send_close(self) -> None:
        if self._close_sent:
            return
        self._close_sent = True
        self._writer.write(self._control.send(hs.Close(sent=self._msgs_sent)))

    def _check_peer_done(self) -> None:
        """Answer the peer's Close once every message it sent has arrived."""
        total = self._peer_sent_total
        if total is not None and self._msgs_received >= total:
            if not self._close_sent:
                with contextlib.suppress(Exception):
                    self._send_close()
            self._peer_close.set()
            self._wake_all_receivers()

    async def _control_loop(self) -> None:
        reader, control = self._reader, self._control
        try:
            while True:
                data = await reader.read(65536)
                control.receive_data(data)
                while True:
                    ev = control.next_event()
                    if ev is hs.NEED_DATA:
                        break
                    if isinstance(ev, hs.Close):
                        self._peer_sent_total = ev.sent
                        self._fail_queued_sends(BrokenResourceError("the peer closed the "
                                                                    "connection"))
                        self._check_peer_done()
                    elif isinstance(ev, hs.ConnectionClosed):
                        if self._peer_sent_total is None:
                            self._fail(BrokenResourceError("the peer disconnected"))
                        else:
                            self._peer_close.set()
                        return
                if not data:
                    return
        except ProtocolError as exc:
            self._fail(RemoteProtocolError(f"control channel: {exc}"))
        except (ConnectionError, OSError) as exc:
            self._fail(BrokenResourceError(f"control channel: {exc}"))
        except asyncio.CancelledError:
            raise

    def _error_for_pending(self) -> BaseException:
        """The exception for an operation that finds the endpoint closed or broken."""
        if self._closed:
            return ClosedResourceError("the endpoint was closed")
        err = self._error
        new: AiordmaError = (RemoteProtocolError(str(err)) if isinstance(err, RemoteProtocolError)
                             else BrokenResourceError(str(err)))
        new.__cause__ = err
        return new

    def _fail(self, exc: BaseException) -> None:
        """The peer or the network broke the endpoint: flush everything, wake every waiter."""
        if self._closed:
            return
        if self._error is not None:
            # A flush often arrives before the completion that caused it: keep the cause.
            if (isinstance(self._error, CompletionError) and self._error.status == WC_WR_FLUSH_ERR
                    and isinstance(exc, CompletionError) and exc.status != WC_WR_FLUSH_ERR):
                self._error = exc
            return
        self._error = exc
        self._qp.to_error()  # outstanding work requests complete now, flushed
        self._wake_everyone(self._error_for_pending())
        self._peer_close.set()

    def _fail_queued_sends(self, exc: BaseException) -> None:
        while self._sendq:
            item = self._sendq.popleft()
            if item.waiter is not None and not item.waiter.done():
                item.waiter.set_exception(exc)

    def _wake_all_receivers(self) -> None:
        while self._recv_waiters:
            w = self._recv_waiters.popleft()
            if not w.done():
                w.set_result(None)

    def _wake_everyone(self, exc: BaseException) -> None:
        self._fail_queued_sends(exc)
        self._wake_all_receivers()
        for _mr, fut in list(self._rdv_out.values()):
            if not fut.done():
                fut.set_exception(exc)

    def _teardown(self, exc: BaseException) -> None:
        """Release everything: queue pair first (the device stops touching memory), then the
        waiters, the route, the memory and the TCP connection."""
        count_resource("endpoints", -1)  # once: abort() runs this only the first time
        release_exposures(self)  # memory windows hold the queue pair: release them first
        self._qp.close()
        self._wake_everyone(exc)
        for wr_id, fut in list(self._onesided_ops.items()):
            self._reactor.unwatch(wr_id)
            resolve_future(fut, exc)
        self._onesided_ops.clear()
        for _ in range(self.config.max_onesided):  # wake any caller waiting for a place: it
            self._onesided_slots.release()  # finds the endpoint closed
        self._reactor.remove_route(self._route)
        release_shared(self._reactor, self._entries)
        for mr, _fut in self._rdv_out.values():
            if mr is not None:  # (None: the caller's own region)
                mr.close()
        self._rdv_out.clear()
        self._reg_cache.close()
        for wr in self._recv_wrs:
            wr.close()  # frees its SGE array (pyverbs does not on garbage collection)
        self._recv_wrs = []
        for mr in (*self._regions, self._scratch, self._recv_mr, self._send_mr):
            mr.close()
        self._regions.clear()
        self._control_task.cancel()
        self._writer.transport.abort()
        self._peer_close.set()

