r"""A client over replicas: :class:`RpcPool` sends each call to one of several servers of the
same service, and :func:`connect_pool` makes one.

How it behaves (the policies themselves are sans-I/O, in :mod:`aiordma.protocols.rpc_pool`):

* **Replicas** come from an address, a list, a DNS name or a resolver
  (:mod:`aiordma.rpc._resolve`), re-resolved every ``resolve_interval``; each has one
  connection (an :class:`~aiordma.rpc.RpcClient`) and a *keeper* task that connects it, checks
  its health and reconnects it.
* **Balancing**: a call goes to the UP replica with the fewest calls outstanding on its
  connection (ties round-robin). One place of each connection's ``max_in_flight`` is kept for
  the health check, so a loaded replica is never ejected for want of a place.
* **Health**: a replica is UP once connected *and* it answered the built-in health method
  (``aiordma.health``, which every :class:`~aiordma.rpc.RpcServer` answers itself, inline);
  then the keeper calls it every ``health_interval`` with ``health_timeout``.
* **Ejection**: a broken connection ejects its replica at once (the call that saw it, or the
  keeper, which waits on the connection's reader between checks); so does a health check that
  fails or times out (a hung server whose TCP connection lives on). An ejected replica's
  connection is aborted: its calls fail at once instead of waiting for answers that will not
  come.
* **Reconnection**: after an ejection the keeper waits (exponential backoff, jittered, capped:
  :class:`~aiordma.protocols.rpc_pool.Backoff`) and connects again, until it succeeds.
* **Draining**: a server that drains (:meth:`~aiordma.rpc.RpcServer.drain`) answers the
  health check ``"draining"`` and refuses new calls with :class:`~aiordma.rpc.Unavailable`: the
  pool ejects it gracefully (the calls it carries are answered, then its connection closes)
  and sends a refused call to another replica, whatever its method: it did not run.
* **Retries**: a call whose connection broke after its request went out *may or may not have
  run*. It is sent again to another replica only if the replica it went to declared its
  method idempotent (``@method(idempotent=True)``, advertised in the health answer), the
  retry budget has a token (:class:`~aiordma.protocols.rpc_pool.RetryBudget`: retries stay
  within ``retry_burst + retry_ratio * calls``), its attempts (``max_attempts``) and its
  timeout are not spent. Otherwise it fails with :class:`UnknownOutcomeError`: never silently
  repeated.

Why the server says which methods are idempotent, not the caller: the declaration sits beside
the method's code, where whoever changes what the method does sees it; one declaration serves
every client (no call site can get it wrong or drift from the service); and it costs nothing
on the wire, since the health answer that proves a replica serves carries it (at connect time,
before the replica takes any call, and again with every check, so a redeployed service's
change is seen).

One replica's life (its keeper), the pool's errors and counters are :mod:`.\_replica`'s.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Self

from aiordma._args import check_int, check_seconds
from aiordma._device.device import Device
from aiordma._endpoint.config import Config
from aiordma._endpoint.connect import (
    _check_config,
    _check_device,
    _check_secret,
    _check_transport,
)
from aiordma._errors import (
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    LocalProtocolError,
    OperationTimeout,
    from_protocol_error,
)
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.rpc_pool import (
    Backoff,
    ReplicaState,
    RetryBudget,
    least_outstanding,
)
from aiordma.rpc._client import RpcClient
from aiordma.rpc._client import connect as _connect_client
from aiordma.rpc._replica import (
    HEALTH_PLACES,
    Connector,
    NoReplicaError,
    PoolStats,
    Replica,
    ReplicaStats,
    UnknownOutcomeError,
    _client_has_room,
    _client_load,
    _client_usable,
    _describe,
)
from aiordma.rpc._resolve import Address, Resolver, as_resolver
from aiordma.rpc._service import MAX_CALLS, MAX_TIMEOUT, Unavailable

__all__ = ["NoReplicaError", "PoolStats", "ReplicaStats", "RpcPool", "UnknownOutcomeError",
           "connect_pool"]

log = logging.getLogger("aiordma.rpc.pool")

WAIT_STEP = 0.1
"""A call waiting for a replica or a free place looks again at least this often (a place
freed by the late answer of a call whose caller gave up wakes nobody)."""

RETIRE_GRACE = 10.0
"""How long a replica the resolver no longer names keeps its connection for the calls it
carries, before it is closed."""


class RpcPool:
    """A client over the replicas of one service: ``await pool.call("name", *args)`` or
    ``await pool.name(*args)``, as with :class:`~aiordma.rpc.RpcClient`. Made by
    :func:`connect_pool` (see it for the parameters and the module for the behaviour). Use as
    ``async with``; ``aclose()`` and ``abort()`` fail pending calls with
    :class:`~aiordma.ClosedResourceError`.
    """

    def __init__(self, resolver: Resolver, connector: Connector, *, max_attempts: int,
                 health_interval: float, health_timeout: float, connect_timeout: float,
                 resolve_interval: float, resolve_timeout: float, wait_for_replica: float,
                 max_replicas: int, backoff: Backoff, budget: RetryBudget,
                 rng: random.Random) -> None:
        self._resolver = resolver
        self.connector = connector
        self.max_attempts = max_attempts
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.connect_timeout = connect_timeout
        self.resolve_interval = resolve_interval
        self.resolve_timeout = resolve_timeout
        self.wait_for_replica = wait_for_replica
        self.max_replicas = max_replicas
        self.backoff = backoff
        self._budget = budget
        self.rng = rng
        self._replicas: dict[Address, Replica] = {}
        self._order: list[Replica] = []  # the replicas, for the balancer
        self._next = 0  # where the balancer's tie-break starts
        self._waiters: set[asyncio.Future[None]] = set()  # calls waiting for a replica or room
        self._retiring: set[asyncio.Task[None]] = set()
        self._leaving: set[RpcClient] = set()  # connections closing once their calls end
        self._resolve_task: asyncio.Task[None] | None = None
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        # counters (the replicas' own are in their stats; these outlive removed replicas)
        self._calls = self._unknown = self._no_replica = 0
        self._ejections = self._reconnects = self._connect_failures = 0
        self._resolves = self._resolve_failures = 0

    # -- calls -----------------------------------------------------------------------------

    async def call(self, name: str, *args: Any, timeout: float | None = None,
                   **kwargs: Any) -> Any:
        """Call ``name`` on one replica; its result, or :class:`~aiordma.rpc.RemoteError`.

        ``timeout`` bounds the whole call: waiting for a replica or a free place, every
        attempt, and the answer; each attempt carries what is left of it as its deadline.

        Raises:
            OperationTimeout: ``timeout`` expired.
            RemoteError: the method raised (``type_name``, ``message``); never retried.
            Unavailable: every replica the call went to refused it without running it (they
                drain, or an interceptor refused it); a refused call goes to another replica,
                whatever its method, within the retry budget and ``max_attempts``.
            UnknownOutcomeError: the connection broke after the request went out and the call
                could not be sent again (see the class).
            NoReplicaError: no replica was UP within ``wait_for_replica``; nothing was sent.
                (When every replica is UP but its connection full, a call waits for a place
                within its ``timeout``, as long as it takes without one: backpressure, as
                with :class:`~aiordma.rpc.RpcClient`.)
            ClosedResourceError: the pool was closed.
            RemoteProtocolError: the replica broke the protocol (its connection is closed).
            LocalProtocolError: an argument cannot be sent.
        """
        if not isinstance(name, str):
            raise LocalProtocolError(f"a method name is a str, not {name!r:.80}")
        check_seconds(timeout, none_ok=True, zero_ok=True, high=MAX_TIMEOUT)
        if self._closed:
            raise ClosedResourceError("the RPC pool is closed")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._calls += 1
        self._budget.on_call()
        failed: set[RpcClient] = set()  # connections this call broke on or was refused by
        attempts = 0
        refused: Unavailable | None = None  # the last refusal (the method did not run)
        maybe_ran = False  # a connection broke after the call went out
        while True:
            try:
                replica, client = await self._pick(failed, deadline, name, timeout)
            except NoReplicaError as exc:
                if not attempts:
                    self._no_replica += 1
                    raise
                if not maybe_ran and refused is not None:
                    raise refused from exc  # every replica it went to refused it: it never ran
                self._unknown += 1  # (a retry found nowhere to go: the call was sent once)
                raise UnknownOutcomeError(
                    f"{name}(): sent to {replica.name}, which broke (or refused it), and no "
                    f"other replica was up to send it again: it may or may not have run",
                    method=name, address=replica.name, attempts=attempts) from exc
            attempts += 1
            replica.calls += 1
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                return await client.call(name, *args, timeout=left, **kwargs)
            except Unavailable as exc:
                # The server did not run the call (it drains, or an interceptor refused it): it
                # may go to another replica whatever its method. (A method's own errors, and an
                # Unavailable a method lets through, are RemoteErrors of other type names.)
                replica.poke.set()  # its health check says at once whether it drains
                if not self._may_retry(attempts, deadline, loop):
                    raise
                refused = exc
                failed.add(client)
            except (BrokenResourceError, ClosedResourceError) as exc:
                if self._closed:
                    raise ClosedResourceError("the RPC pool was closed") from exc
                replica.failures += 1
                replica.eject(client, "broken", _describe(exc))
                failed.add(client)
                if name in replica.idempotent and self._may_retry(attempts, deadline, loop):
                    maybe_ran = True
                    continue
                self._unknown += 1
                why = ("not declared idempotent" if name not in replica.idempotent
                       else f"not retried after {attempts} attempt(s)")
                raise UnknownOutcomeError(
                    f"{name}(): the connection to {replica.name} broke after the call was "
                    f"sent; it may or may not have run ({why})", method=name,
                    address=replica.name, attempts=attempts) from exc
            finally:
                if self._waiters:
                    self._notify()

    def _may_retry(self, attempts: int, deadline: float | None,
                   loop: asyncio.AbstractEventLoop) -> bool:
        if attempts >= self.max_attempts or (deadline is not None and loop.time() >= deadline):
            return False
        return self._budget.try_retry()

    async def _pick(self, failed: set[RpcClient], deadline: float | None, name: str,
                    timeout: float | None) -> tuple[Replica, RpcClient]:
        """The UP replica with the fewest outstanding calls that has room (not a connection in
        ``failed``) and its connection, waiting for one if none has; see :meth:`call` for what
        is raised."""
        loop = asyncio.get_running_loop()
        none_up_since: float | None = None
        while True:
            if self._closed:
                raise ClosedResourceError("the RPC pool is closed")
            order = self._order
            loads: list[int | None] = []
            any_up = False
            for r in order:
                c = r.client
                if c is None or c in failed or not _client_usable(c):
                    loads.append(None)
                    continue
                any_up = True
                loads.append(_client_load(c) if _client_has_room(c) else None)
            i = least_outstanding(loads, self._next)
            if i is not None:
                self._next = i + 1
                r = order[i]
                return r, r.client  # type: ignore[return-value]  # (loads[i]: not None)
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise OperationTimeout(f"{name}(): no replica took the call within {timeout} s")
            until = deadline
            if not any_up:
                if none_up_since is None:
                    none_up_since = now
                give_up = none_up_since + self.wait_for_replica
                if now >= give_up:
                    raise NoReplicaError(f"{name}(): no replica of {len(order)} was up within "
                                         f"{self.wait_for_replica} s: "
                                         f"{self._why_none(order)}")
                until = give_up if until is None else min(until, give_up)
            else:
                none_up_since = None
            await self._wait_change(until, loop)

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

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name.startswith("_"):
            raise AttributeError(name)

        async def proxy(*args: Any, **kwargs: Any) -> Any:
            return await self.call(name, *args, **kwargs)

        return proxy

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

    # -- counters ------------------------------------------------------------------------------

    def _counted(self, ejections: int, reconnects: int, connect_failures: int) -> None:
        self._ejections += ejections
        self._reconnects += reconnects
        self._connect_failures += connect_failures

    def stats(self) -> PoolStats:
        """The pool's counters and each replica's state (see :class:`PoolStats`)."""
        return PoolStats(
            calls=self._calls, retries=self._budget.retries,
            retries_refused=self._budget.refused, unknown_outcomes=self._unknown,
            no_replica=self._no_replica, ejections=self._ejections,
            reconnects=self._reconnects, connect_failures=self._connect_failures,
            resolves=self._resolves, resolve_failures=self._resolve_failures,
            retry_tokens=self._budget.tokens,
            replicas=tuple(r.stats() for r in self._order))

    # -- closing -------------------------------------------------------------------------------

    def _stop_tasks(self) -> list[asyncio.Task[None]]:
        self._closed = True
        tasks = [t for t in (self._resolve_task, *(r.keeper for r in self._order)) if t]
        tasks += list(self._retiring)
        for t in tasks:
            t.cancel()
        self._notify()
        return tasks

    async def aclose(self) -> None:
        """Close every connection gracefully (each bounded by ``Config.close_timeout``);
        pending calls fail with :class:`~aiordma.ClosedResourceError`. Idempotent."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        tasks = self._stop_tasks()
        await asyncio.gather(*tasks, return_exceptions=True)
        clients = list(self._leaving)
        self._leaving.clear()
        for r in self._order:
            if r.client is not None:
                clients.append(r.client)
                r.client = None
            if r.life.state is not ReplicaState.CLOSED:
                r.transition("close")
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)

    def abort(self) -> None:
        """Close at once; pending calls fail with :class:`~aiordma.ClosedResourceError`."""
        self._stop_tasks()
        for client in [*self._leaving, *(r.client for r in self._order if r.client)]:
            client.abort()
        self._leaving.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def connect_pool(target: Any, *, timeout: float = 10.0, max_in_flight: int = 64,
                       health_interval: float = 1.0, health_timeout: float = 3.0,
                       connect_timeout: float = 5.0, reconnect_base: float = 0.1,
                       reconnect_cap: float = 5.0, max_attempts: int = 3,
                       retry_ratio: float = 0.2, retry_burst: float = 20.0,
                       wait_for_replica: float = 5.0, resolve_interval: float = 30.0,
                       resolve_timeout: float = 5.0, max_replicas: int = 64,
                       config: Config | None = None, device: str | Device | None = None,
                       secret: bytes | None = None, connector: Connector | None = None,
                       seed: int | None = None, transport: str = "auto") -> RpcPool:
    """Connect to the replicas of one service; return once every replica had its first try
    (or ``timeout`` passed) and at least one is UP. Use as ``async with``.

    Args:
        target: ``"host:port"`` (a host name may resolve to several replicas), ``(host,
            port)``, a list of those, or a resolver: an ``async`` callable returning such a
            list (see :mod:`aiordma.rpc._resolve`).
        timeout: bound on resolving and connecting before returning.
        max_in_flight: each connection's (2..1024; one place is kept for health checks).
        health_interval, health_timeout: a health check every ``health_interval`` s, which
            ejects the replica unless answered within ``health_timeout`` s.
        connect_timeout: bound on one connection attempt (set-up and first health check).
        reconnect_base, reconnect_cap: the backoff before reconnecting: jittered, doubling
            from ``reconnect_base`` up to ``reconnect_cap`` s.
        max_attempts: the most replicas one call of an idempotent method is sent to.
        retry_ratio, retry_burst: the retry budget: retries stay within ``retry_burst +
            retry_ratio * calls``.
        wait_for_replica: how long a call waits for some replica to be UP before
            :class:`NoReplicaError`.
        resolve_interval, resolve_timeout: how often the addresses are resolved again, and
            the bound on one resolution (a failed or empty one keeps the replicas).
        max_replicas: the most replicas (of the sorted addresses, the first).
        config, device, secret: as :func:`aiordma.connect`, for every connection.
        transport: ``"auto"`` (default), ``"rdma"`` or ``"tcp"``, as :func:`aiordma.connect`,
            for every connection: with ``"auto"`` a replica without an RDMA device (or a
            client without one) is reached over TCP, the others over RDMA; each replica's
            ``ReplicaStats.transport`` says which.
        connector: instead of those, ``await connector(host, port, timeout)`` makes each
            connection (an :class:`~aiordma.rpc.RpcClient`; e.g. over
            :func:`aiordma.testing.channel_pair`).
        seed: seeds the backoff's jitter (for repeatable tests).

    Raises:
        NoReplicaError: the addresses did not resolve, or no replica connected in time.
        LocalProtocolError: a bad argument.
    """
    resolver = as_resolver(target)
    check_seconds(timeout)
    check_int(max_in_flight, name="max_in_flight", low=HEALTH_PLACES + 1, high=MAX_CALLS)
    for name, value in (("health_interval", health_interval),
                        ("health_timeout", health_timeout),
                        ("connect_timeout", connect_timeout),
                        ("wait_for_replica", wait_for_replica),
                        ("resolve_interval", resolve_interval),
                        ("resolve_timeout", resolve_timeout)):
        check_seconds(value, name=name, high=MAX_TIMEOUT)
    check_int(max_attempts, name="max_attempts", low=1, high=100)
    check_int(max_replicas, name="max_replicas", low=1, high=4096)
    try:
        backoff = Backoff(base=reconnect_base, cap=reconnect_cap)
        budget = RetryBudget(retry_ratio, retry_burst)
    except ProtocolError as exc:  # (the sans-I/O policies' own check, as aiordma's error)
        raise from_protocol_error(exc) from None
    if seed is not None:
        check_int(seed, name="seed", low=0)
    _check_config(config)
    _check_device(device, None)
    _check_secret(secret)
    _check_transport(transport)
    if connector is None:

        async def connector(host: str, port: int, timeout: float) -> RpcClient:
            return await _connect_client(host, port, timeout=timeout,
                                         max_in_flight=max_in_flight, config=config,
                                         device=device, secret=secret, transport=transport)
    elif not callable(connector):
        raise LocalProtocolError(f"connector must be an async callable, not {connector!r:.80}")
    pool = RpcPool(resolver, connector, max_attempts=max_attempts,
                   health_interval=health_interval, health_timeout=health_timeout,
                   connect_timeout=connect_timeout, resolve_interval=resolve_interval,
                   resolve_timeout=resolve_timeout, wait_for_replica=wait_for_replica,
                   max_replicas=max_replicas, backoff=backoff, budget=budget,
                   rng=random.Random(seed))
    try:
        await pool._start(timeout)
    except BaseException:
        await pool.aclose()
        raise
    return pool

