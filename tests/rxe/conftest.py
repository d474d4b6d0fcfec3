"""Device-test helpers: a connected loopback pair on the session's device, closed after use."""

from __future__ import annotations

import errno
import gc
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop


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


@pytest.fixture
def no_leaks(rdma_device: Any) -> Any:
    """Leak check around a test: this process's resources (the kernel's count of its verbs
    objects, its open fds, aiordma's own counts) are back where they were before the test
    within ``leaks.SETTLE`` seconds after it (see ``leaks.py``). Yields the baseline."""
    from aiordma._endpoint.connect import _device_for

    from .leaks import held, wait_back

    # connect() and listen() without device= open the default device once per process and
    # keep it: opened here, before the baseline, it is not a leak of the first test to use it.
    _device_for(None, None, None)
    # libuv opens a pipe once per process, with its first loop (its signal lock): not a leak.
    uvloop.new_event_loop().close()
    before = held()
    yield before[0]
    wait_back(before)


class _ErrorLogs(logging.Handler):
    """Collects log records at ERROR and above."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def unexpected() -> Any:
    """Fails the test if anything logged at ERROR or above while it ran: a handler that failed
    in an untyped way, or asyncio's "Future exception was never retrieved" (collected garbage
    is looked at first, so such a future is found before the test ends)."""
    h = _ErrorLogs()
    logging.getLogger().addHandler(h)
    try:
        yield h
        gc.collect()
    finally:
        logging.getLogger().removeHandler(h)
    assert not h.records, [r.getMessage() for r in h.records]


@pytest.fixture
def host2_up(rdma_device: Any) -> None:
    """For the two-host tests: host 2 is up and its agent answers. A test that killed host 2
    (``harness.remote.kill_host2``) leaves it down; the next one that needs it boots it
    here (12-31 s), so the stage's last test that kills it costs no boot."""
    import sys

    from harness.remote import boot_host2, host2_running

    from ..bounds import STEP

    if not host2_running():
        took = boot_host2(timeout=5 * STEP)
        print(f"host 2 booted again: its agent answered after {took:.1f} s", file=sys.stderr)
