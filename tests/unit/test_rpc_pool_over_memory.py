"""The pool over replicas (aiordma.rpc.connect_pool), device-free: replicas of the demo's order
service over the in-memory channel pair (memory_cluster.py), and, with the ``over`` fixture,
over the TCP transport on loopback sockets. Balancing by least outstanding,
the place kept for health checks, ejection of a killed and of a hung replica, reconnection
with backoff, retries of idempotent calls within the budget and the attempts, never a
non-idempotent call sent twice (hypothesis over kill schedules), a server shutting down,
resolvers and DNS names, closing. Counts are read on the servers (each replica's service
counts the request ids it ran). Bounds are counts or hang guards, never rates."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma import ClosedResourceError, LocalProtocolError, OperationTimeout
from aiordma.cli.demo_micro import Orders
from aiordma.rpc import (
    NoReplicaError,
    RemoteError,
    RpcPool,
    RpcServer,
    Unavailable,
    UnknownOutcomeError,
    connect_pool,
    method,
)
from aiordma.rpc._builtins import HEALTH
from aiordma.testing import channel_pair

from ..bounds import STEP, load_factor
from .memory_cluster import MemoryCluster

FAST = {"health_interval": 0.05, "health_timeout": 0.3, "reconnect_base": 0.02,
        "reconnect_cap": 0.1, "wait_for_replica": 2.0, "seed": 7}
# A health check's timeout is how long a healthy replica has to answer: on a busy machine
# (load 17 on 2 CPUs) 0.3 s passed without the loop getting to it, and a healthy replica was
# ejected; and 0.2 s of waiting for a replica did not cover a restarted one's reconnection
# over TCP at load 9. So every health timeout and wait for a replica here is multiplied by
# the load factor (tests/bounds.py), and so is any time a test sets against them; the tests
# assert what happened, never how soon.


@contextlib.asynccontextmanager
async def pooled(n: int = 3, cluster: MemoryCluster | None = None, **options: Any
                 ) -> AsyncIterator[tuple[RpcPool, MemoryCluster]]:
    cluster = cluster or MemoryCluster(n)
    options = {**FAST, **options}
    options["health_timeout"] *= load_factor()
    options["wait_for_replica"] *= load_factor()  # (a replica restarted reconnects in it)
    pool = await connect_pool(cluster.addresses, connector=cluster.connect, timeout=STEP,
                              **options)
    try:
        yield pool, cluster
    finally:
        await asyncio.wait_for(pool.aclose(), STEP)
        await asyncio.wait_for(cluster.aclose(), STEP)


def replica(pool: RpcPool, i: int) -> Any:
    return pool.stats().replicas[i]


async def wait_until(cond: Any, what: str, timeout: float = STEP) -> float:
    """Poll ``cond()``; the seconds it took; AssertionError after ``timeout``."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not cond():
        if loop.time() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.002)
    return loop.time() - t0


async def outcome(aw: Any) -> str:
    """"ok", or the name of what it raised."""
    try:
        await aw
    except Exception as exc:  # noqa: BLE001  # the test counts what each call got
        return type(exc).__name__
    return "ok"


# -- the server's side: idempotent methods and the health method ----------------------------

def test_method_takes_idempotent_as_a_keyword_and_checks_it() -> None:
    from aiordma.rpc._service import _RPC_IDEMPOTENT

    async def read() -> None: ...
    async def write() -> None: ...

    assert getattr(method(idempotent=True)(read), _RPC_IDEMPOTENT) is True
    assert getattr(method(write), _RPC_IDEMPOTENT) is False
    assert getattr(method()(write), _RPC_IDEMPOTENT) is False
    for bad in (1, "yes", None):
        with pytest.raises(LocalProtocolError):
            method(idempotent=bad)
    with pytest.raises(LocalProtocolError):
        method(idempotent=True)("not a function")


