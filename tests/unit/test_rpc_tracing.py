"""aiordma.rpc.tracing (the ``aiordma[otel]`` extra), device-free, with the OpenTelemetry SDK's
in-memory exporter: a call that crosses two services (a front service whose method calls a
back service) is one trace, each span the child of the one before; errors are recorded on
every span they cross; through a pool, each attempt is a span of its own, on its replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from aiordma.rpc import RemoteError, RpcClient, RpcServer, Service, method, tracing
from aiordma.testing import channel_pair

from ..bounds import STEP
from .memory_cluster import MemoryCluster
from .test_rpc_pool_over_memory import pooled, wait_until


class Back(Service):
    @method
    async def price(self, item: str) -> int:
        return 100 + len(item)

    @method
    async def fail(self) -> None:
        raise ValueError("out of stock")


class Front(Service):
    def __init__(self, back: RpcClient) -> None:
        self.back = back

    @method
    async def checkout(self, item: str) -> int:
        return int(await self.back.price(item)) + 1

    @method
    async def broken(self) -> None:
        await self.back.fail()


class Traced:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.client = tracing.client_interceptor(tracer_provider=self.provider)
        self.server = tracing.server_interceptor(tracer_provider=self.provider)

    def spans(self) -> dict[tuple[str, SpanKind], ReadableSpan]:
        got = self.exporter.get_finished_spans()
        by = {(s.name, s.kind): s for s in got}
        assert len(by) == len(got), [(s.name, s.kind) for s in got]
        self.exporter.clear()
        return by


async def serve(service: Service, traced: Traced) -> AsyncIterator[RpcClient]:
    server = RpcServer(service, max_in_flight=8, grace=1.0, interceptors=[traced.server])
    a, b = channel_pair()
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, max_in_flight=8, interceptors=[traced.client])
    try:
        yield client
    finally:
        client.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.gather(serving, return_exceptions=True)


def child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    return (span.parent is not None and span.parent.span_id == parent.context.span_id
            and span.context.trace_id == parent.context.trace_id)


async def test_a_call_across_two_services_is_one_trace_and_errors_are_recorded() -> None:
    traced = Traced()
    back_serving = serve(Back(), traced)
    back = await anext(back_serving)
    front_serving = serve(Front(back), traced)
    front = await anext(front_serving)
    try:
        assert await asyncio.wait_for(front.checkout("apple"), STEP) == 106
        s = traced.spans()
        assert set(s) == {("checkout", SpanKind.CLIENT), ("checkout", SpanKind.SERVER),
                          ("price", SpanKind.CLIENT), ("price", SpanKind.SERVER)}
        cf, sf = s[("checkout", SpanKind.CLIENT)], s[("checkout", SpanKind.SERVER)]
        cb, sb = s[("price", SpanKind.CLIENT)], s[("price", SpanKind.SERVER)]
        assert cf.parent is None
        assert child_of(sf, cf) and child_of(cb, sf) and child_of(sb, cb)
        assert sf.parent is not None and sf.parent.is_remote  # (it came in the metadata)
        assert len({x.context.trace_id for x in s.values()}) == 1
        assert all(x.status.status_code is StatusCode.UNSET for x in s.values())
        assert sb.attributes == {"rpc.system": "aiordma", "rpc.method": "price"}

        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(front.broken(), STEP)
        assert info.value.type_name == "RemoteError"  # (the front's own call failed)
        s = traced.spans()
        sb, cb = s[("fail", SpanKind.SERVER)], s[("fail", SpanKind.CLIENT)]
        sf, cf = s[("broken", SpanKind.SERVER)], s[("broken", SpanKind.CLIENT)]
        assert child_of(sf, cf) and child_of(cb, sf) and child_of(sb, cb)
        for span in (sb, cb, sf, cf):
            assert span.status.status_code is StatusCode.ERROR
            (event,) = [e for e in span.events if e.name == "exception"]
            assert event.attributes is not None
        assert [e.attributes["exception.type"] for e in sb.events] == ["ValueError"]  # type: ignore[index]
        assert "out of stock" in (sb.status.description or "")
        assert cb.attributes["rpc.aiordma.error_type"] == "ValueError"  # type: ignore[index]
        assert cf.attributes["rpc.aiordma.error_type"] == "RemoteError"  # type: ignore[index]
    finally:
        await front_serving.aclose()
        await back_serving.aclose()


async def test_through_a_pool_each_attempt_is_a_span_on_its_replica() -> None:
    """A traced pool over traced replicas: a call is a client span naming its replica and
    attempt, with the server span its child; an idempotent call whose replica dies has two
    client spans (attempts 1 and 2, different replicas) under the caller's span; the health
    checks are not traced."""
    traced = Traced()
    tracer = traced.provider.get_tracer("test")
    cluster = MemoryCluster(3, interceptors=[traced.server])
    async with pooled(cluster=cluster, interceptors=[traced.client]) as (pool, _):
        await asyncio.wait_for(pool.price("p0", "x"), STEP)
        s = traced.spans()
        c, sv = s[("price", SpanKind.CLIENT)], s[("price", SpanKind.SERVER)]
        assert child_of(sv, c)
        attrs: Any = c.attributes
        assert attrs["rpc.aiordma.attempt"] == 1
        assert f"{attrs['server.address']}:{attrs['server.port']}" in cluster.addresses

        with tracer.start_as_current_span("caller") as caller:
            call = asyncio.ensure_future(pool.price("p1", "x", 0.3))
            await wait_until(lambda: "p1" in cluster.ran(), "the call running")
            first = next(r for r in cluster.replicas if "p1" in r.service.ran)
            cluster.kill(cluster.replicas.index(first))
            await asyncio.wait_for(call, STEP)
        got = traced.exporter.get_finished_spans()
        clients = [x for x in got if x.kind is SpanKind.CLIENT]
        assert [x.attributes["rpc.aiordma.attempt"] for x in clients] == [1, 2]  # type: ignore[index]
        assert all(child_of(x, caller) for x in clients)  # type: ignore[arg-type]
        where = [f"{x.attributes['server.address']}:{x.attributes['server.port']}"  # type: ignore[index]
                 for x in clients]
        assert where[0] == first.name and where[1] != first.name
        assert clients[0].status.status_code is StatusCode.ERROR  # (its connection broke)
        assert clients[1].status.status_code is StatusCode.UNSET
        assert not [x for x in got if x.name.startswith("aiordma.")]
