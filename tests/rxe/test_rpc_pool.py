"""A pool over three replicas over rxe (aiordma.rpc.connect_pool), each replica its own process
(``python -m aiordma.cli.demo_micro replica``: the demo's order service, which journals the
request id of every call it runs), running the test's loop, on both loops:

* one of three replicas SIGKILLed mid-load (the demo's scenario, asserted): no idempotent call
  is lost, no non-idempotent call runs twice (counted on the servers: each replica's journal,
  read back by a call after, its killed life included), every order either completed and ran
  exactly once or failed typed (UnknownOutcomeError); the replica is ejected within the
  peer-death bound (2 s, as the fault catalogue's) and, restarted on its port, connected again
  and given calls. As the demo has it, one replica takes TCP only (it answers calls, over
  TCP; the two others over RDMA), every replica requires a token that the pool's interceptor
  adds (a call without it is refused, typed, and runs nowhere), and the pool's metrics are
  scraped over HTTP and parsed (its counters, as its stats say);
* a replica that hangs (SIGSTOP: its connection lives on, nothing answers) is ejected by its
  health check within interval + timeout (+ 2 s), its idempotent calls go elsewhere, nothing
  runs twice; resumed (SIGCONT), it is connected again.

The two timed promises (2 s, and interval + timeout + 2 s) are asserted with the load factor
they allow: the 2 s and the health timeout x (1 + load average / CPUs) (tests/bounds.py).

The same logic without a device, in detail: tests/unit/test_rpc_pool_over_memory.py."""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aiordma.cli.demo_metrics import METRICS_NAME
from aiordma.cli.demo_micro import (
    REFUSED_ID,
    TCP_REPLICA,
    Outcome,
    _run,
    answered,
    replicas,
)
from aiordma.rpc import RemoteError, UnknownOutcomeError, connect_pool
from aiordma.rpc import connect as rpc_connect

from ..bounds import PROMPT, STEP, hang_guard, scaled
from . import warm
from .peers import in_thread

# PROMPT (tests/bounds.py): s from a SIGKILL to the ejection, the catalogue's peer-death bound.
# These two promises are asserted with the load factor they allow (tests/bounds.py): their
# seconds x (1 + the machine's load / CPUs), so 2 s on an idle machine, 4 s at one runnable
# job per CPU.


def loop_name(request: pytest.FixtureRequest) -> str:
    return "uvloop" if "uvloop" in request.node.callspec.id else "asyncio"


