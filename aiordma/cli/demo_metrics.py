"""The metrics part of ``aiordma demo microservices``: the pool's counters exported with
:mod:`aiordma.rpc.metrics` (the ``aiordma[metrics]`` extra) on a free loopback port, scraped
once at the end by a real HTTP client (:mod:`urllib.request`), as Prometheus would.

The extra may be absent (``pip install aiordma`` without ``[metrics]``): then :func:`start`
says so and the demo goes on without this part; the rest of the demo does not need it.
"""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any

METRICS_NAME = "orders"
"""The ``pool`` label the demo's pool is exported under."""

SHOWN = ("aiordma_rpc_pool_calls_total", "aiordma_rpc_pool_retries_total",
         "aiordma_rpc_pool_unknown_outcomes_total", "aiordma_rpc_pool_ejections_total",
         "aiordma_rpc_pool_reconnects_total", "aiordma_rpc_pool_replica_calls_total")
"""The metrics whose lines the demo prints (of the scrape's many)."""


class PoolEndpoint:
    """A pool's metrics served over HTTP from their own registry (:meth:`start`), scraped by
    :meth:`scrape`, stopped by :meth:`close`."""

    def __init__(self, endpoint: Any, registry: Any) -> None:
        self.endpoint = endpoint
        self.registry = registry

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT/metrics``."""
        return str(self.endpoint.url)

    @classmethod
    def start(cls, pool: Any) -> PoolEndpoint | str:
        """Export ``pool`` (on this event loop) at a free loopback port; or, if the
        ``aiordma[metrics]`` extra is not installed, a sentence that says so (the demo prints
        it and goes on)."""
        try:
            from aiordma.rpc import metrics  # (its ImportError names the extra)
        except ImportError as exc:
            return f"metrics: not shown ({exc}); the demo goes on without them"
        from prometheus_client import CollectorRegistry  # (there: metrics imported it)

        registry = CollectorRegistry()  # (its own: nothing else of this process is exported)
        metrics.register(pool, name=METRICS_NAME, registry=registry)
        return cls(metrics.start_http_server(0, registry=registry), registry)

    async def scrape(self, timeout: float) -> str:
        """One ``GET /metrics`` (from a thread: the endpoint's collector takes its snapshot on
        this loop, which must stay free meanwhile); the text it answered.

        Raises:
            OSError: the request failed or took longer than ``timeout`` (urllib's errors are
                ``OSError`` subclasses).
        """
        def get() -> str:
            with urllib.request.urlopen(self.url, timeout=timeout) as answer:
                return str(answer.read().decode())

        return await asyncio.wait_for(asyncio.to_thread(get), timeout + 1.0)

    async def close(self) -> None:
        """Stop serving (its thread joined off this loop)."""
        await asyncio.to_thread(self.endpoint.close)


def excerpt(text: str, shown: tuple[str, ...] = SHOWN) -> list[str]:
    """The sample lines of ``text`` (Prometheus' text format) whose metric is one of
    ``shown``, in the scrape's order."""
    return [line for line in text.splitlines()
            if not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] in shown]


def print_scrape(url: str, text: str | None, note: str) -> None:
    """What the demo prints of its scrape of ``url`` (``text``; None if there was none, then
    ``note`` says why)."""
    if text is None:
        print(f"\n  {note or 'metrics: not scraped'}")
        return
    print(f"\n  GET {url} (urllib, once, at the end): {len(text)} bytes, "
          f"{len(text.splitlines())} lines; the pool's counters among them:")
    for line in excerpt(text):
        print(f"    {line}")
