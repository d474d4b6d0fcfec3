"""RPC over aiordma endpoints: services of ``async`` methods, called like local coroutines.

.. code-block:: python

    from aiordma.rpc import Service, method, serve, connect

    class Calc(Service):
        @method
        async def add(self, a: int, b: int) -> int:
            return a + b

    async with await serve(Calc(), host, port) as server:
        async with await connect(host, port) as client:
            assert await client.call("add", 1, 2) == 3
            assert await client.add(1, 2) == 3          # the same, through the proxy

The wire protocol is :mod:`aiordma.protocols.rpc` (sans-I/O): the frames one side produces in a
loop tick travel as one message (a batch), large ``bytes``, ``memoryview`` and numpy values as
out-of-band messages, which the endpoint moves by rendezvous (RDMA READ, no copy) when they
exceed its eager size. Many calls share a connection; a call of an ``async def`` method runs
in its own task on the server, at most the server's ``max_in_flight`` at once per connection
(more are queued there), and a call of a plain ``def`` method runs inline, as its request is
read, with no task (see :func:`method`); a client has at most its own ``max_in_flight``
outstanding (callers beyond wait for a free place: backpressure). A call's ``timeout`` bounds the whole call and
travels as its deadline: when it expires the client raises :class:`~aiordma.OperationTimeout`
and sends a cancel, which cancels the server's task.
An exception in a method reaches the caller as :class:`RemoteError` with the remote type name
and message.

A service running as several replicas is called through :func:`connect_pool`: per-call
balancing (or by key: rendezvous hashing), health checks, ejection and reconnection, retries
of the methods declared ``@method(idempotent=True)``; metadata, interceptors and streams as on
a client. Prometheus metrics and OpenTelemetry tracing are :mod:`aiordma.rpc.metrics` and
:mod:`aiordma.rpc.tracing` (extras: ``aiordma[metrics]``, ``aiordma[otel]``).

Calls and answers carry metadata (``call(..., metadata={...})``, :func:`current_call` in a
method, :meth:`RpcClient.call_with_metadata`); interceptors wrap calls on either side
(``serve(..., interceptors=[...])``, ``connect(..., interceptors=[...])``); a call a method
makes inherits what is left of its caller's deadline (:func:`ignore_caller_deadline` opts
out). A server drains (:meth:`RpcServer.drain`), limits a method's concurrency
(``@method(max_concurrency=N)``) and counts per method (:meth:`RpcServer.stats`, the built-in
``aiordma.stats`` method, ``aiordma stats HOST:PORT``).

The parts: :mod:`aiordma.rpc._service` (what a service is), :mod:`aiordma.rpc._server`,
:mod:`aiordma.rpc._client`, :mod:`aiordma.rpc._stream` (stream calls),
:mod:`aiordma.rpc._sender` (frames batched per loop tick), :mod:`aiordma.rpc._context` (what
methods and interceptors see of a call, deadline propagation), :mod:`aiordma.rpc._stats` (the
counters), :mod:`aiordma.rpc._builtins` (the built-in methods: stats, health),
:mod:`aiordma.rpc._pool`, :mod:`aiordma.rpc._pool_stream`, :mod:`aiordma.rpc._replica`,
:mod:`aiordma.rpc._replica_set` and :mod:`aiordma.rpc._resolve` (a client over replicas, its
streams, its replicas, where they are).
"""

from __future__ import annotations

import aiordma.rpc._service as _rpc_service
from aiordma.rpc._builtins import STATS
from aiordma.rpc._client import Answer, RpcClient, connect
from aiordma.rpc._context import CallContext, ClientCall, current_call, ignore_caller_deadline
from aiordma.rpc._pool import (
    NoReplicaError,
    PoolStats,
    ReplicaStats,
    RpcPool,
    UnknownOutcomeError,
    connect_pool,
)
from aiordma.rpc._pool_stream import PoolStreamCall
from aiordma.rpc._server import RpcServer, serve
from aiordma.rpc._service import (
    RemoteError,
    Service,
    Unavailable,
    current_endpoint,
    method,
)
from aiordma.rpc._stream import RpcStream, StreamCall

__all__ = [
    "Answer", "CallContext", "ClientCall", "NoReplicaError", "PoolStats", "PoolStreamCall",
    "RemoteError",
    "ReplicaStats", "RpcClient", "RpcPool", "RpcServer", "RpcStream", "Service", "StreamCall",
    "Unavailable", "UnknownOutcomeError", "connect", "connect_pool", "current_call",
    "current_endpoint", "ignore_caller_deadline", "method", "serve",
]

DEADLINE_EXPIRED = _rpc_service.DEADLINE_EXPIRED
MAX_CALLS = _rpc_service.MAX_CALLS
MAX_TIMEOUT = _rpc_service.MAX_TIMEOUT
UNAVAILABLE = _rpc_service.UNAVAILABLE
STATS_METHOD = STATS
"""The built-in method that answers a server's counters (``await client.call(STATS_METHOD)``)."""
