"""A listener's stock of connections' resources made ahead (``Config.setup_stock``).

A set-up on the listener's side makes, once the client's Hello came, a queue pair on its
share of a completion queue, its receive slots and send slots (or, on the shared receive
pool, its place there and a seat in the pool's send arena) and takes the queue pair to INIT:
about half of the listener's CPU time per set-up in the VM (the report of 2026-11-26,
"connections at scale"). None of it depends on the client, so a :class:`SetupStock` makes
that much for up to ``size`` connections while no set-up is under way, and a set-up takes
one (:meth:`SetupStock.take`) instead of making its own.

Rules:

* **Made only while the listener is idle.** The stock is made one connection at a time,
  letting the loop run between two, and only once no set-up has been under way (from the
  TCP connection to the Ready, :meth:`SetupStock.setting_up`) for :data:`QUIET` seconds: a
  burst of set-ups is never slowed by the stock's own making, nor is the stock made again
  in the gaps of a burst (measured: when the clients were slower than the listener, the
  stock refilled between their set-ups, and the listener's CPU per set-up of the burst did
  not drop), and a burst larger than the stock makes the rest as before.
* **Made up again after each set-up** once the set-ups pause.
* **For the device and kind of the latest set-up**: a connection on the pool (when the
  listener's ``Config`` chooses it) or with slots of its own; one made for the pool serves
  only a client that offered it (one with slots of its own serves either). A pool's credit
  rules learn of a connection only when it is taken (:meth:`_Resources.claim`): one in stock
  holds no credits.
* **Bounded and released**: at most ``size``; :meth:`SetupStock.close` (the listener's
  ``aclose()`` and ``abort()``) stops the making and releases every one, queue pair first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

from aiordma._device.device import Device
from aiordma._endpoint.config import Config
from aiordma._endpoint.connect import _Resources
from aiordma._errors import AiordmaError

__all__ = ["QUIET", "SetupStock"]

log = logging.getLogger("aiordma")

QUIET = 0.1
"""Seconds without a set-up under way before the stock is made again: a burst's set-ups come
closer together than that (in the VM, under 16 in flight, a listener sees the next one within
milliseconds of the last)."""


class SetupStock:
    """Up to ``size`` connections' resources made ahead for a listener (see the module
    documentation).

    Args:
        config: the listener's (each connection's resources are made from it).
        size: how many to keep (``Config.setup_stock``).
        device: the device to make them on until a set-up names one.

    Attributes:
        taken: set-ups that took one from the stock.
        missed: set-ups that found none for them (and made their own).
        made: connections' resources made ahead in all.
    """

    def __init__(self, config: Config, size: int, device: Device | None) -> None:
        self._config = config
        self.size = size
        self._device = device
        self._items: list[_Resources] = []
        self._busy = 0  # set-ups under way
        self._started = 0  # set-ups begun, in all
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.taken = self.missed = self.made = 0

    def __len__(self) -> int:
        """Connections' resources in stock now."""
        return len(self._items)

    @contextlib.contextmanager
    def setting_up(self) -> Iterator[None]:
        """Around one set-up: the stock is not made meanwhile."""
        self._busy += 1
        self._started += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()

    def take(self, device: Device, pool: bool) -> _Resources | None:
        """Resources made ahead for a connection on ``device`` (``pool``: its client offered
        the receive pool and the listener takes it), claimed for it; None if the stock has
        none that fit (the caller makes its own). Either way the stock is made up again once
        the set-ups pause.

        Raises:
            DeviceError: releasing one that no longer fits failed (never seen).
        """
        if device is not self._device:  # set-ups go to another device now: make for that
            self._device = device
            self._drop(lambda r: r.device is not device)
        found = None
        for i in range(len(self._items) - 1, -1, -1):
            res = self._items[i]
            if res.pool is None or pool:
                found = self._items.pop(i)
                break
        if found is not None:
            try:
                found.claim()
            except AiordmaError:  # the pool's rules have no room now: make one as before
                found.release()
                found = None
        if found is None:
            self.missed += 1
        else:
            self.taken += 1
        self.fill()
        return found

    def fill(self) -> None:
        """Make the stock up to its size, once no set-up is under way (in a task of its own,
        one connection at a time)."""
        if self._closed or self._task is not None or len(self._items) >= self.size:
            return
        if self._device is None:
            return
        self._task = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        try:
            seen = -1  # set-ups begun when this task last looked
            while not self._closed and len(self._items) < self.size:
                await self._idle.wait()
                started = self._started
                if started != seen:  # a set-up since: let its burst end first
                    seen = started
                    await asyncio.sleep(QUIET if started else 0)
                    continue
                await asyncio.sleep(0)  # (a set-up that just arrived goes first)
                if self._busy or self._closed or self._started != started:
                    continue
                device = self._device
                if device is None:  # (fill() starts no task without one)
                    return
                try:
                    res = _Resources(device, self._config, pool=self._config.receive_pool,
                                     ahead=True)
                except (AiordmaError, OSError) as exc:
                    # (e.g. the device's queue pairs are exhausted: set-ups make their own,
                    # and fail as they would have; the next one tries the stock again)
                    log.warning("aiordma: a listener's stock stopped at %d of %d: %s: %s",
                                len(self._items), self.size, type(exc).__name__, exc)
                    return
                if self._closed:
                    res.release()
                    return
                self._items.append(res)
                self.made += 1
        finally:
            self._task = None

    def _drop(self, which: Callable[[_Resources], bool]) -> None:
        keep = []
        for res in self._items:
            if which(res):
                res.release()
            else:
                keep.append(res)
        self._items = keep

    def close(self) -> None:
        """Stop making and release everything in stock (idempotent)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            self._task = None
        items, self._items = self._items, []
        for res in items:
            res.release()

    def __repr__(self) -> str:
        return (f"<SetupStock {len(self._items)}/{self.size}, {self.taken} taken, "
                f"{self.missed} missed{' closed' if self._closed else ''}>")