async def test_every_server_answers_the_health_method_itself_inline() -> None:
    """The health answer names the idempotent methods; it is answered while the server runs
    its max_in_flight calls (inline: no admission), and a service cannot take its name."""

    class Busy(Orders):
        @method
        async def hold(self) -> None:
            await asyncio.Event().wait()

    a, b = channel_pair()
    server = RpcServer(Busy(), max_in_flight=2, grace=0.5)
    serving = asyncio.ensure_future(server.serve_connection(b))
    from aiordma.rpc import RpcClient

    client = RpcClient(a, max_in_flight=8)
    try:
        holds = [asyncio.ensure_future(client.hold()) for _ in range(4)]  # 2 run, 2 queued
        answer = await asyncio.wait_for(client.call(HEALTH), STEP)
        assert answer == {"status": "serving", "idempotent": [
            "bulk_quote", "journal", "price", "quotes", "whoami"]}
        for h in holds:
            h.cancel()
        with pytest.raises(RemoteError) as info:  # not a method of any service's
            await asyncio.wait_for(client.call("aiordma.nothing"), STEP)
        assert info.value.type_name == "AttributeError"
    finally:
        client.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.gather(serving, return_exceptions=True)


# -- balancing -------------------------------------------------------------------------------

@pytest.mark.usefixtures("over")
async def test_calls_are_spread_evenly_by_least_outstanding() -> None:
    # No health checks after the first: one in flight holds a place, so it is a call
    # outstanding to the balancer, and at load 5-8 one was in flight when a call of the
    # one-at-a-time part was placed (2026-11-26), which then went to the next replica.
    async with pooled(health_interval=3600.0) as (pool, cluster):
        # 30 at once: each replica takes 10 (ties go round-robin)
        await asyncio.wait_for(asyncio.gather(*(pool.price(f"p{i}", "x", 0.05)
                                                for i in range(30))), STEP)
        assert [r.calls for r in pool.stats().replicas] == [10, 10, 10]
        # one at a time: round-robin
        for i in range(9):
            got = await asyncio.wait_for(pool.call("price", f"q{i}", "x"), STEP)
            assert got["replica"] == cluster.replicas[i % 3].name
        assert [r.calls for r in pool.stats().replicas] == [13, 13, 13]


@pytest.mark.usefixtures("over")
async def test_a_busy_replica_gets_no_call_while_others_are_idle() -> None:
    """One caller holds replica 0 with a long call; another makes 20 calls one at a time:
    none goes to replica 0 (it has one outstanding, the others none; no health checks after
    the first, as above: two in flight at once would tie the others with replica 0)."""
    async with pooled(cluster=MemoryCluster(3, paces={0: 30.0}),
                      health_interval=3600.0) as (pool, _):
        held = asyncio.ensure_future(pool.price("held", "x"))
        await wait_until(lambda: replica(pool, 0).outstanding == 1, "the long call")
        for i in range(20):
            await asyncio.wait_for(pool.price(f"p{i}", "x"), STEP)
        assert [r.calls for r in pool.stats().replicas] == [1, 10, 10]
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held


@pytest.mark.usefixtures("over")
async def test_a_full_connection_is_skipped_and_a_place_is_kept_for_health() -> None:
    """Connections of 4 places: calls use at most 3 on each (6 of 12 run at once, the others
    wait), and the health checks, which take the fourth, keep passing (no ejection) while
    every connection is full for longer than the health timeout (without the kept place, a
    check would wait for a place past its timeout and eject the replica). The three times
    keep their order on a busy machine: each is x the load factor."""
    cluster = MemoryCluster(2, max_in_flight=4)
    k = load_factor()
    async with pooled(cluster=cluster, health_timeout=0.3) as (pool, _):  # (x k)
        calls = [asyncio.ensure_future(pool.price(f"p{i}", "x", 0.8 * k)) for i in range(12)]
        await wait_until(lambda: len(cluster.ran()) == 6, "6 calls running")
        await asyncio.sleep(0.5 * k)  # > health_timeout, < the calls' time
        assert len(cluster.ran()) == 6
        assert [r.outstanding for r in pool.stats().replicas] in ([3, 3], [4, 3], [3, 4], [4, 4])
        got = await asyncio.wait_for(asyncio.gather(*calls), STEP)
        assert [g["replica"] for g in got].count(cluster.replicas[0].name) == 6
        assert pool.stats().ejections == 0


