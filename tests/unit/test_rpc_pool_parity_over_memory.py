"""The pool as capable as a client (aiordma.rpc.connect_pool), device-free: metadata and
``call_with_metadata``, client interceptors around each attempt (health checks included),
calls and streams by key (rendezvous hashing), and streams through the pool (one replica;
started again elsewhere only when idempotent and untouched). Replicas of the demo's order
service over the in-memory channel pair (memory_cluster.py), and, with the ``over`` fixture,
over the TCP transport on loopback sockets; what ran where is counted on the servers (each replica's service records the request ids it ran, with their metadata)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma import BrokenResourceError, ClosedResourceError, LocalProtocolError, OperationTimeout
from aiordma.protocols.rpc_pool import affinity_key, rendezvous
from aiordma.rpc import (
    Answer,
    ClientCall,
    NoReplicaError,
    RemoteError,
    RpcPool,
    UnknownOutcomeError,
    connect_pool,
)

from ..bounds import STEP
from .memory_cluster import MemoryCluster
from .test_rpc_pool_over_memory import (
    FAST,
    check_at_most_once,
    outcome,
    play,
    pooled,
    replica,
    wait_until,
)


def names_of(cluster: MemoryCluster) -> list[str]:
    return [r.name for r in cluster.replicas]


def index(cluster: MemoryCluster, name: str | None) -> int:
    return names_of(cluster).index(name or "")


def home(cluster: MemoryCluster, key: Any, down: tuple[int, ...] = ()) -> str:
    """The replica ``key`` hashes to when the replicas ``down`` are not UP."""
    names = names_of(cluster)
    i = rendezvous(affinity_key(key), [None if j in down else n for j, n in enumerate(names)])
    return names[i]  # type: ignore[index]


def for_(cluster: MemoryCluster, name: str) -> Any:
    return cluster.replicas[index(cluster, name)].service


# -- metadata -------------------------------------------------------------------------------

@pytest.mark.usefixtures("over")
async def test_metadata_travels_with_a_pooled_call_and_the_answers_comes_back() -> None:
    async with pooled() as (pool, cluster):
        got = await asyncio.wait_for(
            pool.call("whoami", metadata={"tenant": "acme", "blob": b"\x01"}), STEP)
        assert got["metadata"] == {"tenant": "acme", "blob": "\x01"}
        answer = await asyncio.wait_for(
            pool.call_with_metadata("price", "r1", "x", metadata={"tenant": "acme"}), STEP)
        assert isinstance(answer, Answer)  # (the pool's own method, not a remote one)
        result, md = answer
        assert md == {"replica": result["replica"]}
        assert for_(cluster, result["replica"]).metadata["r1"] == [{"tenant": "acme"}]
        assert (await asyncio.wait_for(pool.whoami(metadata={"k": "v"}), STEP))["metadata"] \
            == {"k": "v"}  # (the proxy passes it too)
        with pytest.raises(RemoteError) as info:  # an error answer's metadata is the error's
            await asyncio.wait_for(pool.call_with_metadata("price", "r2"), STEP)
        assert info.value.metadata == {}
        with pytest.raises(LocalProtocolError):
            await pool.call("price", "r3", "x", metadata={"Not A Key": "v"})
        assert "r3" not in cluster.ran() and "call_with_metadata" not in cluster.ran()


# -- interceptors ----------------------------------------------------------------------------

def token_check(expected: str) -> Any:
    async def check(call: Any, proceed: Any) -> Any:
        if call.metadata.get("token") != expected:
            raise PermissionError("no valid token")
        return await proceed()
    return check


@pytest.mark.usefixtures("over")
async def test_a_pool_interceptor_carries_a_token_that_the_servers_check() -> None:
    """Servers that check a token refuse the health check of a pool without one (no replica
    connects); a pool whose interceptor adds the token calls and streams through them all."""
    cluster = MemoryCluster(3, interceptors=[token_check("s3cret")])
    with pytest.raises(NoReplicaError):
        await connect_pool(cluster.addresses, connector=cluster.connect, timeout=1.0, **FAST)

    seen: list[tuple[str, str | None, int, bool]] = []

    async def token(call: ClientCall, proceed: Any) -> Any:
        seen.append((call.method, call.replica, call.attempt, call.stream))
        call.metadata["token"] = "s3cret"
        return await proceed()

    # (No periodic health check while the calls run: one in flight on a replica would make it
    # the busier one and move the round-robin; the checks made to connect are seen above.)
    async with pooled(cluster=cluster, interceptors=[token], health_interval=STEP) as (pool, _):
        assert pool.interceptors == (token,)
        assert all(r.state == "UP" for r in pool.stats().replicas)
        for i in range(3):
            got = await asyncio.wait_for(pool.whoami(), STEP)
            assert got["metadata"] == {"token": "s3cret"}
        async with pool.stream("quotes", "q", ["a", "b"]) as s:
            assert [x["item"] async for x in s] == ["a", "b"]
        assert ("quotes", s.replica, 1, True) in seen
        assert {m for m, *_ in seen} >= {"aiordma.health", "whoami", "quotes"}
        assert [(r, a) for m, r, a, _ in seen if m == "whoami"] == [
            (n, 1) for n in names_of(cluster)]  # (round-robin: one each)
        assert pool.stats().ejections == 0


@pytest.mark.usefixtures("over")
async def test_a_client_interceptor_runs_again_for_each_attempt_on_the_new_replica() -> None:
    """An idempotent call whose replica dies is sent again: the interceptor ran once per
    attempt, each seeing its replica and attempt number, and what it put in the metadata
    reached that attempt's server."""
    attempts: list[tuple[str | None, int]] = []

    async def record(call: ClientCall, proceed: Any) -> Any:
        if call.method == "price":
            attempts.append((call.replica, call.attempt))
            call.metadata["attempt"] = str(call.attempt)
        return await proceed()

    async with pooled(interceptors=[record]) as (pool, cluster):
        call = asyncio.ensure_future(pool.price("p", "x", 0.3))
        await wait_until(lambda: "p" in cluster.ran(), "the call running")
        first = attempts[0][0]
        cluster.kill(index(cluster, first))
        got = await asyncio.wait_for(call, STEP)
        assert [a for _, a in attempts] == [1, 2]
        second = attempts[1][0]
        assert second != first and got["replica"] == second
        assert for_(cluster, first).metadata["p"] == [{"attempt": "1"}]
        assert for_(cluster, second).metadata["p"] == [{"attempt": "2"}]
        assert pool.stats().retries == 1


