"""Fixtures of the device-free layer.

``over``: the RPC, stream, metadata and key-value tests that take it run three times, over
the in-memory channel pair, over the same seen as a plain ``MessageChannel`` (read with a
task: the RPC layer's path for a channel that is not a ``ReadyChannel``) and over the TCP
transport's channels on loopback sockets (real
``aiordma.connect(..., transport="tcp")`` and ``aiordma.listen``, no device): a service's
suite runs over TCP on a host without RDMA. Their helpers (``tests/rpc_services.py``) connect
what it says.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..rpc_services import Pairs


@pytest.fixture(params=["memory", "plain", "tcp"])
def over(request: pytest.FixtureRequest) -> Iterator[str]:
    saved, Pairs.kind = Pairs.kind, request.param
    try:
        yield request.param
    finally:
        Pairs.kind = saved
