"""A shared receive queue (SRQ): receive buffers posted once for many queue pairs.

The queue pairs created with it (:class:`~aiordma._verbs.qp.RCQueuePair`'s ``srq``) take every
incoming SEND's buffer from it instead of from a receive queue of their own; the completion
(on the queue pair's CQ) names the queue pair by ``qp_num``. Posting is the driver's, as the
queue pair's: ``prepare_slots(wr_base, address, slot_size, lkey, n)`` once, then
``post_slots([i, ...])`` (one chain where compiled), which returns 0 or an errno.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiordma._errors import DeviceError
from aiordma._verbs.drivers import srq_driver

__all__ = ["SharedReceiveQueue"]


class SharedReceiveQueue:
    """A shared receive queue in ``pd`` with room for ``max_wr`` posted receives.

    Raises:
        DeviceError: the device refused it (no SRQ support, or ``max_wr`` above its
            ``max_srq_wr``).
    """

    def __init__(self, pd: Any, *, max_wr: int, device_name: str) -> None:
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr

        try:
            self._srq = SRQ(pd, SrqInitAttr(SrqAttr(max_wr=max_wr, max_sge=1)))
        except PyverbsError as exc:
            raise DeviceError(f"cannot create a shared receive queue of {max_wr} on "
                              f"{device_name}: {exc}",
                              errno=getattr(exc, "error_code", None)) from exc
        driver = self._driver = srq_driver(self._srq)
        self.max_wr = max_wr
        self.compiled: bool = driver.compiled
        self.prepare_slots: Callable[..., None] = driver.prepare_slots
        self.post_slots: Callable[[list[int]], int] = driver.post_slots

    @property
    def raw(self) -> Any:
        """pyverbs' ``SRQ`` (for ``QPInitAttr(srq=...)``)."""
        return self._srq

    def close(self) -> None:
        """Destroy the queue (its queue pairs first: pyverbs closes those it knows) and free
        the driver's work requests; idempotent."""
        try:
            self._srq.close()
        finally:
            self._driver.release()
