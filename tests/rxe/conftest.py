"""Device-test helpers: a connected loopback pair on the session's device, closed after use."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class Pair:
    device: Any
    reactor: Any
    a: Any
    b: Any


@pytest.fixture
async def pair(rdma_device: Any) -> AsyncIterator[Pair]:
    """Two RC queue pairs on one device, connected to each other, on this test's loop."""
    from aiordma import DeviceError
    from aiordma.lowlevel import CompletionReactor, connect_pair

    reactor = CompletionReactor(rdma_device)
    try:
        a, b = connect_pair(rdma_device, reactor)
    except DeviceError as exc:
        reactor.close()
        if getattr(exc.__cause__, "error_code", None) == errno.EOPNOTSUPP:
            pytest.skip(f"the device does not support this: {exc}")
        raise
    yield Pair(rdma_device, reactor, a, b)
    reactor.close()


@dataclass
class Connected:
    client: Any
    server: Any
    listener: Any


@pytest.fixture
async def connected(rdma_device: Any) -> AsyncIterator[Connected]:
    """A listener and one connected client; ``server`` is the listener's endpoint for it."""
    import asyncio

    import aiordma

    served: asyncio.Queue[Any] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(ep: Any) -> None:
        await served.put(ep)
        await done.wait()  # the listener closes the endpoint when its handler returns

    listener = await aiordma.listen(handler, "127.0.0.1", 0, device=rdma_device)
    client = await aiordma.connect("127.0.0.1", listener.port, timeout=60, device=rdma_device)
    server = await asyncio.wait_for(served.get(), 60)
    yield Connected(client, server, listener)
    done.set()
    client.abort()
    await listener.aclose()
