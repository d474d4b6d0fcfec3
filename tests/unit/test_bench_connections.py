"""Area (s)'s figures from one measurement (no device: the arithmetic and the words)."""

from __future__ import annotations

import pytest

from aiordma.bench.connections import ConnectionFigures, describe
from aiordma.bench.measure import UNITS


def test_figures_per_connection() -> None:
    f = ConnectionFigures(n=32, setup_s=2.0, rss_kib=32 * 1200, pin_kib=32 * 1088, echo_s=0.08,
                          objects={"qp": 32, "mr": 32}, left=0)
    v = f.values()
    assert v == {"setups_per_s": 16.0, "rss_kib_per_conn": 1200.0, "pin_kib_per_conn": 1088.0,
                 "echo_ms": pytest.approx(80.0), "server_qps": 32, "server_mrs": 32,
                 "left_after_close": 0, "rss_mib": 37.5, "mrs_per_conn": 1.0}
    assert set(v) <= set(UNITS)  # every figure has a unit in the table
    assert "32 QPs, 32 MRs; 0 left after close" in describe(f)


def test_pinned_memory_beyond_a_pool() -> None:
    """On pools the pinned growth includes the pool's slots once: beyond it, per connection."""
    f = ConnectionFigures(n=1000, setup_s=5.0, rss_kib=1000 * 129, pin_kib=82_000,
                          echo_s=0.4, objects={"qp": 1000, "mr": 33}, left=0, pool_kib=32_768)
    v = f.values()
    assert v["pin_beyond_pool_kib_per_conn"] == pytest.approx((82_000 - 32_768) / 1000)
    assert v["mrs_per_conn"] == pytest.approx(0.033)
    assert v["rss_mib"] == pytest.approx(129_000 / 1024)
    assert set(v) <= set(UNITS)


def test_figures_without_the_kernels_counts() -> None:
    f = ConnectionFigures(n=4, setup_s=1.0, rss_kib=400, pin_kib=0, echo_s=0.01, objects=None,
                          left=None)
    assert "server_mrs" not in f.values() and "left_after_close" not in f.values()
    assert describe(f).endswith("kernel counts unavailable")


def test_cpu_per_echo() -> None:
    f = ConnectionFigures(n=100, setup_s=1.0, rss_kib=0, pin_kib=0, echo_s=0.5, objects=None,
                          left=None, server_cpu_s=0.2, client_cpu_s=0.3, packets=450)
    v = f.values()
    assert v["echo_server_cpu_us"] == pytest.approx(2000.0)
    assert v["echo_client_cpu_us"] == pytest.approx(3000.0)
    assert set(v) <= set(UNITS)
    assert v["echo_packets"] == pytest.approx(4.5)
    assert "(CPU per echo: server 2000 us, client 3000 us, 4.5 packets)" in describe(f)


def test_cpu_per_setup() -> None:
    f = ConnectionFigures(n=10, setup_s=1.0, rss_kib=0, pin_kib=0, echo_s=0.5, objects=None,
                          left=None, setup_server_cpu_s=0.25, setup_client_cpu_s=0.5)
    v = f.values()
    assert v["setup_server_cpu_ms"] == pytest.approx(25.0)
    assert v["setup_client_cpu_ms"] == pytest.approx(50.0)
    assert set(v) <= set(UNITS)
    assert "(10.0/s) (CPU per set-up: server 25.0 ms, client 50.0 ms)" in describe(f)
