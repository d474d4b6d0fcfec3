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

from aiordma._verbs.compiled import fastpath
from aiordma._verbs.pydrivers import PyCQDriver, PyMessageRoute, PyQPDriver, PySRQDriver

__all__ = ["cq_driver", "message_route", "qp_driver", "srq_driver"]


def cq_driver(cq: Any, channel: Any, ack_batch: int, report: Callable[[Exception], None],
              poll_batch: int = 64) -> Any:
    """The driver of pyverbs' ``cq`` and its ``channel``: compiled where built, else
    :class:`~aiordma._verbs.pydrivers.PyCQDriver`."""
    fast = fastpath()
    if fast is not None:
        return fast.CQDriver(cq, channel, ack_batch, report)
    return PyCQDriver(cq, channel, ack_batch, report, poll_batch)


def qp_driver(qp: Any) -> Any:
    """The posting driver of pyverbs' ``qp``: compiled where built, else
    :class:`~aiordma._verbs.pydrivers.PyQPDriver`."""
    fast = fastpath()
    return fast.QPDriver(qp) if fast is not None else PyQPDriver(qp)


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
        fast = fastpath()
        if fast is not None:
            return fast.MessageRoute(proto, qp_driver, waiters, on_failure, on_input)
    return PyMessageRoute(proto, qp_driver.run_actions, waiters, on_failure, on_input)
