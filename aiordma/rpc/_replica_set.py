"""The replica set of a pool (:class:`ReplicaSet`, which :class:`~aiordma.rpc.RpcPool`
extends): where the replicas are (resolved, and resolved again every ``resolve_interval``),
one :class:`~aiordma.rpc._replica.Replica` with its keeper per address, the settings the
keepers use, retiring a replica the resolver no longer names, the counters of the replicas'
lives, and the wake-up of calls waiting for a replica or a place. The calls themselves are
:mod:`aiordma.rpc._pool`'s."""

from __future__ import annotations

import asyncio
import logging
import random

from aiordma._errors import AiordmaError
from aiordma.protocols.rpc_pool import Backoff, ReplicaState
from aiordma.rpc._client import RpcClient
from aiordma.rpc._context import ClientInterceptor
from aiordma.rpc._replica import (
    Connector,
    NoReplicaError,
    Replica,
    _client_load,
    _client_usable,
    _describe,
)
from aiordma.rpc._resolve import Address, Resolver

__all__ = ["RETIRE_GRACE", "WAIT_STEP", "ReplicaSet"]

log = logging.getLogger("aiordma.rpc.pool")

WAIT_STEP = 0.1
"""A call waiting for a replica or a free place looks again at least this often (a place
freed by the late answer of a call whose caller gave up wakes nobody)."""

RETIRE_GRACE = 10.0
"""How long a replica the resolver no longer names keeps its connection for the calls it
carries, before it is closed."""


class ReplicaSet:
    """The replicas of a pool and their keepers' settings (a
    :class:`~aiordma.rpc._replica.ReplicaOwner`); see the module."""

    def __init__(self, resolver: Resolver, connector: Connector, *,
                 interceptors: tuple[ClientInterceptor, ...], health_interval: float,
                 health_timeout: float, connect_timeout: float, resolve_interval: float,
                 resolve_timeout: float, max_replicas: int, backoff: Backoff,
                 rng: random.Random) -> None:
        self._resolver = resolver
        self.connector = connector
        self.interceptors = interceptors
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.connect_timeout = connect_timeout
        self.resolve_interval = resolve_interval
        self.resolve_timeout = resolve_timeout
        self.max_replicas = max_replicas
        self.backoff = backoff
        self.rng = rng
        self._replicas: dict[Address, Replica] = {}
        self._order: list[Replica] = []  # the replicas, for the balancer
        self._waiters: set[asyncio.Future[None]] = set()  # calls waiting for a replica or room
        self._retiring: set[asyncio.Task[None]] = set()
        self._leaving: set[RpcClient] = set()  # connections closing once their calls end
        self._resolve_task: asyncio.Task[None] | None = None
        # counters (the replicas' own are in their stats; these outlive removed replicas)
        self._ejections = self._reconnects = self._connect_failures = 0
        self._resolves = self._resolve_failures = 0

    # -- the replica set ---------------------------------------------------------------------

    async def _start(self, timeout: float) -> None:
        """Resolve, connect every replica (each its first attempt, within ``timeout``).

        Raises:
            NoReplicaError: nothing resolved, or no replica connected.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with asyncio.timeout(min(timeout, self.resolve_timeout)):
                addresses = list(await self._resolver())
        except (AiordmaError, OSError, TimeoutError) as exc:
            raise NoReplicaError(f"the replicas' addresses did not resolve: "
                                 f"{_describe(exc)}") from exc
        if isinstance(addresses, str) or not addresses:
            raise NoReplicaError("the replicas' addresses resolved to none")
        self._resolves += 1
        self._update(addresses)
        firsts = [asyncio.ensure_future(r.first_attempt.wait()) for r in self._order]
        try:
            await asyncio.wait(firsts, timeout=max(0.0, deadline - loop.time()))
        finally:
            for f in firsts:
                f.cancel()
        if not any(r.life.state is ReplicaState.UP for r in self._order):
            raise NoReplicaError(f"no replica connected within {timeout} s: "
                                 f"{self._why_none(self._order)}")
        self._resolve_task = loop.create_task(self._resolve_forever())

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval)
            await self._resolve_once()

    async def _resolve_once(self) -> None:
        try:
            async with asyncio.timeout(self.resolve_timeout):
                addresses = list(await self._resolver())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  # a resolver's failure keeps the replicas
            self._resolve_failures += 1
            log.warning("aiordma.rpc pool: resolving failed, replicas kept: %s", _describe(exc))
            return
        if not addresses:
            self._resolve_failures += 1
            log.warning("aiordma.rpc pool: resolved to no address, replicas kept")
            return
        self._resolves += 1
        self._update(addresses)

    def _update(self, addresses: list[Address]) -> None:
        """Make the replica set ``addresses`` (the first ``max_replicas``): new ones get a
        keeper, those no longer named are retired."""
        wanted = list(dict.fromkeys(addresses))[:self.max_replicas]
        keep = set(wanted)
        for address in [a for a in self._replicas if a not in keep]:
            self._retire(self._replicas.pop(address))
        loop = asyncio.get_running_loop()
        for address in wanted:
            if address not in self._replicas:
                r = self._replicas[address] = Replica(address, self)
                r.keeper = loop.create_task(r.keep())
        self._order = list(self._replicas.values())
        self._notify()

    def _retire(self, r: Replica) -> None:
        """``r`` takes no new call; its connection closes once its calls are answered (at
        most :data:`RETIRE_GRACE` s)."""
        log.info("aiordma.rpc pool: replica %s is no longer named", r.name)
        if r.keeper is not None:
            r.keeper.cancel()
        client, r.client = r.client, None
        r.transition("close")
        if client is not None:
            self._close_later(client)

    def _close_later(self, client: RpcClient) -> None:
        """Close ``client`` once its calls are answered (at most :data:`RETIRE_GRACE` s)."""
        self._leaving.add(client)
        task = asyncio.get_running_loop().create_task(self._close_when_idle(client))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _close_when_idle(self, client: RpcClient) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + RETIRE_GRACE
        while _client_load(client) and _client_usable(client) and loop.time() < until:
            await asyncio.sleep(WAIT_STEP)
        self._leaving.discard(client)
        await client.aclose()

    def _counted(self, ejections: int, reconnects: int, connect_failures: int) -> None:
        self._ejections += ejections
        self._reconnects += reconnects
        self._connect_failures += connect_failures

    @staticmethod
    def _why_none(order: list[Replica]) -> str:
        return "; ".join(f"{r.name} {r.life.state.name} ({r.last_error or 'no error'})"
                         for r in order[:8]) or "no replica resolved"

    async def _wait_change(self, until: float | None, loop: asyncio.AbstractEventLoop) -> None:
        change: asyncio.Future[None] = loop.create_future()
        self._waiters.add(change)
        step = WAIT_STEP if until is None else max(0.0, min(WAIT_STEP, until - loop.time()))
        try:
            await asyncio.wait([change], timeout=step)
        finally:
            self._waiters.discard(change)

    def _notify(self) -> None:
        """Something changed (a place freed, a replica UP or gone): waiting calls look again."""
        waiters, self._waiters = self._waiters, set()
        for w in waiters:
            if not w.done():
                w.set_result(None)