@pytest.mark.usefixtures("over")
async def test_an_interceptors_own_error_is_the_callers_and_ejects_nothing() -> None:
    async def refuse(call: ClientCall, proceed: Any) -> Any:
        if call.method == "order":  # (the connection is fine: not a broken replica)
            raise BrokenResourceError("the interceptor says no")
        if call.method == "price":
            raise PermissionError("nope")
        return await proceed()

    async with pooled(interceptors=[refuse]) as (pool, cluster):
        with pytest.raises(BrokenResourceError) as info:
            await asyncio.wait_for(pool.order("o", "x"), STEP)
        assert not isinstance(info.value, UnknownOutcomeError)
        with pytest.raises(PermissionError):
            await asyncio.wait_for(pool.price("p", "x"), STEP)
        s = pool.stats()
        assert (s.ejections, s.unknown_outcomes, s.retries) == (0, 0, 0)
        assert cluster.ran() == {}


# -- affinity ---------------------------------------------------------------------------------

@pytest.mark.usefixtures("over")
async def test_equal_keys_go_to_one_replica_and_only_a_leavers_keys_move() -> None:
    """24 keys over 3 replicas: each key's calls all go to its rendezvous replica (every
    replica has some); replica 1 dies: its keys go to their next choice, the others stay;
    back, it has its keys again."""
    async with pooled() as (pool, cluster):
        keys = [f"user-{i}" for i in range(24)]
        where: dict[str, str] = {}
        for k in keys:
            got = {(await asyncio.wait_for(pool.call("price", f"{k}-{j}", "x", key=k), STEP)
                    )["replica"] for j in range(3)}
            assert got == {home(cluster, k)}
            where[k] = got.pop()
        assert set(where.values()) == set(names_of(cluster))
        gone = names_of(cluster)[1]
        cluster.kill(1)
        await wait_until(lambda: replica(pool, 1).state != "UP", "the ejection")
        moved = 0
        for k in keys:
            got = (await asyncio.wait_for(pool.call("price", f"{k}-a", "x", key=k), STEP)
                   )["replica"]
            if where[k] == gone:
                assert got == home(cluster, k, down=(1,))
                moved += 1
            else:
                assert got == where[k]
        assert moved == list(where.values()).count(gone) > 0
        cluster.restart(1)
        await wait_until(lambda: replica(pool, 1).state == "UP", "the reconnect")
        for k in keys:
            got = (await asyncio.wait_for(pool.call("price", f"{k}-b", "x", key=k), STEP)
                   )["replica"]
            assert got == where[k]
        # an int key is its decimal text
        a = await asyncio.wait_for(pool.call("whoami", key=42), STEP)
        b = await asyncio.wait_for(pool.call("whoami", key="42"), STEP)
        assert a["replica"] == b["replica"] == home(cluster, 42)


