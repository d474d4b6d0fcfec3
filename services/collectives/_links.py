"""Directed links: how one rank moves data to another.

For every ordered pair of ranks ``(a, b)`` a group holds one endpoint on which ``a`` sends and
``b`` receives; ``a`` holds it as an :class:`Outbound`, ``b`` as an :class:`Inbound`. Data
only flows from ``a`` to ``b`` on it, and only credits flow back, so neither side ever has to
tell apart what it receives.

Pieces
    A piece is a byte range of the collective's logical buffer, at most one of ``b``'s
    receive slots long; both sides cut a range into pieces the same way (by ``b``'s slot
    size). A piece of at most ``inline_max`` bytes travels inside an ``Inline`` message (one
    SEND, copied out of the sender's buffer at once, no credit). A larger one is RDMA-written
    into ``b``'s next slot and announced by a ``Piece`` message posted right behind the WRITE
    on the same queue pair (:meth:`aiordma.Endpoint.post_write`): when ``b`` receives the
    message the data is in place, and ``a`` never waits for the WRITE's acknowledgement on
    the way. ``b`` consumes pieces in order and returns the slots as ``Credit`` messages, a
    half of its slots at a time (the writer stalls only when all are out, and by then the
    reader has at least half of them to consume, so credits always come back).

Buffers a WRITE reads from
    Until a WRITE is acknowledged the device may still read its source; :meth:`Outbound.settle`
    waits for the WRITEs that read a byte range, and the algorithms call it before they write
    into a range they sent from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aiordma import BrokenResourceError, Endpoint, MemoryRegion, RemoteBuffer, RemoteProtocolError
from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import ProtocolError

from ._errors import CollectiveMismatchError

__all__ = ["Inbound", "Outbound", "mismatch", "pieces"]

_GONE = ("PEER_CLOSED", "CLOSED")  # endpoint states once the peer closed gracefully


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


async def receive_event(ep: Endpoint, peer: int) -> proto.Event:
    """The next collectives message on ``ep``, from rank ``peer``."""
    data = await ep.recv()
    if data is None:
        raise BrokenResourceError(f"rank {peer} left the group (closed its connection)")
    try:
        return proto.decode(data)
    except ProtocolError as exc:
        raise RemoteProtocolError(f"rank {peer}: {exc}") from exc


class Outbound:
    """This rank's sending end of the link to ``peer``: credits for the peer's slots, the
    WRITEs still unacknowledged, and the messages (see the module documentation)."""

    def __init__(self, *, ep: Endpoint, peer: int, remote: RemoteBuffer, count: int,
                 size: int, inline_max: int) -> None:
        self.ep, self.peer = ep, peer
        self.remote, self.count, self.size = remote, count, size
        self.inline_max = inline_max
        self._credits = count
        self._written = 0  # slot pieces written (the peer's slot is written % count)
        # WRITEs not yet known acknowledged: (region, lo, hi, ack)
        self._pending: list[tuple[MemoryRegion, int, int, asyncio.Future[None]]] = []

    async def _take_credit(self) -> None:
        while self._credits == 0:
            ev = await receive_event(self.ep, self.peer)
            if not isinstance(ev, proto.Credit):
                raise RemoteProtocolError(f"rank {self.peer} sent {ev!r:.200}, not a Credit")
            self._credits += ev.count
        self._credits -= 1

    async def put(self, region: MemoryRegion, data: np.ndarray, call: int, step: int,
                  lo: int, hi: int, sig: int, unit: int = 1) -> None:
        """Send bytes ``lo:hi`` of ``data`` (a uint8 view of ``region``'s buffer, starting at
        its byte 0) as pieces of whole ``unit``-byte items, inline or written (returns once
        all are posted)."""
        for a, b in pieces(lo, hi, self.size, unit):
            if b - a <= self.inline_max:
                await self.ep.send(proto.encode(proto.Inline(
                    call=call, step=step, offset=a, signature=sig, data=data[a:b].tobytes())))
                continue
            await self._take_credit()
            slot = self._written % self.count
            self._written += 1
            base = slot * self.size
            note = proto.encode(proto.Piece(call=call, step=step, slot=slot, offset=a,
                                            nbytes=b - a, signature=sig))
            ack = await self.ep.post_write(region[a:b], self.remote[base:base + b - a],
                                           notify=note)
            self._pending.append((region, a, b, ack))

    async def collect(self) -> None:
        """Take the credits that have already come back, without waiting for more (the
        endpoint returns a message it holds at once)."""
        while self.ep.stats().inbox:
            ev = await receive_event(self.ep, self.peer)
            if not isinstance(ev, proto.Credit):
                raise RemoteProtocolError(f"rank {self.peer} sent {ev!r:.200}, not a Credit")
            self._credits += ev.count

    async def fits(self, lo: int, hi: int, unit: int = 1) -> bool:
        """Whether :meth:`put` of ``lo:hi`` can post everything without waiting for a credit
        (so a caller may receive only after it has sent, with no risk of a circular wait),
        counting the credits that have come back."""
        need = sum(1 for a, b in pieces(lo, hi, self.size, unit) if b - a > self.inline_max)
        if need > self._credits:
            await self.collect()
        return need <= self._credits

    async def settle(self, region: MemoryRegion | None = None, lo: int = 0,
                     hi: int | None = None) -> None:
        """Wait until no WRITE of this link still reads bytes ``lo:hi`` of ``region``
        (default: any region, any bytes)."""
        keep = []
        for r, a, b, ack in self._pending:
            if (region is None or r is region) and (hi is None or a < hi) and lo < b:
                await ack
            elif not ack.done():
                keep.append((r, a, b, ack))
        self._pending = keep

    async def send_value(self, call: int, step: int, origin: int, value: Any) -> None:
        await self.ep.send(proto.encode(proto.Value(call=call, step=step, origin=origin,
                                                    value=value)))


class Inbound:
    """This rank's receiving end of the link from ``peer``: its receive slots (exposed to the
    peer for RDMA WRITE), pieces taken in order, credits owed."""

    def __init__(self, *, ep: Endpoint, peer: int, slots: np.ndarray, count: int,
                 size: int) -> None:
        self.ep, self.peer = ep, peer
        self.slots, self.count, self.size = slots, count, size
        self._read = 0  # slot pieces taken
        self._owed = 0  # slots consumed and not yet returned
        self._in_slot = False  # the piece last taken sits in a slot (release returns it)

    async def get(self, call: int, step: int, lo: int, hi: int, sig: int) -> np.ndarray:
        """The bytes of the expected piece ``lo:hi`` (at most one slot): a view of the slot
        or of the message, valid until :meth:`release`."""
        ev = await receive_event(self.ep, self.peer)
        if type(ev) is proto.Inline:
            if (ev.call, ev.step, ev.offset, ev.signature, len(ev.data)) != (
                    call, step, lo, sig, hi - lo):
                raise mismatch(f"piece {lo}:{hi} of call {call} step {step}", ev, self.peer)
            self._in_slot = False
            return np.frombuffer(ev.data, np.uint8)
        slot = self._read % self.count
        want = proto.Piece(call=call, step=step, slot=slot, offset=lo, nbytes=hi - lo,
                           signature=sig)
        if ev != want:
            raise mismatch(repr(want), ev, self.peer)
        self._read += 1
        self._in_slot = True
        base = slot * self.size
        return self.slots[base:base + hi - lo]

    async def release(self) -> None:
        """The piece last taken is consumed: owe its slot back, and return half the slots at
        a time. Not to a peer that has closed gracefully: it writes nothing more (the credit
        for the last piece of a collective may cross its close)."""
        if not self._in_slot:
            return
        self._in_slot = False
        self._owed += 1
        if self._owed < max(1, self.count // 2):
            return
        owed, self._owed = self._owed, 0
        ep = self.ep
        if ep.state in _GONE:
            return
        try:
            await ep.send(proto.encode(proto.Credit(count=owed)))
        except BrokenResourceError:
            if ep.state not in _GONE:
                raise

    async def take(self, call: int, step: int, lo: int, hi: int, sig: int,
                   into: Callable[[int, int, np.ndarray], None], unit: int = 1,
                   guard: Callable[[int, int], Awaitable[None]] | None = None) -> None:
        """Take the pieces of ``lo:hi`` in order, handing each to ``into(a, b, bytes)`` (which
        copies or combines it) before its slot is released; ``guard(a, b)``, if given, is
        awaited first (e.g. until no WRITE still reads the bytes ``into`` overwrites)."""
        for a, b in pieces(lo, hi, self.size, unit):
            got = await self.get(call, step, a, b, sig)
            if guard is not None:
                await guard(a, b)
            into(a, b, got)
            await self.release()

    async def recv_value(self, call: int, step: int, origin: int) -> Any:
        ev = await receive_event(self.ep, self.peer)
        if not (type(ev) is proto.Value and (ev.call, ev.step, ev.origin)
                == (call, step, origin)):
            raise mismatch(f"Value(call={call}, step={step}, origin={origin})", ev, self.peer)
        return ev.value