@pytest.mark.usefixtures("over")
async def test_a_timeout_bounds_the_wait_for_a_place() -> None:
    async with pooled(n=1, cluster=MemoryCluster(1, max_in_flight=2)) as (pool, _):
        held = asyncio.ensure_future(pool.price("held", "x", 30.0))
        await wait_until(lambda: replica(pool, 0).outstanding == 1, "the long call")
        with pytest.raises(OperationTimeout):
            await asyncio.wait_for(pool.price("waits", "x", timeout=0.2), STEP)
        with pytest.raises(OperationTimeout):
            await asyncio.wait_for(pool.price("spent", "x", timeout=0), STEP)
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held


# -- a replica dies --------------------------------------------------------------------------

@pytest.mark.usefixtures("over")
async def test_a_killed_replica_is_ejected_at_once_and_only_idempotent_calls_move() -> None:
    """12 price (idempotent) and 12 order (not) calls in flight, 4 of each on replica 1,
    which dies: every price completes (the 4 sent again elsewhere), the 4 orders on it fail
    typed, every other order completes; no order ran twice (counted on the servers)."""
    async with pooled() as (pool, cluster):
        long = 0.3 * load_factor()  # (the calls are still running at the kill on a busy machine)
        calls = {f"{kind}-{i}": asyncio.ensure_future(outcome(pool.call(kind, f"{kind}-{i}", "x",
                                                                        long)))
                 for i in range(12) for kind in ("price", "order")}
        await wait_until(lambda: len(cluster.ran()) == 24, "every call running")
        cluster.kill(1)
        took = await wait_until(lambda: replica(pool, 1).state != "UP", "the ejection")
        got = {rid: await asyncio.wait_for(c, STEP) for rid, c in calls.items()}
        ran = cluster.ran()
        assert {got[f"price-{i}"] for i in range(12)} == {"ok"}
        orders = [got[f"order-{i}"] for i in range(12)]
        assert orders.count("UnknownOutcomeError") == 4 and orders.count("ok") == 8
        assert all(ran[f"order-{i}"] == 1 for i in range(12))  # ran once, answered or not
        assert sum(ran[f"price-{i}"] for i in range(12)) == 16  # 4 ran twice: idempotent
        s = pool.stats()
        assert (s.ejections, s.retries, s.unknown_outcomes) == (1, 4, 4)
        assert s.replicas[1].failures == 8
        print(f"ejected {took * 1000:.1f} ms after the kill")


