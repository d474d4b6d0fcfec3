"""Replicas of the demo's order service over the in-memory channel pair (or, with the ``over``
fixture's ``tcp``, over the TCP transport on loopback sockets, each replica a listener of its
own), for the pool's device-free tests: each replica an :class:`RpcServer` at a made-up
address, reached through a connector that :func:`aiordma.rpc.connect_pool` takes. A replica can be killed (its
connections aborted, new ones refused, as a dead process's are), frozen (its connections stay
open but nothing is read: a hung server), started again and thawed. Each records when a
connection was asked of it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiordma
from aiordma import BrokenResourceError
from aiordma.cli.demo_micro import Orders
from aiordma.rpc import RpcClient, RpcServer
from aiordma.testing import channel_pair

from ..rpc_services import Pairs, PlainChannel


class Gated:
    """A server's end of a channel that reads nothing while its replica is frozen."""

    def __init__(self, inner: Any, running: asyncio.Event) -> None:
        self._inner = inner
        self._running = running

    def __getattr__(self, name: str) -> Any:
        if name in ("recv_nowait", "call_when_readable"):  # (they would read past the gate:
            raise AttributeError(name)  # a plain MessageChannel, read with recv())
        return getattr(self._inner, name)

    @property
    def eager_max(self) -> int:
        return int(self._inner.eager_max)

    @property
    def peer_max_message(self) -> int:
        return int(self._inner.peer_max_message)

    @property
    def closed(self) -> bool:
        return bool(self._inner.closed)

    @property
    def broken(self) -> bool:
        return bool(self._inner.broken)

    async def recv(self) -> bytearray | None:
        await self._running.wait()
        msg: bytearray | None = await self._inner.recv()
        await self._running.wait()
        return msg


class MemoryReplica:
    def __init__(self, host: str, port: int, pace: float = 0.0,
                 interceptors: Sequence[Any] = ()) -> None:
        self.address = (host, port)
        self.name = f"{host}:{port}"
        self.service = Orders(self.name, pace=pace)
        self.server = RpcServer(self.service, max_in_flight=64, grace=5.0,
                                interceptors=interceptors)
        self.up = True
        self.running = asyncio.Event()
        self.running.set()
        self.channels: list[Any] = []  # the server's ends of its connections
        self.asked: list[float] = []  # loop times at which a connection was asked for
        self.listener: Any = None  # over TCP: where its connections arrive


class MemoryCluster:
    """``n`` replicas at 10.0.0.1:7000, 10.0.0.2:7000, ... (``interceptors``: each server's)"""

    def __init__(self, n: int, *, max_in_flight: int = 16, paces: dict[int, float] | None = None,
                 interceptors: Sequence[Any] = ()) -> None:
        self.replicas = [MemoryReplica(f"10.0.0.{i + 1}", 7000, (paces or {}).get(i, 0.0),
                                       interceptors) for i in range(n)]
        self.by_address = {r.address: r for r in self.replicas}
        self.max_in_flight = max_in_flight
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def addresses(self) -> list[str]:
        return [r.name for r in self.replicas]

    async def connect(self, host: str, port: int, timeout: float) -> RpcClient:
        r = self.by_address[(host, port)]
        r.asked.append(asyncio.get_running_loop().time())
        if not r.up:
            raise BrokenResourceError(f"cannot reach {host}:{port}: connection refused")
        if Pairs.kind == "tcp":
            return RpcClient(await self._connect_tcp(r, timeout), max_in_flight=self.max_in_flight)
        a, b = channel_pair()
        r.channels.append(b)
        t = asyncio.ensure_future(r.server.serve_connection(Gated(b, r.running)))
        self.tasks.add(t)
        return RpcClient(PlainChannel(a) if Pairs.kind == "plain" else a,
                         max_in_flight=self.max_in_flight)

    async def _connect_tcp(self, r: MemoryReplica, timeout: float) -> Any:
        """A real TCP-transport connection to ``r``'s listener (made at its first), whose
        handler serves it."""
        if r.listener is None:
            async def handler(ch: Any) -> None:
                r.channels.append(ch)
                await r.server.serve_connection(Gated(ch, r.running))

            r.listener = await aiordma.listen(handler, "127.0.0.1", 0, transport="tcp")
        return await aiordma.connect("127.0.0.1", r.listener.port, timeout=timeout,
                                     transport="tcp")

    def kill(self, i: int) -> None:
        """Replica ``i`` dies: its connections break, new ones are refused. (Its service's
        counts survive, as the demo's journal does.)"""
        r = self.replicas[i]
        r.up = False
        for ch in r.channels:
            ch.abort()
        r.channels.clear()

    def restart(self, i: int) -> None:
        self.replicas[i].up = True

    def freeze(self, i: int) -> None:
        self.replicas[i].running.clear()

    def thaw(self, i: int) -> None:
        self.replicas[i].running.set()

    def ran(self) -> dict[str, int]:
        """Request id -> times run, over every replica."""
        total: dict[str, int] = {}
        for r in self.replicas:
            for rid, n in r.service.ran.items():
                total[rid] = total.get(rid, 0) + n
        return total

    async def aclose(self) -> None:
        for r in self.replicas:
            r.running.set()
            for ch in r.channels:
                ch.abort()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for r in self.replicas:
            if r.listener is not None:
                await r.listener.aclose()
            await r.server.aclose()
