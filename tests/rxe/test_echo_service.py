"""The echo service over RPC over a device, in one process and served by `aiordma serve echo`
in another process."""

from __future__ import annotations

import asyncio
import os

from hypothesis import given
from hypothesis import strategies as st

from aiordma.rpc import connect, serve
from aiordma.services.echo import Echo

from ..bounds import STEP
from .peers import served_by_cli
from .values import normal

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=50)
    | st.binary(max_size=300) | st.sampled_from([b"", os.urandom(70_000)]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10)




@given(value=VALUES)
async def test_echo_returns_any_value(rdma_device, value) -> None:  # type: ignore[no-untyped-def]
    service = Echo()
    async with await serve(service, "127.0.0.1", 0, device=rdma_device) as server:  # noqa: SIM117
        async with await connect("127.0.0.1", server.port, timeout=STEP,
                                 device=rdma_device) as client:
            got = await asyncio.wait_for(client.echo(value), STEP)
            assert normal(got) == normal(value)
            assert await asyncio.wait_for(client.stats(), STEP) == {"calls": 1}


async def test_served_by_the_cli_in_another_process(rdma_device) -> None:
    with served_by_cli("echo") as port:
        async with await connect("127.0.0.1", port, timeout=STEP, device=rdma_device) as client:
            assert await asyncio.wait_for(client.ping(), STEP) == "pong"
            blob = os.urandom(300_000)
            assert bytes(await asyncio.wait_for(client.echo(blob), STEP)) == blob