@pytest.mark.usefixtures("over")
async def test_a_hung_replica_is_ejected_by_its_health_check_then_comes_back() -> None:
    """Replica 1 stops reading (its connection lives on): calls sent to it get no answer until
    the health check times out and ejects it; its idempotent calls then go elsewhere, the
    others fail typed and never ran. Thawed, it is connected again. (How soon: the fault
    catalogue's promise, over rxe, tests/rxe/test_rpc_pool.py; here, that it happened, and
    that no call on it was answered before.)"""
    async with pooled(health_interval=0.1, health_timeout=0.3) as (pool, cluster):
        cluster.freeze(1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        calls = {f"{kind}-{i}": asyncio.ensure_future(outcome(pool.call(kind, f"{kind}-{i}", "x")))
                 for i in range(3) for kind in ("price", "order")}
        await wait_until(lambda: replica(pool, 1).state != "UP", "the ejection")
        took = loop.time() - t0
        assert cluster.replicas[1].service.ran == {}  # frozen: it read, so ran, nothing
        got = {rid: await asyncio.wait_for(c, STEP) for rid, c in calls.items()}
        assert [got[f"price-{i}"] for i in range(3)] == ["ok"] * 3
        unknown = [rid for rid, o in got.items() if o == "UnknownOutcomeError"]
        assert len(unknown) == 1 and unknown[0].startswith("order-")
        assert cluster.ran().get(unknown[0], 0) == 0  # (it never ran: nothing was read)
        assert "health check" in (replica(pool, 1).last_error or "")
        cluster.thaw(1)
        await wait_until(lambda: replica(pool, 1).state == "UP", "the reconnect")
        assert pool.stats().reconnects == 1
        print(f"ejected {took * 1000:.0f} ms after freezing")


@pytest.mark.usefixtures("over")
async def test_reconnects_back_off_exponentially() -> None:
    """While replica 1 is dead, each connection attempt waits at least half its envelope
    (0.02 s doubling, capped at 0.32: >= 0.02, 0.04, 0.08, 0.16, 0.16 s); restarted, it is connected again and
    takes calls."""
    async with pooled(reconnect_base=0.02, reconnect_cap=0.32) as (pool, cluster):
        cluster.kill(1)
        r = cluster.replicas[1]
        n0 = len(r.asked)
        await wait_until(lambda: replica(pool, 1).connect_failures >= 6, "6 failed attempts")
        asked = r.asked[n0:]
        gaps = [b - a for a, b in itertools.pairwise(asked)]
        for k, gap in enumerate(gaps[:5]):  # after failure k+1: its envelope, capped
            assert gap >= min(0.32, 0.02 * 2 ** (k + 1)) / 2 * 0.99, (k, gaps)
        cluster.restart(1)
        await wait_until(lambda: replica(pool, 1).state == "UP", "the reconnect")
        s = pool.stats()
        assert (s.ejections, s.reconnects) == (1, 1) and s.connect_failures >= 6
        for i in range(6):
            await asyncio.wait_for(pool.price(f"after-{i}", "x"), STEP)
        assert replica(pool, 1).calls >= 2


@pytest.mark.usefixtures("over")
async def test_the_retry_budget_bounds_the_retries() -> None:
    """A budget of 2 tokens that calls do not refill: of the 4 idempotent calls on the dead
    replica, 2 are sent again and 2 fail typed."""
    async with pooled(retry_burst=2, retry_ratio=0.0) as (pool, cluster):
        calls = [asyncio.ensure_future(outcome(pool.price(f"p{i}", "x", 0.3))) for i in range(12)]
        await wait_until(lambda: len(cluster.ran()) == 12, "every call running")
        cluster.kill(1)
        got = await asyncio.wait_for(asyncio.gather(*calls), STEP)
        assert got.count("ok") == 10 and got.count("UnknownOutcomeError") == 2
        s = pool.stats()
        assert (s.retries, s.retries_refused, s.unknown_outcomes) == (2, 2, 2)


@pytest.mark.usefixtures("over")
async def test_max_attempts_bounds_the_replicas_a_call_is_sent_to() -> None:
    async with pooled(max_attempts=1) as (pool, cluster):
        call = asyncio.ensure_future(pool.price("p", "x", 30.0))
        await wait_until(lambda: len(cluster.ran()) == 1, "the call running")
        cluster.kill(0)
        with pytest.raises(UnknownOutcomeError) as info:
            await asyncio.wait_for(call, STEP)
        assert (info.value.method, info.value.attempts) == ("price", 1)
        assert info.value.address == "10.0.0.1:7000"
        assert pool.stats().retries == 0


@pytest.mark.usefixtures("over")
async def test_a_retry_with_nowhere_to_go_fails_as_unknown_not_as_no_replica() -> None:
    """One replica: an idempotent call on it when it dies has no other replica to go to; it
    was sent once, so it fails UnknownOutcomeError (NoReplicaError says nothing was sent)."""
    async with pooled(n=1, wait_for_replica=0.2) as (pool, cluster):
        call = asyncio.ensure_future(pool.price("p", "x", 30.0))
        await wait_until(lambda: "p" in cluster.ran(), "the call running")
        cluster.kill(0)
        with pytest.raises(UnknownOutcomeError) as info:
            await asyncio.wait_for(call, STEP)
        assert isinstance(info.value.__cause__, NoReplicaError)
        s = pool.stats()
        assert (s.retries, s.unknown_outcomes, s.no_replica) == (1, 1, 0)


async def play(cluster: MemoryCluster, plan: list[tuple[str, int]],
               start: Any) -> tuple[dict[str, str], dict[str, int]]:
    """Run a schedule over ``cluster``'s three replicas: ``("kill" | "restart", i)``, a
    ``"pause"``, or any other step, which ``start(step)`` turns into a dict of request id ->
    future of its outcome. Then restart every replica; what each request got, and how often
    each ran (counted on the servers)."""
    pending: dict[str, asyncio.Future[str]] = {}
    for step, (what, i) in enumerate(plan):
        if what == "kill":
            cluster.kill(i)
        elif what == "restart":
            cluster.restart(i)
        elif what != "pause":
            pending.update(start(step))
        await asyncio.sleep(0.01 if what != "pause" else 0.1)
    for i in range(3):
        cluster.restart(i)
    got = {rid: await asyncio.wait_for(c, STEP) for rid, c in pending.items()}
    return got, cluster.ran()


def check_at_most_once(got: dict[str, str], ran: dict[str, int], once: str) -> None:
    """Every request ended ok or typed; one that found no replica never ran; those whose id
    starts with ``once`` (not idempotent) ran at most once, exactly once if ok; the others
    ran at least once if ok."""
    for rid, o in got.items():
        assert o in ("ok", "UnknownOutcomeError", "NoReplicaError"), (rid, o)
        if o == "NoReplicaError":
            assert ran.get(rid, 0) == 0
        elif rid.startswith(once):
            assert ran.get(rid, 0) <= 1, rid
            if o == "ok":
                assert ran[rid] == 1, rid
        elif o == "ok":
            assert ran.get(rid, 0) >= 1
    assert all(n <= 1 for rid, n in ran.items() if rid.startswith(once))


@pytest.mark.usefixtures("over")
@settings(max_examples=8, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["calls", "kill", "restart", "pause"]),
                               st.integers(0, 2)), min_size=1, max_size=10))
