"""Reliable-connected queue pairs: creation, the RESET -> INIT -> RTR -> RTS bring-up, posting.

A :class:`QueuePair` is created in RESET on a :class:`~aiordma._reactor.reactor.CompletionReactor`'s CQ
(send and receive). :meth:`QueuePair.connect` walks the states pyverbs names, with the peer's
:class:`QPAddress` (exchanged by the connection handshake):

* ``to_init``: port, P_Key index 0, the remote access the QP accepts;
* ``to_rtr``: the path to the peer (RoCE: a global route to its GID), its QP number, its
  initial PSN, the path MTU (the smaller of both ports'), responder resources for reads/atomics;
* ``to_rts``: our initial PSN, ACK timeout and retry counts, initiator depth.

The verbs calls themselves are :class:`aiordma._verbs.qp.RCQueuePair`'s (posting through
the compiled fast path where it is built, else pyverbs' objects); this module holds the
policy (timeouts, retries, depths) and the awaitable operations.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiordma._args import check_int, check_word
from aiordma._device.device import Device
from aiordma._errors import (
    BrokenResourceError,
    ClosedResourceError,
    DeviceError,
    LocalProtocolError,
)
from aiordma._memory.region import LocalSlice, RemoteBuffer
from aiordma._reactor.reactor import CompletionReactor
from aiordma._resources import Share
from aiordma._verbs.enums import value
from aiordma._verbs.mr import access_flags
from aiordma._verbs.qp import RCQueuePair

__all__ = ["QPAddress", "QueuePair", "connect_pair", "opcode"]


def opcode(name: str) -> int:
    """The work-request opcode ``IBV_WR_<name>`` as a plain int (``"SEND"``, ``"RDMA_READ"``,
    ``"RDMA_WRITE"``, ``"ATOMIC_FETCH_AND_ADD"``, ``"ATOMIC_CMP_AND_SWP"``), so that callers
    of :meth:`QueuePair.post_send` need not import pyverbs."""
    return value(f"WR_{name}")


def _posted(rc: int, call: str) -> None:
    """A driver's post result: 0, or the errno as :class:`DeviceError`."""
    if rc:
        raise DeviceError(f"{call} failed: {os.strerror(rc)}")


def _check_remote(local: LocalSlice, remote: RemoteBuffer, what: str) -> None:
    if not isinstance(local, LocalSlice):
        raise LocalProtocolError(f"{what}: the local side must be a registered region's slice "
                                 f"(region[start:stop]), not {type(local).__name__}")
    if not isinstance(remote, RemoteBuffer):
        raise LocalProtocolError(f"{what}: the remote side must be a RemoteBuffer (from the "
                                 f"peer's expose(), RemoteBuffer.from_wire), not "
                                 f"{type(remote).__name__}")
    if local.length != remote.length:
        raise LocalProtocolError(f"{what}: local range is {local.length} B, remote range is "
                                 f"{remote.length} B")
    if what == "write" and not remote.writable:
        raise LocalProtocolError("write: the remote buffer was not exposed writable")
    if what == "read" and not remote.readable:
        raise LocalProtocolError("read: the remote buffer was not exposed readable")


def _check_atomic(local: LocalSlice, remote: RemoteBuffer) -> None:
    if not isinstance(local, LocalSlice):
        raise LocalProtocolError(f"the atomic result buffer must be a registered region's "
                                 f"slice, not {type(local).__name__}")
    if not isinstance(remote, RemoteBuffer):
        raise LocalProtocolError(f"an atomic's target must be a RemoteBuffer, not "
                                 f"{type(remote).__name__}")
    if local.length != 8 or remote.length != 8:
        raise LocalProtocolError("atomics operate on exactly 8 bytes")
    if remote.address % 8:
        raise LocalProtocolError(f"atomic target {remote.address:#x} is not 8-byte aligned")
    if not remote.atomic:
        raise LocalProtocolError("the remote buffer was not exposed for atomics")
    if local.region.readonly:
        raise LocalProtocolError("the atomic result buffer must be writable")


