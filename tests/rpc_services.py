"""Services the RPC tests serve, over the in-memory pair (tests/unit) and over a device
(tests/rxe)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from typing import Any

from aiordma.rpc import RpcClient, RpcServer, Service, current_endpoint, method
from aiordma.testing import channel_pair

from .bounds import STEP

TAG: contextvars.ContextVar[str] = contextvars.ContextVar("tag", default="untouched")


class Calc(Service):
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.finished_slow = 0
        self.inline_tasks: list[asyncio.Task[Any] | None] = []  # current task, per mul() call

    # plain defs: they run inline, as their request is read (no task of their own)
    @method
    def mul(self, a: int, b: int) -> int:
        self.inline_tasks.append(asyncio.current_task())
        TAG.set("set by mul")  # in a copy of the connection's context: nobody else sees it
        return a * b

    @method
    def fail_now(self, text: str) -> None:
        raise KeyError(text)

    @method
    def caller(self) -> int:
        return int(current_endpoint().id)

    @method
    async def tag(self) -> str:
        return TAG.get()

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


@contextlib.asynccontextmanager
async def served_over_memory(service: Service, *, server_limit: int = 64, client_limit: int = 64,
                 grace: float = 5.0, **pair: Any) -> AsyncIterator[tuple[RpcClient, RpcServer]]:
    """A server for ``service`` on one end of an in-memory pair, a client on the other."""
    a, b = channel_pair(**pair)
    server = RpcServer(service, max_in_flight=server_limit, grace=grace)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, max_in_flight=client_limit)
    try:
        yield client, server
    finally:
        client.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)
