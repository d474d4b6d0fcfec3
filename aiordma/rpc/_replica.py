"""One replica of a pool: its life and its keeper (connect, check health, eject, back off,
reconnect), its counters, and the errors a pool's calls raise. The pool itself (calls,
balancing, retries, the replica set) is :mod:`aiordma.rpc._pool`.

What a pool reads of an :class:`~aiordma.rpc.RpcClient` beyond its public API (whether its
connection failed, its free places, its reader task) is in the ``_client_*`` functions below,
in one place.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiordma._errors import (
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    OperationTimeout,
    RemoteProtocolError,
)
from aiordma.protocols.rpc_pool import Backoff, ReplicaLife, ReplicaState
from aiordma.rpc._builtins import HEALTH
from aiordma.rpc._client import Answer, RpcClient
from aiordma.rpc._context import ClientCall, ClientInterceptor, run_chain
from aiordma.rpc._resolve import Address, format_address
from aiordma.rpc._service import Unavailable

__all__ = ["Connector", "NoReplicaError", "PoolStats", "Replica", "ReplicaOwner",
           "ReplicaStats", "UnknownOutcomeError", "attempt"]

log = logging.getLogger("aiordma.rpc.pool")

Connector = Callable[[str, int, float], Awaitable[RpcClient]]
"""``await connector(host, port, timeout)``: a new :class:`RpcClient` to one replica."""

HEALTH_PLACES = 1
"""Places of each connection's ``max_in_flight`` that calls leave for the health check."""


class ReplicaOwner(Protocol):
    """What a replica's keeper needs of its pool: settings, and where its news goes."""

    connector: Connector
    interceptors: tuple[ClientInterceptor, ...]
    connect_timeout: float
    health_timeout: float
    health_interval: float
    backoff: Backoff
    rng: random.Random

    def _notify(self) -> None:
        """Wake the calls that wait for a replica or a place."""

    def _close_later(self, client: RpcClient) -> None:
        """Close ``client`` once the calls it carries are answered."""

    def _counted(self, ejections: int, reconnects: int, connect_failures: int) -> None:
        """Add a replica's new ejections, reconnections and failed connects to the pool's."""


class NoReplicaError(BrokenResourceError):
    """No replica could take the call: none was UP (all ejected, reconnecting or not yet
    connected) within the pool's ``wait_for_replica``. The call was not sent anywhere.
    :func:`connect_pool` raises it too when no replica connected within its ``timeout``, or the
    addresses did not resolve."""


class UnknownOutcomeError(BrokenResourceError):
    """The connection carrying the call broke (or its replica was ejected) after the request
    went out: the call may or may not have run on that replica. Raised for a method its server
    did not declare idempotent (it is never sent twice), and for an idempotent one that could
    not be retried (the retry budget, ``max_attempts`` or the timeout ran out).

    Attributes:
        method: the method called.
        address: the replica the last attempt went to, ``"host:port"``.
        attempts: how many replicas the call was sent to.
    """

    def __init__(self, message: str, *, method: str = "", address: str = "",
                 attempts: int = 0) -> None:
        super().__init__(message)
        self.method = method
        self.address = address
        self.attempts = attempts


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaStats:
    """One replica, as :meth:`RpcPool.stats` saw it.

    Attributes:
        address: ``"host:port"``.
        state: ``"CONNECTING"``, ``"UP"``, ``"EJECTED"`` (waiting to reconnect), ``"CLOSED"``
            (the pool is closed).
        outstanding: calls on its connection not yet answered.
        calls: attempts sent to it.
        failures: attempts that failed because its connection broke or it was ejected.
        ejections: times it was ejected while UP.
        reconnects: times it came back UP after an ejection.
        connect_failures: connection attempts that failed.
        idempotent: the methods its server declared idempotent.
        last_error: why it was last ejected or failed to connect, or None.
        transport: what carries its connection while it has one (``"rdma"``, ``"tcp"``; a
            connector's own channels say theirs), else None.
    """

    address: str
    state: str
    outstanding: int
    calls: int
    failures: int
    ejections: int
    reconnects: int
    connect_failures: int
    idempotent: tuple[str, ...]
    last_error: str | None
    transport: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    """A snapshot of a pool's counters (:meth:`RpcPool.stats`); counts since the pool started,
    replicas removed by the resolver included.

    Attributes:
        calls: calls made (not counting retries).
        retries: attempts sent again to another replica.
        retries_refused: retries the budget refused (those calls raised
            :class:`UnknownOutcomeError`).
        unknown_outcomes: calls that raised :class:`UnknownOutcomeError`.
        no_replica: calls that raised :class:`NoReplicaError`.
        ejections: replicas ejected (broken, or a failed health check).
        reconnects: replicas that came back UP after an ejection.
        connect_failures: connection attempts that failed.
        resolves: resolutions that gave addresses; resolve_failures: those that failed (the
            replicas were kept as they were).
        retry_tokens: what the retry budget holds now.
        replicas: one :class:`ReplicaStats` per current replica.
    """

    calls: int
    retries: int
    retries_refused: int
    unknown_outcomes: int
    no_replica: int
    ejections: int
    reconnects: int
    connect_failures: int
    resolves: int
    resolve_failures: int
    retry_tokens: float
    replicas: tuple[ReplicaStats, ...]