async def test_the_demo_one_of_three_replicas_killed_mid_load(
        rdma_device: Any, request: pytest.FixtureRequest) -> None:
    loop = loop_name(request)
    ops = 360
    token = "demo-token"
    with tempfile.TemporaryDirectory(prefix="aiordma-pool-") as d:
        async with in_thread(replicas(3, loop, d, popen=warm.popen,
                                      transports={TCP_REPLICA: "tcp"},
                                      token=token, timeout=hang_guard())) as procs:
            out: Outcome = await asyncio.wait_for(
                _run(procs, loop_name=loop, ops=ops, workers=24, work=0.05, victim=1,
                     quiet=True, token=token, metrics=True), hang_guard(STEP * 6))
            addresses = [p.address for p in procs]
    s = out.stats
    by_address = {r.address: r for r in s.replicas}
    transports = [by_address[a].transport for a in addresses]
    answers = [answered(by_address[a]) for a in addresses]
    print(f"{loop}: {out.outcomes}; ejected {out.ejected_after * 1000:.0f} ms after the kill, "
          f"back {out.back_after * 1000:.0f} ms after the restart, then {out.calls_after_restart} "
          f"calls; retries {s.retries}, unknown {s.unknown_outcomes}, connect failures "
          f"{s.connect_failures}; {out.elapsed:.1f} s; transports {transports}, answered "
          f"{answers}; without the token: {out.refused!r}")
    # the TCP replica answered calls, over TCP, beside two over RDMA
    assert transports == ["rdma", "rdma", "tcp"] and TCP_REPLICA == 2
    assert all(n > 0 for n in answers)
    # the call without the token: refused before its method ran, typed
    assert isinstance(out.refused, RemoteError) and out.refused.type_name == "PermissionError"
    assert out.refused_at == addresses[TCP_REPLICA] and out.ran[REFUSED_ID] == 0
    # the scrape: the pool's counters, parsed, as its stats say
    assert out.metrics is not None and out.metrics_url.startswith("http://127.0.0.1:")
    samples = {(m.name, sample.labels.get("replica")): sample.value
               for m in text_string_to_metric_families(out.metrics) for sample in m.samples
               if sample.labels.get("pool") == METRICS_NAME}
    assert samples[("aiordma_rpc_pool_calls", None)] == s.calls == ops
    assert samples[("aiordma_rpc_pool_ejections", None)] == s.ejections
    assert samples[("aiordma_rpc_pool_reconnects", None)] == s.reconnects
    assert [samples[("aiordma_rpc_pool_replica_calls", a)] for a in addresses] == [
        by_address[a].calls for a in addresses]
    assert out.outcomes["price"] == {"ok": ops // 2}  # no idempotent call lost
    orders = out.outcomes["order"]
    assert set(orders) <= {"ok", "UnknownOutcomeError"}
    assert sum(orders.values()) == ops // 2
    order_runs = {rid: n for rid, n in out.ran.items() if rid.startswith("order-")}
    assert max(order_runs.values()) == 1  # none ran twice (the journals, all lives)
    assert all(out.ran[rid] == 1 for rid in out.ok_orders)  # completed: ran exactly once
    assert all(out.ran[f"price-{i}"] >= 1 for i in range(0, ops, 2))
    allowed = scaled(PROMPT)
    assert out.ejected_after <= allowed.seconds, (  # catalogue
        f"{out.ejected_after:.2f} s > {allowed.describe()}")
    assert (s.ejections, s.reconnects) == (1, 1)
    assert out.calls_after_restart > 0  # back in the rotation
    assert s.retries + s.unknown_outcomes >= 1  # calls were in flight on it when it died
    assert out.problems == []


async def test_a_hung_replica_is_ejected_by_its_health_check(rdma_device: Any,
                                                             request: pytest.FixtureRequest
                                                             ) -> None:
    loop = loop_name(request)
    # the health check's timeout is the budget of a healthy replica (x the load factor: at
    # 2.0 s, healthy ones were ejected on a machine at load 13-21)
    interval, timeout = 0.5, scaled(2.0).seconds
    with tempfile.TemporaryDirectory(prefix="aiordma-pool-") as d:
        async with in_thread(replicas(3, loop, d, popen=warm.popen, timeout=hang_guard())) as procs:
            hung = procs[2]
            # by name: "localhost" resolves to the replicas' 127.0.0.1
            pool = await connect_pool([f"localhost:{p.port}" for p in procs], timeout=STEP,
                                      health_interval=interval, health_timeout=timeout,
                                      connect_timeout=10.0, reconnect_cap=1.0)
            got: dict[str, str] = {}
            try:
                async def call(kind: str, i: int) -> None:
                    rid = f"{kind}-{i}"
                    try:
                        await pool.call(kind, rid, "x", 0.05, timeout=STEP)
                        got[rid] = "ok"
                    except UnknownOutcomeError:
                        got[rid] = "UnknownOutcomeError"

                await asyncio.wait_for(asyncio.gather(*(call(k, i) for i in range(12)
                                                        for k in ("price", "order"))), STEP)
                address = f"127.0.0.1:{hung.port}"

                def hung_stats() -> Any:
                    return next(r for r in pool.stats().replicas if r.address == address)

                assert hung_stats().calls > 0
                assert hung.proc is not None
                hung.proc.send_signal(signal.SIGSTOP)
                t0 = time.monotonic()
                calls = asyncio.gather(*(call(k, i) for i in range(12, 24)
                                         for k in ("price", "order")))
                while hung_stats().state == "UP":
                    assert time.monotonic() - t0 < STEP, "never ejected"
                    await asyncio.sleep(0.01)
                took = time.monotonic() - t0
                await asyncio.wait_for(calls, STEP)
                hung.proc.send_signal(signal.SIGCONT)
                t1 = time.monotonic()
                while pool.stats().reconnects < 1:
                    assert time.monotonic() - t1 < STEP, "never back"
                    await asyncio.sleep(0.01)
                back = time.monotonic() - t1
                stats, last_error = pool.stats(), hung_stats().last_error
            finally:
                await asyncio.wait_for(pool.aclose(), STEP)
            ran: dict[str, int] = {}
            for p in procs:  # read back by a call
                async with await rpc_connect("127.0.0.1", p.port, timeout=STEP) as client:
                    for rid, n in (await client.call("journal", timeout=STEP)).items():
                        ran[rid] = ran.get(rid, 0) + n
    print(f"{loop}: ejected {took * 1000:.0f} ms after SIGSTOP ({last_error}),"
          f" back {back * 1000:.0f} ms after SIGCONT; {stats.retries} retries, "
          f"{stats.unknown_outcomes} unknown outcomes")
    allowed = scaled(PROMPT)  # the promise's spare, x the load factor
    assert took <= interval + timeout + allowed.seconds, (
        f"{took:.2f} s > {interval} + {timeout:.2f} + {allowed.describe()}")  # catalogue
    assert all(got[f"price-{i}"] == "ok" for i in range(24))
    assert stats.ejections == 1 and stats.reconnects == 1
    assert "health check" in (last_error or "")
    assert all(n == 1 for rid, n in ran.items() if rid.startswith("order-")
               and got[rid] == "ok")
    assert max(n for rid, n in ran.items() if rid.startswith("order-")) == 1


def journal(procs: list[Any]) -> dict[str, int]:
    """Request id -> times run, over the replicas' journal files (all their lives)."""
    ran: dict[str, int] = {}
    for p in procs:
        with open(p.journal) as f:
            for line in f:
                if line.strip():
                    rid = line.split()[1]
                    ran[rid] = ran.get(rid, 0) + 1
    return ran


async def until(cond: Any, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < STEP, f"never: {what}"
        await asyncio.sleep(0.01)


async def test_the_pool_is_as_capable_as_a_client(rdma_device: Any,
                                                 request: pytest.FixtureRequest) -> None:
    """Three replica processes behind a pool with a token interceptor: metadata both ways,
    keyed calls on their rendezvous replica, a stream and a client stream on one replica
    each; then an idempotent stream whose replica is SIGKILLed before its first item starts
    again on another (the interceptor sees the second attempt there), and a bulk order whose
    replica is SIGKILLed mid-stream fails UnknownOutcomeError, run at most once (the
    journals)."""
    from aiordma.protocols.rpc_pool import affinity_key, rendezvous

    loop = loop_name(request)
    seen: list[tuple[str, str | None, int]] = []

    async def token(call: Any, proceed: Any) -> Any:
        seen.append((call.method, call.replica, call.attempt))
        call.metadata["token"] = "s3cret"
        return await proceed()

    with tempfile.TemporaryDirectory(prefix="aiordma-pool-") as d:
        async with in_thread(replicas(3, loop, d, popen=warm.popen, timeout=hang_guard())) as procs:
            names = [p.address for p in procs]
            address = {p.name: p.address for p in procs}  # (a replica answers with its name)
            pool = await connect_pool(names, timeout=STEP, health_interval=0.5,
                                      health_timeout=5.0, connect_timeout=10.0,
                                      reconnect_cap=1.0, interceptors=[token])
            try:
                result, md = await pool.call_with_metadata("whoami", metadata={"tenant": "a"},
                                                           timeout=STEP)
                assert result["metadata"] == {"tenant": "a", "token": "s3cret"}
                assert md == {"replica": result["replica"]}
                for k in range(12):
                    key = f"user-{k}"
                    home = names[rendezvous(affinity_key(key), names)]  # type: ignore[index]
                    for j in range(2):
                        got = await pool.call("price", f"{key}-{j}", "x", key=key,
                                              timeout=STEP)
                        assert address[got["replica"]] == home
                items = [f"i{i}" for i in range(50)]
                async with pool.stream("quotes", "q-all", items, timeout=STEP) as s:
                    got = [x async for x in s]
                assert [g["item"] for g in got] == items
                assert {address[g["replica"]] for g in got} == {s.replica}
                async with pool.stream_call("bulk_order", "b-ok", timeout=STEP) as call:
                    for i in range(20):
                        await call.send(f"line-{i}")
                    await call.send_eof()
                    assert (await call.result())["lines"] == 20
                # an idempotent stream, its replica killed before the first item
                s = pool.stream("quotes", "q-moved", ["a", "b"], 3.0, timeout=STEP)
                async with s:
                    await until(lambda: "q-moved" in journal(procs), "the stream running")
                    first = s.replica
                    victim = procs[names.index(first or "")]
                    victim.kill()
                    got = [x async for x in s]
                assert [g["item"] for g in got] == ["a", "b"]
                assert s.replica != first
                assert {address[g["replica"]] for g in got} == {s.replica}
                assert [(r, a) for m, r, a in seen if m == "quotes"][-2:] == [
                    (first, 1), (s.replica, 2)]
                # a bulk order, its replica killed mid-stream
                call = pool.stream_call("bulk_order", "b-lost", timeout=STEP)
                async with call:
                    await call.send("line-0")
                    await until(lambda: "b-lost" in journal(procs), "the order running")
                    procs[names.index(call.replica or "")].kill()
                    with pytest.raises(UnknownOutcomeError):
                        await call.result()
                stats = pool.stats()
            finally:
                await asyncio.wait_for(pool.aclose(), STEP)
            ran = journal(procs)
    print(f"{loop}: {stats.calls} calls and streams, {stats.retries} retries, "
          f"{stats.unknown_outcomes} unknown outcomes, {stats.ejections} ejections")
    assert ran["b-ok"] == 1 and ran["b-lost"] == 1 and ran["q-moved"] == 2
    assert stats.retries >= 1 and stats.unknown_outcomes == 1 and stats.ejections == 2