@pytest.mark.usefixtures("over")
async def test_a_keyed_call_waits_for_a_place_on_its_replica_rather_than_spill() -> None:
    cluster = MemoryCluster(3, max_in_flight=3)  # 2 places for calls, 1 kept for health
    async with pooled(cluster=cluster) as (pool, _):
        mine = home(cluster, "cart-7")
        held = [asyncio.ensure_future(pool.price(f"h{i}", "x", 0.5, key="cart-7"))
                for i in range(2)]
        await wait_until(lambda: len(cluster.ran()) == 2, "two calls holding its places")
        waiting = asyncio.ensure_future(pool.call("price", "w", "x", key="cart-7"))
        await asyncio.sleep(0.2)
        assert not waiting.done() and "w" not in cluster.ran()
        assert (await asyncio.wait_for(waiting, STEP))["replica"] == mine
        assert {h["replica"] for h in await asyncio.gather(*held)} == {mine}


@pytest.mark.usefixtures("over")
async def test_bad_keys_are_refused_typed_at_once() -> None:
    async with pooled() as (pool, cluster):
        for bad in (1.5, True, None.__class__, ("a",)):
            with pytest.raises(LocalProtocolError):
                await pool.call("price", "p", "x", key=bad)
            with pytest.raises(LocalProtocolError):
                pool.stream("quotes", "q", [], key=bad)
        with pytest.raises(LocalProtocolError):
            pool.stream_call("bulk_order", "b", window=0)
        with pytest.raises(LocalProtocolError):
            pool.stream(7)  # type: ignore[arg-type]
        assert cluster.ran() == {} and pool.stats().calls == 0


# -- streams ----------------------------------------------------------------------------------

@pytest.mark.usefixtures("over")
async def test_a_stream_stays_on_one_replica_and_a_key_picks_it() -> None:
    async with pooled() as (pool, cluster):
        items = [f"i{i}" for i in range(10)]
        s = pool.stream("quotes", "q1", items, metadata={"t": "1"})
        assert s.replica is None  # (it starts when first used)
        async with s:
            got = [x async for x in s]
        assert [g["item"] for g in got] == items
        assert {g["replica"] for g in got} == {s.replica}
        assert s.answer_metadata == {"replica": s.replica}
        assert for_(cluster, s.replica or "").metadata["q1"] == [{"t": "1"}]
        for j in range(3):
            ks = pool.stream("quotes", f"k{j}", ["a"], key="cart-9")
            assert [x["replica"] async for x in ks] == [home(cluster, "cart-9")]
        call = pool.stream_call("bulk_order", "b1", key="cart-9")
        for line in ("x", "y", "z"):
            await asyncio.wait_for(call.send(line), STEP)
        await call.send_eof()
        assert await asyncio.wait_for(call.result(), STEP) == {
            "replica": home(cluster, "cart-9"), "order": "b1", "lines": 3}
        assert cluster.ran()["b1"] == 1
        s = pool.stats()
        assert (s.calls, s.retries) == (5, 0)


