"""aiordma.rpc.metrics (the ``aiordma[metrics]`` extra), device-free: a server over the
in-memory pair and a pool over in-memory replicas are registered, their endpoint is scraped
over HTTP by a real client (urllib, from another thread, as Prometheus would), and the text is
read back with prometheus-client's own parser. The numbers are the calls the test made. Also:
aiordma imports without the extras, and the modules that need them say which extra."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aiordma import LocalProtocolError
from aiordma.cli.demo_micro import Orders
from aiordma.rpc import RemoteError, RpcClient, RpcServer, metrics
from aiordma.testing import channel_pair

from ..bounds import STEP
from .test_rpc_pool_over_memory import pooled


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=STEP) as answer:  # (http://127.0.0.1)
        assert answer.status == 200
        return str(answer.read().decode())


class Samples:
    """A scrape's samples: ``value(name, **labels)``."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, found)
        return float(found[0])

    def total(self, name: str, **labels: str) -> float:
        return sum(float(s.value) for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        return sorted((float(s.labels["le"]), float(s.value)) for s in self.samples
                      if s.name == name + "_bucket"
                      and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_a_scrape_has_the_servers_and_the_pools_counters_and_latencies() -> None:
    registry = CollectorRegistry()
    server = RpcServer(Orders("front"), max_in_flight=16, grace=1.0)
    a, b = channel_pair()
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, max_in_flight=8)
    try:
        await asyncio.wait_for(client.price("before", "x"), STEP)  # (in no histogram)
        metrics.register(server, name="front", registry=registry)
        for i in range(5):
            await asyncio.wait_for(client.price(f"p{i}", "x"), STEP)
        with pytest.raises(RemoteError):
            await asyncio.wait_for(client.price(), STEP)  # a TypeError: an error answer
        async with pooled() as (pool, _cluster):
            metrics.register(pool, name="orders", registry=registry)
            for i in range(7):
                await asyncio.wait_for(pool.price(f"q{i}", "x", key=f"user-{i % 2}"), STEP)
            endpoint = metrics.start_http_server(0, registry=registry)
            try:
                assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
                got = Samples(await asyncio.to_thread(scrape, endpoint.url))
            finally:
                endpoint.close()
            # (collected on the loop's own thread too: no hop)
            assert b"aiordma_rpc_pool_calls_total" in generate_latest(registry)
    finally:
        client.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.gather(serving, return_exceptions=True)

    s = {"server": "front", "method": "price"}
    assert got.value("aiordma_rpc_server_calls_total", **s) == 7
    assert got.value("aiordma_rpc_server_answered_total", outcome="ok", **s) == 6
    assert got.value("aiordma_rpc_server_answered_total", outcome="error", **s) == 1
    assert got.value("aiordma_rpc_server_answered_total", outcome="refused", **s) == 0
    assert got.value("aiordma_rpc_server_in_flight", **s) == 0
    assert got.value("aiordma_rpc_server_connections", server="front") == 1
    assert got.value("aiordma_rpc_server_draining", server="front") == 0
    # the histogram: the 6 answers since register(), cumulative buckets up to +Inf
    assert got.families["aiordma_rpc_server_latency_seconds"].type == "histogram"
    assert got.value("aiordma_rpc_server_latency_seconds_count", **s) == 6
    buckets = got.buckets("aiordma_rpc_server_latency_seconds", **s)
    assert buckets[-1] == (float("inf"), 6)
    assert all(x[1] <= y[1] for x, y in itertools.pairwise(buckets))
    assert 0 < got.value("aiordma_rpc_server_latency_seconds_sum", **s) < STEP
    assert got.value("aiordma_rpc_server_latency_seconds_count", server="front",
                     method="order") == 0  # (every method of the service is there)

    p = {"pool": "orders"}
    assert got.value("aiordma_rpc_pool_calls_total", **p) == 7
    for counter in ("retries", "unknown_outcomes", "ejections", "no_replica"):
        assert got.value(f"aiordma_rpc_pool_{counter}_total", **p) == 0
    assert got.value("aiordma_rpc_pool_resolves_total", **p) == 1
    assert got.value("aiordma_rpc_pool_call_latency_seconds_count", method="price", **p) == 7
    assert got.buckets("aiordma_rpc_pool_call_latency_seconds", method="price", **p)[-1] == (
        float("inf"), 7)
    assert got.total("aiordma_rpc_pool_replica_up", **p) == 3
    assert got.total("aiordma_rpc_pool_replica_state", state="UP", **p) == 3
    assert got.total("aiordma_rpc_pool_replica_state", state="EJECTED", **p) == 0
    assert got.total("aiordma_rpc_pool_replica_calls_total", **p) == 7  # (2 keys: 2 replicas)
    assert got.value("aiordma_rpc_pool_replica_outstanding", replica="10.0.0.1:7000", **p) == 0


async def test_register_checks_its_arguments() -> None:
    registry = CollectorRegistry()
    for bad in (None, "server", RpcClient):
        with pytest.raises(LocalProtocolError):
            metrics.register(bad, registry=registry)  # type: ignore[arg-type]
    server = RpcServer(Orders("x"), max_in_flight=4, grace=1.0)
    with pytest.raises(LocalProtocolError):
        metrics.register(server, name="", registry=registry)
    collector = metrics.register(server, registry=registry)
    assert collector.name == "Orders"
    registry.unregister(collector)
    assert b"aiordma_rpc_server" not in generate_latest(registry)
    await server.aclose()


def run_python(code: str) -> Any:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=STEP, check=False)


def test_aiordma_imports_without_the_extras_and_names_them_when_needed() -> None:
    block = ("import sys\n"
             "for m in ('prometheus_client', 'opentelemetry'):\n"
             "    sys.modules[m] = None\n")
    ok = run_python(block + "import aiordma, aiordma.rpc\n"
                    "from aiordma.rpc import connect_pool, serve\nprint('imported')")
    assert ok.returncode == 0 and ok.stdout.strip() == "imported", ok.stderr
    for module, extra in (("aiordma.rpc.metrics", "aiordma[metrics]"),
                          ("aiordma.rpc.tracing", "aiordma[otel]")):
        got = run_python(block + f"import {module}")
        assert got.returncode != 0
        last = got.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError:") and extra in last, got.stderr
