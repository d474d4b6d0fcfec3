"""The data plane of a group: a link to and from every other rank, and the work buffers.

Work buffers
    An operation first copies its input into a registered *work* buffer (grown geometrically
    when a larger call comes, otherwise reused): RDMA WRITEs come from there, received pieces
    go there, and the result is copied out. So any array works (non-contiguous, any byte
    order, 0-d, empty), the caller's memory is never registered, and a cancelled collective
    cannot leave the NIC writing into it. Each running operation leases a :class:`Work` (two
    buffers, so that an algorithm can combine what it sent from one into the other while its
    WRITEs may still be read: recursive doubling alternates them) from the plane's pool, and
    gives it back when it ends; operations in flight at the same time use different ones, and
    the pool holds as many as ever ran at once. Over TCP (no device) they are plain memory:
    nothing is registered, and :meth:`CallPlane.region` is None.

Views
    The algorithms (:mod:`._rounds`, :mod:`._ring`, :mod:`._direct`) see one operation's
    :class:`CallPlane`: its group's ranks (a subgroup's ranks are numbered from 0 and mapped
    onto the whole group's links), those links, and its work buffers.

Concurrency within an operation
    An algorithm may run a sender and a receiver side by side (:func:`run_both`); a sender
    waits for the receiver's progress where the algorithm needs it (:class:`Progress`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np

from aiordma import MemoryRegion
from aiordma.lowlevel import Device

from ._arrays import mapped
from ._links import Inbound, Outbound, Router

__all__ = ["CallPlane", "GroupLinks", "Plane", "Progress", "Work", "run_both"]


class Progress:
    """A counter that tasks can wait on (how far a receiver got)."""

    def __init__(self) -> None:
        self.value = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def advance(self, value: int) -> None:
        self.value = value
        still = []
        for n, fut in self._waiters:
            if n <= value:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((n, fut))
        self._waiters = still

    async def reach(self, n: int) -> None:
        if self.value >= n:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        await fut


async def run_both(*coros: Coroutine[Any, Any, Any]) -> list[Any]:
    """Run coroutines concurrently; the first failure cancels the others and is raised as is
    (not wrapped in an ``ExceptionGroup``: callers expect aiordma's typed errors)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Buffer:
    """One registered work buffer, grown on demand (see the module documentation)."""

    def __init__(self, device: Device | None) -> None:
        self._device = device
        self.data = np.empty(0, np.uint8)
        self.region: MemoryRegion | None = None

    def reserve(self, nbytes: int) -> None:
        if nbytes > self.data.nbytes or (self.region is None and self._device is not None):
            cap = max(nbytes, 2 * self.data.nbytes, 4096)
            cap = -(-cap // 4096) * 4096
            new = mapped(cap)
            if self._device is None:  # (TCP links: nothing to register)
                self.data = new
                return
            region = MemoryRegion(self._device, new)  # a WRITE source: local access only
            if self.region is not None:
                self.region.close()
            self.data, self.region = new, region

    def close(self) -> None:
        """Deregister, and let the memory go (a closed group may stay referenced)."""
        if self.region is not None:
            self.region.close()
            self.region = None
        self.data = np.empty(0, np.uint8)
        self._device = None  # (a reserve() after close makes plain memory, registers none)


class Work:
    """The two work buffers one operation leases (see the module documentation)."""

    def __init__(self, device: Device | None) -> None:
        self._bufs = (_Buffer(device), _Buffer(device))

    def array(self, nbytes: int, which: int = 0) -> np.ndarray:
        w = self._bufs[which]
        w.reserve(nbytes)
        return w.data[:nbytes]

    def region(self, which: int = 0) -> MemoryRegion | None:
        return self._bufs[which].region

    def buffer(self, which: int = 0) -> np.ndarray:
        return self._bufs[which].data

    def close(self) -> None:
        for b in self._bufs:
            b.close()


class Plane:
    """A rank's links (``outs[peer]``, ``ins[peer]`` for every other rank of the whole group)
    and its pool of work buffers. Built by :class:`~._mesh.Mesh` once connected; ``device``
    is None for TCP links."""

    def __init__(self, *, rank: int, world: int, device: Device | None, outs: dict[int, Outbound],
                 ins: dict[int, Inbound]) -> None:
        self.rank, self.world = rank, world
        self.outs, self.ins = outs, ins
        self._device = device
        self.device = device  # (None over TCP links)
        self._idle: list[Work] = []
        self._all: list[Work] = []

    def start(self, router: Router) -> None:
        """Start every link's reader (see :mod:`._links`)."""
        for out in self.outs.values():
            out.start(router)
        for inb in self.ins.values():
            inb.start(router)

    def stop(self) -> None:
        for out in self.outs.values():
            out.stop()
        for inb in self.ins.values():
            inb.stop()

    def lease(self) -> Work:
        """Work buffers for one operation (see :meth:`settle_work` before writing to them)."""
        if self._idle:
            return self._idle.pop()
        w = Work(self._device)
        self._all.append(w)
        return w

    def give_back(self, work: Work) -> None:
        self._idle.append(work)

    @property
    def writing(self) -> bool:
        """Some link may have a WRITE not yet acknowledged."""
        for out in self.outs.values():  # (every operation asks: no generator)
            if out.writing:
                return True
        return False

    async def settle(self, region: MemoryRegion | None) -> None:
        """Wait for every WRITE still reading ``region``, before it is overwritten; by then
        their acknowledgements have almost always arrived."""
        if region is None:
            return
        for out in self.outs.values():
            if out.writing:
                await out.settle(region)

    def close(self) -> None:
        """Deregister the work buffers (the endpoints deregister the rest when they close) and
        let them and the receive slots go."""
        for w in self._all:
            w.close()
        for inb in self.ins.values():
            inb.slots = np.empty(0, np.uint8)


class GroupLinks:
    """A group's ranks on the plane: rank ``i`` of the group is rank ``members[i]`` of the
    whole group, and ``outs[i]``/``ins[i]`` are the links to and from it."""

    def __init__(self, plane: Plane, members: Sequence[int], rank: int) -> None:
        self.rank, self.world = rank, len(members)
        self.outs = {i: plane.outs[m] for i, m in enumerate(members) if i != rank}
        self.ins = {i: plane.ins[m] for i, m in enumerate(members) if i != rank}


class CallPlane:
    """One operation's view: its group's ranks and links, its leased work buffers."""

    __slots__ = ("_plane", "_work", "ins", "outs", "rank", "world")

    def __init__(self, links: GroupLinks, work: Work, plane: Plane) -> None:
        self.rank, self.world = links.rank, links.world
        self.outs, self.ins = links.outs, links.ins
        self._work, self._plane = work, plane

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.world

    def work(self, nbytes: int, which: int = 0) -> np.ndarray:
        """The first ``nbytes`` of work buffer ``which`` (0 or 1), grown if needed; call
        :meth:`settle` first if WRITEs from it may still be out."""
        return self._work.array(nbytes, which)

    def region(self, which: int = 0) -> MemoryRegion | None:
        """The registration of work buffer ``which`` (after :meth:`work`); None over TCP."""
        return self._work.region(which)

    def buffer(self, which: int = 0) -> np.ndarray:
        """All of work buffer ``which`` (uint8), byte 0 first: what ``Outbound.put`` takes."""
        return self._work.buffer(which)

    async def settle(self, which: int | None = None) -> None:
        """Wait for every WRITE still reading work buffer ``which`` (default: either)."""
        if not self._plane.writing:
            return
        if which is not None:
            await self._plane.settle(self._work.region(which))
            return
        await self._plane.settle(self._work.region(0))
        await self._plane.settle(self._work.region(1))
