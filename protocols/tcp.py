"""The TCP transport's message protocol, sans-I/O: an endpoint's message semantics
(:mod:`aiordma.transport`) over one reliable byte stream.

A connection set up for TCP (:mod:`aiordma.protocols.handshake`: ``TcpHello``, ``TcpAccept``,
``Ready``) goes on carrying the frames below on the same byte stream. :class:`StreamMessages`
holds every rule of them: framing, flow control, the receive buffer and closing. The channel
(``aiordma._tcp.channel``) only drives it: it feeds received bytes and its application's calls
in, writes out :attr:`~StreamMessages.outgoing`, and wakes the callers that
:attr:`~StreamMessages.done` and :attr:`~StreamMessages.dropped` name. Nothing here touches a
socket, so two instances joined by a list of byte chunks are tested with hypothesis anywhere
(``tests/unit/test_protocol_tcp.py``).

Frames
    A 12-byte header, then a body. Header: ``kind`` u8, ``flags`` u8, ``slots`` u16,
    ``value`` u64, little-endian.

    ======  ===================================================  ========================
    kind    header                                               body
    ======  ===================================================  ========================
    DATA    ``flags``: :data:`SLOT` or 0; ``value``: its length  the message
    CREDIT  ``slots``, ``value``: slots and bytes given back      none
    CLOSE   ``value``: how many messages this side sent          none
    ======  ===================================================  ========================

The receive buffer (like an endpoint's, and a socket's ``SO_RCVBUF``)
    A side holds up to ``recv_budget`` bytes of messages its application has not read yet, each
    counting :data:`MESSAGE_OVERHEAD` bytes more than its size, and past that up to ``slots``
    more messages (:data:`SLOT` frames), of which at most one is larger than the sender's
    ``eager_max`` (*held*). So it never holds more than ``recv_budget + slots * eager_max``
    bytes and one message of at most ``max_message``, whatever the peer does.

Flow control (the sender keeps the receiver's account)
    Each side knows the other's ``recv_budget``, ``slots`` and ``eager_max`` from the set-up.
    A message goes as a plain DATA frame while it fits the byte window (what the receiver can
    still buffer), else as a SLOT frame while a slot is free (and no other held message is
    out, for one larger than ``eager_max``), else it waits in the queue, and every message
    queued after it waits too: order is kept. The receiver gives bytes back (a CREDIT frame)
    once its application has read a quarter of its budget's worth, and slots at once. A held
    message's sender is done only when the receiver's application has taken it (its slot
    came back): a reader that does not read holds a writer of large messages, as an
    endpoint's rendezvous does. Every other message is done as soon as its frame is out.
    A side whose application reads everything gets every slot back at once, so a queued
    message always goes eventually (no deadlock), and a frame the window does not allow is
    the peer's :class:`RemoteProtocolError`.

Closing
    Each side sends one CLOSE, carrying how many messages it sent (checked against what
    arrived). A side sends it when its application closes and its queue is empty, or at once
    when the peer's CLOSE arrives (messages still queued then are dropped: nobody will read
    them). The lifecycle is an endpoint's: :mod:`aiordma.protocols.messages._state`.
"""

from __future__ import annotations

import itertools
import struct
from collections import deque
from typing import Any

from .errors import LocalProtocolError, RemoteProtocolError
from .messages import FLUSHING, LIVE, SENDING, Lifecycle, next_lifecycle

__all__ = ["CLOSE", "CREDIT", "DATA", "HEADER", "MESSAGE_OVERHEAD", "SLOT", "StreamMessages"]

HEADER = struct.Struct("<BBHQ")
_HDR = HEADER.size  # 12
DATA, CREDIT, CLOSE = 1, 2, 3
SLOT = 1
"""The DATA flag of a message sent past the receiver's byte window, into one of its slots."""
MESSAGE_OVERHEAD = 64
"""Bytes each buffered message counts beyond its size (so a flood of empty ones is bounded)."""
_U16 = 0xFFFF
_U64 = (1 << 64) - 1
_pack = HEADER.pack
_unpack = HEADER.unpack_from


