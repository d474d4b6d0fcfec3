"""A peer process that dies (SIGKILL) mid-conversation: the survivor's pending operations fail
promptly with a typed error, and nothing hangs. Real processes on both ends, over a device."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

import aiordma
from aiordma import BrokenResourceError, RemoteBuffer

from ..bounds import prompt
from .peers import peer_process

# Its subject is the loop integration: both loops under `--loops one` too (tests/loops.py).
pytestmark = pytest.mark.both_loops


async def test_pending_receive_and_one_sided_fail_when_the_peer_is_killed(rdma_device) -> None:
    with peer_process(die_after=3) as port:
        ep = await aiordma.connect("127.0.0.1", port, timeout=60, device=rdma_device)
        peer = RemoteBuffer.from_wire(msgpack.unpackb(await ep.recv()))
        for _ in range(2):
            await ep.send(b"\x00ping")
            assert await asyncio.wait_for(ep.recv(), 30) == b"\x00ping"
        pending = asyncio.ensure_future(ep.recv())
        scratch = ep.register(bytearray(8))
        await asyncio.sleep(0.05)
        await ep.send(b"\x00last")  # the peer SIGKILLs itself on this one
        t0 = time.monotonic()
        with pytest.raises(BrokenResourceError):
            await asyncio.wait_for(pending, 30)
        assert time.monotonic() - t0 < prompt()  # the catalogue's PROMPT x the load factor
        with pytest.raises(BrokenResourceError):
            await asyncio.wait_for(ep.read(scratch[0:8], peer[0:8]), 30)
        with pytest.raises(BrokenResourceError):
            await ep.send(b"\x00after")
        await asyncio.wait_for(ep.aclose(), 30)  # closing a broken endpoint is prompt
        assert ep.closed
