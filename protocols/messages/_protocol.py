"""The message protocol's state machine: :class:`MessageProtocol`, and the work-request ids
it posts with (:func:`send_wr_id`, :func:`decode_wr_id`).

Its rules (sending, send slots, the receive buffer, close counts, immediates, the receive pool)
are the package's documentation, :mod:`aiordma.protocols.messages`. ``scripts/build_fastpath.py``
compiles this module with the C types of ``_protocol_c.pxd`` into ``_protocol_c``.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING, Any

from .. import framing
from ..errors import LocalProtocolError, RemoteProtocolError
from ._actions import (
    EMPTY,
    READING,
    READY,
    UNREAD,
    Immediate,
    Incoming,
    PoolReturn,
    PoolWant,
    PostRecv,
    PostSend,
    SendDone,
    SendDropped,
    SendPosted,
    StartRead,
)
from ._credits import CreditWindow
from ._state import FLUSHING, LIVE, SENDING, Lifecycle, next_lifecycle

if TYPE_CHECKING:
    from ..send_arena import SendChunk

__all__ = ["MESSAGE_OVERHEAD", "POOL_AHEAD", "SEND_BIT", "MessageProtocol", "decode_wr_id",
           "send_wr_id"]

SEND_BIT = 0x8000_0000
_SEQ_MASK = 0x7FFF_FFFF
MESSAGE_OVERHEAD = 64
"""Bytes each buffered message counts against the budget beyond its size (so a flood of empty
messages is bounded too)."""

_DATA, _RTS, _DONE, _CREDIT = (int(k) for k in (framing.Kind.DATA, framing.Kind.RTS,
                                                framing.Kind.DONE, framing.Kind.CREDIT))
_WANT, _RECLAIM, _RETURN = (int(k) for k in (framing.Kind.WANT, framing.Kind.RECLAIM,
                                             framing.Kind.RETURN))
_POOL_BODY = framing.POOL_BODY
POOL_AHEAD = 8
"""Data credits a sender on a peer's pool keeps asked for ahead of its queue while it sends
(it asks again when fewer than half are left)."""
_RTS_BODY = framing.RTS_BODY
_DONE_BODY = framing.DONE_BODY
_HDR = framing.HEADER_SIZE
_unpack_header = framing.HEADER.unpack_from
_IMM = -1  # a queued reservation of a WRITE with immediate data (no frame)


def send_wr_id(seq: int) -> int:
    """The low 32 bits of the work-request id of send number ``seq``."""
    return SEND_BIT | (seq & _SEQ_MASK)


def decode_wr_id(low: int) -> tuple[bool, int]:
    """``(is_send, number)``: a send's sequence number (31 bits) or a receive's slot."""
    return (True, low & _SEQ_MASK) if low & SEND_BIT else (False, low)


class _Outgoing:
    __slots__ = ("address", "kind", "payload", "rkey", "size", "ticket")

    def __init__(self, kind: int, ticket: int, payload: Any = None, size: int = 0,
                 address: int = 0, rkey: int = 0) -> None:
        self.kind, self.ticket, self.payload = kind, ticket, payload
        self.size, self.address, self.rkey = size, address, rkey



class MessageProtocol:
    """One endpoint's message protocol (see the package documentation).

    Args:
        send_region, recv_region: writable memoryviews of the registered slot memory.
        slot_size: bytes per slot on this side (header included).
        send_slots: slots in ``send_region``.
        data_slots, ctrl_slots: receive slots per credit class (``recv_region`` holds both).
        peer_slot_size, peer_data_slots, peer_ctrl_slots: the peer's (from the handshake).
        peer_max_message: the largest message the peer accepts.
        max_message: the largest message this side accepts (the peer learns it at set-up; a
            larger message, eager or rendezvous, breaks the rules).
        recv_budget: bytes of messages buffered out of their slots (0: none; messages then
            stay in their slots until read).
        signal_every: request a send completion every N posts.
        max_reads: rendezvous READs into endpoint buffers in flight at once.
        pool_slots: this side receives from a shared pool of that many slots (0: from its
            own ``data_slots + ctrl_slots``); ``pool_grant``: the data credits the pool
            granted the peer at set-up (at most ``data_slots``, its share).
        peer_pool, peer_pool_grant: the peer receives from a shared pool, which granted this
            side ``peer_pool_grant`` data credits at set-up.
        send_chunk, send_member: this side's send slots are member ``send_member``'s of a
            send arena's chunk (``send_region`` is the chunk's; ``send_slots`` caps its posts
            in flight); None: ``send_slots`` slots of its own.

    Raises:
        LocalProtocolError: this side's parameters are unusable.
        RemoteProtocolError: the peer's are.

    Attributes:
        state: the :class:`~aiordma.protocols.messages.Lifecycle` state.
        actions: what the driver must do, in order; see :meth:`take_actions`.
        receivers_waiting: how many receivers wait for a message; the driver keeps it, so
            that a rendezvous message reaching a waiting receiver is left to it (zero-copy).
        sent, received, delivered: messages posted, arrived, handed to the application.
        buffered: bytes counted against the budget now.
        immediates: this side accepts RDMA WRITEs with immediate data (:meth:`on_immediate`);
            the driver sets it before the peer may send one.
    """

    def __init__(self, *, send_region: memoryview, recv_region: memoryview, slot_size: int,
                 send_slots: int, data_slots: int, ctrl_slots: int, peer_slot_size: int,
                 peer_data_slots: int, peer_ctrl_slots: int, peer_max_message: int,
                 max_message: int, recv_budget: int, signal_every: int = 16,
                 max_reads: int = 8, pool_slots: int = 0, pool_grant: int = 0,
                 peer_pool: bool = False, peer_pool_grant: int = 0,
                 send_chunk: SendChunk | None = None, send_member: int = 0) -> None:
        nslots = pool_slots or data_slots + ctrl_slots
        if send_slots < 2 or signal_every < 1 or max_reads < 1 or recv_budget < 0:
            raise LocalProtocolError("send_slots >= 2, signal_every >= 1, max_reads >= 1 and "
                                     "recv_budget >= 0 are required")
        if slot_size <= _HDR + _RTS_BODY.size:
            raise LocalProtocolError(f"slot_size {slot_size} cannot hold an RTS frame")
        region_slots = send_slots if send_chunk is None else send_chunk.slots
        if send_chunk is not None and send_chunk.reserve > send_slots:
            raise LocalProtocolError(f"a reserve of {send_chunk.reserve} send slots beyond the "
                                     f"cap of {send_slots}")
        if (send_region.nbytes < region_slots * slot_size
                or recv_region.nbytes < nslots * slot_size):
            raise LocalProtocolError("the slot regions are smaller than the slots")
        if peer_slot_size <= _HDR + _RTS_BODY.size:
            raise RemoteProtocolError(f"the peer's slot size {peer_slot_size} cannot hold an "
                                      f"RTS frame")
        try:
            self.credits = CreditWindow(local_data_slots=data_slots, local_ctrl_slots=ctrl_slots,
                                        peer_data_slots=peer_data_slots,
                                        peer_ctrl_slots=peer_ctrl_slots,
                                        threshold=1 if pool_slots else None)
        except LocalProtocolError as exc:
            if "peer" in str(exc):
                raise RemoteProtocolError(f"the peer's window: {exc}") from None
            raise
        # The receive pool: this side's (grants instead of freed slots) or the peer's.
        self._pool = pool_slots > 0
        self._peer_pool = peer_pool
        if self._pool:
            if not 0 <= pool_grant <= data_slots:
                raise LocalProtocolError(f"a pool grant of {pool_grant} beyond the share of "
                                         f"{data_slots}")
            self.credits.peer_data_credits = pool_grant
        if peer_pool:
            if not 0 <= peer_pool_grant <= peer_data_slots:
                raise RemoteProtocolError(f"the peer's pool granted {peer_pool_grant}, beyond "
                                          f"its share of {peer_data_slots}")
            self.credits.data_credits = peer_pool_grant
        self._asked = 0  # (peer_pool) credits asked for and not yet granted
        self._ahead = min(POOL_AHEAD, peer_data_slots)
        self._active = False  # (peer_pool) it waited for a credit since the last RECLAIM
        self._reclaims = 0  # (pool) RECLAIM frames to send
        self._returns: deque[int] = deque()  # (peer_pool) RETURN frames to send
        self.state = Lifecycle.OPEN
        self._send = send_region
        self._recv = recv_region
        self._slot = slot_size
        self._nslots = nslots
        # A DATA frame must fit the peer's receive slot and this side's send slot.
        self.eager_max = min(peer_slot_size, slot_size) - _HDR
        self.peer_max_message = peer_max_message
        self.max_message = max_message
        self.recv_budget = recv_budget
        self._signal_every = signal_every
        self.max_reads = max_reads
        # sending: this side's own free slots, and (in a send arena's chunk) the free slots
        # that every member of the chunk may borrow (one list, shared); a slot from
        # _shared_from on is a borrowed one, and goes back to _shared at its completion.
        if send_chunk is None:
            self._free = list(range(send_slots))
            self._shared: list[int] = []
            self._shared_from = send_slots
        else:
            self._free = send_chunk.reserve_of(send_member)
            self._shared = send_chunk.shared
            self._shared_from = send_chunk.shared_start
        self._cap = send_slots  # posts in flight at most
        self._tail_borrowed = False  # a borrowed slot is in flight after the last signaled post
        self._last_post: PostSend | None = None
        self._inflight: deque[tuple[int, int]] = deque()  # (seq, slot) posted, not known done
        self._seq = 0
        self._queue: deque[_Outgoing] = deque()
        self._dones: deque[int] = deque()  # tokens to acknowledge
        self._tickets = itertools.count(1)
        self._next_token = 1
        self._rdv_out: set[int] = set()  # tokens announced (or queued), DONE not yet received
        # receiving
        self.inbox: deque[bytearray | Incoming | Immediate] = deque()
        self._held: list[Incoming | Immediate] = []  # in their slots, in arrival order
        self.buffered = 0
        self._reads = 0
        self.reads_started = 0  # rendezvous messages READ into endpoint buffers, in all
        self.receivers_waiting = 0
        # counts
        self.sent = self.received = self.delivered = 0
        self.peer_total: int | None = None
        self._close_sent = False
        self.immediates = False  # this side accepts WRITEs with immediate data
        self._hold = False  # a WRITE with immediate data is reserved and not yet posted
        # one per slot, reused, all posted now (a pool's slots are the pool's to post)
        self._reposts = [] if self._pool else [PostRecv(s) for s in range(nslots)]
        self.actions: list[Any] = list(self._reposts)

    # -- the driver's side ---------------------------------------------------------------------

    def take_actions(self) -> list[Any]:
        """The actions accumulated since the last call, in the order they must be carried out.

        In a send arena's chunk, the last post goes signaled if a borrowed slot is in flight
        after the last signaled post: a shared slot is never held past this side's own
        completions, whether more is queued or not (see :mod:`aiordma.protocols.send_arena`).
        """
        acts = self.actions
        if self._tail_borrowed:
            self._tail_borrowed = False
            self._last_post.signaled = True  # type: ignore[union-attr]
        self.actions = []
        return acts

    def on_completion(self, wr_id: int, nbytes: int) -> None:
        """A successful work completion of this endpoint's (low 32 bits of ``wr_id``): a
        receive of ``nbytes`` into a slot, or a signaled send.

        Raises:
            RemoteProtocolError: the frame breaks a rule (the connection must be failed).
        """
        if wr_id & SEND_BIT:
            self._send_completed(wr_id & _SEQ_MASK)
        else:
            self._received(wr_id, nbytes)
        self._pump()

    def on_immediate(self, wr_id: int, nbytes: int, value: int) -> None:
        """A successful receive completion of an RDMA WRITE with immediate data
        (``IBV_WC_RECV_RDMA_WITH_IMM``) into receive slot ``wr_id`` (low 32 bits): ``nbytes``
        written, immediate ``value`` (host order). Files an :class:`Immediate`.

        Raises:
            RemoteProtocolError: this side does not accept immediates (:attr:`immediates`),
                the peer had no data credit, or it had closed.
        """
        if wr_id & SEND_BIT or wr_id >= self._nslots:
            raise LocalProtocolError(f"an immediate's completion for work request {wr_id:#x}, "
                                     f"not one of the {self._nslots} receive slots")
        if not self.immediates:
            raise RemoteProtocolError("the peer sent an RDMA WRITE with immediate data; this "
                                      "endpoint does not accept them")
        self.credits.received(control=False, credits=0, ctrl_credits=0)
        total = self.peer_total
        if total is not None and self.received >= total:
            raise RemoteProtocolError(f"a WRITE with immediate data after the peer's Close "
                                      f"(it said it sent {total})")
        self.received = index = self.received + 1
        cost = MESSAGE_OVERHEAD
        if self.buffered + cost <= self.recv_budget:
            self.inbox.append(Immediate(index, value, nbytes))
            self.buffered += cost
            self._free_slot(wr_id, False)
        else:  # past the budget: it holds its slot (and credit) until read
            item = Immediate(index, value, nbytes, wr_id)
            self.inbox.append(item)
            self._held.append(item)
        self._pump()

    def read_done(self, message: Incoming, payload: Any = None) -> None:
        """The READ of rendezvous ``message`` finished: into ``payload`` (a :class:`StartRead`
        buffer, now ready for delivery), or into a receiver's buffer (``payload`` None).
        DONE goes back to the sender."""
        if payload is not None:
            if not message.reading:
                raise LocalProtocolError(f"{message!r} was not being read")
            message.reading = False
            message.payload = payload
            self._reads -= 1
        self._dones.append(message.token)
        self._refill()
        self._pump()

    # -- sending -------------------------------------------------------------------------------

    def send_data(self, payload: Any) -> int:
        """Queue an eager message of at most :attr:`eager_max` bytes (``bytes``,
        ``bytearray`` or a 1-D memoryview of format ``"B"``; it must stay unchanged until
        posted). Returns 0 if it was posted at once (the caller's
        buffer is free), else a ticket: :class:`SendPosted` says when it is posted.

        Raises:
            LocalProtocolError: not allowed in this state, or too large.
        """
        if self.state not in SENDING:
            raise LocalProtocolError(f"cannot send in state {self.state.name}")
        n = len(payload)
        if n > self.eager_max or n > self.peer_max_message:
            raise LocalProtocolError(f"{n} B is larger than the eager limit {self.eager_max} B "
                                     f"or the peer's limit {self.peer_max_message} B")
        if (not self._queue and self._has_slot() and self.credits.data_credits > 0
                and not self._hold):
            self._post_data(payload, n)
            return 0
        ticket = next(self._tickets)
        self._queue.append(_Outgoing(_DATA, ticket, payload, n))
        if self._peer_pool:
            self._short()
        return ticket

    def try_send_data(self, payload: Any) -> bool:
        """Post an eager message now if nothing is queued before it and a slot and a credit
        are free; False: nothing was done (also when the state does not allow sending or the
        message is not eager)."""
        if (self.state not in SENDING or self._queue or not self._has_slot()
                or self.credits.data_credits <= 0 or self._hold):
            return False
        n = len(payload)
        if n > self.eager_max or n > self.peer_max_message:
            return False
        self._post_data(payload, n)
        return True

    def send_rts(self, size: int, address: int, rkey: int) -> int:
        """Queue a rendezvous message of ``size`` bytes readable at ``address``/``rkey`` (the
        memory must stay readable until :class:`SendDone` or the connection ends). Returns
        its token.

        Raises:
            LocalProtocolError: not allowed in this state, or past the peer's limit.
        """
        if self.state not in SENDING:
            raise LocalProtocolError(f"cannot send in state {self.state.name}")
        if size > self.peer_max_message:
            raise LocalProtocolError(f"a {size} B message exceeds the peer's limit of "
                                     f"{self.peer_max_message} B")
        token = self._token()
        self._rdv_out.add(token)
        out = _Outgoing(_RTS, token, None, size, address, rkey)
        if (not self._queue and self._has_slot() and self.credits.data_credits > 0
                and not self._hold):
            self._post(out)
        else:
            self._queue.append(out)
            if self._peer_pool:
                self._short()
        return token

    def send_imm(self) -> int:
        """Reserve the peer's receive slot for an RDMA WRITE with immediate data (a data
        credit, counted as a message sent). Returns 0 if reserved now: post the WRITE, then
        call :meth:`imm_posted` (or :meth:`imm_abandoned`). Else a ticket, queued behind the
        messages queued before it: its :class:`SendPosted` says the reservation is made (then
        post and call :meth:`imm_posted` as above); :meth:`withdraw` takes it back before.
        Until :meth:`imm_posted`, nothing else is posted that was queued after it.

        Raises:
            LocalProtocolError: not allowed in this state, or a reservation is still open.
        """
        if self.state not in SENDING:
            raise LocalProtocolError(f"cannot send in state {self.state.name}")
        if not self._queue and self.credits.data_credits > 0 and not self._hold:
            self._reserve_imm()
            return 0
        ticket = next(self._tickets)
        self._queue.append(_Outgoing(_IMM, ticket))
        if self._peer_pool:
            self._want()
        return ticket

    def _reserve_imm(self) -> None:
        cr = self.credits
        if cr.data_credits <= 0 or self._hold:
            raise LocalProtocolError("no data credit for a WRITE with immediate data, or one "
                                     "is reserved already")
        cr.data_credits -= 1
        self._hold = True
        self.sent += 1
        if self._peer_pool:
            self._active = True
            self._want()

    def imm_posted(self) -> None:
        """The reserved WRITE with immediate data is posted: what was queued behind it may go.

        Raises:
            LocalProtocolError: nothing was reserved.
        """
        if not self._hold:
            raise LocalProtocolError("imm_posted() without a reservation")
        self._hold = False
        self._pump()

    def imm_abandoned(self) -> None:
        """The reserved WRITE with immediate data will not be posted (its caller gave up):
        its credit comes back. Nothing happens if nothing is reserved."""
        if not self._hold:
            return
        self._hold = False
        self.credits.data_credits += 1
        self.sent -= 1
        self._pump()

    def withdraw(self, ticket: int, *, rendezvous: bool = False) -> bool:
        """Take back a queued message that is not posted yet (its sender gave up). True if it
        was withdrawn; False if it was posted already (a rendezvous message then stays
        announced until DONE)."""
        for out in self._queue:
            if out.ticket == ticket and (out.kind == _RTS) == rendezvous:
                self._queue.remove(out)
                if rendezvous:
                    self._rdv_out.discard(ticket)
                return True
        return False

    @property
    def flushed(self) -> bool:
        """Nothing queued or reserved, and every rendezvous message this side sent has been
        read."""
        return not self._queue and not self._rdv_out and not self._hold

    @property
    def queued(self) -> int:
        """Messages waiting for a send slot or a credit."""
        return len(self._queue)

    @property
    def pending_rendezvous(self) -> int:
        """Rendezvous messages announced or queued whose DONE has not arrived."""
        return len(self._rdv_out)

    def _token(self) -> int:
        t = self._next_token
        while t in self._rdv_out or t == 0:  # 32-bit tokens wrap; skip those still in use
            t = (t + 1) & 0xFFFF_FFFF
        self._next_token = (t + 1) & 0xFFFF_FFFF
        return t

    def _has_slot(self) -> bool:
        """A send slot is free: one of this side's own, or a shared one it may borrow (while
        fewer than its cap of posts are in flight)."""
        return bool(self._free) or (bool(self._shared) and len(self._inflight) < self._cap)

    def _take(self) -> int:
        """A free send slot (:meth:`_has_slot` said there is one): its own first."""
        free = self._free
        if free:
            return free.pop()  # type: ignore[no-any-return]
        return self._shared.pop()  # type: ignore[no-any-return]

    def _post_data(self, payload: Any, n: int) -> None:
        slot = self._take()
        base = slot * self._slot
        c, k = self.credits.send_data()
        view = self._send
        view[base + _HDR:base + _HDR + n] = payload
        framing.HEADER.pack_into(view, base, _DATA, 0, c, k, 0, n)
        self.sent += 1
        self._emit(slot, base, _HDR + n)
        if self._peer_pool:
            self._want()

    def _post(self, out: _Outgoing) -> None:
        """Post a queued message (a data credit and a slot are known to be free)."""
        if out.kind == _DATA:
            self._post_data(out.payload, out.size)
            return
        slot = self._take()
        base = slot * self._slot
        c, k = self.credits.send_data()
        framing.pack_rts(self._send, base, size=out.size, address=out.address, rkey=out.rkey,
                         token=out.ticket, credits=c, ctrl=k)
        self.sent += 1
        self._emit(slot, base, _HDR + _RTS_BODY.size)
        if self._peer_pool:
            self._want()

    def _emit(self, slot: int, base: int, length: int) -> None:
        self._seq = seq = self._seq + 1
        inflight = self._inflight
        inflight.append((seq, slot))
        # A completion now and then, and whenever slots run short (its own, and the shared
        # ones it could borrow), so that one always comes to free the slots of the unsignaled
        # posts before it. The post that takes its last own slot is signaled too: the shared
        # slots it counted on may go to other connections meanwhile, and then its own
        # completion is the one that must come.
        own = len(self._free)
        borrowable = min(len(self._shared), self._cap - len(inflight))
        borrowed = slot >= self._shared_from
        signaled = (seq % self._signal_every == 0 or own + borrowable < 2
                    or (own == 0 and not borrowed))
        post = PostSend(SEND_BIT | (seq & _SEQ_MASK), base, length, signaled)
        if signaled:
            self._tail_borrowed = False
        elif borrowed:
            self._tail_borrowed = True
        self._last_post = post
        self.actions.append(post)

    def _pump(self) -> None:
        """Post what waits, while slots and credits allow: DONEs, then queued messages, then a
        CREDIT frame if one is due."""
        state = self.state
        if state not in LIVE:
            return
        cr = self.credits
        dones = self._dones
        while dones and self._has_slot() and cr.ctrl_credits > 1:
            slot = self._take()
            base = slot * self._slot
            c, k = cr.send_ctrl()
            framing.pack_done(self._send, base, token=dones.popleft(), credits=c, ctrl=k)
            self._emit(slot, base, _HDR + _DONE_BODY.size)
        if self._returns or self._reclaims:
            self._pool_frames()
        q = self._queue
        if q and state in FLUSHING:
            while q and self._has_slot() and cr.data_credits > 0 and not self._hold:
                out = q.popleft()
                if out.kind == _IMM:  # reserved; the caller posts the WRITE (it waits)
                    self._reserve_imm()
                    self.actions.append(SendPosted(out.ticket))
                    break
                self._post(out)
                if out.kind == _DATA:
                    self.actions.append(SendPosted(out.ticket))
            if q and self._peer_pool:
                self._want()
        while self._has_slot() and cr.credit_frame_needed():
            slot = self._take()
            base = slot * self._slot
            c, k = cr.send_credit()
            framing.pack_credit(self._send, base, credits=c, ctrl=k)
            self._emit(slot, base, _HDR)

    # -- the receive pool ----------------------------------------------------------------------

    def grant(self, credits: int) -> None:
        """This side's pool granted the peer ``credits`` more data credits: they go out in
        the next header (a CREDIT frame if no other frame goes now).

        Raises:
            LocalProtocolError: this side does not receive from a pool.
        """
        if not self._pool or credits <= 0:
            raise LocalProtocolError("grant() needs a pool and credits > 0")
        self.credits.owed_data += credits
        self._pump()

    def reclaim(self) -> None:
        """This side's pool asks the peer to return the credits it cannot use now."""
        if not self._pool:
            raise LocalProtocolError("reclaim() needs a pool")
        self._reclaims += 1
        self._pump()

    def _short(self) -> None:
        """(Following the peer's pool) a message was queued: if for want of a data credit,
        this is a sender that keeps sending (ask ahead from now on, until a RECLAIM); ask.
        A sender whose messages all found a credit asks for none ahead: with every client
        asking ahead after one message, a pool shorter than clients x ahead reclaimed from
        everyone (RECLAIM, RETURN and CREDIT frames: 6.4 frames per echo instead of 2 at 256
        clients on 2,048 buffers, device-free)."""
        if self.credits.data_credits <= 0:
            self._active = True
        self._want()

    def _want(self) -> None:
        """(Following the peer's pool) ask for the credits the queue needs, and once it
        has waited for one (:meth:`_short`) for :data:`POOL_AHEAD` ahead, again when fewer
        than half of those are left."""
        cr = self.credits
        have = cr.data_credits + self._asked
        queued = len(self._queue)
        ahead = self._ahead if self._active else 0
        need = queued + ahead - have
        if need <= 0 or (not queued and have > ahead // 2):
            return
        if self.state not in LIVE or not self._has_slot() or cr.ctrl_credits <= 1:
            return  # (asked again when control credits come back: _pump calls this)
        slot = self._take()
        base = slot * self._slot
        c, k = cr.send_ctrl()
        self._asked += need
        framing.pack_pool(self._send, base, kind=_WANT, count=need, credits=c, ctrl=k)
        self._emit(slot, base, _HDR + _POOL_BODY.size)

    def _pool_frames(self) -> None:
        """RETURN frames owed (answers to RECLAIM), then RECLAIM frames, as control frames."""
        cr, returns = self.credits, self._returns
        while returns and self._has_slot() and cr.ctrl_credits > 1:
            slot = self._take()
            base = slot * self._slot
            c, k = cr.send_ctrl()
            framing.pack_pool(self._send, base, kind=_RETURN, count=returns.popleft(),
                              credits=c, ctrl=k)
            self._emit(slot, base, _HDR + _POOL_BODY.size)
        while self._reclaims and self._has_slot() and cr.ctrl_credits > 1:
            self._reclaims -= 1
            slot = self._take()
            base = slot * self._slot
            c, k = cr.send_ctrl()
            framing.pack_pool(self._send, base, kind=_RECLAIM, count=0, credits=c, ctrl=k)
            self._emit(slot, base, _HDR)

    def _pool_frame(self, kind: int, slot: int, base: int, length: int) -> None:
        """A WANT, RECLAIM or RETURN frame arrived (its control credit is counted)."""
        if kind == _RECLAIM and self._peer_pool:
            if length:
                raise RemoteProtocolError("RECLAIM frame with a body")
            self._free_slot(slot, True)
            cr = self.credits
            back = max(0, cr.data_credits - len(self._queue))
            cr.data_credits -= back
            if back:
                self._asked = 0  # (the pool drops the asks of a sender that returns credits)
            self._active = False
            self._returns.append(back)
            return
        if (kind != _WANT and kind != _RETURN) or not self._pool:
            raise RemoteProtocolError(f"unknown frame kind {kind}")
        if length != _POOL_BODY.size:
            raise RemoteProtocolError("pool frame of the wrong size")
        (count,) = _POOL_BODY.unpack_from(self._recv, base + _HDR)
        self._free_slot(slot, True)
        if kind == _WANT:
            if count <= 0:
                raise RemoteProtocolError("a WANT of no credits")
            self.actions.append(PoolWant(count))
            return
        cr = self.credits
        if count > cr.peer_data_credits:
            raise RemoteProtocolError(f"a RETURN of {count} credits; the peer holds at most "
                                      f"{cr.peer_data_credits}")
        cr.peer_data_credits -= count
        self.actions.append(PoolReturn(count))

    def _free_slot(self, slot: int, control: bool) -> None:
        """Repost a receive slot and count its credit owed (a pool's data slot: back to the
        pool, no credit)."""
        if self._pool:
            self.actions.append(PostRecv(slot))
            if not control:
                self.credits.held_data -= 1
                return
        else:
            self.actions.append(self._reposts[slot])
        self.credits.release(control)

    def _send_completed(self, seq: int) -> None:
        inflight, free, shared, first = self._inflight, self._free, self._shared, self._shared_from
        while inflight:
            s, slot = inflight.popleft()
            if slot >= first:  # borrowed: back to the chunk's shared slots
                shared.append(slot)
            else:
                free.append(slot)
            if s & _SEQ_MASK == seq:
                return
        raise LocalProtocolError(f"completion of send {seq}, which is not in flight")

    def release_sends(self) -> None:
        """The queue pair is destroyed (nothing of it is in flight any more): every send slot
        in flight is free again, a borrowed one back to the chunk's shared slots."""
        inflight, free, shared, first = self._inflight, self._free, self._shared, self._shared_from
        while inflight:
            _, slot = inflight.popleft()
            if slot >= first:
                shared.append(slot)
            else:
                free.append(slot)
        self._tail_borrowed = False

    # -- receiving -----------------------------------------------------------------------------

    def _received(self, slot: int, nbytes: int) -> None:
        if slot >= self._nslots:
            raise LocalProtocolError(f"completion for receive slot {slot} of {self._nslots}")
        recv = self._recv
        base = slot * self._slot
        # framing.unpack_header's checks, inline: a Python call less per frame when compiled
        if nbytes < _HDR:
            raise RemoteProtocolError(f"frame of {nbytes} B is shorter than its header")
        kind, flags, credits, ctrl, reserved, length = _unpack_header(recv, base)
        if flags or reserved:
            raise RemoteProtocolError("frame header has unknown flag or reserved bits set")
        if length != nbytes - _HDR:
            raise RemoteProtocolError(f"frame declares {length} B of body, carries "
                                      f"{nbytes - _HDR} B")
        if credits and self._peer_pool:  # grants: asks answered
            self._asked = max(0, self._asked - credits)
        if kind == _DATA or kind == _RTS:
            self.credits.received(control=False, credits=credits, ctrl_credits=ctrl)
            total = self.peer_total
            if total is not None and self.received >= total:
                raise RemoteProtocolError(f"a message after the peer's Close (it said it sent "
                                          f"{total})")
            self.received = index = self.received + 1
            if kind == _DATA:
                if length > self.max_message:  # (it fits a slot, but this side refuses it)
                    raise RemoteProtocolError(f"peer sent a {length} B message; the limit is "
                                              f"{self.max_message} B")
                cost = length + MESSAGE_OVERHEAD
                if self.buffered + cost <= self.recv_budget:  # the common case: out at once
                    start = base + _HDR
                    self.inbox.append(bytearray(recv[start:start + length]))
                    self.buffered += cost
                    if self._pool:
                        self._free_slot(slot, False)
                    else:
                        self.actions.append(self._reposts[slot])
                        self.credits.release(control=False)
                else:
                    item = Incoming(index, slot, length, offset=base + _HDR)
                    self.inbox.append(item)
                    self._held.append(item)
                return
            if length != _RTS_BODY.size:
                raise RemoteProtocolError("RTS frame of the wrong size")
            size, address, rkey, token = _RTS_BODY.unpack_from(recv, base + _HDR)
            if size > self.max_message:
                raise RemoteProtocolError(f"peer announced a {size} B message; the limit is "
                                          f"{self.max_message} B")
            item = Incoming(index, slot, size, rendezvous=True, address=address, rkey=rkey,
                            token=token)
            self.inbox.append(item)
            self._held.append(item)
            self._refill()
            return
        self.credits.received(control=True, credits=credits, ctrl_credits=ctrl)
        if kind == _DONE:
            if length != _DONE_BODY.size:
                raise RemoteProtocolError("DONE frame of the wrong size")
            (token,) = _DONE_BODY.unpack_from(recv, base + _HDR)
            self._free_slot(slot, True)
            if token not in self._rdv_out:
                raise RemoteProtocolError(f"DONE for unknown rendezvous token {token}")
            self._rdv_out.remove(token)
            self.actions.append(SendDone(token))
        elif kind == _CREDIT:
            if length:
                raise RemoteProtocolError("CREDIT frame with a body")
            self._free_slot(slot, True)
        else:
            self._pool_frame(kind, slot, base, length)

    def _release(self, item: Incoming | Immediate) -> None:
        self._free_slot(item.slot, False)
        item.slot = -1

    def _refill(self) -> None:
        """Take held messages out of their slots while the budget allows (first fit, in
        order), leaving the first ``receivers_waiting`` messages of the inbox to receivers."""
        held = self._held
        if not held or self.state not in LIVE:
            return
        room = self.recv_budget - self.buffered
        spoken_for = self.delivered + self.receivers_waiting  # indexes up to it are
        keep: list[Incoming | Immediate] = []
        for item in held:
            if type(item) is Immediate:
                if MESSAGE_OVERHEAD > room:
                    keep.append(item)
                    continue
                room -= MESSAGE_OVERHEAD
                self.buffered += MESSAGE_OVERHEAD
                self._release(item)
                continue
            cost = item.size + MESSAGE_OVERHEAD
            if item.rendezvous:
                if item.index <= spoken_for or self._reads >= self.max_reads or cost > room:
                    keep.append(item)
                    continue
                item.reading = True
                self._reads += 1
                self.reads_started += 1
                self.actions.append(StartRead(item))
            else:
                if cost > room:
                    keep.append(item)
                    continue
                start = item.offset
                item.payload = bytearray(self._recv[start:start + item.size])
            room -= cost
            self.buffered += cost
            self._release(item)
        if len(keep) != len(held):
            self._held = keep

    @property
    def head(self) -> str:
        """What the head of the inbox is: ``"empty"``; ``"ready"`` (:meth:`pop` returns its
        bytes); ``"unread"`` (a rendezvous message for the caller to read: :meth:`pop`
        returns the :class:`Incoming`); ``"reading"`` (being read into a buffer: wait)."""
        if not self.inbox:
            return EMPTY
        item = self.inbox[0]
        if type(item) is bytearray or type(item) is Immediate:
            return READY
        assert isinstance(item, Incoming)
        if item.payload is not None or not item.rendezvous:
            return READY
        return READING if item.reading else UNREAD

    @property
    def head_size(self) -> int:
        """The size of the message at the head of the inbox (which must not be empty)."""
        item = self.inbox[0]
        if type(item) is Immediate:
            return 0
        return len(item) if type(item) is bytearray else item.size  # type: ignore[union-attr]

    def pop(self) -> bytearray | Incoming | Immediate:
        """Hand the head of the inbox to the application: its bytes (``"ready"``), an
        :class:`Immediate` (``"ready"``, :attr:`head_size` 0), or the unread rendezvous
        :class:`Incoming` (``"unread"``: read it, then :meth:`read_done`).

        Raises:
            LocalProtocolError: the inbox is empty, or the head is being read.
        """
        if not self.inbox:
            raise LocalProtocolError("the inbox is empty")
        item = self.inbox[0]
        if type(item) is bytearray:
            self.inbox.popleft()
            self.delivered += 1
            self.buffered -= len(item) + MESSAGE_OVERHEAD
            if self._held:
                self._refill()
                self._pump()
            return item
        if type(item) is Immediate:
            self.inbox.popleft()
            self.delivered += 1
            if item.slot >= 0:  # held in its slot: released now
                self._held.remove(item)
                self._release(item)
            else:
                self.buffered -= MESSAGE_OVERHEAD
            self._refill()
            self._pump()
            return item
        assert isinstance(item, Incoming)
        if item.reading:
            raise LocalProtocolError("the message at the head is still being read")
        self.inbox.popleft()
        self.delivered += 1
        if item.payload is not None:  # buffered earlier
            self.buffered -= item.size + MESSAGE_OVERHEAD
            out: bytearray | Incoming = item.payload
        elif not item.rendezvous:  # still in its slot
            out = bytearray(self._recv[item.offset:item.offset + item.size])
            self._held.remove(item)
            self._release(item)
        else:  # unread: the caller reads it
            self._held.remove(item)
            self._release(item)
            out = item
        self._refill()
        self._pump()
        return out

    def receiver_left(self) -> None:
        """A waiting receiver left without taking a message (cancelled, or its buffer was
        too small): a message left to it may now be buffered."""
        self._refill()
        self._pump()

    @property
    def at_eof(self) -> bool:
        """The peer closed and every message it sent has been delivered."""
        return self.peer_total is not None and self.delivered >= self.peer_total

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """The application closes: no new messages; queued ones still go out."""
        self.state = next_lifecycle(self.state, "close")

    def close_sent(self) -> int:
        """This side sends its Close now: returns how many messages it sent."""
        self.state = next_lifecycle(self.state, "close_sent")
        self._close_sent = True
        return self.sent

    def peer_closed(self, total: int) -> None:
        """The peer's Close arrived: it sent ``total`` messages. Queued messages are dropped
        (:class:`SendDropped`).

        Raises:
            RemoteProtocolError: more than ``total`` already arrived.
        """
        if total < self.received:
            raise RemoteProtocolError(f"the peer's Close says {total} messages; "
                                      f"{self.received} arrived")
        self.state = next_lifecycle(self.state, "peer_close")
        self.peer_total = total
        for out in self._queue:
            rendezvous = out.kind == _RTS
            if rendezvous:
                self._rdv_out.discard(out.ticket)
            self.actions.append(SendDropped(out.ticket, rendezvous))
        self._queue.clear()

    @property
    def answer_due(self) -> bool:
        """The peer closed, everything it sent has arrived, and this side has not sent its
        Close yet."""
        return (self.peer_total is not None and self.received >= self.peer_total
                and not self._close_sent)

    def fail(self, *, salvage: bool = True) -> None:
        """The connection broke: nothing more is posted. What arrived stays deliverable up to
        the first message that cannot be: a rendezvous message not read yet (the peer's memory
        is out of reach), or, without ``salvage`` (the receive slots' memory is gone, e.g. the
        device was lost), an eager message still in its slot."""
        if self.state is Lifecycle.RELEASED:
            return
        self.state = next_lifecycle(self.state, "fail")
        keep: deque[bytearray | Incoming | Immediate] = deque()
        for item in self.inbox:
            if type(item) is Immediate:
                if item.slot >= 0:
                    item.slot = -1
                    self.buffered += MESSAGE_OVERHEAD
            elif type(item) is not bytearray:
                assert isinstance(item, Incoming)
                if item.payload is None:
                    if item.rendezvous or not salvage:
                        break
                    item.payload = bytearray(self._recv[item.offset:item.offset + item.size])
                    item.slot = -1
                    self.buffered += item.size + MESSAGE_OVERHEAD
            keep.append(item)
        self.inbox = keep
        self._held = []
        self._queue.clear()
        self._dones.clear()

    def release(self) -> None:
        """Every resource is being released."""
        self.state = next_lifecycle(self.state, "release")

    def __repr__(self) -> str:
        return (f"<MessageProtocol {self.state.name} sent {self.sent} received {self.received} "
                f"delivered {self.delivered} queued {len(self._queue)} held {len(self._held)} "
                f"buffered {self.buffered} B {self.credits!r}>")
