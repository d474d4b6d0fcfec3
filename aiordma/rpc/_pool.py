r"""A client over replicas: :class:`RpcPool` sends each call to one of several servers of the
same service, and :func:`connect_pool` makes one.

How it behaves (the policies themselves are sans-I/O, in :mod:`aiordma.protocols.rpc_pool`):

* **Replicas** come from an address, a list, a DNS name or a resolver
  (:mod:`aiordma.rpc._resolve`), re-resolved every ``resolve_interval``; each has one
  connection (an :class:`~aiordma.rpc.RpcClient`) and a *keeper* task that connects it, checks
  its health and reconnects it.
* **Balancing**: a call goes to the UP replica with the fewest calls outstanding on its
  connection (ties round-robin); a call with a ``key`` to the key's replica among the UP
  ones (rendezvous hashing: :func:`~aiordma.protocols.rpc_pool.rendezvous`). One place of each connection's ``max_in_flight`` is kept for
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

* **As a client**: calls take ``metadata``; ``call_with_metadata`` returns an
  :class:`~aiordma.rpc.Answer`; the pool's interceptors run around each attempt and each
  health check (:func:`~aiordma.rpc._replica.attempt`); streams stay on one replica
  (:mod:`.\_pool_stream`).

Why the server says which methods are idempotent, not the caller: the declaration sits beside
the method's code, where whoever changes what the method does sees it; one declaration serves
every client (no call site can get it wrong or drift from the service); and it costs nothing
on the wire, since the health answer that proves a replica serves carries it (at connect time,
before the replica takes any call, and again with every check, so a redeployed service's
change is seen).

One replica's life (its keeper), the pool's errors and counters are :mod:`.\_replica`'s; the
replica set (resolving, retiring) :mod:`.\_replica_set`'s; streams :mod:`.\_pool_stream`'s.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
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
from aiordma.protocols.rpc import MAX_CREDIT
from aiordma.protocols.rpc_pool import (
    Backoff,
    ReplicaState,
    RetryBudget,
    affinity_key,
    least_outstanding,
    rendezvous,
)
from aiordma.rpc._client import Answer, RpcClient
from aiordma.rpc._client import connect as _connect_client
from aiordma.rpc._context import (
    ClientInterceptor,
    call_deadline,
    check_interceptors,
    check_metadata,
)
from aiordma.rpc._pool_stream import PoolStreamCall
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
    attempt,
)
from aiordma.rpc._replica_set import ReplicaSet
from aiordma.rpc._resolve import Resolver, as_resolver
from aiordma.rpc._service import MAX_CALLS, MAX_TIMEOUT, Unavailable
from aiordma.rpc._stats import LatencyHistogram
from aiordma.rpc._stream import DEFAULT_WINDOW

__all__ = ["NoReplicaError", "PoolStats", "ReplicaStats", "RpcPool", "UnknownOutcomeError",
           "connect_pool"]

log = logging.getLogger("aiordma.rpc.pool")

class RpcPool(ReplicaSet):
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
                 rng: random.Random, interceptors: tuple[ClientInterceptor, ...] = ()) -> None:
        super().__init__(resolver, connector, interceptors=interceptors,
                         health_interval=health_interval, health_timeout=health_timeout,
                         connect_timeout=connect_timeout, resolve_interval=resolve_interval,
                         resolve_timeout=resolve_timeout, max_replicas=max_replicas,
                         backoff=backoff, rng=rng)
        self.max_attempts = max_attempts
        self.wait_for_replica = wait_for_replica
        self._budget = budget
        self._next = 0  # where the balancer's tie-break starts
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._calls = self._unknown = self._no_replica = 0  # (the set counts the rest)
        self._latency: dict[str, LatencyHistogram] | None = None  # (see _keep_histograms)

    # -- calls -----------------------------------------------------------------------------

    async def call(self, name: str, *args: Any, timeout: float | None = None,
                   metadata: dict[str, str | bytes] | None = None, key: Any = None,
                   **kwargs: Any) -> Any:
        """Call ``name`` on one replica; its result, or :class:`~aiordma.rpc.RemoteError`.

        ``timeout`` bounds the whole call: waiting for a replica or a free place, every
        attempt, and the answer; each attempt carries what is left of it as its deadline
        (inside a method serving a call, the call also ends no later than that call's
        deadline, as with :meth:`~aiordma.rpc.RpcClient.call`). ``metadata`` travels with
        every attempt; :meth:`call_with_metadata` also returns the answer's. The pool's
        interceptors run around *each attempt* (a call sent again to another replica runs
        them again, with ``ClientCall.replica`` and ``ClientCall.attempt`` telling which).

        ``key`` (a ``str``, ``bytes`` or ``int``) sends the call to the replica the key
        hashes to (rendezvous hashing over the UP replicas: calls with equal keys go to the
        same replica, and when a replica leaves or joins only its keys move). While the
        key's replica is not UP (ejected, reconnecting, drained), its calls go to the key's
        next choice among the UP replicas, and come back when it is UP again; while its
        connection is full, a call waits for a place on it (it does not spill to another
        replica). A retry goes to the key's next choice. Without a key, the least loaded
        UP replica takes the call. (``timeout``, ``metadata`` and ``key`` are the pool's own
        keywords: a method's parameter of one of those names is passed positionally.)

        Raises:
            OperationTimeout: ``timeout`` (or the inherited deadline) expired.
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
            LocalProtocolError: an argument, the metadata or the key cannot be sent.
        """
        return (await self._call(name, args, kwargs, timeout, metadata, key)).result

    async def call_with_metadata(self, name: str, *args: Any, timeout: float | None = None,
                                 metadata: dict[str, str | bytes] | None = None,
                                 key: Any = None, **kwargs: Any) -> Answer:
        """:meth:`call`, returning the answer's metadata too, as an
        :class:`~aiordma.rpc.Answer` (the answer of the attempt that succeeded)::

            result, answer_metadata = await pool.call_with_metadata(
                "get", item, metadata={"request-id": rid})

        Raises:
            AiordmaError: as :meth:`call`.
        """
        return await self._call(name, args, kwargs, timeout, metadata, key)

    def _begin(self, name: Any, timeout: Any, metadata: Any, key: Any
               ) -> tuple[float | None, float | None, dict[str, str | bytes] | None,
                          bytes | None]:
        """A call's or a stream's checks and count; its deadline, the timeout its messages
        name, its metadata (checked) and its key (hashed form).

        Raises:
            LocalProtocolError: a bad name, timeout, metadata or key.
            ClosedResourceError: the pool is closed.
        """
        if not isinstance(name, str):
            raise LocalProtocolError(f"a method name is a str, not {name!r:.80}")
        check_seconds(timeout, none_ok=True, zero_ok=True, high=MAX_TIMEOUT)
        md = check_metadata(metadata)
        try:
            hashed = None if key is None else affinity_key(key)
        except ProtocolError as exc:
            raise from_protocol_error(exc) from None
        if self._closed:
            raise ClosedResourceError("the RPC pool is closed")
        deadline, timeout = call_deadline(timeout)
        self._calls += 1
        self._budget.on_call()
        return deadline, timeout, md, hashed

    async def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                    timeout: float | None, metadata: dict[str, str | bytes] | None,
                    key: Any) -> Answer:
        if self._latency is None:
            return await self._attempts(name, args, kwargs, timeout, metadata, key)
        t0 = perf_counter()  # (an exporter asked for latencies: see _keep_histograms)
        try:
            return await self._attempts(name, args, kwargs, timeout, metadata, key)
        finally:
            h = self._latency.get(name)
            if h is None:
                h = self._latency[name] = LatencyHistogram()
            h.observe(perf_counter() - t0)

    def _keep_histograms(self) -> dict[str, LatencyHistogram]:
        """Count each call's latency (from the call to its outcome, every attempt and wait
        included) into a :class:`LatencyHistogram` per method from now on (for an exporter:
        :mod:`aiordma.rpc.metrics`); the histograms so far. Idempotent."""
        if self._latency is None:
            self._latency = {}
        return dict(self._latency)

    async def _attempts(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                        timeout: float | None, metadata: dict[str, str | bytes] | None,
                        key: Any) -> Answer:
        deadline, timeout, md, hashed = self._begin(name, timeout, metadata, key)
        loop = asyncio.get_running_loop()
        failed: set[RpcClient] = set()  # connections this call broke on or was refused by
        attempts = 0
        refused: Unavailable | None = None  # the last refusal (the method did not run)
        maybe_ran = False  # a connection broke after the call went out
        replica: Replica | None = None
        while True:
            try:
                replica, client = await self._pick(failed, deadline, name, timeout, hashed)
            except NoReplicaError as exc:
                err = self._nowhere(exc, name, attempts, refused, maybe_ran, replica)
                if err is exc:
                    raise
                raise err from exc
            attempts += 1
            replica.calls += 1
            try:
                return await attempt(self.interceptors, client, name, args, kwargs, deadline,
                                     timeout, md, replica.name, attempts)
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
                if not self._broke(replica, client, exc):
                    raise  # (an interceptor's own error: the connection is fine)
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

    def _nowhere(self, exc: NoReplicaError, name: str, attempts: int,
                 refused: Unavailable | None, maybe_ran: bool,
                 last: Replica | None) -> AiordmaError:
        """What a call (or a stream) raises when no replica can take its next attempt:
        ``exc`` itself if it was sent nowhere, else what its attempts call for."""
        if not attempts or last is None:
            self._no_replica += 1
            return exc
        if not maybe_ran and refused is not None:
            return refused  # every replica it went to refused it: it never ran
        self._unknown += 1  # (a retry found nowhere to go: the call was sent once)
        return UnknownOutcomeError(
            f"{name}(): sent to {last.name}, which broke (or refused it), and no other "
            f"replica was up to send it again: it may or may not have run", method=name,
            address=last.name, attempts=attempts)

    def _broke(self, replica: Replica, client: RpcClient, exc: AiordmaError) -> bool:
        """An attempt on ``client`` failed with a Broken or Closed error: if its connection
        ended, eject its replica (if still its connection) and say True.

        Raises:
            ClosedResourceError: the pool was closed.
        """
        if self._closed:
            raise ClosedResourceError("the RPC pool was closed") from exc
        if _client_usable(client):
            return False
        replica.failures += 1
        replica.eject(client, "broken", _describe(exc))
        return True

    def stream(self, name: str, *args: Any, timeout: float | None = None,
               window: int = DEFAULT_WINDOW, metadata: dict[str, str | bytes] | None = None,
               key: Any = None, **kwargs: Any) -> PoolStreamCall:
        """:meth:`RpcClient.stream <aiordma.rpc.RpcClient.stream>` on one replica: the stream
        picks a replica when it starts (by ``key`` as :meth:`call` does, or the least loaded)
        and stays on it. A stream of a method its server declared idempotent is started again
        on another replica if its replica broke or refused it before the first item reached
        the caller; otherwise a broken replica fails it with :class:`UnknownOutcomeError`.
        See :class:`~aiordma.rpc._pool_stream.PoolStreamCall`.

        Raises:
            LocalProtocolError: ``name``, ``timeout``, ``window``, ``metadata`` or ``key``
                is not valid (at once).
        """
        return self._stream(name, args, kwargs, timeout, window, metadata, key, False)

    def stream_call(self, name: str, *args: Any, timeout: float | None = None,
                    window: int = DEFAULT_WINDOW, metadata: dict[str, str | bytes] | None = None,
                    key: Any = None, **kwargs: Any) -> PoolStreamCall:
        """:meth:`RpcClient.stream_call <aiordma.rpc.RpcClient.stream_call>` on one replica,
        as :meth:`stream`: an idempotent one is started again elsewhere only before its first
        item was sent and before its first item reached the caller.
        """
        return self._stream(name, args, kwargs, timeout, window, metadata, key, True)

    def _stream(self, name: Any, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: Any,
                window: Any, metadata: Any, key: Any, sends: bool) -> PoolStreamCall:
        if not isinstance(name, str):
            raise LocalProtocolError(f"a method name is a str, not {name!r:.80}")
        check_seconds(timeout, none_ok=True, zero_ok=True, high=MAX_TIMEOUT)
        check_int(window, name="window", low=1, high=MAX_CREDIT)
        check_metadata(metadata)
        try:
            if key is not None:
                affinity_key(key)
        except ProtocolError as exc:
            raise from_protocol_error(exc) from None
        return PoolStreamCall(self, name, args, kwargs, timeout, window, metadata, key, sends)

    def _may_retry(self, attempts: int, deadline: float | None,
                   loop: asyncio.AbstractEventLoop) -> bool:
        if attempts >= self.max_attempts or (deadline is not None and loop.time() >= deadline):
            return False
        return self._budget.try_retry()

    async def _pick(self, failed: set[RpcClient], deadline: float | None, name: str,
                    timeout: float | None, key: bytes | None = None
                    ) -> tuple[Replica, RpcClient]:
        """The replica for the next attempt and its connection, waiting for one if none can
        take it now: without a ``key``, the UP replica with the fewest outstanding calls that
        has room (not a connection in ``failed``); with one, the key's replica among the UP
        ones not in ``failed`` (waiting for room on it). See :meth:`call` for what is
        raised."""
        loop = asyncio.get_running_loop()
        none_up_since: float | None = None
        while True:
            if self._closed:
                raise ClosedResourceError("the RPC pool is closed")
            order = self._order
            loads: list[int | None] = []
            names: list[str | None] = []
            for r in order:
                c = r.client
                if c is None or c in failed or not _client_usable(c):
                    loads.append(None)
                    names.append(None)
                    continue
                names.append(r.name)
                loads.append(_client_load(c) if _client_has_room(c) else None)
            any_up = any(n is not None for n in names)
            if key is None:
                i = least_outstanding(loads, self._next)
                if i is not None:
                    self._next = i + 1
            else:
                i = rendezvous(key, names)
                if i is not None and loads[i] is None:
                    i = None  # its connection is full: wait for a place there
            if i is not None:
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

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name.startswith("_"):
            raise AttributeError(name)

        async def proxy(*args: Any, **kwargs: Any) -> Any:
            return await self.call(name, *args, **kwargs)

        return proxy

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
                       seed: int | None = None,
                       interceptors: Sequence[ClientInterceptor] = (),
                       transport: str = "auto") -> RpcPool:
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
        interceptors: async middleware around each attempt of every call and stream, and
            around the health checks (so a server that checks a token sees one on them too),
            the first the outermost: ``async def interceptor(call: ClientCall, proceed)``, as
            for :func:`~aiordma.rpc.connect`. ``call.replica`` and ``call.attempt`` say which
            replica an attempt goes to and which attempt it is; a retried call runs the chain
            again, on the next replica.

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
    interceptors = check_interceptors(interceptors)
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
                   rng=random.Random(seed), interceptors=interceptors)
    try:
        await pool._start(timeout)
    except BaseException:
        await pool.aclose()
        raise
    return pool