@pytest.mark.usefixtures("over")
async def test_an_idempotent_stream_starts_again_elsewhere_before_its_first_item() -> None:
    async with pooled() as (pool, cluster):
        s = pool.stream("quotes", "q", ["a", "b", "c"], 0.3)
        async with s:  # started: its first item 0.3 s away
            await wait_until(lambda: "q" in cluster.ran(), "the stream running")
            first = s.replica
            cluster.kill(index(cluster, first))
            got = [x async for x in s]
        assert [g["item"] for g in got] == ["a", "b", "c"]
        assert {g["replica"] for g in got} == {s.replica} and s.replica != first
        assert cluster.ran()["q"] == 2 and pool.stats().retries == 1


@pytest.mark.usefixtures("over")
async def test_a_stream_broken_after_its_first_item_fails_unknown_outcome() -> None:
    async with pooled() as (pool, cluster):
        s = pool.stream("quotes", "q", ["a", "b", "c"], 0.3)
        async with s:
            first = await asyncio.wait_for(anext(s), STEP)
            cluster.kill(index(cluster, s.replica))
            with pytest.raises(UnknownOutcomeError, match="reached the caller") as info:
                async for _ in s:
                    pass
        assert (info.value.method, info.value.address) == ("quotes", first["replica"])
        assert cluster.ran()["q"] == 1
        assert pool.stats().unknown_outcomes == 1


@pytest.mark.usefixtures("over")
async def test_a_broken_bulk_order_is_never_sent_again() -> None:
    async with pooled() as (pool, cluster):
        call = pool.stream_call("bulk_order", "b")
        async with call:
            await wait_until(lambda: "b" in cluster.ran(), "the stream running")
            victim = index(cluster, call.replica)
            cluster.kill(victim)
            await wait_until(lambda: replica(pool, victim).state != "UP", "the ejection")
            with pytest.raises(UnknownOutcomeError, match="not declared idempotent"):
                await asyncio.wait_for(call.result(), STEP)
        assert cluster.ran()["b"] == 1 and pool.stats().retries == 0


@pytest.mark.usefixtures("over")
async def test_an_idempotent_stream_call_starts_again_only_before_its_first_item_is_sent(
) -> None:
    async with pooled() as (pool, cluster):
        call = pool.stream_call("bulk_quote", "bq")
        async with call:
            await wait_until(lambda: "bq" in cluster.ran(), "the stream running")
            first = call.replica
            cluster.kill(index(cluster, first))
            await wait_until(lambda: replica(pool, index(cluster, first)).state != "UP",
                             "the ejection")
            for item in ("a", "bb"):
                await asyncio.wait_for(call.send(item), STEP)
            await call.send_eof()
            assert await asyncio.wait_for(call.result(), STEP) == {
                "replica": call.replica, "total": 203}
        assert call.replica != first and cluster.ran()["bq"] == 2
        call = pool.stream_call("bulk_quote", "bq2")
        async with call:
            await asyncio.wait_for(call.send("a"), STEP)
            await wait_until(lambda: "bq2" in cluster.ran(), "the stream running")
            victim = index(cluster, call.replica)
            cluster.kill(victim)
            await wait_until(lambda: replica(pool, victim).state != "UP", "the ejection")
            with pytest.raises(UnknownOutcomeError, match="an item had been sent"):
                await asyncio.wait_for(call.result(), STEP)
        assert cluster.ran()["bq2"] == 1


