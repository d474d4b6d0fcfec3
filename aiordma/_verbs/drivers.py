"""The one place that chooses between the compiled drivers and pyverbs' objects.

A driver does the verbs work of one completion queue (``CQDriver``: read the channel event,
poll, route each completion to its handler, re-arm) or of one queue pair (``QPDriver``: post
from plain integers), with the same methods on both paths. The choice is made when the
resource is created (:func:`~aiordma._verbs.compiled.fastpath`), so a test can run both in
one process; nothing outside this package branches on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiordma._verbs.compiled import _load, fastpath
from aiordma._verbs.enums import value
from aiordma._verbs.pydrivers import PyCQDriver, PyMessageRoute, PyQPDriver, PySRQDriver
from aiordma._verbs.pysteps import PyStepRunner

__all__ = ["cq_driver", "message_route", "rc_queue_pair", "srq_driver", "step_runner"]


def cq_driver(cq: Any, channel: Any, ack_batch: int, report: Callable[[Exception], None],
              poll_batch: int = 64) -> Any:
    """The driver of pyverbs' ``cq`` and its ``channel``: compiled where built, else
    :class:`~aiordma._verbs.pydrivers.PyCQDriver`."""
    fast = fastpath()
    if fast is not None:
        return fast.CQDriver(cq, channel, ack_batch, report)
    return PyCQDriver(cq, channel, ack_batch, report, poll_batch)


def rc_queue_pair(pd: Any, cq: Any, srq: Any, *, max_send_wr: int, max_recv_wr: int,
                  max_inline: int) -> tuple[Any, Any]:
    """An RC queue pair in RESET (pyverbs' ``QP`` in ``pd``, completions on pyverbs' ``cq``,
    receives from pyverbs' ``srq`` if not None, two send SGEs) and its posting driver: made
    by the compiled module where built (one ``ibv_create_qp``, none of pyverbs' attribute
    objects), else by ``QP(pd, QPInitAttr(...))``, with
    :class:`~aiordma._verbs.pydrivers.PyQPDriver`.

    Raises:
        OSError, pyverbs' PyverbsError: the device refused it.
    """
    fast = fastpath()
    if fast is not None:
        qp = fast.create_rc_qp(pd, cq, srq, max_send_wr, max_recv_wr, max_inline)
        return qp, fast.QPDriver(qp)
    from pyverbs.qp import QP, QPCap, QPInitAttr

    cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=0 if srq is not None else max_recv_wr,
                max_send_sge=2, max_recv_sge=1, max_inline_data=max_inline)
    qp = QP(pd, QPInitAttr(qp_type=value("QPT_RC"), scq=cq, rcq=cq, cap=cap, sq_sig_all=0,
                           srq=srq))
    return qp, PyQPDriver(qp)


def srq_driver(srq: Any) -> Any:
    """The posting driver of pyverbs' shared receive queue ``srq``: compiled where built,
    else :class:`~aiordma._verbs.pydrivers.PySRQDriver`."""
    fast = fastpath()
    return fast.SRQDriver(srq) if fast is not None else PySRQDriver(srq)


def message_route(proto: Any, qp_driver: Any, waiters: Any, on_failure: Callable[[Any], None],
                  on_input: Callable[[list[Any] | None], None]) -> Any:
    """An endpoint's route handler over its queue pair's driver: compiled (the whole path of a
    completion in C) where the driver is, else
    :class:`~aiordma._verbs.pydrivers.PyMessageRoute` (see it for the arguments). Both
    hand the receive of an RDMA WRITE with immediate data to the protocol's
    ``on_immediate`` (which refuses it unless ``proto.immediates`` is set)."""
    if qp_driver.compiled:
        fast = _load()  # (loaded: the driver is its)
        if fast is not None:
            return fast.MessageRoute(proto, qp_driver, waiters, on_failure, on_input)
    return PyMessageRoute(proto, qp_driver.run_actions, waiters, on_failure, on_input)


def step_runner(programs: Any, landings: int, qps: dict[int, Any],
                remote: dict[int, tuple[int, int, int]], work_address: int, work_lkey: int,
                land_address: int, cap: int, wr_base: int, land_lkey: int) -> Any:
    """The executor of one rank's step programs over its queue pairs' drivers ``qps``: the
    compiled ``StepRunner`` where every driver is compiled (which can also copy in and out
    and reduce by typed loops in C), else
    :class:`~aiordma._verbs.pysteps.PyStepRunner` (see it for the arguments)."""
    if qps and all(d.compiled for d in qps.values()):
        fast = _load()
        if fast is not None and hasattr(fast, "StepRunner"):
            return fast.StepRunner(programs, landings, qps, remote, work_address, work_lkey,
                                   land_address, cap, wr_base, land_lkey)
    return PyStepRunner(programs, landings, qps, remote, work_address, work_lkey, land_address,
                        cap, wr_base, land_lkey)
