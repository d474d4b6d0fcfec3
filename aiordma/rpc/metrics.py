"""Prometheus metrics of RPC servers and pools (the ``aiordma[metrics]`` extra:
``pip install 'aiordma[metrics]'``, which brings ``prometheus-client``).

.. code-block:: python

    from aiordma.rpc import metrics

    server = await serve(Orders(), host, port)
    metrics.register(server, name="orders")             # its counters and latencies
    pool = await connect_pool(replicas, interceptors=[...])
    metrics.register(pool, name="orders")
    endpoint = metrics.start_http_server(9100)          # http://host:9100/metrics

:func:`register` adds a collector to a registry (prometheus-client's default one unless told
otherwise). Nothing is counted twice: a scrape reads the counters the server
(:meth:`~aiordma.rpc.RpcServer.stats`) and the pool (:meth:`~aiordma.rpc.RpcPool.stats`) keep
anyway, on their event loop's thread (the HTTP server answers from its own). The latency
histograms are the one thing kept only for an exporter: from :func:`register` on, a server
counts each answer's latency (from its request's arrival to its answer) and a pool each
call's (from the call to its outcome, retries and waits included; streams are not counted)
into buckets (:data:`~aiordma.rpc._stats.LATENCY_BUCKETS`), a bisect per call.

What is exported (every name starts with ``aiordma_rpc_``; ``server`` or ``pool`` is the
name given to :func:`register`):

========================================  =======  =========================================
``server_calls_total``                    counter  requests received, by ``method``
``server_answered_total``                 counter  answers, by ``method`` and ``outcome``
                                                   (``ok``, ``error``, ``cancelled``,
                                                   ``expired``, ``refused``)
``server_in_flight``                      gauge    calls received and not answered, by method
``server_latency_seconds``                hist.    arrival to answer, by ``method``
``server_connections``                    gauge    connections being served
``server_draining``                       gauge    1 while the server drains
``pool_calls_total``                      counter  calls and streams made (not retries)
``pool_retries_total`` (and ``pool_retries_refused_total``, ``pool_unknown_outcomes_total``,
``pool_no_replica_total``, ``pool_ejections_total``, ``pool_reconnects_total``,
``pool_connect_failures_total``, ``pool_resolves_total``, ``pool_resolve_failures_total``)
                                          counter  see :class:`~aiordma.rpc.PoolStats`
``pool_retry_tokens``                     gauge    what the retry budget holds
``pool_call_latency_seconds``             hist.    call to outcome, by ``method``
``pool_replica_up``                       gauge    1 for an UP replica, by ``replica``
``pool_replica_state``                    gauge    1 for its state, by ``replica`` and
                                                   ``state``
``pool_replica_outstanding``              gauge    its calls not answered yet
``pool_replica_calls_total``              counter  attempts sent to it (and
                                                   ``pool_replica_failures_total``)
========================================  =======  =========================================

Raises:
    ImportError: (on import) prometheus-client is not installed; the message names the extra.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client import start_http_server as _start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover  (tests/unit/test_rpc_metrics.py runs it)
    raise ImportError("aiordma.rpc.metrics needs prometheus-client: install the extra, "
                      "pip install 'aiordma[metrics]'") from exc

from aiordma._errors import LocalProtocolError, OperationTimeout
from aiordma.protocols.rpc_pool import ReplicaState
from aiordma.rpc._pool import RpcPool
from aiordma.rpc._server import RpcServer
from aiordma.rpc._stats import LatencyHistogram

__all__ = ["MetricsEndpoint", "RpcCollector", "register", "start_http_server"]

SNAPSHOT_TIMEOUT = 5.0
"""How long a scrape waits for the event loop to take the snapshot (a loop blocked longer
fails the scrape, loudly, rather than answering stale or torn numbers)."""

T = TypeVar("T")
_OUTCOMES = {"error": "errors", "cancelled": "cancelled", "expired": "expired",
             "refused": "refused"}  # outcome label -> MethodStats counter
_POOL_COUNTERS = ("calls", "retries", "retries_refused", "unknown_outcomes", "no_replica",
                  "ejections", "reconnects", "connect_failures", "resolves", "resolve_failures")


class RpcCollector(Collector):
    """The metrics of one server or one pool, for a prometheus-client registry (made by
    :func:`register`). ``collect()`` may run on any thread: it takes its snapshot on the
    target's event loop."""

    def __init__(self, target: RpcServer | RpcPool, name: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.target = target
        self.name = name
        self._loop = loop
        target._keep_histograms()

    def collect(self) -> Iterator[Any]:
        if isinstance(self.target, RpcServer):
            yield from _server_families(self.name, *self._on_loop(self._server_snapshot))
        else:
            yield from _pool_families(self.name, *self._on_loop(self._pool_snapshot))

    def _server_snapshot(self) -> tuple[dict[str, Any], dict[str, LatencyHistogram]]:
        server = typing.cast(RpcServer, self.target)  # (collect() chose by type)
        return server.stats(), _copy(server._keep_histograms())

    def _pool_snapshot(self) -> tuple[Any, dict[str, LatencyHistogram]]:
        return self.target.stats(), _copy(self.target._keep_histograms())  # type: ignore[return-value]

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the target's loop (now, if this is its thread), its result.

        Raises:
            OperationTimeout: the loop did not run it within :data:`SNAPSHOT_TIMEOUT`.
            RuntimeError: the loop is closed.
        """
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return fn()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001  # handed to the scraping thread
                done.set_exception(exc)

        loop.call_soon_threadsafe(run)
        try:
            return done.result(SNAPSHOT_TIMEOUT)
        except concurrent.futures.TimeoutError:
            raise OperationTimeout(f"aiordma.rpc.metrics: the event loop of {self.name!r} did "
                                   f"not answer within {SNAPSHOT_TIMEOUT} s") from None


def _copy(histograms: dict[str, LatencyHistogram]) -> dict[str, LatencyHistogram]:
    out = {}
    for name, h in histograms.items():
        c = LatencyHistogram(h.bounds)
        c.counts, c.sum = list(h.counts), h.sum
        out[name] = c
    return out


def _histogram(name: str, doc: str, labels: list[str], values: list[str],
               histograms: dict[str, LatencyHistogram],
               family: HistogramMetricFamily | None = None) -> HistogramMetricFamily:
    family = family or HistogramMetricFamily(name, doc, labels=[*labels, "method"])
    for method, h in sorted(histograms.items()):
        buckets = [("+Inf" if b == float("inf") else repr(float(b)), n)
                   for b, n in h.cumulative()]
        family.add_metric([*values, method], buckets, h.sum)
    return family


def _server_families(name: str, stats: dict[str, Any],
                     histograms: dict[str, LatencyHistogram]) -> Iterator[Any]:
    p = "aiordma_rpc_server_"
    calls = CounterMetricFamily(p + "calls", "RPC requests received", labels=["server", "method"])
    answered = CounterMetricFamily(p + "answered", "RPC answers sent, by outcome",
                                   labels=["server", "method", "outcome"])
    in_flight = GaugeMetricFamily(p + "in_flight", "RPC calls received and not answered yet",
                                  labels=["server", "method"])
    for method, m in sorted(stats["methods"].items()):
        calls.add_metric([name, method], m["calls"])
        done = m["calls"] - m["in_flight"]
        failed = sum(m[key] for key in _OUTCOMES.values())
        answered.add_metric([name, method, "ok"], done - failed)
        for outcome, key in _OUTCOMES.items():
            answered.add_metric([name, method, outcome], m[key])
        in_flight.add_metric([name, method], m["in_flight"])
    yield calls
    yield answered
    yield in_flight
    yield _histogram(p + "latency_seconds", "RPC latency from a request's arrival to its answer",
                     ["server"], [name], histograms)
    connections = GaugeMetricFamily(p + "connections", "RPC connections being served",
                                    labels=["server"])
    connections.add_metric([name], stats["connections"])
    yield connections
    draining = GaugeMetricFamily(p + "draining", "1 while the RPC server drains",
                                 labels=["server"])
    draining.add_metric([name], 1 if stats["draining"] else 0)
    yield draining


def _pool_families(name: str, stats: Any,
                   histograms: dict[str, LatencyHistogram]) -> Iterator[Any]:
    p = "aiordma_rpc_pool_"
    for counter in _POOL_COUNTERS:
        family = CounterMetricFamily(p + counter, f"RPC pool: {counter.replace('_', ' ')}",
                                     labels=["pool"])
        family.add_metric([name], getattr(stats, counter))
        yield family
    tokens = GaugeMetricFamily(p + "retry_tokens", "RPC pool: what the retry budget holds",
                               labels=["pool"])
    tokens.add_metric([name], stats.retry_tokens)
    yield tokens
    yield _histogram(p + "call_latency_seconds", "RPC pool: latency from a call to its outcome",
                     ["pool"], [name], histograms)
    labels = ["pool", "replica"]
    up = GaugeMetricFamily(p + "replica_up", "1 for a replica that takes calls", labels=labels)
    state = GaugeMetricFamily(p + "replica_state", "1 for a replica's state",
                              labels=[*labels, "state"])
    outstanding = GaugeMetricFamily(p + "replica_outstanding", "calls on a replica's "
                                    "connection not answered yet", labels=labels)
    calls = CounterMetricFamily(p + "replica_calls", "attempts sent to a replica", labels=labels)
    failures = CounterMetricFamily(p + "replica_failures", "attempts that failed because a "
                                   "replica's connection ended", labels=labels)
    for r in stats.replicas:
        up.add_metric([name, r.address], 1 if r.state == "UP" else 0)
        for s in ReplicaState:
            state.add_metric([name, r.address, s.name], 1 if r.state == s.name else 0)
        outstanding.add_metric([name, r.address], r.outstanding)
        calls.add_metric([name, r.address], r.calls)
        failures.add_metric([name, r.address], r.failures)
    yield from (up, state, outstanding, calls, failures)


def register(target: RpcServer | RpcPool, *, name: str | None = None,
             registry: CollectorRegistry | None = None) -> RpcCollector:
    """Export ``target``'s counters and latency histograms (see the module) through
    ``registry`` (prometheus-client's default ``REGISTRY`` if None), labelled ``name`` (the
    server's service class name, or ``"pool"``, if None). Call it on the target's event loop.
    ``registry.unregister(collector)`` stops it.

    Raises:
        LocalProtocolError: ``target`` is neither an :class:`~aiordma.rpc.RpcServer` nor an
            :class:`~aiordma.rpc.RpcPool`, or ``name`` is not a non-empty ``str``.
        RuntimeError: no event loop runs here.
    """
    if not isinstance(target, (RpcServer, RpcPool)):
        raise LocalProtocolError(f"metrics.register() takes an RpcServer or an RpcPool, not "
                                 f"{target!r:.80}")
    if name is None:
        name = type(target.service).__name__ if isinstance(target, RpcServer) else "pool"
    if not isinstance(name, str) or not name:
        raise LocalProtocolError(f"a metrics name is a non-empty str, not {name!r:.80}")
    collector = RpcCollector(target, name, asyncio.get_running_loop())
    (REGISTRY if registry is None else registry).register(collector)
    return collector


class MetricsEndpoint:
    """The HTTP endpoint of :func:`start_http_server`: ``port`` (the one bound, for port 0)
    and :meth:`close`."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host: str = httpd.server_address[0]
        self.port: int = httpd.server_address[1]

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (blocks until its thread stopped, at most a few seconds). Idempotent."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


def start_http_server(port: int = 0, addr: str = "127.0.0.1", *,
                      registry: CollectorRegistry | None = None) -> MetricsEndpoint:
    """Serve ``registry`` (the default ``REGISTRY`` if None) at ``http://addr:port/metrics``
    from a thread (prometheus-client's own server); ``port`` 0 picks a free one. ``addr``
    is loopback unless told otherwise: exposing metrics is a choice.

    Raises:
        OSError: the address cannot be bound.
    """
    httpd, thread = _start_http_server(port, addr=addr,
                                       registry=REGISTRY if registry is None else registry)
    return MetricsEndpoint(httpd, thread)
