"""OpenTelemetry tracing of RPC calls (the ``aiordma[otel]`` extra: ``pip install
'aiordma[otel]'``, which brings ``opentelemetry-api``; an SDK, or a distribution, is the
application's choice).

.. code-block:: python

    from aiordma.rpc import tracing

    server = await serve(Orders(), host, port,
                         interceptors=[tracing.server_interceptor()])
    pool = await connect_pool(replicas, interceptors=[tracing.client_interceptor()])

Two interceptors (see :mod:`aiordma.rpc._context`): the client's makes a ``CLIENT`` span per
call (through a pool, per *attempt*: a call sent again to another replica has one span per
replica, with ``rpc.aiordma.attempt`` and ``server.address``) and puts its context in the
call's metadata as W3C trace context (``traceparent``, ``tracestate``, and ``baggage``, with
the default propagators); the server's takes that context out of the metadata and makes the
``SERVER`` span of the call, its child, inside which the method runs: calls the method makes
(through a client with the client interceptor) are children of it. So a request that crosses
services is one trace. A span is named after the method; its attributes are
``rpc.system`` (``"aiordma"``) and ``rpc.method``. An exception is recorded on the span
(``record_exception``) and sets its status to ERROR; a :class:`~aiordma.rpc.RemoteError` also
sets ``rpc.aiordma.error_type`` (the remote exception's type name). A stream call's client
span covers its opening (the request going out); its server span, the whole stream.

Built-in methods (``aiordma.health``, which a pool calls every ``health_interval``, and
``aiordma.stats``) are not traced unless ``trace_builtins=True``.

Raises:
    ImportError: (on import) opentelemetry-api is not installed; the message names the extra.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

try:
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import Getter, TextMapPropagator
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider
except ImportError as exc:  # pragma: no cover  (tests/unit/test_rpc_metrics.py runs it)
    raise ImportError("aiordma.rpc.tracing needs opentelemetry-api: install the extra, "
                      "pip install 'aiordma[otel]'") from exc

from aiordma.rpc._builtins import PREFIX
from aiordma.rpc._context import (
    CallContext,
    ClientCall,
    ClientInterceptor,
    Proceed,
    ServerInterceptor,
)
from aiordma.rpc._service import RemoteError

__all__ = ["INSTRUMENTATION", "client_interceptor", "server_interceptor"]

INSTRUMENTATION = "aiordma.rpc"
"""The instrumentation scope's name (the tracer's)."""


class _MetadataGetter(Getter[Mapping[str, Any]]):
    """Reads a propagator's fields from call metadata (``bytes`` values as Latin-1 text)."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            return None
        return [value if isinstance(value, str) else bytes(value).decode("latin-1")]

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return list(carrier)


_GETTER = _MetadataGetter()


def _record(span: Span, exc: BaseException) -> None:
    """An exception ended the call: on its span, as an event and an ERROR status."""
    if isinstance(exc, asyncio.CancelledError):
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    if isinstance(exc, RemoteError):
        span.set_attribute("rpc.aiordma.error_type", exc.type_name)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:300]))


async def _in_span(tracer: Tracer, name: str, kind: SpanKind, attributes: dict[str, Any],
                   parent: Context | None, proceed: Proceed,
                   inject: Callable[[], None] | None = None) -> Any:
    """``proceed()`` inside a new current span (the child of ``parent``, or of the current
    span if None); ``inject()`` first, inside it (the client writes its context out). An
    exception is recorded on the span and raised."""
    with tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes,
                                      record_exception=False,
                                      set_status_on_exception=False) as span:
        if inject is not None:
            inject()
        try:
            return await proceed()
        except BaseException as exc:
            _record(span, exc)
            raise


def _attributes(method: str, stream: bool) -> dict[str, Any]:
    attributes: dict[str, Any] = {"rpc.system": "aiordma", "rpc.method": method}
    if stream:
        attributes["rpc.aiordma.stream"] = True
    return attributes


def client_interceptor(*, tracer_provider: TracerProvider | None = None,
                       propagator: TextMapPropagator | None = None,
                       trace_builtins: bool = False) -> ClientInterceptor:
    """A client interceptor (for :func:`~aiordma.rpc.connect` or
    :func:`~aiordma.rpc.connect_pool`) that makes a CLIENT span per call (per attempt through
    a pool) and carries its context in the call's metadata.

    Args:
        tracer_provider: where the spans go (the global one if None).
        propagator: how the context is written into the metadata (the global one if None:
            W3C trace context and baggage by default).
        trace_builtins: trace the built-in methods too (the pool's health checks).
    """
    tracer = trace.get_tracer(INSTRUMENTATION, tracer_provider=tracer_provider)

    async def tracing(call: ClientCall, proceed: Proceed) -> Any:
        if not trace_builtins and call.method.startswith(PREFIX):
            return await proceed()
        attributes = _attributes(call.method, call.stream)
        if call.replica is not None:
            host, _, port = call.replica.rpartition(":")
            attributes.update({"server.address": host, "server.port": int(port),
                               "rpc.aiordma.attempt": call.attempt})
        return await _in_span(tracer, call.method, SpanKind.CLIENT, attributes, None, proceed,
                              lambda: (propagator or propagate.get_global_textmap()).inject(
                                  call.metadata))

    return tracing


def server_interceptor(*, tracer_provider: TracerProvider | None = None,
                       propagator: TextMapPropagator | None = None,
                       trace_builtins: bool = False) -> ServerInterceptor:
    """A server interceptor (for :func:`~aiordma.rpc.serve`) that makes each call's SERVER
    span, the child of the context its metadata carries (a new trace if it carries none);
    the method runs inside it.

    Args:
        tracer_provider, propagator, trace_builtins: as :func:`client_interceptor`.
    """
    tracer = trace.get_tracer(INSTRUMENTATION, tracer_provider=tracer_provider)

    async def tracing(call: CallContext, proceed: Proceed) -> Any:
        if not trace_builtins and call.method.startswith(PREFIX):
            return await proceed()
        parent = (propagator or propagate.get_global_textmap()).extract(call.metadata,
                                                                        getter=_GETTER)
        return await _in_span(tracer, call.method, SpanKind.SERVER,
                              _attributes(call.method, call.stream), parent, proceed)

    return tracing