ACK_TIMEOUT = 17
"""Local ACK timeout exponent: 4.096 us * 2**17 = 0.54 s without any packet from the peer
before the requester retries (rxe pushes the timer out on every response packet).

Measured on rxe in the VM: retries are routine under load (``rdma statistic``
``completer_retry_err`` rose by 10-25 in one ``aiordma bench --only c,d`` run), and healthy
connections see silences longer than 0.5 s: with 2**14 (67 ms) and :data:`RETRY_COUNT` 6 both
soak tests failed with ``IBV_WC_RETRY_EXC_ERR``. So the timeout is long enough that seven
tries outlast those silences; the cost is 0.54 s per retry (one bench run each: the 64 B
message rate was 0.08-0.14x ``ib_send_bw`` against 0.21-0.27x at 2**14; noisy)."""

RETRY_COUNT = 6
"""Transport retries before a work request fails with ``IBV_WC_RETRY_EXC_ERR``
(:class:`~aiordma.PeerUnreachableError`): about 7 x 0.54 s = 3.8 s of silence. Not 7: rxe's
completer treats 7 as *infinite* (``if (qp->comp.retry_cnt != 7) qp->comp.retry_cnt--``), and
a retried READ whose responder resource is gone is dropped by the responder
(``duplicate_request``, "Class D error"), so with 7 such a READ would wait for ever: the
likely cause of the one-sided operation that did not complete within 60 s in one CI run."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QPAddress:
    """What a peer needs to connect to a queue pair."""

    qp_num: int
    psn: int  # 24-bit initial packet sequence number (random)
    gid: bytes  # 16 bytes
    lid: int
    mtu: int  # ibv_mtu enum (1..5)


class QueuePair:
    """An RC queue pair on a reactor's CQ.

    Args:
        device: the opened device.
        reactor: the reactor whose CQ receives both send and receive completions.
        max_send_wr, max_recv_wr: queue depths.
        max_inline: bytes a SEND may carry inline (copied at post time).
        remote_access: accept RDMA READ/WRITE and atomics from the peer (the memory regions
            still decide what is reachable).
        srq: a shared receive queue (:class:`~aiordma._endpoint.receive_pool.ReceivePool`'s
            ``srq``) to take receive buffers from instead of a receive queue of its own.

    ``close()`` is idempotent; the reactor and the device close their queue pairs first.
    """

    def __init__(self, device: Device, reactor: CompletionReactor, *, max_send_wr: int = 256,
                 max_recv_wr: int = 256, max_inline: int = 0, max_rd_atomic: int = 16,
                 remote_access: bool = True, srq: Any = None) -> None:
        self.device = device
        self.reactor = reactor
        self._verbs = RCQueuePair(device.pd, reactor.completion_queue, max_send_wr=max_send_wr,
                                  max_recv_wr=max_recv_wr, max_inline=max_inline,
                                  device_name=device.name, srq=srq)
        self._share = Share(self, "qps")
        self.qp_num: int = self._verbs.qp_num
        self.psn: int = secrets.randbits(24)
        self.max_inline = max_inline
        self._rd_atomic = min(max_rd_atomic, device.attr.max_qp_rd_atom or 1,
                              device.attr.max_qp_init_rd_atom or 1)
        self._rd_atomic_out = self._rd_atomic  # lowered to the peer's depth by connect()
        self._access = access_flags(local_write=True, remote_read=remote_access,
                                    remote_write=remote_access, atomic=remote_access)
        self._send = value("WR_SEND")
        self._signaled = value("SEND_SIGNALED")
        self._inline = value("SEND_INLINE")
        self._with_imm = value("WC_WITH_IMM")
        self._atomics = frozenset({value("WR_ATOMIC_FETCH_AND_ADD"),
                                   value("WR_ATOMIC_CMP_AND_SWP")})
        self._closed = False
        self._error: BaseException | None = None
        self.initialized = False  # RESET -> INIT done (it needs nothing of the peer's)
        device._adopt(self)
        reactor._adopt(self)

    # -- bring-up ------------------------------------------------------------------------------

    def local_address(self) -> QPAddress:
        return QPAddress(qp_num=self.qp_num, psn=self.psn, gid=self.device.gid,
                         lid=int(self.device.port_info.lid), mtu=self.device.active_mtu_enum)

    def connect(self, remote: QPAddress, *, peer_rd_atomic: int | None = None) -> None:
        """RESET -> INIT -> RTR -> RTS towards ``remote`` (from INIT if :meth:`to_init` was
        called ahead: it needs nothing of the peer's).

        ``peer_rd_atomic``: the READs/atomics the peer accepts in flight (its responder
        depth); this side never has more outstanding (a responder that runs out of resources
        drops a retried READ, see :data:`RETRY_COUNT`).

        Raises:
            DeviceError: a step failed (the message names it).
        """
        if peer_rd_atomic is not None:
            self._rd_atomic_out = max(1, min(self._rd_atomic, peer_rd_atomic))
        if not self.initialized:
            self.to_init()
        self.to_rtr(remote)
        self.to_rts()

    def to_init(self) -> None:
        self._verbs.to_init(port=self.device.port, access=self._access)
        self.initialized = True

    def to_rtr(self, remote: QPAddress) -> None:
        device = self.device
        # RoCE needs a global route (GRH) to the peer's GID; InfiniBand without a GID, a LID
        routed = device.port_info.link_layer == "Ethernet" or remote.gid != bytes(16)
        self._verbs.to_rtr(port=device.port, path_mtu=min(remote.mtu, device.active_mtu_enum),
                           dest_qp_num=remote.qp_num, rq_psn=remote.psn, lid=remote.lid,
                           gid=remote.gid if routed else None, sgid_index=device.gid_index,
                           max_dest_rd_atomic=self._rd_atomic,
                           min_rnr_timer=12)  # 0.64 ms

    def to_rts(self) -> None:
        # RNR: retry for ever (credits keep a SEND from meeting no receive)
        self._verbs.to_rts(sq_psn=self.psn, timeout=ACK_TIMEOUT,
                           retry_cnt=RETRY_COUNT, rnr_retry=7, max_rd_atomic=self._rd_atomic_out)

    # -- posting -------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise ClosedResourceError("the queue pair is closed")
        if self._error is not None:
            raise BrokenResourceError("the queue pair is broken") from self._error

    def post_send(self, wr_id: int, opcode: int, address: int, length: int, lkey: int, *,
                  signaled: bool = True, remote_address: int = 0, rkey: int = 0,
                  compare_add: int = 0, swap: int = 0, inline: bool = False,
                  imm_data: int = 0) -> None:
        """Post one send-queue work request (SEND, RDMA WRITE/READ, atomics) from plain ints;
        ``imm_data``: a WITH_IMM opcode's immediate value (host order, 32 bits).

        Raises:
            ClosedResourceError, BrokenResourceError: the queue pair is closed or broken.
            DeviceError: the post failed.
        """
        if self._closed or self._error is not None:
            self._check()
        flags = self._signaled if signaled else 0
        if inline:
            flags |= self._inline
        _posted(self._verbs.post_send(wr_id, opcode, address, length, lkey, flags,
                                      remote_address, rkey, compare_add, swap,
                                      opcode in self._atomics,
                                      socket.htonl(imm_data) if imm_data else 0),
                "ibv_post_send")

    def post_gather(self, wr_id: int, opcode: int, address: int, length: int, lkey: int,
                    send_flags: int, remote_address: int, rkey: int, imm_data: int, *,
                    tail: LocalSlice) -> None:
        """Post an RDMA work request (as :meth:`post_future`'s ``post`` gets it, ``imm_data``
        in network order) with ``tail`` as its second SGE, gathered behind the first."""
        if self._closed or self._error is not None:
            self._check()
        _posted(self._verbs.post_gather(wr_id, opcode, address, length, lkey, tail.address,
                                        tail.length, tail.lkey, send_flags, remote_address,
                                        rkey, imm_data), "ibv_post_send")

    def post_sends(self, items: list[tuple[int, int, int, int, bool]]) -> None:
        """Post SENDs, each ``(wr_id, address, length, lkey, signaled)``, in order: with the
        compiled driver as one chain (one doorbell: on rxe one system call, which does the
        packet work, instead of one per message), else one by one."""
        if self._closed or self._error is not None:
            self._check()
        _posted(self._verbs.post_sends(items, self._send, self._signaled), "ibv_post_send")

    def prepare_slots(self, wr_base: int, address: int, slot_size: int, lkey: int,
                      n: int) -> None:
        """Build the receive work requests of ``n`` fixed slots once, to post again and again
        with :meth:`post_slot`: slot ``i`` is ``slot_size`` bytes at ``address + i *
        slot_size``, its ``wr_id`` is ``wr_base | i`` (creating work requests per post costs
        more than the post)."""
        self._verbs.prepare_slots(wr_base, address, slot_size, lkey, n)

    def action_runner(self, post_send_type: type, post_recv_type: type, wr_base: int,
                      send_address: int, send_lkey: int) -> Callable[[list[Any]],
                                                                     list[Any] | None]:
        """The driver's ``run_actions`` for a message protocol's actions (see
        :class:`aiordma._verbs.qp.RCQueuePair`): ``runner(actions)`` posts the SENDs (frames
        of the send region at ``send_address``, ids ``wr_base | wr_id``) and receive reposts
        among ``actions`` and returns the others in order (or None); a failed post, or a
        closed queue pair, raises ``OSError``. Called once per endpoint, which then calls the
        runner itself: its hot path has no layer in between."""
        self._verbs.set_actions(post_send_type, post_recv_type, wr_base, send_address,
                                send_lkey, self._send, self._signaled)
        return self._verbs.run_actions

    def led_runner(self) -> Callable[..., list[Any] | None]:
        """The driver's ``run_actions_led(actions, wr_id, opcode, address, length, lkey,
        send_flags, remote_address, rkey, imm_data)``: :meth:`action_runner`'s runner with
        one RDMA work request at the head of the first chain (one doorbell for a WRITE and
        the SEND announcing it where compiled). Call :meth:`action_runner` first."""
        return self._verbs.run_actions_led

    def message_route(self, proto: Any, waiters: Any, on_failure: Callable[[Any], None],
                      on_input: Callable[[list[Any] | None], None]) -> Any:
        """A reactor route handler that drives message protocol ``proto`` over this queue
        pair (see :func:`aiordma._verbs.drivers.message_route`): the whole path of a
        completion in C where the fast path is built. Call :meth:`action_runner` before the
        first completion."""
        return self._verbs.message_route(proto, waiters, on_failure, on_input)

    def post_slot(self, i: int) -> None:
        """Post receive slot ``i`` (see :meth:`prepare_slots`)."""
        if self._closed or self._error is not None:
            self._check()
        _posted(self._verbs.post_slot(i), "ibv_post_recv")

    def post_recv(self, wr_id: int, address: int, length: int, lkey: int) -> None:
        """Post one receive buffer."""
        self._check()
        _posted(self._verbs.post_recv(wr_id, address, length, lkey), "ibv_post_recv")

    def post_request(self, wr: Any, what: str) -> None:
        """Post a work request the verbs layer built (a memory window's bind)."""
        self._check()
        _posted(self._verbs.post_request(wr), f"ibv_post_send ({what})")

    # -- awaitable operations (each posts one signaled work request) ----------------------------

    def post_future(self, what: str, opcode: int, local: LocalSlice, *,
                    remote: RemoteBuffer | None = None, compare_add: int = 0,
                    swap: int = 0, done: Callable[[], None] | None = None, imm_data: int = 0,
                    post: Callable[..., None] | None = None
                    ) -> tuple[int, asyncio.Future[Any]]:
        """Post one signaled work request now; return its ``wr_id`` and the future of its
        completion. ``local``'s region stays referenced until the completion arrives, when
        ``done`` (if given) is called, even if the future was cancelled.

        ``post``: instead of posting the work request alone, call ``post(wr_id, opcode,
        address, length, lkey, send_flags, remote_address, rkey, imm_data)`` (an RDMA work
        request, as :meth:`led_runner`'s runner takes it, ``imm_data`` in network order: e.g.
        to post it at the head of a chain); it raises if nothing was posted."""
        reactor = self.reactor
        wr_id = reactor.next_wr_id()
        fut = reactor.expect(wr_id, what, local.region, done)
        try:
            if post is not None:
                if self._closed or self._error is not None:
                    self._check()
                post(wr_id, opcode, local.address, local.length, local.lkey, self._signaled,
                     remote.address if remote else 0, remote.rkey if remote else 0,
                     socket.htonl(imm_data) if imm_data else 0)
            else:
                self.post_send(wr_id, opcode, local.address, local.length, local.lkey,
                               remote_address=remote.address if remote else 0,
                               rkey=remote.rkey if remote else 0, compare_add=compare_add,
                               swap=swap, imm_data=imm_data)
        except BaseException:
            reactor.unwatch(wr_id)
            raise
        return wr_id, fut

    async def _post_wait(self, what: str, opcode: int, local: LocalSlice, *,
                         remote: RemoteBuffer | None = None, compare_add: int = 0,
                         swap: int = 0, imm_data: int = 0) -> Any:
        _, fut = self.post_future(what, opcode, local, remote=remote, compare_add=compare_add,
                                  swap=swap, imm_data=imm_data)
        try:
            return await fut
        except BrokenResourceError as exc:
            self.mark_broken(exc)
            raise

    async def send(self, src: LocalSlice) -> None:
        """SEND ``src``; returns when the send completed (the peer's receive got it)."""
        await self._post_wait("send", self._send, src)

    def recv_future(self, dst: LocalSlice) -> asyncio.Future[Any]:
        """Post ``dst`` as a receive buffer now; the future resolves with its work completion.

        The region stays referenced until the completion (or the flush at close) arrives,
        whatever happens to the future.
        """
        reactor = self.reactor
        wr_id = reactor.next_wr_id()
        fut = reactor.expect(wr_id, "recv", dst.region)
        try:
            self.post_recv(wr_id, dst.address, dst.length, dst.lkey)
        except BaseException:
            reactor.unwatch(wr_id)
            raise
        return fut

    async def recv(self, dst: LocalSlice) -> int:
        """Post ``dst`` as a receive buffer and wait for a message; return its length."""
        return (await self.recv_with_imm(dst))[0]

    async def recv_with_imm(self, dst: LocalSlice) -> tuple[int, int | None]:
        """Post ``dst`` as a receive buffer and wait for what consumes it: a SEND (its bytes
        land in ``dst``) or a :meth:`write` with ``imm`` (its bytes land where it wrote;
        ``dst`` is untouched and may be empty). Returns the byte count (a SEND's, or the
        WRITE's) and the immediate value, or None if there was none.

        Raises:
            ClosedResourceError, BrokenResourceError: the queue pair is closed or broke.
        """
        fut = self.recv_future(dst)
        try:
            wc = await fut
        except BrokenResourceError as exc:
            self.mark_broken(exc)
            raise
        if wc.wc_flags & self._with_imm:
            return int(wc.byte_len), socket.ntohl(wc.imm_data)  # (on the wire: network order)
        return int(wc.byte_len), None

    async def write(self, src: LocalSlice, dst: RemoteBuffer, *, imm: int | None = None) -> None:
        """RDMA WRITE ``src`` into the peer's ``dst`` (same length).

        ``imm``: a 32-bit value (0..2**32-1) sent with the WRITE (``RDMA_WRITE_WITH_IMM``):
        the peer learns that the data is in place from a receive completion carrying it
        (:meth:`recv_with_imm`), with no message of its own. It consumes one of the peer's
        posted receive buffers, as a SEND does: the peer must have one posted, or the WRITE
        fails with a receiver-not-ready error once the retries run out.

        Raises:
            LocalProtocolError: the ranges differ in length, ``dst`` is not writable, or
                ``imm`` is not an integer 0..2**32-1.
        """
        _check_remote(src, dst, "write")
        if imm is None:
            await self._post_wait("rdma write", value("WR_RDMA_WRITE"), src, remote=dst)
            return
        word = check_int(imm, name="imm", low=0, high=0xFFFF_FFFF)
        await self._post_wait("rdma write with imm", value("WR_RDMA_WRITE_WITH_IMM"), src,
                              remote=dst, imm_data=word)

    async def read(self, dst: LocalSlice, src: RemoteBuffer) -> None:
        """RDMA READ the peer's ``src`` into ``dst`` (same length)."""
        _check_remote(dst, src, "read")
        await self._post_wait("rdma read", value("WR_RDMA_READ"), dst, remote=src)

    async def fetch_add(self, dst8: LocalSlice, target: RemoteBuffer, add: int) -> int:
        """Atomic fetch-and-add on 8 aligned remote bytes; the old value lands in ``dst8``."""
        _check_atomic(dst8, target)
        await self._post_wait("fetch_add", value("WR_ATOMIC_FETCH_AND_ADD"), dst8,
                              remote=target, compare_add=check_word(add, name="add"))
        return int.from_bytes(dst8.memoryview(), "little")

    async def compare_swap(self, dst8: LocalSlice, target: RemoteBuffer, expected: int,
                           new: int) -> int:
        """Atomic compare-and-swap on 8 aligned remote bytes; returns the old value."""
        _check_atomic(dst8, target)
        await self._post_wait("compare_swap", value("WR_ATOMIC_CMP_AND_SWP"), dst8,
                              remote=target, compare_add=check_word(expected, name="expected"),
                              swap=check_word(new, name="new"))
        return int.from_bytes(dst8.memoryview(), "little")

    def to_error(self) -> None:
        """Move to the error state: every outstanding work request completes, flushed."""
        if not self._closed:
            self._verbs.to_error()

    def mark_broken(self, cause: BaseException) -> None:
        if self._error is None:
            self._error = cause

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def state(self) -> int:
        return self._verbs.state

    def close(self) -> None:
        """Destroy the queue pair (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._verbs.close()
        finally:
            self._share.give_back()

    def __repr__(self) -> str:
        return f"<QueuePair {self.qp_num:#x}{' closed' if self._closed else ''}>"

    @property
    def driver(self) -> Any:
        """The posting driver (compiled where built; see :mod:`aiordma._verbs.drivers`)."""
        return self._verbs._driver

    @property
    def compiled(self) -> bool:
        """Posts go through the compiled fast path (else pyverbs' WR objects)."""
        return self._verbs.compiled

    @property
    def raw(self) -> Any:
        """The pyverbs ``QP`` (for :mod:`aiordma.lowlevel` users)."""
        return self._verbs.raw


def connect_pair(device: Device, reactor: CompletionReactor, **kwargs: Any
                 ) -> tuple[QueuePair, QueuePair]:
    """Two queue pairs on one device, connected to each other (loopback; tests and demos)."""
    a = QueuePair(device, reactor, **kwargs)
    b = QueuePair(device, reactor, **kwargs)
    try:
        a.connect(b.local_address())
        b.connect(a.local_address())
    except BaseException:
        a.close()
        b.close()
        raise
    return a, b
