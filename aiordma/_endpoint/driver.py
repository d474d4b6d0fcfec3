"""How an endpoint drives its connection: the base class of :class:`~aiordma.Endpoint`.

:class:`EndpointDriver` holds an endpoint's state and everything that is not called by its
user: it feeds the sans-I/O :class:`aiordma.protocols.messages.MessageProtocol` the work
completions of its queue pair (a route of the shared reactor), carries out the actions the
protocol emits (post a chain of SENDs, repost a receive slot, READ a rendezvous message into
the receive buffer), wakes the callers that wait, reads the TCP control channel (the peer's
Close, its death), and fails or releases everything when the connection breaks or closes.
What the user calls (messages, one-sided operations, closing) is :mod:`.endpoint`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from typing import Any, cast

from aiordma._device.device import Device
from aiordma._endpoint.config import BUFFER_READS, Config
from aiordma._endpoint.onesided import OneSided
from aiordma._endpoint.qp import QueuePair, opcode
from aiordma._endpoint.receive_pool import SharedReceivePool, release_pool
from aiordma._endpoint.send_arena import SendSeat
from aiordma._endpoint.side import SideChannel
from aiordma._errors import (
    WC_WR_FLUSH_ERR,
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    CompletionError,
    DeviceError,
    RemoteProtocolError,
    error_from_status,
    from_protocol_error,
)
from aiordma._memory.region import MemoryRegion, RegistrationCache, RemoteBuffer
from aiordma._memory.window import Exposures
from aiordma._places import wake_first
from aiordma._reactor.reactor import CompletionReactor, release_shared, resolve_future
from aiordma._resources import count_resource
from aiordma._verbs.compiled import message_protocol
from aiordma.protocols import handshake as hs
from aiordma.protocols import messages as msgs
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.receive_pool import Grant, ReceivePool, Return, Want

__all__ = ["EndpointDriver"]

_ids = itertools.count(1)
_L = msgs.Lifecycle
_LIVE_STATES = frozenset(s for s in _L if s not in (_L.BROKEN, _L.RELEASED))


class _PoolOnly:
    """(A type no action has: an endpoint on a pool gets its reposts back from the runner.)"""


class EndpointDriver:
    """An endpoint's state and its driving (see the module documentation); the public API is
    :class:`~aiordma.Endpoint`'s, which derives from this."""

    def __init__(self, *, device: Device, config: Config, control: hs.ControlConnection,
                 side: SideChannel,
                 peer: hs._QPParams, qp: QueuePair, reactor: CompletionReactor,
                 entries: int, slots: MemoryRegion, established: bool = True,
                 pool: SharedReceivePool | None = None, pool_grant: int = 0,
                 send_seat: SendSeat | None = None) -> None:
        # Built by _connect.py as the handshake ends, users do not call this: on the server
        # before its Accept goes out (established=False: the control channel is read from
        # :meth:`_established` on, once the client's Ready came), on the client before its
        # Ready goes out; either way the receive slots are posted before the peer may send.
        # ``slots``: the receive slots (data, then control), then the send slots, in one
        # registration; with a receive ``pool``, ``slots`` is the region of
        # the chunk of the pool's send arena that ``send_seat`` is in (its frames arrive in
        # the pool's slots, and its sends use its seat's slots of the chunk).
        peer_pool = hs.receives_from_pool(peer)
        if pool is not None:
            rules = cast(ReceivePool, pool.rules)  # (an endpoints' pool has them)
            recv_bytes, recv_region = 0, pool.region.view
            data_slots, ctrl_slots = rules.share_max, rules.ctrl_reserve
        else:
            recv_bytes = (config.data_slots + config.ctrl_slots) * config.slot_size
            recv_region = slots.view[:recv_bytes]
            data_slots, ctrl_slots = config.data_slots, config.ctrl_slots
        self._proto = message_protocol()(
            send_region=slots.view[recv_bytes:], recv_region=recv_region,
            slot_size=config.slot_size,
            send_slots=config.send_slots, data_slots=data_slots,
            ctrl_slots=ctrl_slots, peer_slot_size=peer.slot_size,
            peer_data_slots=peer.data_slots, peer_ctrl_slots=peer.ctrl_slots,
            peer_max_message=peer.max_message, max_message=config.max_message,
            recv_budget=config.recv_buffer, signal_every=config.signal_every,
            max_reads=BUFFER_READS, pool_slots=pool.buffers if pool is not None else 0,
            pool_grant=pool_grant, peer_pool=peer_pool,
            peer_pool_grant=peer.pool_grant if peer_pool else 0,  # type: ignore[attr-defined]
            **({} if send_seat is None else {"send_chunk": send_seat.chunk,
                                             "send_member": send_seat.member}))
        self._seat = send_seat
        self._proto.immediates = config.immediates  # (before the route: it picks by it)
        self._pool = pool
        self._peer_pool = peer_pool  # (the peer's receives are a pool's)
        self._pool_slots: dict[int, bool] = {}  # pool slots this endpoint holds -> data frame
        self.device = device
        self.config = config
        self.id = next(_ids)
        self._loop = asyncio.get_running_loop()
        self._control = control
        self._side = side
        self._control_done = False  # the control channel ended, broke or was left
        self._peer = peer
        self._qp = qp
        self._reactor = reactor
        self._entries = entries
        self._recv_waiters: deque[asyncio.Future[None]] = deque()
        # The route of this endpoint's completions: fed to the protocol, its posts carried
        # out and a waiting receiver woken by the verbs layer (in C where compiled); the rest
        # comes back to _route_input or _route_failed.
        self._message_route = qp.message_route(
            self._proto, self._recv_waiters, self._route_failed, self._route_input)
        self._route = reactor.add_route(self._message_route)
        self._wr_base = self._route << 32
        self._slots = slots
        self._posted: dict[int, asyncio.Future[None]] = {}  # ticket -> queued eager send
        self._rdv_out: dict[int, tuple[MemoryRegion | None, asyncio.Future[None]]] = {}
        self._flush_waiter: asyncio.Future[None] | None = None
        self._tick_open = False  # an eager send() posted this loop tick: later ones wait
        self._peer_close = asyncio.Event()  # the closing exchange is over (or broke)
        self._error: BaseException | None = None  # the peer/network broke it: why
        self._inbound_error: CompletionError | None = None  # a buffering READ's own failure
        self._close_task: asyncio.Task[None] | None = None
        self._regions: list[MemoryRegion] = []
        self._reg_cache = RegistrationCache(device)
        self._exposures = Exposures()  # revoked before the queue pair is destroyed
        self._onesided = OneSided(device, qp, config.max_onesided, check_open=self._before_post,
                                  failure=self._onesided_failure)
        self.local_address = side.get_extra_info("sockname")
        self.peer_address = side.get_extra_info("peername")
        if pool is None:
            nslots = config.data_slots + config.ctrl_slots
            qp.prepare_slots(self._wr_base, slots.address, config.slot_size, slots.lkey, nslots)
        else:
            pool.join_member(qp.qp_num, self)  # (joined at set-up, with a stand-in)
        # On a pool, a repost (PostRecv) is the pool's: the runner hands it back (_carry_out).
        self._run_actions = qp.action_runner(msgs.PostSend,
                                             msgs.PostRecv if pool is None else _PoolOnly,
                                             self._wr_base, slots.address + recv_bytes,
                                             slots.lkey)
        self._run_led = qp.led_runner()  # (post_write with notify=: one doorbell)
        self._run()  # posts every receive slot (none on a pool)
        if established:
            self._established()
        count_resource("endpoints", 1)

    def _established(self) -> None:
        """The handshake is over: the control channel's messages (the peer's Close, its death)
        come to :meth:`_control_input` from now on, in the loop's own callbacks; those that
        came with the handshake's last message are in the control connection already."""
        self._side.attach(self._control_input, self._control_end)
        self._loop.call_soon(self._control_events)

    # -- internals: the driver -----------------------------------------------------------------

    def _run(self) -> None:
        """Carry out the protocol's actions, in order (reposts before the credits they
        grant). The driver posts the SENDs and reposts (the SENDs of one call as one chain
        where compiled: one doorbell) and hands back the other actions, carried out here
        after those posts."""
        proto, run = self._proto, self._run_actions
        while proto.actions:
            try:
                rest = run(proto.take_actions())
            except OSError as exc:
                self._posting_failed(DeviceError(f"{exc.strerror or exc}"))
                return
            if rest is not None and not self._carry_out(rest):
                return

    def _post_soon(self) -> None:
        """Post what an eager ``send()`` queued: at once if it is the first this loop tick,
        else at the tick's end with every SEND queued meanwhile, as one chain (one doorbell:
        a sender that streams messages pays one system call per tick, not one per message)."""
        if not self._tick_open:
            self._tick_open = True
            self._loop.call_soon(self._end_tick)
            self._run()

    def _end_tick(self) -> None:
        self._tick_open = False
        self._post_held()

    def _post_held(self) -> None:
        """Post what the protocol holds (the SENDs of this tick after its first), unless
        the endpoint is broken or released."""
        proto = self._proto
        if proto.actions and proto.state in _LIVE_STATES:
            self._run()

    def _before_post(self) -> None:
        """Right before another work request is posted on the queue pair (a one-sided
        operation, a memory window's): raise if the endpoint is closed or broken, and post
        the SENDs this tick still holds first, so the queue pair executes its work in the
        order it was asked for (a WRITE with immediate data stays behind the messages sent
        before it)."""
        self._post_held()
        self._check_open()

    def _carry_out(self, rest: list[Any]) -> bool:
        """The protocol's actions other than posts, after those posts; False if the endpoint
        failed meanwhile."""
        for a in rest:
            t = type(a)
            if t is msgs.SendPosted:
                fut = self._posted.pop(a.ticket, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            elif t is msgs.SendDone:
                self._rendezvous_done(a.token)
            elif t is msgs.StartRead:
                try:
                    self._start_read(a.message)
                except AiordmaError as exc:
                    self._posting_failed(exc)
                    return False
            elif t is msgs.SendDropped:
                self._dropped(a)
            elif not self._pool_action(a):
                return False
        return True

    # -- internals: the shared receive pool ----------------------------------------------------

    def _pool_action(self, a: Any) -> bool:
        """A pool slot reposted, or the peer's WANT or RETURN for the pool's rules; False if
        the endpoint failed meanwhile."""
        pool = self._pool
        if pool is None:
            return True
        qp_num = self._qp.qp_num
        t = type(a)
        rules = cast(ReceivePool, pool.rules)
        try:
            if t is msgs.PostRecv:
                pool.give_back_one(qp_num, a.slot, self._pool_slots.pop(a.slot))
            elif t is msgs.PoolWant:
                rules.on_want(qp_num, Want(frames=a.frames))
                pool.dispatch()
            elif t is msgs.PoolReturn:
                rules.on_return(qp_num, Return(credits=a.credits))
                pool.dispatch()
        except ProtocolError as exc:
            self._fail(from_protocol_error(exc))
            return False
        return True

    def _pool_completion(self, slot: int, wc: Any) -> None:
        """A frame of this endpoint's arrived in pool slot ``slot``: a data frame spends a
        pool credit; then the endpoint's route takes it as its own receive."""
        pool = cast(SharedReceivePool, self._pool)  # (called by the pool: it has one)
        if self._proto.state in (_L.BROKEN, _L.RELEASED) or self._error is not None:
            pool.release([slot])  # nobody reads it (its credit comes back at detach)
            return
        data = pool.is_data(slot)
        self._pool_slots[slot] = data
        if data:
            try:
                cast(ReceivePool, pool.rules).on_frame(self._qp.qp_num)
            except ProtocolError as exc:
                self._fail(from_protocol_error(exc))
                return
        self._message_route(wc)

    def _pool_event(self, event: Any) -> None:
        """The pool's rules grant this endpoint's peer credits, or reclaim them."""
        proto = self._proto
        if proto.state not in _LIVE_STATES:
            return
        if isinstance(event, Grant):
            proto.grant(event.credits)
        else:
            proto.reclaim()
        self._run()

    def _pool_drop(self) -> None:
        """The connection failed: the pool slots it holds go back (what could be salvaged was
        copied out by ``fail``)."""
        if self._pool is not None and self._pool_slots:
            self._pool.give_back(self._qp.qp_num, self._pool_slots)

    def _posting_failed(self, exc: AiordmaError) -> None:
        if self._proto.state not in (_L.BROKEN, _L.RELEASED):
            self._fail(BrokenResourceError(f"posting failed: {exc}"))

    def _route_failed(self, outcome: Any) -> None:
        """This endpoint's route (see :meth:`QueuePair.message_route`): a work completion
        failed, the reactor closed under us, the peer broke the protocol, or a post failed."""
        if isinstance(outcome, OSError):
            self._posting_failed(DeviceError(f"{outcome.strerror or outcome}"))
        elif isinstance(outcome, ProtocolError):
            self._fail(from_protocol_error(outcome))
        elif isinstance(outcome, BaseException):  # the reactor closed under us
            self._fail(outcome if isinstance(outcome, BrokenResourceError)  # e.g. device lost
                       else BrokenResourceError("the completion reactor was closed"))
        elif self._proto.state is not _L.RELEASED:
            self._fail(error_from_status(outcome.status, opcode=outcome.opcode,
                                         vendor_err=outcome.vendor_err, what="message transfer"))

    def _route_input(self, rest: list[Any] | None) -> None:
        """This endpoint's route: the protocol took a completion, and what followed needs more
        than posts and a receiver woken (other actions, or the protocol is closing)."""
        if rest is not None and not self._carry_out(rest):
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
        self._side.write(self._control.send(hs.Close(sent=self._proto.close_sent())))
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

    def _control_input(self, data: bytes) -> None:
        """Bytes of the control channel (see :meth:`_established`)."""
        if self._control_done:
            return
        try:
            self._control.receive_data(data)
        except ProtocolError as exc:
            self._control_broke(RemoteProtocolError(f"control channel: {exc}"))
            return
        self._control_events()

    def _control_end(self, exc: Exception | None) -> None:
        """The control channel's end: the peer's (``exc`` None), or the connection broke."""
        if self._control_done:
            return
        if exc is not None:
            self._control_broke(BrokenResourceError(f"control channel: {exc}"))
            return
        self._control_input(b"")

    def _control_broke(self, exc: AiordmaError) -> None:
        self._control_done = True
        self._fail(exc)

    def _control_events(self) -> None:
        """Act on every event the control connection has: the peer's Close, the end. A
        control message that breaks a rule (the handshake's or the message protocol's: a
        Close's count) fails the endpoint with :class:`RemoteProtocolError`."""
        control = self._control
        try:
            while not self._control_done:
                ev = control.next_event()
                if ev is hs.NEED_DATA:
                    return
                if isinstance(ev, hs.Close):
                    self._proto.peer_closed(ev.sent)
                    if self._proto.state is _L.CLOSED:
                        self._peer_close.set()
                    self._after_input()
                elif isinstance(ev, hs.ConnectionClosed):
                    self._control_done = True
                    if self._proto.peer_total is None:
                        self._fail(BrokenResourceError("the peer disconnected"))
                    else:
                        self._peer_close.set()
        except ProtocolError as exc:
            self._control_broke(RemoteProtocolError(f"control channel: {exc}"))

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
        proto.fail(salvage=not self._slots.closed)
        self._pool_drop()
        self._qp.to_error()  # outstanding work requests complete now, flushed
        # Tell the peer now, as a dead process's kernel would: the end of the control channel
        # is its BrokenResourceError. Its queue pair may be healthy (this end found the peer's
        # frame malformed, or its own work request failed), or in the error state with no
        # receives of its own to flush (on a shared receive pool); either way it would hear of
        # this only at this endpoint's close, which its owner may put off.
        self._side.abort()
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
        pool = self._pool
        if pool is not None:  # after the queue pair: nothing of it is in flight any more
            pool.leave(self._qp.qp_num, self._pool_slots)
            if self._seat is not None:  # its borrowed slots back, then its place
                self._proto.release_sends()
                self._seat.leave()
            release_pool(pool)
        self._wake_everyone(exc)
        self._onesided.teardown(exc, self._reactor)
        self._reactor.remove_route(self._route)
        release_shared(self._reactor, self._entries)
        for mr, _fut in self._rdv_out.values():
            if mr is not None:  # (None: the caller's own region)
                mr.close()
        self._rdv_out.clear()
        self._reg_cache.close()
        for mr in self._regions:
            mr.close()
        if self._seat is None:  # (a seat's region is its chunk's: closed by the last to leave)
            self._slots.close()
        self._regions.clear()
        self._control_done = True
        self._side.detach()
        self._side.abort()
        self._peer_close.set()
