"""A completion queue with its own completion channel, driven per wake-up by a driver."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from aiordma._errors import DeviceError
from aiordma._verbs.drivers import cq_driver
from aiordma._verbs.load import require_pyverbs

__all__ = ["CompletionQueue"]

Handlers = dict[int, Any]


class CompletionQueue:
    """A CQ of ``cqe`` entries on ``context``, reporting to a completion channel of its own
    (one channel per CQ), whose fd is non-blocking.

    The per-wake-up steps are the driver's, bound here as attributes (one call, no
    indirection on the hot path):

    - ``wake(handlers, routes)``: read the channel event, poll until empty calling each
      completion's handler (``wr_id`` below 2**32: popped from ``handlers``; above: the route
      ``wr_id >> 32``), re-arm, poll again; how many completions ran. An event loop can call it
      directly when :attr:`fd` is readable (``loop.add_reader(cq.fd, cq.wake, handlers,
      routes)``); :attr:`wakeups` counts the calls.
    - ``get_event()``, ``drain(handlers, routes)``, ``arm()``: the same steps one by one.

    Handlers get a work completion with pyverbs ``WC``'s field names (``wr_id``, ``status``,
    ``opcode``, ``vendor_err``, ``byte_len``, ``imm_data``, ``qp_num``, ``wc_flags``). A
    handler that raises is reported to ``report`` and the others still run.

    Raises:
        DeviceError: the device refused the CQ or the channel.
    """

    def __init__(self, context: Any, cqe: int, *, ack_batch: int,
                 report: Callable[[Exception], None], device_name: str,
                 poll_batch: int = 64) -> None:
        require_pyverbs()
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.pyverbs_error import PyverbsError

        try:
            self._channel = CompChannel(context)
            self._cq = CQ(context, cqe, None, self._channel, 0)
        except PyverbsError as exc:
            raise DeviceError(f"cannot create a CQ on {device_name}: {exc}") from exc
        self.fd: int = self._channel.fd
        os.set_blocking(self.fd, False)  # else ibv_get_cq_event blocks holding the GIL
        driver = cq_driver(self._cq, self._channel, ack_batch, report, poll_batch)
        self.driver: Any = driver  # (its `draining` and `later`: see Notify in aiordma._places)
        self.compiled: bool = driver.compiled
        self.wake: Callable[[Handlers, Handlers], int] = driver.wake
        self.drain: Callable[[Handlers, Handlers], int] = driver.drain
        self.get_event: Callable[[], bool] = driver.get_event
        self.arm: Callable[[], None] = driver.arm
        self._cq.req_notify()

    @property
    def completions(self) -> int:
        """How many work completions the driver dispatched."""
        return int(self.driver.completions)

    @property
    def wakeups(self) -> int:
        """How many times :attr:`wake` ran."""
        return int(self.driver.wakeups)

    @property
    def raw(self) -> Any:
        """pyverbs' ``CQ``."""
        return self._cq

    def close(self) -> None:
        """Acknowledge every event read, destroy the CQ, then its channel (close the queue
        pairs on it first)."""
        self.driver.ack_all()
        self._cq.close()
        self._channel.close()
