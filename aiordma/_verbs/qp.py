"""A reliable-connected queue pair's verbs: creation in RESET, the RESET -> INIT -> RTR -> RTS
steps as pyverbs names them (one verbs call each where compiled), and posting through a driver
(compiled, or pyverbs' objects)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from aiordma._errors import DeviceError
from aiordma._verbs.cq import CompletionQueue
from aiordma._verbs.drivers import message_route, rc_queue_pair
from aiordma._verbs.enums import value

__all__ = ["RCQueuePair"]


def _check(step: str, err: int) -> None:
    """A driver's state change: 0, or the errno it failed with (raised as DeviceError)."""
    if err:
        raise DeviceError(f"queue pair bring-up failed ({step}): {os.strerror(err)}",
                          errno=err)


class RCQueuePair:
    """An RC queue pair in ``pd`` whose send and receive completions go to ``cq``, created in
    RESET (:func:`~aiordma._verbs.drivers.rc_queue_pair`: one verbs call where compiled).

    Posting is the driver's, bound here as attributes; each returns 0 or an errno:
    ``post_send(wr_id, opcode, address, length, lkey, send_flags, remote_address=0, rkey=0,
    compare_add=0, swap=0, atomic=False)``, ``post_sends(items, opcode, signaled_flag)`` (a
    chain of SENDs, each ``(wr_id, address, length, lkey, signaled)``), ``prepare_slots(wr_base,
    address, slot_size, lkey, n)`` then ``post_slot(i)`` (receive slots built once),
    ``post_recv(wr_id, address, length, lkey)``. A message protocol's posting actions:
    ``set_actions(post_send_type, post_recv_type, wr_base, send_address, send_lkey,
    send_opcode, signaled_flag)`` once, then ``run_actions(actions)``: the SENDs and receive
    reposts carried out (the SENDs as one chain where compiled), the other actions returned in
    order or None; a failed post raises ``OSError``. ``run_actions_led(actions, wr_id, opcode,
    address, length, lkey, send_flags, remote_address, rkey, imm_data=0)``: the same with one
    RDMA work request at the head of the first chain (one doorbell for a WRITE and its notice).
    ``post_send`` also takes ``imm_data`` (a WITH_IMM opcode's field as sent: network order).
    ``post_gather(wr_id, opcode, address, length, lkey, address2, length2, lkey2, send_flags,
    remote_address, rkey, imm_data=0)``: one RDMA work request of two SGEs (the queue pair
    takes two per send work request).

    ``srq``: a :class:`~aiordma._verbs.srq.SharedReceiveQueue` the queue pair takes its
    receive buffers from (it then has no receive queue of its own).

    Raises:
        DeviceError: the device refused the queue pair.
    """

    def __init__(self, pd: Any, cq: CompletionQueue, *, max_send_wr: int, max_recv_wr: int,
                 max_inline: int, device_name: str, srq: Any = None) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        self._error = PyverbsError
        try:  # (with a shared queue's receives, none of its own)
            self._qp, driver = rc_queue_pair(pd, cq.raw, srq.raw if srq is not None else None,
                                             max_send_wr=max_send_wr, max_recv_wr=max_recv_wr,
                                             max_inline=max_inline)
        except (PyverbsError, OSError) as exc:
            raise DeviceError(f"cannot create a queue pair on {device_name}: {exc}",
                              errno=getattr(exc, "errno", None)) from exc
        self._driver = driver
        self.qp_num: int = int(self._qp.qp_num)
        self.compiled: bool = driver.compiled
        self.post_send: Callable[..., int] = driver.post_send
        self.post_sends: Callable[..., int] = driver.post_sends
        self.post_gather: Callable[..., int] = driver.post_gather
        self.prepare_slots: Callable[..., None] = driver.prepare_slots
        self.post_slot: Callable[[int], int] = driver.post_slot
        self.post_recv: Callable[..., int] = driver.post_recv
        self.set_actions: Callable[..., None] = driver.set_actions
        self.run_actions: Callable[[list[Any]], list[Any] | None] = driver.run_actions
        self.run_actions_led: Callable[..., list[Any] | None] = driver.run_actions_led

    # -- bring-up ------------------------------------------------------------------------------

    # Each step is one call of the driver's, 0 or an errno: compiled, one ibv_modify_qp with
    # pyverbs' masks; pyverbs' path builds its attribute objects (several Python objects, a
    # logger each) and its RTR queries the queue pair's state first (in the VM 7-37x the
    # verbs call's CPU time: docs/reports/2026-11-26-connections-at-scale.md).

    def to_init(self, *, port: int, access: int) -> None:
        """RESET -> INIT: the port, P_Key index 0, the remote access the queue pair accepts."""
        _check("INIT", self._driver.to_init(port, access))

    def to_rtr(self, *, port: int, path_mtu: int, dest_qp_num: int, rq_psn: int, lid: int,
               gid: bytes | None, sgid_index: int, max_dest_rd_atomic: int,
               min_rnr_timer: int, hop_limit: int = 64) -> None:
        """INIT -> RTR: the path to the peer (``gid``: a global route to it, as RoCE needs;
        None: by LID), its queue pair number and initial PSN, responder resources."""
        _check("RTR", self._driver.to_rtr(port, path_mtu, dest_qp_num, rq_psn, lid, gid,
                                          sgid_index, max_dest_rd_atomic, min_rnr_timer,
                                          hop_limit))

    def to_rts(self, *, sq_psn: int, timeout: int, retry_cnt: int, rnr_retry: int,
               max_rd_atomic: int) -> None:
        """RTR -> RTS: our initial PSN, the ACK timeout and retry counts, initiator depth."""
        _check("RTS", self._driver.to_rts(sq_psn, timeout, retry_cnt, rnr_retry, max_rd_atomic))

    def message_route(self, proto: Any, waiters: Any, on_failure: Callable[[Any], None],
                      on_input: Callable[[list[Any] | None], None]) -> Any:
        """A reactor route handler for a message protocol driven over this queue pair (see
        :func:`aiordma._verbs.drivers.message_route`; :meth:`set_actions` first)."""
        return message_route(proto, self._driver, waiters, on_failure, on_input)

    def to_error(self) -> None:
        """Move to the error state (every outstanding work request completes, flushed); a
        queue pair that cannot be moved is unusable anyway, and destroying it is what
        remains."""
        from pyverbs.qp import QPAttr

        attr = QPAttr(qp_state=value("QPS_ERR"))
        try:
            self._qp.modify(attr, value("QP_STATE"))
        except self._error:
            pass

    @property
    def state(self) -> int:
        return int(self._qp.qp_state)

    def post_request(self, wr: Any) -> int:
        """Post a work request built elsewhere in this package (a memory window's bind,
        :func:`~aiordma._verbs.mr.bind_request`); 0 or an errno."""
        try:
            self._qp.post_send(wr)
        except self._error as exc:
            return int(getattr(exc, "error_code", 0) or 5)  # EIO
        return 0

    @property
    def raw(self) -> Any:
        """pyverbs' ``QP``."""
        return self._qp

    def close(self) -> None:
        """Destroy the queue pair and free the driver's work requests."""
        try:
            self._qp.close()
        finally:
            self._driver.release()