class StreamMessages:
    """One side of the TCP transport's message protocol (see the module documentation).

    Args:
        recv_budget, slots: this side's receive buffer, in bytes, and its slots past it.
        eager_max: messages up to this size do not wait for the peer to read them, even in a
            slot (:attr:`aiordma.transport.MessageChannel.eager_max`).
        max_message: the largest message this side accepts.
        peer_budget, peer_slots, peer_eager_max, peer_max_message: the peer's (from the
            set-up).

    Raises:
        LocalProtocolError: this side's parameters are unusable.
        RemoteProtocolError: the peer's are.

    Attributes:
        state: the :class:`~aiordma.protocols.messages.Lifecycle` state.
        outgoing: bytes to write, in order (the driver takes them; see
            :meth:`data_to_send`).
        done: tickets of sends that are complete (their frame is out, or, for a held message,
            the peer's application took it).
        dropped: tickets of sends that will never complete: the peer closed first.
        inbox: messages arrived and not yet delivered, oldest first.
        sent, received, delivered: messages framed, arrived, handed to the application.
        buffered: bytes of the inbox counted against the budget.
        peer_total: how many messages the peer said it sent (its CLOSE), else None.
    """

    def __init__(self, *, recv_budget: int, slots: int, eager_max: int, max_message: int,
                 peer_budget: int, peer_slots: int, peer_eager_max: int,
                 peer_max_message: int) -> None:
        for name, value, low, high in (("recv_budget", recv_budget, 0, _U64),
                                       ("slots", slots, 1, _U16),
                                       ("eager_max", eager_max, 0, _U64),
                                       ("max_message", max_message, 0, _U64)):
            if not low <= value <= high:
                raise LocalProtocolError(f"{name} {value} is outside {low}..{high}")
        for name, value, low, high in (("recv_budget", peer_budget, 0, _U64),
                                       ("slots", peer_slots, 1, _U16),
                                       ("eager_max", peer_eager_max, 0, _U64),
                                       ("max_message", peer_max_message, 0, _U64)):
            if not low <= value <= high:
                raise RemoteProtocolError(f"the peer's {name} {value} is outside {low}..{high}")
        self.state = Lifecycle.OPEN
        self.recv_budget, self.slots = recv_budget, slots
        self.eager_max, self.max_message = eager_max, max_message
        self.peer_budget, self.peer_slots = peer_budget, peer_slots
        self.peer_eager_max, self.peer_max_message = peer_eager_max, peer_max_message
        self.outgoing: list[bytes] = []
        self.done: list[int] = []
        self.dropped: list[int] = []
        # sending: the receiver's account as this side knows it
        self._window = peer_budget  # bytes it can still buffer
        self._free_slots = peer_slots
        self._slot_out: deque[int] = deque()  # SLOT frames out, oldest first: ticket or 0
        self._held_out = False  # a held message is out (its ticket is in _slot_out)
        self._queue: deque[tuple[int, Any, int]] = deque()  # (ticket, payload, size)
        self._tickets = itertools.count(1)
        # receiving: what this side granted, and owes back
        self._granted = recv_budget  # bytes the peer may still send unslotted
        self._granted_slots = slots
        self._owed = 0
        self._owed_slots = 0
        self._threshold = max(1, recv_budget // 4)
        self._slot_seqs: deque[int] = deque()  # arrival numbers of the inbox's SLOT messages
        self._held_in = -1  # arrival number of a held message not yet delivered, else -1
        self.inbox: deque[bytearray] = deque()
        self.buffered = 0
        self._buf = bytearray()
        self._partial: bytearray | None = None  # a DATA body arriving in pieces
        self._filled = 0
        self._partial_slot = False
        self.sent = self.received = self.delivered = 0
        self.peer_total: int | None = None
        self._close_sent = False

    # -- sending -------------------------------------------------------------------------------

    def send(self, payload: Any) -> int:
        """Queue a message (``bytes``, ``bytearray`` or a 1-D memoryview of format ``"B"``;
        it must stay unchanged until framed). Returns 0 if it is framed already and its send
        is complete, else a ticket that :attr:`done` or :attr:`dropped` will name.

        Raises:
            LocalProtocolError: not allowed in this state, or larger than the peer accepts.
        """
        if self.state not in SENDING:
            raise LocalProtocolError(f"cannot send in state {self.state.name}")
        n = len(payload)
        if n > self.peer_max_message:
            raise LocalProtocolError(f"a {n} B message exceeds the peer's limit of "
                                     f"{self.peer_max_message} B")
        if not self._queue:
            cost = n + MESSAGE_OVERHEAD
            if cost <= self._window:  # the common case, written out
                self._window -= cost
                self.outgoing.append(_pack(DATA, 0, 0, n) + payload)
                self.sent += 1
                return 0
            if self._free_slots and (n <= self.eager_max or not self._held_out):
                ticket = next(self._tickets) if n > self.eager_max else 0
                self._frame_slot(payload, n, ticket)
                return ticket
        ticket = next(self._tickets)
        self._queue.append((ticket, payload, n))
        return ticket

    def try_send(self, payload: Any) -> bool:
        """Frame a message of at most :attr:`eager_max` bytes now if nothing is queued before
        it and the receiver has room; False: nothing was done (also when the state does not
        allow sending, or the message is larger)."""
        n = len(payload)
        if self.state not in SENDING or self._queue or n > self.eager_max \
                or n > self.peer_max_message:
            return False
        cost = n + MESSAGE_OVERHEAD
        if cost <= self._window:
            self._window -= cost
            self.outgoing.append(_pack(DATA, 0, 0, n) + payload)
            self.sent += 1
            return True
        if self._free_slots:
            self._frame_slot(payload, n, 0)
            return True
        return False

    def withdraw(self, ticket: int) -> bool:
        """Take back a queued message that is not framed yet (its sender gave up): True if
        it was withdrawn, False if it went already (a held message then stays with the
        peer, and its ticket still ends in :attr:`done` or :attr:`dropped`)."""
        for item in self._queue:
            if item[0] == ticket:
                self._queue.remove(item)
                self._pump()  # the message behind it may fit
                return True
        return False

    @property
    def queued(self) -> int:
        """Messages waiting for room at the receiver."""
        return len(self._queue)

    @property
    def flushed(self) -> bool:
        """Nothing is queued, and no held message waits for the peer to read it (as an
        endpoint's rendezvous messages: a graceful close waits for both)."""
        return not self._queue and not self._held_out

    def data_to_send(self) -> list[bytes]:
        """Take :attr:`outgoing`: the bytes to write, in order."""
        out = self.outgoing
        self.outgoing = []
        return out

    def _frame_slot(self, payload: Any, n: int, ticket: int) -> None:
        self._free_slots -= 1
        self._slot_out.append(ticket)
        if n > self.eager_max:
            self._held_out = True
        self.outgoing.append(_pack(DATA, SLOT, 0, n) + payload)
        self.sent += 1

    def _pump(self) -> None:
        """Frame queued messages while the receiver has room for them, in order."""
        q = self._queue
        while q and self.state in FLUSHING:
            ticket, payload, n = q[0]
            cost = n + MESSAGE_OVERHEAD
            if cost <= self._window:
                self._window -= cost
                self.outgoing.append(_pack(DATA, 0, 0, n) + payload)
                self.sent += 1
                self.done.append(ticket)
            elif self._free_slots and (n <= self.eager_max or not self._held_out):
                held = n > self.eager_max
                self._frame_slot(payload, n, ticket if held else 0)
                if not held:
                    self.done.append(ticket)
            else:
                return
            q.popleft()

    # -- receiving -----------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes from the stream: messages go to :attr:`inbox`, credits free queued
        messages, the peer's CLOSE is answered.

        Raises:
            RemoteProtocolError: the peer broke a rule (the connection must be failed).
            LocalProtocolError: called after :meth:`fail` or :meth:`release`.
        """
        if self.state not in LIVE:
            raise LocalProtocolError(f"cannot receive in state {self.state.name}")
        partial = self._partial
        if partial is not None:  # the rest of a large message first
            data = self._fill(partial, data)
            if not data:
                return
        buf = self._buf
        src: bytes | bytearray | memoryview
        if buf:
            buf += data
            src = buf
        else:
            src = data  # (the common case: whole frames, parsed where they are, not copied)
        pos, end = 0, len(src)
        mv = memoryview(src)  # (a message is copied once, from here into its bytearray)
        try:
            while end - pos >= _HDR:
                kind, flags, slots, value = _unpack(src, pos)
                start = pos + _HDR
                if kind == DATA and not flags and not slots:  # a message: the common case
                    cost = value + MESSAGE_OVERHEAD
                    if cost > self._granted or value > self.max_message or \
                            self.peer_total is not None:
                        self._check_data(value, 0)  # (raises the peer's error)
                    self._granted -= cost
                    pos = start + value
                    if pos > end:
                        self._begin_partial(mv[start:end], value, False)
                        pos = end
                        break
                    self.buffered += cost
                    self.received += 1
                    self.inbox.append(bytearray(mv[start:pos]))
                elif kind == DATA and flags == SLOT and not slots:
                    self._check_data(value, flags)
                    pos = start + value
                    if pos > end:
                        self._begin_partial(mv[start:end], value, True)
                        pos = end
                        break
                    self._arrived(bytearray(mv[start:pos]), True)
                elif kind == CREDIT and not flags:
                    self._credited(slots, value)
                    pos = start
                elif kind == CLOSE and not flags and not slots:
                    pos = start
                    self._peer_closed(value)
                else:
                    raise RemoteProtocolError(f"unknown frame: kind {kind}, flags {flags}, "
                                              f"slots {slots}")
        finally:
            mv.release()  # (before the buffer is resized)
            if src is buf:
                del buf[:pos]
            elif pos < end:
                buf += src[pos:]
        if self._queue:
            self._pump()

    def _begin_partial(self, head: Any, size: int, slot: bool) -> None:
        """A message whose body has not all arrived: it is filled in place as it does."""
        self._partial = msg = bytearray(size)
        self._filled = len(head)
        msg[:len(head)] = head
        self._partial_slot = slot

    def _fill(self, partial: bytearray, data: bytes | bytearray | memoryview) -> memoryview:
        """Fill the partial message from ``data``; what is left of ``data`` after it."""
        view = memoryview(data)
        take = min(len(partial) - self._filled, len(view))
        partial[self._filled:self._filled + take] = view[:take]
        self._filled += take
        if self._filled == len(partial):
            self._partial = None
            self._arrived(partial, self._partial_slot)
        return view[take:]

    def _check_data(self, n: int, slot: int) -> None:
        if self.peer_total is not None:
            raise RemoteProtocolError("a message after the peer's CLOSE")
        if n > self.max_message:
            raise RemoteProtocolError(f"a {n} B message exceeds this side's limit of "
                                      f"{self.max_message} B")
        if not slot:
            cost = n + MESSAGE_OVERHEAD
            if cost > self._granted:
                raise RemoteProtocolError(f"a {n} B message overruns the receive buffer "
                                          f"({self._granted} B left)")
            self._granted -= cost
            return
        if not self._granted_slots:
            raise RemoteProtocolError("a message in a slot, with no slot free")
        if n > self.peer_eager_max:
            if self._held_in >= 0:
                raise RemoteProtocolError("a second held message before the first was read")
            self._held_in = self.received
        self._granted_slots -= 1

    def _arrived(self, msg: bytearray, slot: int | bool) -> None:
        if slot:
            self._slot_seqs.append(self.received)
        else:
            self.buffered += len(msg) + MESSAGE_OVERHEAD
        self.received += 1
        self.inbox.append(msg)

    def _credited(self, slots: int, nbytes: int) -> None:
        if self._window + nbytes > self.peer_budget:
            raise RemoteProtocolError(f"the peer gave back {nbytes} B it had not been sent")
        if slots > len(self._slot_out):
            raise RemoteProtocolError(f"the peer gave back {slots} slots; "
                                      f"{len(self._slot_out)} were in use")
        self._window += nbytes
        self._free_slots += slots
        out = self._slot_out
        for _ in range(slots):
            ticket = out.popleft()
            if ticket:  # a held message, taken: its sender is done
                self._held_out = False
                self.done.append(ticket)

    def _peer_closed(self, total: int) -> None:
        if self.peer_total is not None:
            raise RemoteProtocolError("a second CLOSE")
        if total != self.received:
            raise RemoteProtocolError(f"the peer says it sent {total} messages; "
                                      f"{self.received} arrived")
        self.state = next_lifecycle(self.state, "peer_close")
        self.peer_total = total
        # Nobody will read what is still queued, nor the held message out.
        self.dropped.extend(t for t, _, _ in self._queue)
        self._queue.clear()
        self.dropped.extend(t for t in self._slot_out if t)
        self._slot_out = deque(0 for _ in self._slot_out)  # (their slots may still come back)
        self._held_out = False
        if not self._close_sent:
            self.send_close()  # the answer: everything this side sent is before it

    # -- delivering ----------------------------------------------------------------------------

    @property
    def head_size(self) -> int:
        """The size of the next message (the inbox must not be empty)."""
        return len(self.inbox[0])

    def pop(self) -> bytearray:
        """The next message, handed to the application; its room goes back to the peer (a
        CREDIT frame in :attr:`outgoing` when due)."""
        msg = self.inbox.popleft()
        seq = self.delivered
        self.delivered = seq + 1
        seqs = self._slot_seqs
        if seqs and seqs[0] == seq:
            seqs.popleft()
            if seq == self._held_in:
                self._held_in = -1
            self._granted_slots += 1
            self._owed_slots += 1
        else:
            cost = len(msg) + MESSAGE_OVERHEAD
            self.buffered -= cost
            self._granted += cost
            self._owed += cost
            if self._owed < self._threshold:
                return msg
        if self.peer_total is None and self.state in LIVE:  # (else the peer sends no more)
            self.outgoing.append(_pack(CREDIT, 0, self._owed_slots, self._owed))
            self._owed = self._owed_slots = 0
        return msg

    @property
    def at_eof(self) -> bool:
        """The peer closed and every message it sent has been delivered."""
        return self.peer_total is not None and not self.inbox

    # -- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """This side's application closes: no new messages; queued ones still go."""
        self.state = next_lifecycle(self.state, "close")

    def send_close(self) -> None:
        """Frame this side's CLOSE (once its queue is empty: see :attr:`flushed`)."""
        if self._close_sent:
            raise LocalProtocolError("CLOSE was sent already")
        if self._queue:
            raise LocalProtocolError("CLOSE before the queued messages went")
        self.state = next_lifecycle(self.state, "close_sent")
        self._close_sent = True
        self.outgoing.append(_pack(CLOSE, 0, 0, self.sent))

    def fail(self) -> None:
        """The stream broke (or the peer broke a rule): nothing more is framed; what is
        queued or held out is dropped."""
        self.state = next_lifecycle(self.state, "fail")
        self.dropped.extend(t for t, _, _ in self._queue)
        self.dropped.extend(t for t in self._slot_out if t)
        self._queue.clear()
        self._slot_out.clear()
        self._held_out = False
        self.outgoing = []

    def release(self) -> None:
        """This side let everything go (``abort()``, or the end of ``aclose()``)."""
        self.state = next_lifecycle(self.state, "release")
        self._queue.clear()
        self._slot_out.clear()
        self.outgoing = []
