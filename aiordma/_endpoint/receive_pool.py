"""A shared receive pool: one shared receive queue per device and event loop, its buffers
posted once for all of that loop's queue pairs on the device, refilled as they are consumed.

:class:`SharedReceivePool` registers ``buffers`` slots of ``slot_size`` bytes in one memory
region, posts them all to a :class:`~aiordma._verbs.srq.SharedReceiveQueue`, and routes the
completions of those slots (one route of the reactor, as an endpoint's) to the consumer that
the completion's queue pair number names (:meth:`SharedReceivePool.attach`). A consumer gets
the slot's bytes and says whether the slot may be reposted at once; a slot it keeps is
reposted by :meth:`SharedReceivePool.release` (several go as one chain). The credit rules
that keep a sender from finding no posted buffer are :mod:`aiordma.protocols.receive_pool`'s.

:func:`shared_receive_pool` gives each (event loop, reactor, slot size) one pool, counted: the
last :func:`release_pool` closes it.

Endpoints (``Config(receive_pool=True)``: a listener's when its client offers it too, and a
client's with ``client_pool`` too) use it
through :func:`join_pool` and :meth:`SharedReceivePool.leave`: each is a *member*, its queue
pair's completions of pool slots go to ``member._pool_completion(slot, wc)`` (the kind of
frame is looked at first: a data frame is counted against the connection's pool credits),
and the pool's credit rules (:class:`~aiordma.protocols.receive_pool.ReceivePool`, one per
pool) grant and reclaim through ``member._pool_event(event)``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any, Protocol

from aiordma._device.device import Device
from aiordma._endpoint.send_arena import SendArena
from aiordma._errors import DeviceError, LocalProtocolError
from aiordma._memory.region import MemoryRegion
from aiordma._reactor.reactor import CompletionReactor, release_shared
from aiordma._verbs.srq import SharedReceiveQueue
from aiordma.protocols.errors import LocalProtocolError as _WireLocalError
from aiordma.protocols.messages import MIN_CTRL_SLOTS
from aiordma.protocols.receive_pool import PoolEvent, ReceivePool

__all__ = ["PoolMember", "SharedReceivePool", "join_pool", "release_pool", "shared_receive_pool"]

POOL_INITIAL = 1
"""Data credits a connection is granted at set-up when the pool has them free."""
_DATA_KINDS = (1, 2)  # framing.Kind.DATA, RTS: frames that spend a pool credit


class PoolMember(Protocol):
    """What an endpoint on a pool provides (see the module documentation)."""

    def _pool_completion(self, slot: int, wc: Any) -> None: ...

    def _pool_event(self, event: PoolEvent) -> None: ...

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
        self.rules: ReceivePool | None = None  # endpoints' credit rules (join_pool)
        self._members: dict[int, PoolMember] = {}
        self.cq_entries = 0  # CQ entries reserved on each of its reactors for it (join_pool)
        self.reactors = [reactor]  # every reactor whose CQ its queue pairs use (add_reactor)
        # its endpoints' send slots, by (reserve, shared): see send_arena.join_send_arena
        self.send_arenas: dict[tuple[int, int], SendArena] = {}

    def add_reactor(self, reactor: CompletionReactor) -> bool:
        """Let queue pairs on ``reactor``'s CQ use the pool too: its slots' completions come
        to that CQ for them, so the pool's route must have the same id there as on its first
        reactor (a fresh reactor's first route does). False if it cannot: ``reactor`` unused.
        """
        route = reactor.add_route(self._on_completion)
        if route != self._route:
            reactor.remove_route(route)
            return False
        self.reactors.append(reactor)
        return True

    def attach(self, qp_num: int, consumer: Consumer) -> None:
        """Route the frames that arrive for queue pair ``qp_num`` to ``consumer``."""
        self._consumers[qp_num] = consumer

    def detach(self, qp_num: int) -> None:
        """Stop routing ``qp_num``'s frames (its queue pair is destroyed)."""
        self._consumers.pop(qp_num, None)

    # -- endpoints (members) --------------------------------------------------------------------

    def join(self, qp_num: int, member: PoolMember) -> int:
        """Attach an endpoint's queue pair (created with ``srq=self.srq``): its frames go to
        ``member``; return the data credits granted at once (the Accept carries them).

        Raises:
            LocalProtocolError: the rules have no room (:meth:`ReceivePool.can_attach`).
        """
        if self.rules is None:
            raise LocalProtocolError("this pool has no credit rules: join_pool() makes one")
        grant = self.rules.attach(qp_num)
        self._members[qp_num] = member
        return grant

    def join_member(self, qp_num: int, member: PoolMember) -> None:
        """The endpoint of a queue pair joined at set-up takes its place."""
        if qp_num in self._members:
            self._members[qp_num] = member

    def leave(self, qp_num: int, slots: dict[int, bool]) -> None:
        """An endpoint's queue pair is destroyed: detach it, repost the ``slots`` it still
        held (slot -> held a data frame), and let the rules give its credits to others."""
        self._members.pop(qp_num, None)
        rules = self.rules
        if rules is not None:
            try:
                rules.detach(qp_num)
            except _WireLocalError:
                pass  # (never attached: a set-up that failed before join)
        self.give_back(None, slots)

    def give_back(self, qp_num: int | None, slots: dict[int, bool]) -> None:
        """Repost ``slots`` (slot -> held a data frame) for ``qp_num`` (None: detached), then
        carry out the rules' grants and reclaims."""
        if slots:
            self.release(list(slots))
            rules = self.rules
            if rules is not None:
                for data in slots.values():
                    if data:
                        rules.release(qp_num)
            slots.clear()
        self.dispatch()

    def give_back_one(self, qp_num: int, slot: int, data: bool) -> None:
        """:meth:`give_back` of one slot (the common case: a frame read, its slot reposted),
        without the dict."""
        self.release([slot])
        if data and self.rules is not None:
            self.rules.release(qp_num)
        self.dispatch()

    def is_data(self, slot: int) -> bool:
        """Whether the frame in ``slot`` spends a pool credit (DATA, RTS)."""
        return self._view[slot * self.slot_size] in _DATA_KINDS

    def dispatch(self) -> None:
        """Carry out what the rules decided: each Grant and Reclaim to its endpoint."""
        rules = self.rules
        if rules is None or not rules.actions:
            return
        members = self._members
        for ev in rules.take_actions():
            m = members.get(ev.conn)  # type: ignore[attr-defined]
            if m is not None:
                m._pool_event(ev)

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
        member = self._members.get(wc.qp_num)
        if member is not None:
            member._pool_completion(slot, wc)
            return
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
        for reactor in self.reactors:
            reactor.remove_route(self._route)
        self._consumers.clear()
        self._members.clear()
        for arena in self.send_arenas.values():  # (empty unless an endpoint leaked its seat)
            arena.close()
        self.send_arenas.clear()
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
    key = (id(reactor), slot_size)  # (a reactor is on one device)
    pool = per_loop.get(key)
    if pool is None or pool.closed:
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
    if pool.cq_entries:
        for reactor in pool.reactors:
            release_shared(reactor, pool.cq_entries)
        pool.cq_entries = 0


def join_pool(device: Device, entries: int, *, buffers: int, slot_size: int,
              share: int) -> tuple[SharedReceivePool, CompletionReactor] | None:
    """A pool of the running loop on ``device`` with room for one more connection, and the
    reactor of that pool with ``entries`` CQ entries reserved for the connection's sends:
    a pool that exists if one's rules have room (on one of its reactors, or on a reactor
    added to it when they are full), else a new one (``buffers`` slots, the credit rules of
    at most ``share`` data credits per connection); None if there is none to be had (the
    connection gets slots of its own). Counted: :func:`release_pool` (then
    ``release_shared(reactor, entries)``).

    Each reactor of a pool reserves ``buffers`` CQ entries for the pool (every posted slot
    could complete on one CQ) besides its connections' sends: one CQ of the device's
    ``max_cqe`` (32,767 on rxe) holds about 240 connections of the default ``Config`` beside
    2,048 slots, so a pool of 1,000 connections has five reactors, one slot region and one
    shared receive queue.
    """
    cqe = min(POOL_CQE, int(getattr(device.attr, "max_cqe", POOL_CQE) or POOL_CQE))
    for (_, size), pool in _pools.get(asyncio.get_running_loop(), {}).items():
        if (size != slot_size or pool.closed or pool.device is not device
                or pool.rules is None or not pool.rules.can_attach()):
            continue
        reactor = next((r for r in pool.reactors if r.reserve(entries)), None)
        if reactor is None:  # every CQ of the pool is full: one more for it
            reactor = _pool_reactor(device, cqe, pool.cq_entries + entries)
            if reactor is None:
                continue
            if not pool.add_reactor(reactor):
                reactor.close()
                continue
        pool.users += 1
        return pool, reactor
    # A reactor of the pool's own (not one the loop's other endpoints share: they would fill
    # its CQ, and the next connection would need a second pool); it closes with the last
    # of the pool and its endpoints (release_shared).
    reactor = _pool_reactor(device, cqe, entries + buffers)
    if reactor is None:
        return None
    try:
        pool = shared_receive_pool(device, reactor, buffers=buffers, slot_size=slot_size)
    except DeviceError:
        reactor.close()
        return None  # (no SRQ on this device, or not this many: slots of its own)
    pool.cq_entries = buffers
    pool.rules = ReceivePool(buffers=buffers, share_max=share, ctrl_reserve=MIN_CTRL_SLOTS,
                             initial=POOL_INITIAL)
    return pool, reactor


def _pool_reactor(device: Device, cqe: int, entries: int) -> CompletionReactor | None:
    """A new reactor of ``cqe`` entries with ``entries`` of them reserved, or None if they do
    not fit."""
    reactor = CompletionReactor(device, cqe=cqe)
    if not reactor.reserve(entries):
        reactor.close()
        return None
    return reactor


POOL_CQE = 32768
"""CQ entries of a reactor created for a pool (capped at the device's ``max_cqe``): the pool's
slots and many connections' sends share it."""