def test_no_call_is_sent_twice_unless_idempotent(plan: list[tuple[str, int]]) -> None:
    """Any schedule of calls, kills and restarts of three replicas (all dead at once too): no
    order runs twice; an order that completed ran exactly once, one that failed typed at most
    once, one that found no replica never; every call ends ok or typed. Counted on the
    servers."""
    async def run() -> None:
        async with pooled(wait_for_replica=0.2) as (pool, cluster):
            def start(step: int) -> dict[str, asyncio.Future[str]]:
                calls = {}
                for k in range(4):
                    kind = "order" if k % 2 else "price"
                    rid = f"{kind}-{step}-{k}"
                    calls[rid] = asyncio.ensure_future(
                        outcome(pool.call(kind, rid, "x", 0.02 * k, timeout=STEP)))
                return calls

            check_at_most_once(*await play(cluster, plan, start), once="order-")

    asyncio.run(run())


# -- a server shutting down, no replica, closing ---------------------------------------------

@pytest.mark.usefixtures("over")
async def test_a_draining_server_is_left_gracefully_and_its_refusals_go_elsewhere() -> None:
    """Replica 1's server drains with a call running (its grace keeps it up): a call that
    reaches it meanwhile is refused (``Unavailable``: it did not run), which makes the pool
    check its health at once (not at the next interval, 30 s away): "draining", so it is
    ejected, gracefully: the running call is still answered. A refused call goes to replica 0
    whatever its method, an order too, and runs there once."""
    async with pooled(n=2, health_interval=30.0) as (pool, cluster):
        long = [asyncio.ensure_future(pool.order(f"long-{i}", "x", 2.0)) for i in range(2)]
        await wait_until(lambda: len(cluster.ran()) == 2, "one long call on each")
        closing = asyncio.ensure_future(cluster.replicas[1].server.drain(5.0))
        await asyncio.sleep(0.01)
        for i in range(2):  # equal loads: the first two calls go one to each
            got = await asyncio.wait_for(pool.order(f"o{i}", "x"), STEP)
            assert got["replica"] == cluster.replicas[0].name
        assert cluster.ran().get("o0") == 1 and cluster.ran().get("o1") == 1
        for i in range(4):
            got = await asyncio.wait_for(pool.price(f"p{i}", "x"), STEP)
            assert got["replica"] == cluster.replicas[0].name
        # before the long calls end (2 s), after which the server would close the connection
        await wait_until(lambda: replica(pool, 1).state != "UP", "the ejection", 1.0)
        assert not any(c.done() for c in long)
        assert [g["order"] for g in await asyncio.wait_for(asyncio.gather(*long), STEP)] == [
            "long-0", "long-1"]  # answered: the connection was not aborted
        s = pool.stats()
        assert s.ejections == 1 and s.unknown_outcomes == 0 and s.retries == 1
        await asyncio.wait_for(closing, STEP)


