"""``aiordma demo microservices`` without a device: its three replica processes over TCP (on a
host with no RDMA device, ``auto`` is TCP; the one told ``tcp`` takes nothing else), the token
interceptors, the refused call, the metrics scrape, and the demo going on without the
``aiordma[metrics]`` extra. The same run over rxe, two replicas over RDMA:
tests/rxe/test_rpc_pool.py (``-k demo``)."""

from __future__ import annotations

import re
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aiordma.cli.demo_metrics import METRICS_NAME, excerpt
from aiordma.cli.demo_micro import REFUSED_ID, TCP_REPLICA, answered, run_micro_demo, scenario
from aiordma.rpc import RemoteError


def test_the_demo_over_tcp_refuses_a_call_without_the_token_and_is_scraped() -> None:
    ops = 60
    out = scenario(loop="asyncio", ops=ops, workers=6)
    assert out.problems == []
    s = out.stats
    tcp_only = [r for r in s.replicas if out.transports[r.address] == "tcp"]
    assert len(tcp_only) == 1 and tcp_only[0].transport == "tcp"
    assert all(answered(r) > 0 for r in s.replicas)
    assert sum(answered(r) for r in s.replicas) >= ops - s.unknown_outcomes
    assert isinstance(out.refused, RemoteError)
    assert out.refused.type_name == "PermissionError"
    assert out.refused_at == tcp_only[0].address
    assert out.ran[REFUSED_ID] == 0  # refused before its method ran
    assert out.metrics is not None
    samples = {(m.name, sample.labels.get("replica")): sample.value
               for m in text_string_to_metric_families(out.metrics) for sample in m.samples
               if sample.labels.get("pool") == METRICS_NAME}
    assert samples[("aiordma_rpc_pool_calls", None)] == s.calls == ops
    assert samples[("aiordma_rpc_pool_ejections", None)] == s.ejections == 1
    for r in s.replicas:
        assert samples[("aiordma_rpc_pool_replica_calls", r.address)] == r.calls
    shown = excerpt(out.metrics)
    assert f'aiordma_rpc_pool_calls_total{{pool="{METRICS_NAME}"}} {float(ops)}' in shown
    assert all(not line.startswith("#") for line in shown)


def test_without_the_metrics_extra_the_demo_says_so_and_goes_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import aiordma.rpc

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "aiordma.rpc.metrics", raising=False)
    monkeypatch.delattr(aiordma.rpc, "metrics", raising=False)
    assert run_micro_demo(ops=30, workers=4, loop="asyncio") == 0
    printed = capsys.readouterr().out
    assert "metrics: not shown (aiordma.rpc.metrics needs prometheus-client: install the " \
           "extra, pip install 'aiordma[metrics]'); the demo goes on without them" in printed
    assert f"r{TCP_REPLICA} taking TCP only" in printed
    assert "refused, RemoteError: PermissionError: order(): the call carries no valid " \
           "'token' in its metadata; ran: 0 times" in printed
    # (no device here: all three over TCP)
    assert re.search(r"carried: tcp \d+ calls answered by 3 replicas\n", printed), printed
    assert "every promise kept" in printed
