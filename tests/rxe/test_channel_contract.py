"""The channel contract (aiordma.testing.CONTRACT) against real endpoints over the device, on
both loops: the same checks tests/unit/test_channel_contract.py runs against the in-memory
pair, so code tested over the in-memory pair meets the same semantics over RDMA."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from aiordma import Config, testing
from aiordma.transport import MessageChannel

from .peers import endpoints

# Its subject is the loop integration: both loops under `--loops one` too (tests/loops.py).
pytestmark = pytest.mark.both_loops


@pytest.mark.parametrize("check", sorted(testing.CONTRACT))
async def test_endpoints_keep_the_contract(rdma_device: Any, check: str) -> None:
    @asynccontextmanager
    async def endpoint_pairs(**options: Any) -> AsyncIterator[tuple[Any, Any]]:
        async with endpoints(rdma_device, Config(**options)) as (client, server):
            assert isinstance(client, MessageChannel)
            yield client, server

    await testing.CONTRACT[check](endpoint_pairs)
