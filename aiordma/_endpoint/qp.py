"""Reliable-connected queue pairs: creation, the RESET -> INIT -> RTR -> RTS bring-up, posting.

A :class:`QueuePair` is created in RESET on a :class:`~aiordma._reactor.reactor.CompletionReactor`'s CQ
(send and receive). :meth:`QueuePair.connect` walks the states pyverbs names, with the peer's
:class:`QPAddress` (exchanged by the connection handshake):

* ``to_init``: port, P_Key index 0, the remote access the QP accepts;
* ``to_rtr``: the path to the peer (RoCE: a global route to its GID), its QP number, its
  initial PSN, the path MTU (the smaller of both ports'), responder resources for reads/atomics;
* ``to_rts``: our initial PSN, ACK timeout and retry counts, initiator depth.

Posting goes through the compiled fast path where it is built (:mod:`aiordma._verbs.compiled`: one call
from plain integers, receive slots' work requests built once in C). Otherwise it reuses one
scatter-gather element and one work request object per queue pair (the verbs copy them at
post time), so the hot path allocates nothing in pyverbs: pyverbs' SGE and WR objects never
free their C arrays.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiordma._args import check_word
from aiordma._device.device import Device
from aiordma._device.discovery import bytes_to_gid
from aiordma._errors import (
    BrokenResourceError,
    ClosedResourceError,
    DeviceError,
    LocalProtocolError,
)
from aiordma._memory.region import LocalSlice, RemoteBuffer
from aiordma._reactor.reactor import CompletionReactor
from aiordma._resources import Share
from aiordma._verbs.compiled import fastpath

__all__ = ["QPAddress", "QueuePair", "connect_pair", "opcode"]

_OP_SEND = 0
_SIGNALED = 0
_INLINE = 0
_ATOMIC_OPS: frozenset[int] = frozenset()
_PyverbsError: type[Exception] = Exception


def _load_constants() -> None:
    """Plain-int copies of the verbs constants the hot path uses (pyverbs loaded lazily)."""
    global _OP_SEND, _SIGNALED, _INLINE, _ATOMIC_OPS, _PyverbsError
    import pyverbs.libibverbs_enums as e
    from pyverbs.pyverbs_error import PyverbsError

    _OP_SEND = int(e.IBV_WR_SEND)
    _SIGNALED = int(e.IBV_SEND_SIGNALED)
    _INLINE = int(e.IBV_SEND_INLINE)
    _ATOMIC_OPS = frozenset({int(e.IBV_WR_ATOMIC_FETCH_AND_ADD), int(e.IBV_WR_ATOMIC_CMP_AND_SWP)})
    _PyverbsError = PyverbsError


def opcode(name: str) -> int:
    """The work-request opcode ``IBV_WR_<name>`` as a plain int (``"SEND"``, ``"RDMA_READ"``,
    ``"RDMA_WRITE"``, ``"ATOMIC_FETCH_AND_ADD"``, ``"ATOMIC_CMP_AND_SWP"``), so that callers
    of :meth:`QueuePair.post_send` need not import pyverbs."""
    import pyverbs.libibverbs_enums as e

    return int(getattr(e, f"IBV_WR_{name}"))


def _posted(rc: int, call: str) -> None:
    """A compiled post's result: 0, or the errno as :class:`DeviceError`."""
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

    ``close()`` is idempotent; the reactor and the device close their queue pairs first.
    """

    def __init__(self, device: Device, reactor: CompletionReactor, *, max_send_wr: int = 256,
                 max_recv_wr: int = 256, max_inline: int = 0, max_rd_atomic: int = 16,
                 remote_access: bool = True) -> None:
        import pyverbs.libibverbs_enums as e
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPCap, QPInitAttr
        from pyverbs.wr import SGE, SendWR

        self._e = e
        _load_constants()
        self.device = device
        self.reactor = reactor
        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=1,
                    max_recv_sge=1, max_inline_data=max_inline)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=reactor.cq, rcq=reactor.cq, cap=cap,
                          sq_sig_all=0)
        try:
            self._qp = QP(device.pd, init)  # RESET: no QPAttr, so pyverbs does not move it
        except PyverbsError as exc:
            raise DeviceError(f"cannot create a queue pair on {device.name}: {exc}") from exc
        self._share = Share(self, "qps")
        self.qp_num: int = int(self._qp.qp_num)
        self.psn: int = secrets.randbits(24)
        self.max_inline = max_inline
        self._rd_atomic = min(max_rd_atomic, device.attr.max_qp_rd_atom or 1,
                              device.attr.max_qp_init_rd_atom or 1)
        self._rd_atomic_out = self._rd_atomic  # lowered to the peer's depth by connect()
        self._access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
                        | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
                        ) if remote_access else e.IBV_ACCESS_LOCAL_WRITE
        self._sge = SGE(0, 0, 0)
        self._wr = SendWR(wr_id=0, opcode=e.IBV_WR_SEND, num_sge=1, sg=[self._sge], send_flags=0)
        self._wr.sg_list = self._sge  # alias: updating _sge updates the WR's list
        fast = fastpath()
        self._fast = fast.QPDriver(self._qp) if fast is not None else None
        self._slots: list[Any] = []  # the receive slots' pyverbs RecvWRs (no fast path)
        self._closed = False
        self._error: BaseException | None = None
        device._adopt(self)
        reactor._adopt(self)

    # -- bring-up ------------------------------------------------------------------------------

    def local_address(self) -> QPAddress:
        return QPAddress(qp_num=self.qp_num, psn=self.psn, gid=self.device.gid,
                         lid=int(self.device.port_info.lid), mtu=self.device.active_mtu_enum)

    def connect(self, remote: QPAddress, *, peer_rd_atomic: int | None = None) -> None:
        """RESET -> INIT -> RTR -> RTS towards ``remote``.

        ``peer_rd_atomic``: the READs/atomics the peer accepts in flight (its responder
        depth); this side never has more outstanding (a responder that runs out of resources
        drops a retried READ, see :data:`RETRY_COUNT`)."""
        from pyverbs.pyverbs_error import PyverbsError

        if peer_rd_atomic is not None:
            self._rd_atomic_out = max(1, min(self._rd_atomic, peer_rd_atomic))
        try:
            self.to_init()
            self.to_rtr(remote)
            self.to_rts()
        except PyverbsError as exc:
            raise DeviceError(f"queue pair bring-up failed: {exc}") from exc

    def to_init(self) -> None:
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.device.port)
        attr.pkey_index = 0
        attr.qp_access_flags = self._access
        self._qp.to_init(attr)

    def to_rtr(self, remote: QPAddress) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self._e
        attr = QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT,
                      port_num=self.device.port,
                      path_mtu=min(remote.mtu, self.device.active_mtu_enum))
        if self.device.port_info.link_layer == "Ethernet" or remote.gid != bytes(16):
            gr = GlobalRoute(dgid=GID(bytes_to_gid(remote.gid)), sgid_index=self.device.gid_index,
                             hop_limit=64)
            attr.ah_attr = AHAttr(port_num=self.device.port, is_global=1, gr=gr, dlid=remote.lid)
        else:
            attr.ah_attr = AHAttr(port_num=self.device.port, is_global=0, dlid=remote.lid)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = self._rd_atomic
        attr.min_rnr_timer = 12  # 0.64 ms
        self._qp.to_rtr(attr)

    def to_rts(self) -> None:
        from pyverbs.qp import QPAttr

        e = self._e
        attr = QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RTR, port_num=self.device.port)
        attr.sq_psn = self.psn
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_COUNT
        attr.rnr_retry = 7  # RNR: retry for ever (credits keep a SEND from meeting no receive)
        attr.max_rd_atomic = self._rd_atomic_out
        self._qp.to_rts(attr)

    # -- posting -------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise ClosedResourceError("the queue pair is closed")
        if self._error is not None:
            raise BrokenResourceError("the queue pair is broken") from self._error

    def post_send(self, wr_id: int, opcode: int, address: int, length: int, lkey: int, *,
                  signaled: bool = True, remote_address: int = 0, rkey: int = 0,
                  compare_add: int = 0, swap: int = 0, inline: bool = False) -> None:
        """Post one send-queue work request (SEND, RDMA WRITE/READ, atomics).

        Hot path: plain ints (enum members compare slowly), one reused SGE and WR.
        """
        if self._closed or self._error is not None:
            self._check()
        fast = self._fast
        if fast is not None:
            flags = _SIGNALED if signaled else 0
            if inline:
                flags |= _INLINE
            _posted(fast.post_send(wr_id, opcode, address, length, lkey, flags, remote_address,
                                   rkey, compare_add, swap, opcode in _ATOMIC_OPS),
                    "ibv_post_send")
            return
        sge, wr = self._sge, self._wr
        sge.addr = address
        sge.length = length
        sge.lkey = lkey
        wr.wr_id = wr_id
        opcode = int(opcode)
        wr.opcode = opcode
        wr.num_sge = 1 if length else 0
        flags = _SIGNALED if signaled else 0
        if inline:
            flags |= _INLINE
        wr.send_flags = flags
        if opcode in _ATOMIC_OPS:
            wr.set_wr_atomic(rkey, remote_address, compare_add, swap)
        elif opcode != _OP_SEND:
            wr.set_wr_rdma(rkey, remote_address)
        try:
            self._qp.post_send(wr)
        except _PyverbsError as exc:
            raise DeviceError(f"ibv_post_send failed: {exc}") from exc

    def post_sends(self, items: list[tuple[int, int, int, int, bool]]) -> None:
        """Post SENDs, each ``(wr_id, address, length, lkey, signaled)``, in order: with the
        fast path as one chain (one doorbell: on rxe one system call, which does the packet
        work, instead of one per message), else one by one."""
        if self._closed or self._error is not None:
            self._check()
        fast = self._fast
        if fast is not None:
            _posted(fast.post_sends(items, _OP_SEND, _SIGNALED), "ibv_post_send")
            return
        for wr_id, address, length, lkey, signaled in items:
            self.post_send(wr_id, _OP_SEND, address, length, lkey, signaled=signaled)

    def prepare_slots(self, wr_base: int, address: int, slot_size: int, lkey: int,
                      n: int) -> None:
        """Build the receive work requests of ``n`` fixed slots once, to post again and again
        with :meth:`post_slot`: slot ``i`` is ``slot_size`` bytes at ``address + i *
        slot_size``, its ``wr_id`` is ``wr_base | i`` (creating pyverbs objects per post costs
        more than the post)."""
        if self._fast is not None:
            self._fast.prepare_slots(wr_base, address, slot_size, lkey, n)
            return
        from pyverbs.wr import SGE, RecvWR

        self._free_slots()
        for i in range(n):
            sge = SGE(address + i * slot_size, slot_size, lkey)
            self._slots.append(RecvWR(wr_id=wr_base | i, num_sge=1, sg=[sge]))  # copies the SGE
            sge.close()

    def post_slot(self, i: int) -> None:
        """Post receive slot ``i`` (see :meth:`prepare_slots`)."""
        if self._closed or self._error is not None:
            self._check()
        fast = self._fast
        if fast is not None:
            _posted(fast.post_slot(i), "ibv_post_recv")
            return
        try:
            self._qp.post_recv(self._slots[i])
        except _PyverbsError as exc:
            raise DeviceError(f"ibv_post_recv failed: {exc}") from exc

    def _free_slots(self) -> None:
        for wr in self._slots:
            wr.close()  # frees its SGE array (pyverbs does not on garbage collection)
        self._slots = []

    def post_recv(self, wr_id: int, address: int, length: int, lkey: int) -> None:
        """Post one receive buffer."""
        self._check()
        if self._fast is not None:
            _posted(self._fast.post_recv(wr_id, address, length, lkey), "ibv_post_recv")
            return
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.wr import SGE, RecvWR

        sge = SGE(address, length, lkey)
        wr = RecvWR(wr_id=wr_id, num_sge=1, sg=[sge])
        try:
            self._qp.post_recv(wr)
        except PyverbsError as exc:
            raise DeviceError(f"ibv_post_recv failed: {exc}") from exc
        finally:
            wr.close()  # frees the WR's copy of the SGE array (pyverbs never does)
            sge.close()

    # -- awaitable operations (each posts one signaled work request) ----------------------------

    def post_future(self, what: str, opcode: int, local: LocalSlice, *,
                    remote: RemoteBuffer | None = None, compare_add: int = 0,
                    swap: int = 0, done: Callable[[], None] | None = None
                    ) -> tuple[int, asyncio.Future[Any]]:
        """Post one signaled work request now; return its ``wr_id`` and the future of its
        completion. ``local``'s region stays referenced until the completion arrives, when
        ``done`` (if given) is called, even if the future was cancelled."""
        reactor = self.reactor
        wr_id = reactor.next_wr_id()
        fut = reactor.expect(wr_id, what, local.region, done)
        try:
            self.post_send(wr_id, opcode, local.address, local.length, local.lkey,
                           remote_address=remote.address if remote else 0,
                           rkey=remote.rkey if remote else 0, compare_add=compare_add, swap=swap)
        except BaseException:
            reactor.unwatch(wr_id)
            raise
        return wr_id, fut

    async def _post_wait(self, what: str, opcode: int, local: LocalSlice, *,
                         remote: RemoteBuffer | None = None, compare_add: int = 0,
                         swap: int = 0) -> Any:
        _, fut = self.post_future(what, opcode, local, remote=remote, compare_add=compare_add,
                                  swap=swap)
        try:
            return await fut
        except BrokenResourceError as exc:
            self.mark_broken(exc)
            raise

    async def send(self, src: LocalSlice) -> None:
        """SEND ``src``; returns when the send completed (the peer's receive got it)."""
        await self._post_wait("send", self._e.IBV_WR_SEND, src)

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
        fut = self.recv_future(dst)
        try:
            wc = await fut
        except BrokenResourceError as exc:
            self.mark_broken(exc)
            raise
        return int(wc.byte_len)

    async def write(self, src: LocalSlice, dst: RemoteBuffer) -> None:
        """RDMA WRITE ``src`` into the peer's ``dst`` (same length)."""
        _check_remote(src, dst, "write")
        await self._post_wait("rdma write", self._e.IBV_WR_RDMA_WRITE, src, remote=dst)

    async def read(self, dst: LocalSlice, src: RemoteBuffer) -> None:
        """RDMA READ the peer's ``src`` into ``dst`` (same length)."""
        _check_remote(dst, src, "read")
        await self._post_wait("rdma read", self._e.IBV_WR_RDMA_READ, dst, remote=src)

    async def fetch_add(self, dst8: LocalSlice, target: RemoteBuffer, add: int) -> int:
        """Atomic fetch-and-add on 8 aligned remote bytes; the old value lands in ``dst8``."""
        _check_atomic(dst8, target)
        await self._post_wait("fetch_add", self._e.IBV_WR_ATOMIC_FETCH_AND_ADD, dst8,
                              remote=target, compare_add=check_word(add, name="add"))
        return int.from_bytes(dst8.memoryview(), "little")

    async def compare_swap(self, dst8: LocalSlice, target: RemoteBuffer, expected: int,
                           new: int) -> int:
        """Atomic compare-and-swap on 8 aligned remote bytes; returns the old value."""
        _check_atomic(dst8, target)
        await self._post_wait("compare_swap", self._e.IBV_WR_ATOMIC_CMP_AND_SWP, dst8,
                              remote=target, compare_add=check_word(expected, name="expected"),
                              swap=check_word(new, name="new"))
        return int.from_bytes(dst8.memoryview(), "little")

    def to_error(self) -> None:
        """Move to the error state: every outstanding work request completes, flushed."""
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QPAttr

        if self._closed:
            return
        attr = QPAttr(qp_state=self._e.IBV_QPS_ERR)
        try:
            self._qp.modify(attr, self._e.IBV_QP_STATE)
        except PyverbsError:
            pass  # already unusable; destroying it is what remains

    def mark_broken(self, cause: BaseException) -> None:
        if self._error is None:
            self._error = cause

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def state(self) -> int:
        return int(self._qp.qp_state)

    def close(self) -> None:
        """Destroy the queue pair (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._qp.close()
        finally:
            self._free_slots()
            self._share.give_back()

    def __repr__(self) -> str:
        return f"<QueuePair {self.qp_num:#x}{' closed' if self._closed else ''}>"

    @property
    def compiled(self) -> bool:
        """Posts go through the compiled fast path (else pyverbs' WR objects)."""
        return self._fast is not None

    @property
    def raw(self) -> Any:
        """The pyverbs ``QP`` (for :mod:`aiordma.lowlevel` users)."""
        return self._qp


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