@pytest.mark.usefixtures("over")
async def test_a_call_every_replica_refuses_raises_unavailable_and_ran_nowhere() -> None:
    """Both replicas drain (a long call keeps each up): an order is refused by one, sent to
    the other, refused again: the caller gets ``Unavailable`` (not UnknownOutcomeError: it
    ran nowhere)."""
    async with pooled(n=2, health_interval=30.0) as (pool, cluster):
        long = [asyncio.ensure_future(pool.order(f"long-{i}", "x", 2.0)) for i in range(2)]
        await wait_until(lambda: len(cluster.ran()) == 2, "one long call on each")
        closing = [asyncio.ensure_future(r.server.drain(5.0)) for r in cluster.replicas]
        await asyncio.sleep(0.01)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(pool.order("refused", "x"), STEP)
        assert not cluster.ran().get("refused")
        assert pool.stats().unknown_outcomes == 0
        await asyncio.wait_for(asyncio.gather(*long, *closing), STEP)


@pytest.mark.usefixtures("over")
async def test_with_every_replica_dead_a_call_fails_no_replica_and_sends_nothing() -> None:
    # 0.5 s x the load factor for the restarted replica to reconnect: 0.2 s x 2.9 (0.58 s) did
    # not cover it in a CI run's unit stage beside three VMs (it was still reconnecting)
    async with pooled(wait_for_replica=0.5) as (pool, cluster):
        for i in range(3):
            cluster.kill(i)
        await wait_until(lambda: all(r.state != "UP" for r in pool.stats().replicas),
                         "every ejection")
        with pytest.raises(NoReplicaError):
            await asyncio.wait_for(pool.order("o", "x"), STEP)
        assert "o" not in cluster.ran() and pool.stats().no_replica == 1
        cluster.restart(2)  # a call waiting for a replica takes the first back
        assert (await asyncio.wait_for(pool.order("o2", "x"), STEP))["replica"] == \
            cluster.replicas[2].name


@pytest.mark.usefixtures("over")
async def test_connect_pool_fails_typed_when_nothing_connects_or_resolves() -> None:
    cluster = MemoryCluster(2)
    cluster.kill(0)
    cluster.kill(1)
    with pytest.raises(NoReplicaError, match="no replica connected"):
        await connect_pool(cluster.addresses, connector=cluster.connect, timeout=STEP, **FAST)

    async def broken() -> list[str]:
        raise OSError("the registry is down")

    with pytest.raises(NoReplicaError, match="did not resolve"):
        await connect_pool(broken, connector=cluster.connect, timeout=STEP, **FAST)

    async def empty() -> list[str]:
        return []

    with pytest.raises(NoReplicaError, match="none"):
        await connect_pool(empty, connector=cluster.connect, timeout=STEP, **FAST)
    await cluster.aclose()


