"""The drivers over pyverbs' own objects: the same interface as the compiled drivers of
``_fastpath.pyx`` (:class:`PyCQDriver` as ``CQDriver``, :class:`PyQPDriver` as ``QPDriver``),
for where the fast path is not built (an interpreter's own pyverbs has no ``.pxd`` files to
compile against) or ``AIORDMA_FASTPATH=0`` is set.

They cost more per operation: ``CQ.poll`` builds a pyverbs ``WC`` per completion (with a
logger lookup), and a post sets a pyverbs work request's properties one by one. To allocate
nothing in pyverbs per post, a queue pair reuses one scatter-gather element and one work
request (the verbs copy them at post time): pyverbs' SGE and WR objects never free their C
arrays on their own.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import Any

from aiordma._verbs.discovery import bytes_to_gid
from aiordma._verbs.enums import value
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.messages import Lifecycle

__all__ = ["PyCQDriver", "PyMessageRoute", "PyQPDriver", "PySRQDriver"]

_ROUTE_MIN = 0x1_0000_0000  # wr_ids from here on belong to routes
_RECV_RDMA_WITH_IMM = 129  # IBV_WC_RECV_RDMA_WITH_IMM (verbs.h; a unit test checks it)


def _errno(exc: Exception) -> int:
    return int(getattr(exc, "error_code", 0) or errno.EIO)


def _slot_requests(wr_base: int, address: int, slot_size: int, lkey: int,
                   n: int) -> list[Any]:
    """The ``RecvWR`` of each of ``n`` receive slots (slot ``i``: ``wr_id = wr_base | i``, at
    ``address + i * slot_size``)."""
    from pyverbs.wr import SGE, RecvWR

    if n <= 0:
        raise ValueError("n must be positive")
    out = []
    for i in range(n):
        sge = SGE(address + i * slot_size, slot_size, lkey)
        out.append(RecvWR(wr_id=wr_base | i, num_sge=1, sg=[sge]))  # copies the SGE
        sge.close()
    return out


class PyCQDriver:
    """The verbs work of one completion queue and its channel, per wake-up (see the compiled
    ``CQDriver`` for the contract)."""

    compiled = False

    def __init__(self, cq: Any, channel: Any, ack_batch: int,
                 report: Callable[[Exception], None], poll_batch: int = 64) -> None:
        from pyverbs.pyverbs_error import PyverbsRDMAError

        self._cq = cq
        self._channel = channel
        self._rdma_error = PyverbsRDMAError
        self._ack_batch = max(1, ack_batch)
        self._report = report
        self._batch = poll_batch
        self._closing = False
        self.unacked = 0
        self.completions = 0
        self.wakeups = 0  # calls of wake()
        self.draining = False  # inside a drain: wake-ups that are calls wait in `later`
        self.later: list[Callable[[], object]] = []  # run once the drain is over

    def get_event(self) -> bool:
        """Read one channel event if there is one (non-blocking fd); ``True`` if read.

        One event per wake-up: the CQ is armed for one notification at a time, so a second
        one is rare, and if present it keeps the fd readable and brings the loop back."""
        try:
            self._channel.get_cq_event(self._cq)
        except self._rdma_error as exc:
            if exc.error_code not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise
            return False
        self.unacked += 1
        if self.unacked >= self._ack_batch:
            self._cq.ack_events(self.unacked)
            self.unacked = 0
        return True

    def ack_all(self) -> None:
        """Before the CQ is destroyed: stop draining. (pyverbs' ``CQ.close`` acknowledges the
        events read through its ``get_cq_event``.)"""
        self._closing = True

    def arm(self) -> None:
        self._cq.req_notify()

    def drain(self, handlers: dict[int, Any], routes: dict[int, Any]) -> int:
        if self.draining:  # (a handler drained: the outer drain runs what it deferred)
            return self._drain(handlers, routes)
        return self._deferring(handlers, routes, False)

    def _deferring(self, handlers: dict[int, Any], routes: dict[int, Any], rearm: bool) -> int:
        """Drain (and with ``rearm``, re-arm and drain again) with ``draining`` set, then run
        the calls deferred to ``later`` meanwhile; how many completions ran."""
        self.draining = True
        try:
            found = self._drain(handlers, routes)
            if rearm and not self._closing:
                self._cq.req_notify()
                found += self._drain(handlers, routes)
        finally:
            self.draining = False
        if self.later:
            self._run_later()
        return found

    def _run_later(self) -> None:
        calls, self.later = self.later, []
        for call in calls:
            try:
                call()
            except Exception as exc:  # noqa: BLE001
                self._report(exc)

    def _drain(self, handlers: dict[int, Any], routes: dict[int, Any]) -> int:
        cq, batch = self._cq, self._batch
        total = 0
        while not self._closing:
            n, wcs = cq.poll(batch)
            for wc in wcs:
                wr_id = wc.wr_id
                h = routes.get(wr_id >> 32) if wr_id >= _ROUTE_MIN else handlers.pop(wr_id, None)
                if h is not None:
                    try:  # a faulty handler must not stall the others
                        h(wc)
                    except Exception as exc:  # noqa: BLE001
                        self._report(exc)
                    if self._closing:  # it closed the CQ: close failed the rest's handlers
                        break
            total += n
            if n < batch:
                break
        self.completions += total
        return total

    def wake(self, handlers: dict[int, Any], routes: dict[int, Any]) -> int:
        self.wakeups += 1
        self.get_event()
        return self._deferring(handlers, routes, True)


class PyQPDriver:
    """Posting on one queue pair through pyverbs' work requests (see the compiled
    ``QPDriver``). Every post returns 0 or an errno."""

    compiled = False

    def __init__(self, qp: Any) -> None:
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.wr import SGE, SendWR

        self._qp = qp
        self._error = PyverbsError
        self._send = value("WR_SEND")
        self._atomics = frozenset({value("WR_ATOMIC_FETCH_AND_ADD"),
                                   value("WR_ATOMIC_CMP_AND_SWP")})
        self._sge = SGE(0, 0, 0)
        self._wr = SendWR(wr_id=0, opcode=self._send, num_sge=1, sg=[self._sge], send_flags=0)
        self._wr.sg_list = self._sge  # alias: updating _sge updates the WR's list
        self._slots: list[Any] = []  # the receive slots' RecvWRs
        self._actions: tuple[Any, ...] = ()  # what run_actions carries out (set_actions)

    # -- bring-up: pyverbs' state changes, their attribute objects built here -----------------

    def _modify(self, step: Callable[[Any], None], attr: Any) -> int:
        try:
            step(attr)
        except self._error as exc:
            return getattr(exc, "error_code", None) or errno.EIO
        return 0

    def to_init(self, port: int, access: int) -> int:
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=port)
        attr.pkey_index = 0
        attr.qp_access_flags = access
        return self._modify(self._qp.to_init, attr)

    def to_rtr(self, port: int, path_mtu: int, dest_qp_num: int, rq_psn: int, lid: int,
               gid: bytes | None, sgid_index: int, max_dest_rd_atomic: int, min_rnr_timer: int,
               hop_limit: int) -> int:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(qp_state=value("QPS_RTR"), cur_qp_state=value("QPS_INIT"), port_num=port,
                      path_mtu=path_mtu)
        if gid is not None:
            gr = GlobalRoute(dgid=GID(bytes_to_gid(gid)), sgid_index=sgid_index,
                             hop_limit=hop_limit)
            attr.ah_attr = AHAttr(port_num=port, is_global=1, gr=gr, dlid=lid)
        else:
            attr.ah_attr = AHAttr(port_num=port, is_global=0, dlid=lid)
        attr.dest_qp_num = dest_qp_num
        attr.rq_psn = rq_psn
        attr.max_dest_rd_atomic = max_dest_rd_atomic
        attr.min_rnr_timer = min_rnr_timer
        return self._modify(self._qp.to_rtr, attr)

    def to_rts(self, sq_psn: int, timeout: int, retry_cnt: int, rnr_retry: int,
               max_rd_atomic: int) -> int:
        from pyverbs.qp import QPAttr

        attr = QPAttr(qp_state=value("QPS_RTS"), cur_qp_state=value("QPS_RTR"))
        attr.sq_psn = sq_psn
        attr.timeout = timeout
        attr.retry_cnt = retry_cnt
        attr.rnr_retry = rnr_retry
        attr.max_rd_atomic = max_rd_atomic
        return self._modify(self._qp.to_rts, attr)

    def post_send(self, wr_id: int, opcode: int, address: int, length: int, lkey: int,
                  send_flags: int, remote_address: int = 0, rkey: int = 0,
                  compare_add: int = 0, swap: int = 0, atomic: bool = False,
                  imm_data: int = 0) -> int:
        sge, wr = self._sge, self._wr
        sge.addr = address
        sge.length = length
        sge.lkey = lkey
        wr.wr_id = wr_id
        wr.opcode = opcode
        wr.num_sge = 1 if length else 0
        wr.send_flags = send_flags
        wr.imm_data = imm_data  # (as sent: the caller puts it in network order)
        if atomic:
            wr.set_wr_atomic(rkey, remote_address, compare_add, swap)
        elif opcode != self._send:
            wr.set_wr_rdma(rkey, remote_address)
        return self._post(wr)

    def _post(self, wr: Any) -> int:
        try:
            self._qp.post_send(wr)
        except self._error as exc:
            return _errno(exc)
        return 0

    def post_gather(self, wr_id: int, opcode: int, address: int, length: int, lkey: int,
                    address2: int, length2: int, lkey2: int, send_flags: int,
                    remote_address: int, rkey: int, imm_data: int = 0) -> int:
        """As the compiled driver's: one RDMA work request gathering two SGEs."""
        from pyverbs.wr import SGE, SendWR

        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=2,
                    sg=[SGE(address, length, lkey), SGE(address2, length2, lkey2)],
                    send_flags=send_flags)
        wr.imm_data = imm_data  # (as sent: network order)
        wr.set_wr_rdma(rkey, remote_address)
        return self._post(wr)

    def post_sends(self, items: list[tuple[int, int, int, int, bool]], opcode: int,
                   signaled_flag: int) -> int:
        """One by one (pyverbs posts no chain); those before a failing one are posted."""
        for wr_id, address, length, lkey, signaled in items:
            rc = self.post_send(wr_id, opcode, address, length, lkey,
                                signaled_flag if signaled else 0)
            if rc:
                return rc
        return 0

    def set_actions(self, post_send_type: type, post_recv_type: type, wr_base: int,
                    send_address: int, send_lkey: int, send_opcode: int,
                    signaled_flag: int) -> None:
        self._actions = (post_send_type, post_recv_type, wr_base, send_address, send_lkey,
                         send_opcode, signaled_flag)

    def run_actions_led(self, actions: list[Any], wr_id: int, opcode: int, address: int,
                        length: int, lkey: int, send_flags: int, remote_address: int,
                        rkey: int, imm_data: int = 0) -> list[Any] | None:
        """As the compiled driver's: the RDMA work request posted first, then ``actions``
        (one by one: pyverbs posts no chain).

        Raises:
            OSError: a post failed (its errno).
        """
        rc = self.post_send(wr_id, opcode, address, length, lkey, send_flags, remote_address,
                            rkey, imm_data=imm_data)
        if rc:
            raise OSError(rc, "ibv_post_send failed")
        return self.run_actions(actions)

    def run_actions(self, actions: list[Any]) -> list[Any] | None:
        """As the compiled driver's: the posting actions carried out (one by one: pyverbs
        posts no chain), the others returned in order, or None.

        Raises:
            OSError: a post failed (its errno).
        """
        post_send, post_recv, base, address, lkey, opcode, flag = self._actions
        rest = None
        for a in actions:
            t = type(a)
            if t is post_send:
                rc = self.post_send(base | a.wr_id, opcode, address + a.offset, a.length, lkey,
                                    flag if a.signaled else 0)
            elif t is post_recv:
                rc = self.post_slot(a.slot)
            else:
                if rest is None:
                    rest = []
                rest.append(a)
                continue
            if rc:
                raise OSError(rc, f"{'ibv_post_send' if t is post_send else 'ibv_post_recv'} "
                                  f"failed")
        return rest

    def prepare_slots(self, wr_base: int, address: int, slot_size: int, lkey: int,
                      n: int) -> None:
        self.release()
        self._slots = _slot_requests(wr_base, address, slot_size, lkey, n)

    def post_slot(self, i: int) -> int:
        if not 0 <= i < len(self._slots):
            raise IndexError(f"no receive slot {i} (of {len(self._slots)})")
        try:
            self._qp.post_recv(self._slots[i])
        except self._error as exc:
            return _errno(exc)
        return 0

    def post_recv(self, wr_id: int, address: int, length: int, lkey: int) -> int:
        from pyverbs.wr import SGE, RecvWR

        sge = SGE(address, length, lkey)
        wr = RecvWR(wr_id=wr_id, num_sge=1, sg=[sge])
        try:
            self._qp.post_recv(wr)
        except self._error as exc:
            return _errno(exc)
        finally:
            wr.close()  # frees the WR's copy of the SGE array (pyverbs never does)
            sge.close()
        return 0

    def release(self) -> None:
        """Free the receive slots' work requests (pyverbs does not on garbage collection)."""
        for wr in self._slots:
            wr.close()
        self._slots = []


