"""Directed links: how one rank moves data to another, and how its messages are filed.

For every ordered pair of ranks ``(a, b)`` a group holds one endpoint on which ``a`` sends and
``b`` receives; ``a`` holds it as an :class:`Outbound`, ``b`` as an :class:`Inbound`. Data
only flows from ``a`` to ``b`` on it, and only credits flow back. The links belong to the
whole group: its subgroups, and all the operations running at the same time, share them.

Pieces
    A piece is a byte range of an operation's logical buffer, at most one of ``b``'s receive
    slots long; both sides cut a range into pieces the same way (by ``b``'s slot size). A
    piece of at most ``inline_max`` bytes travels inside an ``Inline`` message (one SEND,
    copied out of the sender's buffer at once, no credit). A larger one is RDMA-written into
    ``b``'s next slot with its ``Piece`` (the note) gathered behind it, as one WRITE with
    immediate data (``post_write(..., imm=)``; :mod:`aiordma.protocols.collectives`, "Written
    pieces"): ``b`` gets it in order among the messages once the data is in place, and ``a``
    never waits for the WRITE's acknowledgement on the way.
    ``b`` returns slots as ``Credit`` messages (:class:`~aiordma.protocols.collectives.SlotLedger`
    says when), and ``a`` waits for a credit when all its slots are out
    (:class:`~aiordma.protocols.collectives.SlotWriter`).

Links over TCP
    A group whose links are :class:`~aiordma.TcpChannel` s (see :mod:`._mesh`) has no slots
    to write into: ``b`` announces a piece size (what one of its messages carries) instead,
    every piece travels inline (``inline_max`` is that size), nothing is registered, and no
    credit flows (``count`` is 0; the channel's own flow control holds a sender back). The
    filing below is the same.

Filing (several operations in flight)
    Every message is read as it arrives, from formation to close (by the operation waiting on
    the link, else by a background reader: see :class:`Inbound`), and filed under its tag's
    key (group, channel, call), handed at once to the operation waiting for that key, if there
    is one; otherwise it waits in that key's queue (an operation that is behind, or not
    started yet on this rank). A message whose tag this
    rank cannot be running (a finished call, another kind: see
    :class:`~aiordma.protocols.collectives.CallOrder`) breaks the group with a typed error.
    A queued piece keeps its slot; when every slot of the link is in use, the reader copies
    the queued pieces out and gives their slots back, so a link never waits for an operation
    that is waiting for something else: whatever the operations wait on, every link drains,
    and no set of operations can wait on each other in a circle through the slots.

Buffers a WRITE reads from
    Until a WRITE is acknowledged the device may still read its source; :meth:`Outbound.settle`
    waits for the WRITEs that read a byte range, and the algorithms call it before they write
    into a range they sent from.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from aiordma import (
    BrokenResourceError,
    ClosedResourceError,
    Endpoint,
    Immediate,
    LocalProtocolError,
    MemoryRegion,
    RemoteBuffer,
    RemoteProtocolError,
    TcpChannel,
)
from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import ProtocolError

from ._errors import CollectiveMismatchError
from ._errors import fresh as _fresh

__all__ = ["Delivery", "Inbound", "Link", "Outbound", "Router", "eager", "mismatch", "pieces"]

_GONE = ("PEER_CLOSED", "CLOSED")  # endpoint states once the peer closed gracefully
Key = tuple[int, int, int]
Link = Endpoint | TcpChannel
"""A link's connection: an RDMA endpoint, or a TCP channel (every message inline)."""


class Router(Protocol):
    """What the links report to (the group's :class:`~._fabric.Fabric`)."""

    def check(self, event: proto.Piece | proto.Value | proto.Inline, peer: int) -> None:
        """Raise if this rank cannot be running the operation ``event`` belongs to."""

    def signal(self, event: proto.Value) -> None:
        """A window's signal arrived (its data is in place): count it (see :mod:`._window`)."""

    def fault(self, peer: int, reason: str) -> BaseException:
        """Rank ``peer`` reported that the group broke (a :class:`proto.Fault`); the error the
        reader raises (the operation reading, if one is, fails with it)."""

    def failed(self, exc: BaseException, peer: int) -> None:
        """The link with ``peer`` broke, or brought something that breaks the group."""


