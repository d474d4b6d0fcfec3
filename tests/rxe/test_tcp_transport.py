"""The TCP transport beside RDMA on a real device, servers in other processes, on both loops:

* ``transport="auto"`` picks RDMA between two processes that both have the device, and
  ``"tcp"`` forced to the same server works beside it: the server counts one of each;
* a client of ``auto`` at a server that takes TCP only (as a replica on a host without a
  device does) is refused RDMA and connects again over TCP; ``"rdma"`` forced there is
  refused typed;
* the key-value service: one server answers an RDMA client's GET with one READ (its CPU never
  sees it) and a TCP client's by RPC, with the same value;
* a mixed pool: two replicas over RDMA and one over TCP (its process takes TCP only), each
  replica's ``ReplicaStats.transport`` says which; the TCP replica SIGKILLed mid-load is
  ejected and restarted, no idempotent call is lost, no order runs twice (the demo's
  scenario, with the replicas' journals).

The same behaviour device-free: tests/unit/test_tcp_transport.py."""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import pytest

from aiordma import ConnectionRejectedError
from aiordma.cli.demo_micro import Outcome, _run, replicas
from aiordma.protocols.handshake import RejectCategory
from aiordma.rpc import STATS_METHOD
from aiordma.rpc import connect as rpc_connect
from aiordma.services import kv

from ..bounds import STEP, hang_guard
from . import warm
from .peers import in_thread, served_by_cli


def loop_name(request: pytest.FixtureRequest) -> str:
    return "uvloop" if "uvloop" in request.node.callspec.id else "asyncio"


async def test_auto_picks_rdma_and_tcp_forced_works_beside_it(rdma_device: Any) -> None:
    async with in_thread(served_by_cli("echo", "--transport", "auto")) as port, \
            await rpc_connect("127.0.0.1", port, timeout=STEP) as over_rdma, \
            await rpc_connect("127.0.0.1", port, timeout=STEP, transport="tcp") as over_tcp:
        assert (over_rdma.transport, over_tcp.transport) == ("rdma", "tcp")
        blob = bytes(range(256)) * 4096  # 1 MiB: out of band, by rendezvous over RDMA
        for client in (over_rdma, over_tcp):
            assert await client.echo(blob, timeout=STEP) == blob
        stats = await over_tcp.call(STATS_METHOD, timeout=STEP)
        assert stats["transports"] == {"rdma": 1, "tcp": 1}
        assert stats["methods"]["echo"]["calls"] == 2


async def test_auto_at_a_tcp_only_server_connects_again_over_tcp(rdma_device: Any) -> None:
    async with in_thread(served_by_cli("echo", "--transport", "tcp")) as port:
        async with await rpc_connect("127.0.0.1", port, timeout=STEP) as client:
            assert client.transport == "tcp"  # after a refused RDMA Hello
            assert await client.ping(timeout=STEP) == "pong"
        with pytest.raises(ConnectionRejectedError) as info:
            await rpc_connect("127.0.0.1", port, timeout=STEP, transport="rdma")
        assert info.value.category == RejectCategory.TRANSPORT


async def test_one_kv_server_answers_a_read_over_rdma_and_rpc_over_tcp(rdma_device: Any) -> None:
    async with in_thread(served_by_cli("kv")) as port, \
            await kv.connect("127.0.0.1", port, timeout=STEP) as over_rdma, \
            await kv.connect("127.0.0.1", port, timeout=STEP, transport="tcp") as over_tcp:
        assert (over_rdma.rpc.transport, over_tcp.rpc.transport) == ("rdma", "tcp")
        await over_tcp.put(b"key", b"value over tcp", timeout=STEP)
        for client in (over_rdma, over_tcp):
            assert await client.get(b"key", timeout=STEP) == b"value over tcp"
        assert over_rdma.counters["one_sided_hit"] == 1
        assert over_tcp.counters["fallback_no_rdma"] == 1
        assert (await over_rdma.stats())["get"] == 1  # the READ never reached its CPU


async def test_a_mixed_pool_with_its_tcp_replica_killed_mid_load(
        rdma_device: Any, request: pytest.FixtureRequest) -> None:
    loop = loop_name(request)
    ops = 240
    with tempfile.TemporaryDirectory(prefix="aiordma-mixed-") as d:
        async with in_thread(replicas(3, loop, d, popen=warm.popen, transports={2: "tcp"},
                                      timeout=hang_guard())) as procs:
            out: Outcome = await asyncio.wait_for(
                _run(procs, loop_name=loop, ops=ops, workers=16, work=0.05, victim=2,
                     quiet=True), hang_guard(STEP * 6))
            by_address = {r.address: r for r in out.stats.replicas}
            transports = [by_address[p.address].transport for p in procs]
            calls = [by_address[p.address].calls for p in procs]
    s = out.stats
    print(f"{loop}: transports {transports}, calls {calls}; {out.outcomes}; ejected "
          f"{out.ejected_after * 1000:.0f} ms after the kill, back "
          f"{out.back_after * 1000:.0f} ms after the restart; retries {s.retries}, unknown "
          f"{s.unknown_outcomes}")
    assert transports == ["rdma", "rdma", "tcp"]  # the TCP replica is back, over TCP
    assert all(n > 0 for n in calls)
    assert out.outcomes["price"] == {"ok": ops // 2}  # no idempotent call lost
    assert max(n for rid, n in out.ran.items() if rid.startswith("order-")) == 1
    assert (s.ejections, s.reconnects) == (1, 1) and out.calls_after_restart > 0
    assert out.problems == []
