"""The echo service: the smallest service on aiordma's RPC layer, for examples and benchmarks.

``echo(value)`` returns its argument (large ``bytes`` travel out of band both ways),
``ping()`` returns ``"pong"``, and ``stats()`` reports how many calls were served. Its methods
are plain ``def``: they return at once, so they run inline with no task per call (see
:func:`aiordma.rpc.method`).

    from aiordma.rpc import serve, connect
    from aiordma.services.echo import Echo

    async with await serve(Echo(), "127.0.0.1", 0) as server:
        async with await connect("127.0.0.1", server.port) as client:
            assert await client.echo(b"hi") == b"hi"
"""

from __future__ import annotations

from typing import Any

from aiordma.rpc import Service, method

__all__ = ["Echo"]


class Echo(Service):
    """Returns what it is given."""

    def __init__(self) -> None:
        self.calls = 0

    @method
    def echo(self, value: Any) -> Any:
        self.calls += 1
        return value

    @method
    def ping(self) -> str:
        self.calls += 1
        return "pong"

    @method
    def stats(self) -> dict[str, int]:
        return {"calls": self.calls}
