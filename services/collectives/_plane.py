"""The data plane of a group: a link to and from every other rank, and the work buffers.

Work buffers
    A collective first copies its input into a registered *work* buffer (grown geometrically
    when a larger call comes, otherwise reused): RDMA WRITEs come from there, received pieces
    go there, and the result is copied out. So any array works (non-contiguous, any byte
    order, 0-d, empty), the caller's memory is never registered, and a cancelled collective
    cannot leave the NIC writing into it. There are two, so that an algorithm can combine
    what it sent from one into the other while its WRITEs may still be read (recursive
    doubling alternates them).

Concurrency
    An algorithm runs a sender and a receiver side by side (:func:`run_both`). A receiver
    never waits for a sender: it frees every slot as soon as it has consumed it, so data keeps
    moving and there is no circular wait, whatever the array size. A sender waits for the
    receiver's progress where the algorithm needs it (:class:`Progress`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np

from aiordma import MemoryRegion
from aiordma.lowlevel import Device

from ._links import Inbound, Outbound

__all__ = ["Plane", "Progress", "run_both"]


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


class _Work:
    """One registered work buffer, grown on demand (see the module documentation)."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self.data = np.empty(0, np.uint8)
        self.region: MemoryRegion | None = None

    def reserve(self, nbytes: int) -> None:
        if self.region is None or nbytes > self.data.nbytes:
            cap = max(nbytes, 2 * self.data.nbytes, 4096)
            cap = -(-cap // 4096) * 4096
            new = np.empty(cap, np.uint8)
            region = MemoryRegion(self._device, new)  # a WRITE source: local access only
            if self.region is not None:
                self.region.close()
            self.data, self.region = new, region

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None


class Plane:
    """A rank's links (``outs[peer]``, ``ins[peer]`` for every other rank) and work buffers.

    Built by :class:`aiordma.services.collectives.Group` once the mesh is connected; the
    algorithms (:mod:`._rounds`, :mod:`._ring`) take it and a ``call`` number that every rank
    counts identically.
    """

    def __init__(self, *, rank: int, world: int, device: Device, outs: dict[int, Outbound],
                 ins: dict[int, Inbound]) -> None:
        self.rank, self.world = rank, world
        self.outs, self.ins = outs, ins
        self._work = (_Work(device), _Work(device))

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.world

    def work(self, nbytes: int, which: int = 0) -> np.ndarray:
        """The first ``nbytes`` of work buffer ``which`` (0 or 1), grown if needed; call
        :meth:`settle` first if WRITEs from it may still be out."""
        w = self._work[which]
        w.reserve(nbytes)
        return w.data[:nbytes]

    def region(self, which: int = 0) -> MemoryRegion:
        """The registration of work buffer ``which`` (after :meth:`work`)."""
        region = self._work[which].region
        assert region is not None, "work() reserves the buffer first"
        return region

    def buffer(self, which: int = 0) -> np.ndarray:
        """All of work buffer ``which`` (uint8), byte 0 first: what ``Outbound.put`` takes."""
        return self._work[which].data

    async def settle(self, which: int | None = None) -> None:
        """Wait for every WRITE still reading work buffer ``which`` (default: either), before
        it is overwritten; by then their acknowledgements have almost always arrived."""
        region = None if which is None else self._work[which].region
        if which is not None and region is None:
            return
        for out in self.outs.values():
            await out.settle(region)

    def close(self) -> None:
        """Deregister the work buffers (the endpoints deregister the rest when they close)."""
        for w in self._work:
            w.close()