class PySRQDriver:
    """The receive slots of a shared receive queue through pyverbs' work requests (see the
    compiled ``SRQDriver``). Every post returns 0 or an errno."""

    compiled = False

    def __init__(self, srq: Any) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        self._srq = srq
        self._error = PyverbsError
        self._slots: list[Any] = []

    def prepare_slots(self, wr_base: int, address: int, slot_size: int, lkey: int,
                      n: int) -> None:
        self.release()
        self._slots = _slot_requests(wr_base, address, slot_size, lkey, n)

    def post_slots(self, slots: list[int]) -> int:
        """One by one (those before a failing one are posted)."""
        n = len(self._slots)
        for i in slots:
            if not 0 <= i < n:
                raise IndexError(f"no receive slot {i} (of {n})")
            try:
                self._srq.post_recv(self._slots[i])
            except self._error as exc:
                return _errno(exc)
        return 0

    def release(self) -> None:
        for wr in self._slots:
            wr.close()
        self._slots = []


class PyMessageRoute:
    """An endpoint's route: the completions of its receive slots and sends, in Python (the
    reference of the compiled ``MessageRoute``, which does the same in C).

    Each successful completion is fed to ``proto`` (the endpoint's
    :class:`~aiordma.protocols.messages.MessageProtocol`), unless it is broken or released
    (the receive of a WRITE with immediate data to its ``on_immediate``, the value in host
    order);
    the posting actions that follow go to ``run_actions`` (the queue pair's); then, while the
    protocol is open and nothing else is due, the first receiver still waiting in
    ``waiters`` (a deque of futures) is woken if a message is there. Otherwise:

    - ``on_input(rest)``: the protocol is not open, the peer closed, or actions other than
      posts came (``rest``, in order, or None): the endpoint carries them out and wakes whom
      they concern;
    - ``on_failure(outcome)``: a failed work completion, the reactor's exception at close, a
      :class:`~aiordma.protocols.errors.ProtocolError` the protocol raised, or an
      ``OSError`` from a post.
    """

    __slots__ = ("_on_failure", "_on_input", "_proto", "_run_actions", "_waiters")

    def __init__(self, proto: Any, run_actions: Callable[[list[Any]], list[Any] | None],
                 waiters: Any, on_failure: Callable[[Any], None],
                 on_input: Callable[[list[Any] | None], None]) -> None:
        self._proto, self._run_actions, self._waiters = proto, run_actions, waiters
        self._on_failure, self._on_input = on_failure, on_input

    def __call__(self, wc: Any) -> None:
        if isinstance(wc, BaseException) or wc.status:
            self._on_failure(wc)
            return
        proto = self._proto
        state = proto.state
        if state is Lifecycle.BROKEN or state is Lifecycle.RELEASED:
            return
        try:
            if wc.opcode == _RECV_RDMA_WITH_IMM:
                proto.on_immediate(wc.wr_id & 0xFFFF_FFFF, wc.byte_len,
                                   socket.ntohl(wc.imm_data))  # (on the wire: network order)
            else:
                proto.on_completion(wc.wr_id & 0xFFFF_FFFF, wc.byte_len)
        except ProtocolError as exc:
            self._on_failure(exc)
            return
        rest = None
        if proto.actions:
            try:
                rest = self._run_actions(proto.take_actions())
            except OSError as exc:
                self._on_failure(exc)
                return
        if rest is not None or proto.state is not Lifecycle.OPEN or proto.peer_total is not None:
            self._on_input(rest)
            return
        waiters = self._waiters
        if waiters and proto.inbox:
            while waiters:
                w = waiters.popleft()
                if not w.done():
                    w.set_result(None)
                    break