@pytest.mark.usefixtures("over")
async def test_a_stream_a_draining_replica_refuses_goes_elsewhere_whatever_its_method() -> None:
    async with pooled(n=2, health_interval=30.0) as (pool, cluster):
        long = [asyncio.ensure_future(pool.order(f"long-{i}", "x", 2.0)) for i in range(2)]
        await wait_until(lambda: len(cluster.ran()) == 2, "one long call on each")
        closing = asyncio.ensure_future(cluster.replicas[1].server.drain(5.0))
        await asyncio.sleep(0.01)
        for i in range(2):  # equal loads: one of them goes to the draining replica first
            call = pool.stream_call("bulk_order", f"b{i}")
            async with call:
                await asyncio.wait_for(call.send("x"), STEP)
                await call.send_eof()
                got = await asyncio.wait_for(call.result(), STEP)
            assert got["replica"] == cluster.replicas[0].name
        assert cluster.ran()["b0"] == cluster.ran()["b1"] == 1
        s = pool.stats()
        assert (s.retries, s.unknown_outcomes) == (1, 0)
        await asyncio.wait_for(asyncio.gather(*long, closing), STEP)


@pytest.mark.usefixtures("over")
async def test_a_streams_own_error_and_its_timeout_are_the_callers() -> None:
    async with pooled() as (pool, cluster):
        with pytest.raises(RemoteError) as info:
            async for _ in pool.stream("quotes", "q", 5):  # (5 is not a list of items)
                pass
        assert info.value.type_name == "TypeError"
        with pytest.raises(OperationTimeout):
            async for _ in pool.stream("quotes", "slow", ["a"], 5.0, timeout=0.2):
                pass
        assert cluster.ran()["q"] == cluster.ran()["slow"] == 1
        assert pool.stats().retries == 0 and pool.stats().ejections == 0


@pytest.mark.usefixtures("over")
async def test_closing_the_pool_fails_its_streams_closed() -> None:
    async with pooled() as (pool, cluster):
        s = pool.stream("quotes", "q", ["a", "b"], 30.0)
        reading = asyncio.ensure_future(outcome(s.__anext__()))
        await wait_until(lambda: "q" in cluster.ran(), "the stream running")
        pool.abort()
        assert await asyncio.wait_for(reading, STEP) == "ClosedResourceError"
        with pytest.raises(ClosedResourceError):
            await pool.stream("quotes", "q2", ["a"]).__anext__()


# -- any schedule of kills ----------------------------------------------------------------------

async def read_quotes(pool: RpcPool, rid: str) -> str:
    try:
        got = [x async for x in pool.stream("quotes", rid, ["a", "b", "c"], 0.01,
                                            timeout=STEP)]
    except Exception as exc:  # noqa: BLE001  # the test counts what each stream got
        return type(exc).__name__
    whole = [g["item"] for g in got] == ["a", "b", "c"] and len({g["replica"] for g in got}) == 1
    return "ok" if whole else f"partial {got}"


async def place_bulk(pool: RpcPool, rid: str) -> str:
    try:
        async with pool.stream_call("bulk_order", rid, timeout=STEP) as call:
            for line in ("x", "y", "z"):
                await call.send(line)
                await asyncio.sleep(0.01)
            await call.send_eof()
            got = await call.result()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    return "ok" if got["lines"] == 3 else f"wrong {got}"


@pytest.mark.usefixtures("over")
@settings(max_examples=6, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["streams", "kill", "restart", "pause"]),
                               st.integers(0, 2)), min_size=1, max_size=8))
def test_no_stream_runs_twice_unless_idempotent(plan: list[tuple[str, int]]) -> None:
    """Any schedule of streams, kills and restarts of three replicas: every stream ends whole
    (all its items, from one replica) or typed; no bulk order ran twice, one that completed
    ran once, one that found no replica never. Counted on the servers."""
    async def run() -> None:
        async with pooled(wait_for_replica=0.2) as (pool, cluster):
            def start(step: int) -> dict[str, asyncio.Future[str]]:
                streams = {}
                for k in range(2):
                    streams[f"quotes-{step}-{k}"] = asyncio.ensure_future(
                        read_quotes(pool, f"quotes-{step}-{k}"))
                    streams[f"bulk-{step}-{k}"] = asyncio.ensure_future(
                        place_bulk(pool, f"bulk-{step}-{k}"))
                return streams

            check_at_most_once(*await play(cluster, plan, start), once="bulk-")

    asyncio.run(run())
