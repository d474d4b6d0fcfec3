"""Places: a counting semaphore for the RPC hot path.

``asyncio.Semaphore`` costs two coroutines and a scan of its waiters per acquisition, even
when a place is free. :class:`Places` takes a free place with one comparison
(:meth:`Places.try_take`) and leaves the waiting to the rare caller who finds none
(:meth:`Places.take`). Waiters get places in arrival order; a place given back goes straight to
the first waiter, and one handed to a waiter that is cancelled before it runs is passed on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Notify", "Places", "wake_first"]


class Notify:
    """A receiver's wake-up that is a call, for a channel's ``call_when_readable`` (see
    :class:`aiordma.transport.ReadyChannel`): it waits in the channel's deque of receivers'
    futures like one of them, and waking it (``set_result``) calls ``callback()``. It is
    dropped from the deque when woken, so it fires once.

    ``batch``, if given, is a completion queue's driver (see :attr:`CompletionReactor.batch
    <aiordma._reactor.reactor.CompletionReactor.batch>`): woken while it drains, the call waits
    in its ``later`` list until the drain is over, so the callback finds every message of
    the poll batch, as a woken task would, instead of one per completion."""

    __slots__ = ("batch", "callback")

    def __init__(self, callback: Callable[[], object], batch: Any = None) -> None:
        self.callback = callback
        self.batch = batch

    def done(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def set_result(self, _result: object) -> None:
        batch = self.batch
        if batch is not None and batch.draining:
            batch.later.append(self.callback)
        else:
            self.callback()


def wake_first(waiters: deque[asyncio.Future[None]]) -> bool:
    """Wake the first of ``waiters`` still waiting, dropping those cancelled before it; False:
    nobody was waiting."""
    while waiters:
        w = waiters.popleft()
        if not w.done():
            w.set_result(None)
            return True
    return False


class Places:
    """``limit`` places; callers beyond wait in arrival order."""

    __slots__ = ("free", "waiters")

    def __init__(self, limit: int) -> None:
        self.free = limit
        self.waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        """Take a free place if one is free and nobody waits for it; False: none taken."""
        if self.free and not self.waiters:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        """Wait for a place (after :meth:`try_take` found none). Cancellation-safe: a
        cancelled caller holds no place."""
        if self.try_take():
            return
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(place)
        try:
            await place
        except BaseException:
            if place.done() and not place.cancelled():
                self.give()  # handed a place it will not use: pass it on
            elif place in self.waiters:  # (a give() may have dropped it already)
                self.waiters.remove(place)
            raise

    def give(self) -> None:
        """Give a place back: to the first waiter, else to the free ones."""
        if not (self.waiters and wake_first(self.waiters)):
            self.free += 1