def pieces(lo: int, hi: int, size: int, unit: int = 1) -> list[tuple[int, int]]:
    """Byte range ``lo:hi`` cut into pieces of at most ``size`` bytes and whole ``unit``-byte
    items (both ends of a link cut a range this way, with the receiver's slot size)."""
    if hi - lo <= size and hi - lo >= unit:  # the common case: one piece
        return [(lo, hi)]
    per = max(1, size // unit)
    return [(a * unit, b * unit) for a, b in proto.piece_bounds(lo // unit, hi // unit, per)]


def mismatch(expected: str, got: proto.Event, peer: int) -> CollectiveMismatchError:
    return CollectiveMismatchError(f"expected {expected}, rank {peer} sent {got!r:.300}; the "
                                   f"ranks are not running the same collectives")


def _order_mismatch(tag: proto.Tag, got: proto.Piece | proto.Value | proto.Inline,
                    peer: int) -> CollectiveMismatchError:
    what = "collective" if tag.channel == 0 else "message"
    return CollectiveMismatchError(
        f"{what} #{tag.call}: rank {peer} started {proto.KINDS[got.op]}, this rank "
        f"{proto.KINDS[tag.op]}; every rank must start a group's collectives in the same order")


async def receive_event(ep: Link, peer: int) -> proto.Event:
    """The next collectives message on ``ep``, from rank ``peer`` (formation only: afterwards
    the links' readers take every message)."""
    data = await ep.recv()
    if data is None:
        raise BrokenResourceError(f"rank {peer} left the group (closed its connection)")
    try:
        return proto.decode(data)
    except ProtocolError as exc:
        raise RemoteProtocolError(f"rank {peer}: {exc}") from exc


def eager(ep: Link, message: bytes) -> bytes:
    """``message``, checked to go eagerly (in one of the peer's receive slots). Every message
    on an RDMA data link must: an operation that takes over reading a link from its background
    reader cancels that reader's ``recv()``, which is safe only while it waits for a message,
    not while it RDMA-READs a rendezvous one (the endpoint would drop that message). A TCP
    channel's ``recv()`` is safe to cancel whatever the size (the message stays queued), and
    its ``send()`` refuses what the peer does not accept.

    Raises:
        LocalProtocolError: the message is too large for the endpoints' slots
            (``Config.slot_size``; e.g. an array description of very many fields).
    """
    if len(message) > ep.eager_max and ep.transport == "rdma":  # (RDMA: the common case)
        raise LocalProtocolError(f"a {len(message)} B collectives message does not fit the "
                                 f"links' {ep.eager_max} B message slots: use a larger "
                                 f"Config.slot_size")
    return message


class Outbound:
    """This rank's sending end of the link to ``peer``: credits for the peer's slots, the
    WRITEs still unacknowledged, and the messages (see the module documentation)."""

    def __init__(self, *, ep: Link, peer: int, remote: RemoteBuffer | None, count: int,
                 size: int, inline_max: int) -> None:
        self.ep, self.peer = ep, peer
        self.remote, self.count, self.size = remote, count, size
        self.inline_max = inline_max
        self.stride = size + proto.NOTE_BYTES  # (the peer's slots, each with a note's room)
        self._slots = proto.SlotWriter(max(count, 1))  # (count 0: a TCP link, none taken)
        self._notes = (ep.register(bytearray(count * proto.NOTE_BYTES))
                       if count and isinstance(ep, Endpoint) else None)
        self._credit_waiters: list[asyncio.Future[None]] = []
        self._gone: BaseException | None = None
        self._lock = asyncio.Lock()  # a slot is taken and its WRITE and message posted at once
        # WRITEs not yet known acknowledged: (region, lo, hi, ack)
        self._pending: list[tuple[MemoryRegion, int, int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self, router: Router) -> None:
        """Start the reader of the peer's credits."""
        self._task = asyncio.get_running_loop().create_task(self._read(router))

    def stop(self) -> None:
        """Stop the reader; operations waiting for credits fail (the group is closing)."""
        if self._task is not None:
            self._task.cancel()
        if self._gone is None:
            self._end(ClosedResourceError("the group was closed"))

    async def _read(self, router: Router) -> None:
        try:
            while True:
                data = await self.ep.recv()
                if data is None:
                    self._end(BrokenResourceError(f"rank {self.peer} left the group (closed "
                                                  f"its connection)"))
                    return
                try:
                    ev = proto.decode(data)
                    if type(ev) is not proto.Credit:
                        raise RemoteProtocolError(f"sent {ev!r:.200}, not a Credit")
                    self._slots.credit(ev.count)
                except ProtocolError as exc:
                    raise RemoteProtocolError(f"rank {self.peer}: {exc}") from exc
                waiters, self._credit_waiters = self._credit_waiters, []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001  (every failure is the group's)
            self._end(exc)
            router.failed(exc, self.peer)

    def _end(self, exc: BaseException) -> None:
        self._gone = exc
        waiters, self._credit_waiters = self._credit_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(_fresh(exc))

    async def _take_slot(self) -> int:
        while (slot := self._slots.take()) is None:
            if self._gone is not None:
                raise _fresh(self._gone)
            fut = asyncio.get_running_loop().create_future()
            self._credit_waiters.append(fut)
            await fut
        return slot

    async def put(self, region: MemoryRegion | None, data: np.ndarray, call: proto.Tag, step: int,
                  lo: int, hi: int, sig: int, unit: int = 1, base: int = 0) -> None:
        """Send bytes ``lo:hi`` of ``data`` (a uint8 view of ``region``'s buffer, starting at
        its byte 0) as pieces of whole ``unit``-byte items, inline or written (returns once
        all are posted). The messages give each piece's offset from ``base`` (where the
        receiver's range starts in the sender's buffer; both ends then cut it alike). Over
        TCP every piece is inline, and ``region`` is None (nothing is registered)."""
        g, ch, c, op = call.group, call.channel, call.call, call.op
        for a, b in pieces(lo, hi, self.size, unit):
            if b - a <= self.inline_max:
                await self.ep.send(eager(self.ep, proto.encode_inline(
                    call, step, a - base, sig, data[a:b].tobytes())))
                continue
            assert region is not None and self.remote is not None  # (RDMA links only)
            async with self._lock:
                slot = await self._take_slot()
                ack = await self._write(region, a, b, slot, proto.encode(proto.Piece(
                    group=g, channel=ch, call=c, op=op, step=step, slot=slot, offset=a - base,
                    nbytes=b - a, signature=sig)))
            self._pending.append((region, a, b, ack))
        if len(self._pending) > 64:  # (acknowledged WRITEs of buffers nobody settles now)
            self._pending = [p for p in self._pending if not p[3].done()]

    async def _write(self, region: MemoryRegion, a: int, b: int, slot: int,
                     note: bytes) -> asyncio.Future[None]:
        """Post the WRITE of ``region[a:b]`` into the peer's ``slot``, its note behind it."""
        at, n = slot * self.stride, len(note)
        ep, notes = self.ep, self._notes
        assert isinstance(ep, Endpoint) and self.remote is not None
        if notes is None or n > proto.NOTE_BYTES or slot >> 16:  # (the note as a message)
            return await ep.post_write(region[a:b], self.remote[at:at + b - a],
                                       notify=eager(ep, note))
        lo = slot * proto.NOTE_BYTES
        notes.view[lo:lo + n] = note
        return await ep.post_write((region[a:b], notes[lo:lo + n]),
                                   self.remote[at:at + b - a + n], imm=proto.note_imm(slot, n))

    @property
    def writing(self) -> bool:
        """Some WRITE of this link may not be acknowledged yet."""
        return bool(self._pending)

    def fits(self, lo: int, hi: int, unit: int = 1) -> bool:
        """Whether :meth:`put` of ``lo:hi`` finds a credit for each piece right now (a caller
        may then send before it receives; it is safe either way, see the module's "Filing")."""
        n = hi - lo
        if unit <= n <= self.size:  # one piece (pieces()'s common case), inline or written
            return n <= self.inline_max or self._slots.credits > 0
        need = sum(1 for a, b in pieces(lo, hi, self.size, unit) if b - a > self.inline_max)
        return need <= self._slots.credits

    async def settle(self, region: MemoryRegion | None = None, lo: int = 0,
                     hi: int | None = None) -> None:
        """Wait until no WRITE of this link still reads bytes ``lo:hi`` of ``region``
        (default: any region, any bytes)."""
        acks = [ack for r, a, b, ack in self._pending
                if (region is None or r is region) and (hi is None or a < hi) and lo < b]
        for ack in acks:
            await ack
        if acks:  # (others may have added WRITEs meanwhile: keep every one not yet done)
            self._pending = [p for p in self._pending if not p[3].done()]

    async def send_value(self, call: proto.Tag, step: int, origin: int, value: Any) -> None:
        await self.ep.send(self.value_message(call, step, origin, value))

    def value_message(self, call: proto.Tag, step: int, origin: int, value: Any) -> bytes:
        """A ``Value`` of ``call`` as this link sends it (checked to go eagerly)."""
        return eager(self.ep, proto.encode(proto.Value(
            group=call.group, channel=call.channel, call=call.call, op=call.op, step=step,
            origin=origin, value=value)))


class Delivery:
    """A message filed for an operation: the event, its bytes (a view of the slot while
    ``piece`` is set, else of the message or a copy), and the slot's piece number."""

    __slots__ = ("data", "event", "piece")

    def __init__(self, event: proto.Piece | proto.Value | proto.Inline,
                 data: np.ndarray | None, piece: int | None) -> None:
        self.event, self.data, self.piece = event, data, piece


class Inbound:
    """This rank's receiving end of the link from ``peer``: its receive slots (exposed to the
    peer for RDMA WRITE), the messages filed by tag, the credits owed.

    Who reads the endpoint: an operation waiting for a message that is not filed yet reads it
    itself (and files whatever else comes first), so the common case, one operation waiting,
    costs no hand-over between tasks; while no operation reads, a background reader does (so
    every message is filed and checked as it arrives), and an operation that comes to wait
    takes over from it (cancelling it where it waits for a message: the endpoint keeps that
    message for the next receiver). When an operation stops reading, the background reader
    starts one turn of the event loop later (:meth:`_resume_soon`): in a run of collectives
    the next operation usually comes to wait first and just reads on, with no reader to
    create and cancel per message.
    """

    def __init__(self, *, ep: Link, peer: int, slots: np.ndarray, count: int,
                 size: int) -> None:
        self.ep, self.peer = ep, peer
        self.slots, self.count, self.size = slots, count, size  # count 0: a TCP link
        self.stride = size + proto.NOTE_BYTES  # (a slot and its note's room)
        # (an RDMA link's endpoint accepts WRITEs with immediate data: the written pieces)
        self._recv: Callable[[], Awaitable[Any]] = (
            ep.recv_event if isinstance(ep, Endpoint) else ep.recv)
        self._ledger = proto.SlotLedger(max(count, 1))
        self._queues: dict[Key, deque[Delivery]] = {}
        self.filed = self._queues  # (read-only outside: empty while nothing is filed)
        self._waiters: dict[Key, asyncio.Future[Delivery]] = {}
        self._gone: BaseException | None = None
        self._router: Router | None = None
        self._idle: asyncio.Task[None] | None = None  # the background reader
        self._idle_in_recv = False  # ... and it waits in ep.recv() (safe to cancel)
        self._leading = False  # an operation reads the endpoint itself
        self._resuming = False  # a _resume is scheduled (see _resume_soon)
        self._stopped = False
        self._stalled = False  # every slot is in use: _unstall() (after _take())

    def start(self, router: Router) -> None:
        """Start filing this link's messages."""
        self._router = router
        self._resume()

    def stop(self) -> None:
        """Stop reading; operations waiting for messages fail (the group is closing)."""
        self._stopped = True
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._gone is None:
            self._end(ClosedResourceError("the group was closed"))

    # -- reading -----------------------------------------------------------------------------

    def _resume(self) -> None:
        """Nobody reads the endpoint now: the background reader does, while the link lives."""
        self._resuming = False  # (a _resume_soon's call, or an earlier one: either way, done)
        if (self._idle is None and not self._leading and not self._stopped
                and self._gone is None and self._router is not None):
            self._idle = asyncio.get_running_loop().create_task(self._read_idle())

    def _resume_soon(self) -> None:
        """An operation stopped reading: :meth:`_resume` after this turn of the loop, unless
        an operation leads again by then (creating the reader at once, only to cancel it
        when the next collective waits on the link, is a task's life per message: see the
        report of 2026-11-26 on the collectives' bench rows)."""
        if not self._resuming:
            self._resuming = True
            asyncio.get_running_loop().call_soon(self._resume)

    async def _read_idle(self) -> None:
        me = asyncio.current_task()
        try:
            while True:
                self._idle_in_recv = True
                try:
                    data = await self._recv()
                finally:
                    self._idle_in_recv = False
                if not self._take(data):
                    return
                if self._stalled:
                    await self._unstall()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001  (every failure is the group's)
            self._broke(exc)
        finally:
            if self._idle is me:
                self._idle = None

    async def _lead(self, fut: asyncio.Future[Delivery]) -> None:
        """Read the endpoint until ``fut`` (this operation's message) is there."""
        idle, self._idle = self._idle, None
        if idle is not None:
            idle.cancel()  # (it waits in recv(): a message stays in the endpoint for us)
        self._leading = True
        try:
            while not fut.done():
                if not self._take(await self._recv()):
                    break
                if self._stalled:
                    await self._unstall()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001  (every failure is the group's)
            self._broke(exc)
        finally:
            self._leading = False
            self._resume_soon()

    def _broke(self, exc: BaseException) -> None:
        self._end(exc)
        if self._router is not None:
            self._router.failed(exc, self.peer)

    def _take(self, data: bytearray | Immediate | None) -> bool:
        """File one message read from the endpoint; False at its end (the peer closed). The
        caller then unstalls the link if every slot is in use (see :meth:`_unstall`).

        Raises:
            RemoteProtocolError, CollectiveMismatchError: what came cannot be filed (the
                group breaks).
        """
        peer, router = self.peer, self._router
        assert router is not None
        if data is None:
            self._end(BrokenResourceError(f"rank {peer} left the group (closed its "
                                          f"connection)"))
            return False
        try:
            if type(data) is Immediate:  # a written piece: its note is behind its data
                ev: proto.Event = proto.written_piece(data.value, data.nbytes, self.slots,
                                                      self.count, self.size)
            else:
                ev = proto.decode(data)  # type: ignore[arg-type]
        except ProtocolError as exc:
            raise RemoteProtocolError(f"rank {peer}: {exc}") from exc
        t = type(ev)
        if t is proto.Piece:
            router.check(ev, peer)  # type: ignore[arg-type]
            if not self.count:
                raise RemoteProtocolError(f"rank {peer} announced a written piece on a TCP "
                                          f"link (it has no slots)")
            try:
                piece = self._ledger.fill(ev.slot)  # type: ignore[attr-defined]
            except ProtocolError as exc:
                raise RemoteProtocolError(f"rank {peer}: {exc}") from exc
            base = ev.slot * self.stride  # type: ignore[attr-defined]
            self._file(ev, self.slots[base:base + ev.nbytes], piece)  # type: ignore
            self._stalled = self._ledger.stalled  # (the caller unstalls)
        elif t is proto.Inline:
            router.check(ev, peer)  # type: ignore[arg-type]
            self._file(ev, np.frombuffer(ev.data, np.uint8), None)  # type: ignore
        elif t is proto.Value:
            if ev.channel == proto.SIGNAL_CHANNEL:  # type: ignore[attr-defined]
                router.signal(ev)  # type: ignore[arg-type]
                return True  # (a window's signal: counted, never filed; see _window)
            router.check(ev, peer)  # type: ignore[arg-type]
            self._file(ev, None, None)  # type: ignore[arg-type]
        elif t is proto.Fault:
            raise router.fault(peer, ev.reason)  # type: ignore[attr-defined]
        else:
            raise RemoteProtocolError(f"rank {peer} sent {ev!r:.200} on a data link")
        return True

    def _file(self, ev: proto.Piece | proto.Value | proto.Inline, data: np.ndarray | None,
              piece: int | None) -> None:
        key = (ev.group, ev.channel, ev.call)
        d = Delivery(ev, data, piece)
        fut = self._waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(d)
            return
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
        q.append(d)

    async def _unstall(self) -> None:
        """Every slot is in use: copy the queued pieces out of their slots and give the slots
        back (see the module's "Filing")."""
        self._stalled = False
        for q in self._queues.values():
            for d in q:
                if d.piece is not None:
                    assert d.data is not None
                    d.data = d.data.copy()
                    self._ledger.release(d.piece)
                    d.piece = None
        await self._give_back()

    def _end(self, exc: BaseException) -> None:
        self._gone = exc
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(_fresh(exc))

    async def _give_back(self) -> None:
        n = self._ledger.due()
        if not n:
            return
        ep = self.ep
        if ep.state in _GONE:  # a peer that closed gracefully writes nothing more
            return
        try:
            await ep.send(eager(ep, proto.encode(proto.Credit(count=n))))
        except (BrokenResourceError, ClosedResourceError):
            if ep.state not in _GONE and self._gone is None:
                raise

    # -- what operations call ----------------------------------------------------------------

    async def next(self, key: Key) -> Delivery:
        """The next message filed under ``key`` (waiting for it if none is there yet)."""
        q = self._queues.get(key)
        if q:
            d = q.popleft()
            if not q:
                del self._queues[key]
            return d
        if self._gone is not None:
            raise _fresh(self._gone)
        if key in self._waiters:
            raise RuntimeError(f"two receivers for {key} on the link from rank {self.peer}")
        fut: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        try:
            if not self._leading and (self._idle is None or self._idle_in_recv):
                await self._lead(fut)
            return await fut  # (done already, unless another reads for it)
        except asyncio.CancelledError:
            if self._waiters.get(key) is fut:
                del self._waiters[key]
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                self._queues.setdefault(key, deque()).appendleft(fut.result())  # not taken
            raise

    def leftover(self, key: Key) -> Delivery | None:
        """Take what is still filed under ``key`` (an operation that ended left it: the
        sender ran something else); its first message, or None."""
        q = self._queues.pop(key, None)
        if not q:
            return None
        for d in q:
            if d.piece is not None:
                self._ledger.release(d.piece)
                d.piece = None
        return q[0]

    async def release(self, d: Delivery) -> None:
        """``d`` is consumed: its slot may be given back."""
        if d.piece is None:
            return
        self._ledger.release(d.piece)
        d.piece = None
        await self._give_back()

    def _expected(self, d: Delivery, call: proto.Tag, step: int, lo: int, hi: int,
                  sig: int) -> BaseException | None:
        """None if ``d`` is the piece ``lo:hi`` (at most one slot) of ``call``'s step
        ``step``, else the error to raise (after releasing it)."""
        ev = d.event
        if ev.op != call.op:
            return _order_mismatch(call, ev, self.peer)
        t = type(ev)
        if t is proto.Inline:
            if (ev.step, ev.offset, ev.signature, len(ev.data)) == (  # type: ignore
                    step, lo, sig, hi - lo):
                return None
        elif t is proto.Piece and (ev.step, ev.offset, ev.nbytes, ev.signature) == (  # type: ignore
                step, lo, hi - lo, sig):
            return None
        return mismatch(f"piece {lo}:{hi} of step {step} of {proto.KINDS[call.op]} "
                        f"#{call.call}", ev, self.peer)

    async def take(self, call: proto.Tag, step: int, lo: int, hi: int, sig: int,
                   into: Callable[[int, int, np.ndarray], None], unit: int = 1,
                   guard: Callable[[int, int], Awaitable[None]] | None = None) -> None:
        """Take the pieces of ``lo:hi`` in order, handing each to ``into(a, b, bytes)`` (which
        copies or combines it) before its slot is released; ``guard(a, b)``, if given, is
        awaited first (e.g. until no WRITE still reads the bytes ``into`` overwrites).

        Raises:
            CollectiveMismatchError: what came is not the expected piece (another operation,
                step, offset, size or signature); it is released first.
        """
        key = call[:3]  # (Tag.key, without its call)
        for a, b in pieces(lo, hi, self.size, unit):
            d = await self.next(key)
            exc = self._expected(d, call, step, a, b, sig)
            if exc is not None:
                await self.release(d)
                raise exc
            if guard is not None:
                await guard(a, b)
            assert d.data is not None
            into(a, b, d.data)
            if d.piece is not None:  # (an inline piece has no slot to give back)
                await self.release(d)

    async def recv_value(self, call: proto.Tag, step: int, origin: int) -> Any:
        d = await self.next(call.key)
        ev = d.event
        if ev.op != call.op:
            await self.release(d)
            raise _order_mismatch(call, ev, self.peer)
        if not (type(ev) is proto.Value and (ev.step, ev.origin) == (step, origin)):
            await self.release(d)
            raise mismatch(f"Value(step={step}, origin={origin}) of {proto.KINDS[call.op]} "
                           f"#{call.call}", ev, self.peer)
        return ev.value
