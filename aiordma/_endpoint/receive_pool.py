"""A shared receive pool: one shared receive queue per device and event loop, its buffers
posted once for all of that loop's queue pairs on the device, refilled as they are consumed.

:class:`SharedReceivePool` registers ``buffers`` slots of ``slot_size`` bytes in one memory
region, posts them all to a :class:`~aiordma._verbs.srq.SharedReceiveQueue`, and routes the
completions of those slots (one route of the reactor, as an endpoint's) to the consumer that
the completion's queue pair number names (:meth:`SharedReceivePool.attach`). A consumer gets
the slot's bytes and says whether the slot may be reposted at once; a slot it keeps is
reposted by :meth:`SharedReceivePool.release` (several go as one chain). The credit rules
that keep a sender from finding no posted buffer are :mod:`aiordma.protocols.receive_pool`'s.

:func:`shared_receive_pool` gives each (event loop, device, slot size) one pool, counted: the
last :func:`release_pool` closes it. Endpoints do not use it yet (see ``docs/receive-pool.md``
for what is missing); queue pairs created with ``srq=pool.srq`` do.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from aiordma._device.device import Device
from aiordma._errors import DeviceError, LocalProtocolError
from aiordma._memory.region import MemoryRegion
from aiordma._reactor.reactor import CompletionReactor
from aiordma._verbs.srq import SharedReceiveQueue

__all__ = ["SharedReceivePool", "release_pool", "shared_receive_pool"]

Consumer = Callable[[int, memoryview], bool]
"""``consumer(slot, data) -> reposted_now``: a frame arrived in ``slot`` (``data``: its bytes,
valid until the slot is reposted); True: repost it now, False: the consumer calls
:meth:`SharedReceivePool.release` later."""


class SharedReceivePool:
    """Receive buffers shared by the queue pairs of one reactor on one device.

    Args:
        device: the opened device.
        reactor: the reactor whose CQ the queue pairs use (the pool's completions come there).
        buffers: slots posted (at most the device's ``max_srq_wr``).
        slot_size: bytes per slot.

    Attributes:
        srq: the shared receive queue (give it to :class:`~aiordma._endpoint.qp.QueuePair`).
        region: the registered slots (one memory region).
        posted: slots posted now.
        received: frames that arrived, in all.
        unrouted: frames that arrived for no attached queue pair (reposted at once).

    Raises:
        DeviceError: the device has no shared receive queues, or not this many.
        LocalProtocolError: ``buffers`` or ``slot_size`` out of range.
    """

    def __init__(self, device: Device, reactor: CompletionReactor, *, buffers: int,
                 slot_size: int) -> None:
        if not 1 <= buffers <= 1 << 20 or not 64 <= slot_size <= 1 << 20:
            raise LocalProtocolError(f"a pool of {buffers} slots of {slot_size} B is out of "
                                     f"range (1..2**20 slots of 64 B..1 MiB)")
        limit = int(getattr(device.attr, "max_srq_wr", 0) or 0)
        if limit and buffers > limit:
            raise DeviceError(f"{device.name} posts at most {limit} receives to a shared "
                              f"queue, not {buffers}")
        self.device, self.reactor = device, reactor
        self.slot_size, self.buffers = slot_size, buffers
        self.srq = SharedReceiveQueue(device.pd, max_wr=buffers, device_name=device.name)
        try:
            self.region = MemoryRegion(device, bytearray(buffers * slot_size))
            self._route = reactor.add_route(self._on_completion)
        except BaseException:
            self.srq.close()
            raise
        self._view = self.region.view
        self._consumers: dict[int, Consumer] = {}
        self._closed = False
        self.received = self.unrouted = 0
        self.srq.prepare_slots(self._route << 32, self.region.address, slot_size,
                               self.region.lkey, buffers)
        self.posted = 0
        self._post(list(range(buffers)))
        self.users = 0  # (shared_receive_pool's count)

    def attach(self, qp_num: int, consumer: Consumer) -> None:
        """Route the frames that arrive for queue pair ``qp_num`` to ``consumer``."""
        self._consumers[qp_num] = consumer

    def detach(self, qp_num: int) -> None:
        """Stop routing ``qp_num``'s frames (its queue pair is destroyed)."""
        self._consumers.pop(qp_num, None)

    def release(self, slots: list[int]) -> None:
        """Repost slots that consumers kept (one chain where compiled)."""
        if not self._closed:
            self._post(slots)

    def _post(self, slots: list[int]) -> None:
        rc = self.srq.post_slots(slots)
        if rc:
            raise DeviceError(f"ibv_post_srq_recv failed: {os.strerror(rc)}")
        self.posted += len(slots)

    def _on_completion(self, wc: Any) -> None:
        if isinstance(wc, BaseException):  # the reactor closed under us
            self._closed = True
            return
        slot = wc.wr_id & 0xFFFF_FFFF
        self.posted -= 1
        if wc.status:  # a receive the device gave back unused (flushed): post it again
            if not self._closed:
                self._post([slot])
            return
        self.received += 1
        consumer = self._consumers.get(wc.qp_num)
        if consumer is None:
            self.unrouted += 1
            self._post([slot])
            return
        start = slot * self.slot_size
        if consumer(slot, self._view[start:start + wc.byte_len]):
            self._post([slot])

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Destroy the queue and deregister the slots (idempotent). Close the queue pairs
        that use it first: pyverbs would destroy them with it, behind their backs."""
        if self.region.closed and self._closed:
            return
        self._closed = True
        self.reactor.remove_route(self._route)
        self._consumers.clear()
        try:
            self.srq.close()
        finally:
            self.region.close()

    def __repr__(self) -> str:
        return (f"<SharedReceivePool {self.posted}/{self.buffers} posted of {self.slot_size} B"
                f"{' closed' if self._closed else ''}>")


_pools: dict[asyncio.AbstractEventLoop, dict[tuple[int, int], SharedReceivePool]] = {}


def shared_receive_pool(device: Device, reactor: CompletionReactor, *, buffers: int,
                        slot_size: int) -> SharedReceivePool:
    """The pool of the running loop on ``device`` for ``slot_size`` slots (created with
    ``buffers`` slots on first use); counted: give it back with :func:`release_pool`."""
    per_loop = _pools.setdefault(asyncio.get_running_loop(), {})
    key = (id(device), slot_size)
    pool = per_loop.get(key)
    if pool is None or pool.closed or pool.reactor is not reactor:
        if pool is not None and not pool.closed:
            raise LocalProtocolError("one receive pool per device and loop: its reactor is "
                                     "another")
        pool = per_loop[key] = SharedReceivePool(device, reactor, buffers=buffers,
                                                 slot_size=slot_size)
    pool.users += 1
    return pool


def release_pool(pool: SharedReceivePool) -> None:
    """Give a pool back; the last user's release closes it."""
    pool.users -= 1
    if pool.users > 0:
        return
    for per_loop in _pools.values():
        for key, p in list(per_loop.items()):
            if p is pool:
                del per_loop[key]
    pool.close()
