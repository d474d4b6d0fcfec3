"""The RPC layer over real endpoints on a device: calls, concurrency, errors, deadlines that
cancel the server's task, large values out of band, graceful shutdown. Both loops."""

from __future__ import annotations

import asyncio
import os

import pytest

from aiordma import OperationTimeout
from aiordma.rpc import RemoteError, Service, connect, method, serve

STEP = 60.0


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


async def test_calls_errors_deadlines_and_large_values(rdma_device) -> None:
    calc = Calc()
    async with await serve(calc, "127.0.0.1", 0, device=rdma_device) as server:
        async with await connect("127.0.0.1", server.port, timeout=STEP,
                                 device=rdma_device) as client:
            assert await asyncio.wait_for(client.call("add", 1, 2), STEP) == 3
            assert await asyncio.wait_for(client.add(a=40, b=2), STEP) == 42  # proxy, kwargs

            results = await asyncio.wait_for(
                asyncio.gather(*(client.add(i, i) for i in range(40))), STEP)
            assert results == [2 * i for i in range(40)]

            with pytest.raises(RemoteError) as info:
                await asyncio.wait_for(client.fail("boom"), STEP)
            assert info.value.type_name == "ValueError" and info.value.message == "boom"
            with pytest.raises(RemoteError) as info:
                await asyncio.wait_for(client.not_exported(), STEP)
            assert info.value.type_name == "AttributeError"

            with pytest.raises(OperationTimeout):
                await client.call("sleep", 30.0, timeout=0.5)
            await asyncio.wait_for(calc.cancelled.wait(), STEP)  # the server's task was cancelled

            big = os.urandom(1 << 20)  # out of band, by rendezvous
            got = await asyncio.wait_for(client.echo(big), STEP)
            assert bytes(got) == big
            nested = {"k": [1, 2.5, "x", None, True], "blob": os.urandom(100)}
            assert await asyncio.wait_for(client.echo(nested), STEP) == nested

            assert await asyncio.wait_for(client.add(1, 1), STEP) == 2  # still serving


async def test_shutdown_finishes_calls_in_flight(rdma_device) -> None:
    calc = Calc()
    server = await serve(calc, "127.0.0.1", 0, device=rdma_device, grace=STEP)
    client = await connect("127.0.0.1", server.port, timeout=STEP, device=rdma_device)
    call = asyncio.ensure_future(client.sleep(0.5))
    await asyncio.sleep(0.2)
    await asyncio.wait_for(server.aclose(), STEP)
    assert calc.finished_slow == 1
    assert await asyncio.wait_for(call, STEP) == "slept"
    await client.aclose()