# -- what the pool reads of an RpcClient --------------------------------------------------------

def _client_usable(client: RpcClient) -> bool:
    """Neither closed nor failed: a call made now is sent (its request is put synchronously)."""
    return not client._closed and client._failure is None


def _client_load(client: RpcClient) -> int:
    """Calls holding a place: outstanding, including those whose caller gave up."""
    return client.max_in_flight - client._places.free


def _client_has_room(client: RpcClient) -> bool:
    """A call made now takes a place at once, leaving :data:`HEALTH_PLACES` free."""
    places = client._places
    return places.free > HEALTH_PLACES and not places.waiters


def _client_ended(client: RpcClient) -> asyncio.Future[Any]:
    """Done when the connection ended (broke, or was closed)."""
    return client._reader


def _client_failure(client: RpcClient) -> str:
    failure = client._failure
    return "closed" if failure is None else f"{type(failure).__name__}: {failure}"


async def attempt(interceptors: tuple[ClientInterceptor, ...], client: RpcClient, name: str,
                  args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float | None,
                  timeout: float | None, metadata: dict[str, str | bytes] | None,
                  replica: str, number: int) -> Answer:
    """One attempt of a pool's call, on ``client`` (the connection to ``replica``): through
    the pool's ``interceptors`` (each attempt a new :class:`ClientCall`, made from the call's
    own arguments and metadata, its ``replica`` and ``attempt`` set), then the client's own
    (those a custom connector gave it), to the one place a request is sent
    (``RpcClient._send_call``). The answer.

    Raises:
        AiordmaError: as :meth:`RpcClient.call`; or what an interceptor raised.
    """
    if interceptors:
        call = ClientCall(name, args, kwargs, dict(metadata or {}), deadline, False, replica,
                          number)
        result = await run_chain(interceptors, call,
                                 lambda: client._chain_end(call, timeout, own=True))
        return Answer(result, call.answer_metadata or {})
    ev = await client._answer(name, args, kwargs, deadline, timeout, metadata)
    return Answer(ev.result, ev.metadata or {})


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _health_from(answer: Any) -> tuple[bool, frozenset[str]]:
    """Whether a health answer says the server takes calls (else it drains), and the
    idempotent methods it names.

    Raises:
        RemoteProtocolError: not an aiordma health answer.
    """
    names = answer.get("idempotent") if isinstance(answer, dict) else None
    if (not isinstance(answer, dict) or answer.get("status") not in ("serving", "draining")
            or not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise RemoteProtocolError(f"{HEALTH} answered {answer!r:.120}, not an aiordma "
                                  f"server's health")
    return answer["status"] == "serving", frozenset(names)


class Replica:
    """One replica: its address, its life (:class:`ReplicaLife`), its connection while UP,
    and its keeper (:meth:`keep`: connect, watch its health, back off, reconnect), whose
    settings and news are its pool's."""

    __slots__ = ("_pool", "address", "calls", "client", "failures", "first_attempt",
                 "idempotent", "keeper", "last_error", "life", "name", "poke")

    def __init__(self, address: Address, pool: ReplicaOwner) -> None:
        self._pool = pool
        self.address = address
        self.name = format_address(address)
        self.life = ReplicaLife()
        self.client: RpcClient | None = None  # set while UP only
        self.idempotent: frozenset[str] = frozenset()
        self.calls = 0
        self.failures = 0
        self.last_error: str | None = None
        self.keeper: asyncio.Task[None] | None = None
        self.first_attempt = asyncio.Event()  # its first connection attempt ended
        self.poke = asyncio.Event()  # check its health now, not at the next interval

    def stats(self) -> ReplicaStats:
        client, life = self.client, self.life
        return ReplicaStats(
            address=self.name, state=life.state.name,
            outstanding=0 if client is None else _client_load(client), calls=self.calls,
            failures=self.failures, ejections=life.ejections, reconnects=life.reconnects,
            connect_failures=life.connect_failures, idempotent=tuple(sorted(self.idempotent)),
            last_error=self.last_error, transport=None if client is None else client.transport)

    # -- its life ---------------------------------------------------------------------------

    def transition(self, event: str) -> None:
        life = self.life
        before = (life.ejections, life.reconnects, life.connect_failures)
        life.handle(event)
        self._pool._counted(life.ejections - before[0], life.reconnects - before[1],
                            life.connect_failures - before[2])

    def eject(self, client: RpcClient, event: str, why: str, *,
               graceful: bool = False) -> None:
        """Eject this replica if ``client`` is still its connection (else an earlier connection's
        news: nothing to do). Its connection is aborted (its calls fail at once), or, for a
        server that shuts down (``graceful``), closed once the calls it carries are answered,
        as the server promises to within its grace."""
        if self.client is not client or self.life.state is not ReplicaState.UP:
            return
        self.client = None
        self.last_error = why
        self.transition(event)
        if graceful:
            self._pool._close_later(client)
        else:
            client.abort()
        log.warning("aiordma.rpc pool: replica %s ejected (%s)", self.name, why)
        self._pool._notify()

    async def keep(self) -> None:
        """The keeper: connect, watch, back off, reconnect; until it is closed."""
        try:
            while (state := self.life.state) is not ReplicaState.CLOSED:
                if state is ReplicaState.CONNECTING:
                    await self._connect()
                    self.first_attempt.set()
                elif state is ReplicaState.UP:
                    await self._watch()
                else:
                    await asyncio.sleep(self._pool.backoff.delay(self.life.attempt, self._pool.rng.random()))
                    self.transition("backoff_done")
        except Exception:  # a bug: said loudly (the replica is no longer looked after)
            log.exception("aiordma.rpc pool: the keeper of %s failed", self.name)
            raise
        finally:
            self.first_attempt.set()

    async def _connect(self) -> None:
        host, port = self.address
        client: RpcClient | None = None
        try:
            async with asyncio.timeout(self._pool.connect_timeout):
                client = await self._pool.connector(host, port, self._pool.connect_timeout)
                serving, idempotent = await self._check(client)
                if not serving:
                    raise Unavailable("the server drains")
        except asyncio.CancelledError:
            if client is not None:
                client.abort()
            raise
        except Exception as exc:  # noqa: BLE001  # any failure to connect: back off, try again
            if client is not None:
                client.abort()
            if isinstance(exc, TimeoutError) and not isinstance(exc, OperationTimeout):
                exc = OperationTimeout(f"connecting took longer than {self._pool.connect_timeout} s")
            self.last_error = _describe(exc)
            self.transition("connect_failed")
            log.debug("aiordma.rpc pool: cannot connect to %s (%s)", self.name, self.last_error)
            return
        self.client = client
        self.idempotent = idempotent
        reconnect = self.life.was_up
        self.transition("connected")
        if reconnect:
            log.info("aiordma.rpc pool: replica %s is back", self.name)
        self._pool._notify()

    async def _watch(self) -> None:
        """Wait ``health_interval`` (or less, if the connection ends), then check health."""
        client = self.client
        if client is None:
            return
        ended = _client_ended(client)
        poked: asyncio.Future[Any] = asyncio.ensure_future(self.poke.wait())
        try:
            await asyncio.wait([ended, poked], timeout=self._pool.health_interval,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            poked.cancel()
        self.poke.clear()
        if self.client is not client:
            return  # a call ejected it meanwhile
        if ended.done():
            self.eject(client, "broken", _client_failure(client))
            return
        try:
            serving, self.idempotent = await self._check(client)
            if not serving:
                raise Unavailable("the server drains")
        except AiordmaError as exc:
            why = f"health check: {_describe(exc)}"
            if isinstance(exc, Unavailable):
                # the server refuses calls: it drains, and answers those it has
                self.eject(client, "health_failed", why, graceful=True)
            elif isinstance(exc, (BrokenResourceError, ClosedResourceError)):
                self.eject(client, "broken", why)
            else:
                self.eject(client, "health_failed", why)

    async def _check(self, client: RpcClient) -> tuple[bool, frozenset[str]]:
        """Call the health method on ``client``, through the pool's interceptors (a server
        that checks its callers' credentials checks the health check's too), within
        ``health_timeout``; whether it serves, and its idempotent methods."""
        timeout = self._pool.health_timeout
        deadline = asyncio.get_running_loop().time() + timeout
        answer = await attempt(self._pool.interceptors, client, HEALTH, (), {}, deadline,
                               timeout, None, self.name, 1)
        return _health_from(answer.result)
