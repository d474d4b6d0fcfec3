"""Services the RPC tests serve, over the in-memory pair (tests/unit) and over a device
(tests/rxe)."""

from __future__ import annotations

import asyncio

from aiordma.rpc import Service, current_endpoint, method


class Calc(Service):
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.finished_slow = 0

    @method
    async def add(self, a: int, b: int) -> int:
        return a + b

    @method
    async def echo(self, value):  # type: ignore[no-untyped-def]
        return value

    @method
    async def fail(self, text: str) -> None:
        raise ValueError(text)

    @method
    async def sleep(self, seconds: float) -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished_slow += 1
        return "slept"

    async def not_exported(self) -> str:
        return "secret"


class Gauge(Service):
    """Records how many calls run at once, per connection (current_endpoint()), and answers."""

    def __init__(self) -> None:
        self.running: dict[int, int] = {}
        self.peak: dict[int, int] = {}

    @method
    async def hold(self, seconds: float) -> int:
        ep = current_endpoint().id
        self.running[ep] = self.running.get(ep, 0) + 1
        self.peak[ep] = max(self.peak.get(ep, 0), self.running[ep])
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running[ep] -= 1
        return ep

    @method
    async def blob(self, n: int) -> bytes:
        return bytes(n)