@pytest.mark.usefixtures("over")
async def test_closing_fails_pending_and_waiting_calls_closed() -> None:
    async with pooled(n=2, wait_for_replica=STEP) as (pool, cluster):
        running = asyncio.ensure_future(pool.price("running", "x", 30.0))
        await wait_until(lambda: "running" in cluster.ran(), "the call running")
        cluster.kill(0)
        cluster.kill(1)
        await wait_until(lambda: all(r.state != "UP" for r in pool.stats().replicas),
                         "every ejection")
        waiting = asyncio.ensure_future(pool.price("waiting", "x"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        cluster.restart(0)
        await asyncio.wait_for(pool.aclose(), STEP)
        for call in (running, waiting):
            with pytest.raises(ClosedResourceError):
                await asyncio.wait_for(call, STEP)
        with pytest.raises(ClosedResourceError):
            await pool.price("after", "x")
        await asyncio.wait_for(pool.aclose(), STEP)  # idempotent
        pool.abort()


@pytest.mark.usefixtures("over")
async def test_abort_fails_pending_calls_closed() -> None:
    async with pooled() as (pool, cluster):
        calls = [asyncio.ensure_future(pool.order(f"o{i}", "x", 30.0)) for i in range(3)]
        await wait_until(lambda: len(cluster.ran()) == 3, "the calls running")
        pool.abort()
        for c in calls:
            with pytest.raises(ClosedResourceError):
                await asyncio.wait_for(c, STEP)


# -- where the replicas are -----------------------------------------------------------------

@pytest.mark.usefixtures("over")
async def test_a_resolver_adds_and_removes_replicas() -> None:
    """The resolver's answer is the replica set: a new address becomes a replica that takes
    calls, a vanished one stops taking calls and its running call still completes; a failed
    or empty resolution keeps the replicas."""
    cluster = MemoryCluster(3)
    named = cluster.addresses[:2]
    fail = ""

    async def resolver() -> list[str]:
        if fail == "raise":
            raise OSError("registry down")
        return [] if fail == "empty" else list(named)

    pool = await connect_pool(resolver, connector=cluster.connect, timeout=STEP,
                              resolve_interval=0.02, **FAST)
    try:
        assert [r.address for r in pool.stats().replicas] == named
        held = asyncio.ensure_future(pool.price("held", "x", 0.5))
        await wait_until(lambda: "held" in cluster.ran(), "the call running")
        on = next(r for r in cluster.replicas if "held" in r.service.ran)
        named[:] = [a for a in cluster.addresses if a != on.name]  # drop it, add the third
        await wait_until(lambda: sorted(r.address for r in pool.stats().replicas
                                        if r.state == "UP") == sorted(named), "the change")
        assert (await asyncio.wait_for(held, STEP))["replica"] == on.name
        for i in range(4):
            got = await asyncio.wait_for(pool.price(f"p{i}", "x"), STEP)
            assert got["replica"] != on.name
        for fail in ("raise", "empty"):
            n = pool.stats().resolve_failures + 2
            await wait_until(lambda n=n: pool.stats().resolve_failures >= n, "failed resolves")
            assert sorted(r.address for r in pool.stats().replicas) == sorted(named)
    finally:
        await pool.aclose()
        await cluster.aclose()


@pytest.mark.usefixtures("over")
async def test_a_name_with_several_addresses_is_several_replicas(monkeypatch: Any) -> None:
    cluster = MemoryCluster(3)
    loop = asyncio.get_running_loop()

    async def getaddrinfo(host: str, port: int, **kw: Any) -> list[Any]:
        assert host == "orders.example" and kw["family"] == socket.AF_INET
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.0.0.{i}", port))
                for i in (3, 1, 2, 1)]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    pool = await connect_pool("orders.example:7000", connector=cluster.connect, timeout=STEP,
                              **FAST)
    try:
        assert [r.address for r in pool.stats().replicas] == cluster.addresses
        assert all(r.state == "UP" for r in pool.stats().replicas)
    finally:
        await pool.aclose()
        await cluster.aclose()


async def test_addresses_are_resolved_by_the_system() -> None:
    from aiordma.rpc._resolve import as_resolver

    assert await as_resolver("localhost:7000")() == [("127.0.0.1", 7000)]
    assert await as_resolver([("127.0.0.1", 1), "127.0.0.1:1", "127.0.0.2:1"])() == [
        ("127.0.0.1", 1), ("127.0.0.2", 1)]
    with pytest.raises(OSError):
        await as_resolver("no-such-host.invalid:1")()


@pytest.mark.usefixtures("over")
async def test_the_proxy_and_the_counters() -> None:
    async with pooled(n=2) as (pool, _):
        assert (await asyncio.wait_for(pool.price("a", "abc"), STEP))["price"] == 103
        with pytest.raises(RemoteError):  # a method's error is the caller's, never retried
            await asyncio.wait_for(pool.price(), STEP)
        s = pool.stats()
        assert (s.calls, s.retries, s.ejections, s.resolves) == (2, 0, 0, 1)
        assert s.replicas[0].idempotent == ("bulk_quote", "journal", "price", "quotes", "whoami")
        with pytest.raises(AttributeError):
            _ = pool._private
