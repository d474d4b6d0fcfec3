"""Server operations in the RPC layer, over the in-memory channel pair (no device; over rxe with
the server in another process: tests/rxe/test_rpc_ops.py).

* ``drain(timeout)``: calls in flight (running, queued, a stream) finish and are answered;
  new calls are refused typed (``Unavailable``, the method not run) while built-ins answer;
  past the timeout what still runs is cancelled and answered; then the connections close;
* ``@method(max_concurrency=N)``: never more than N at once across connections (counted by
  the service), the rest in arrival order, each bounded by its deadline, holding no place of
  its connection while it waits;
* per-method counters: exact counts of every outcome, in flight, latency percentiles, a
  limited method's running and waiting calls; the same over RPC (``aiordma.stats``); calls of
  a client that left are accounted for; the table ``aiordma stats`` prints.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from aiordma import BrokenResourceError, LocalProtocolError, OperationTimeout, protocols
from aiordma.rpc import STATS_METHOD, RemoteError, RpcServer, Service, Unavailable, method
from aiordma.rpc._stats import format_stats
from aiordma.testing import channel_pair

from ..bounds import STEP
from ..rpc_ops_services import LIMIT, Traced, served
from .rpc_builds import rpc_layer_build  # noqa: F401  # (each test with both builds)


async def until(cond: Callable[[], bool], what: str) -> None:
    """Wait (bounded by STEP) until ``cond()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STEP
    while not cond():
        assert loop.time() < deadline, f"not within {STEP} s: {what}"
        await asyncio.sleep(0.005)


def method_stats(server: RpcServer, name: str) -> dict[str, Any]:
    got: dict[str, Any] = server.stats()["methods"][name]
    return got


# -- drain ----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_drain_finishes_calls_in_flight_refuses_new_ones_then_closes() -> None:
    traced = Traced()
    async with served(traced, server_limit=1, clients=2) as ([c1, c2], server):
        running = asyncio.ensure_future(c1.call("hold", -1))  # until the gate opens
        queued = asyncio.ensure_future(c1.call("hold", 0))  # behind it (max_in_flight 1)
        other = asyncio.ensure_future(c2.call("hold", -1))
        rows = c2.stream("rows", 40, window=2, timeout=STEP)
        assert await asyncio.wait_for(anext(rows), STEP) == 0
        await until(lambda: method_stats(server, "hold")["in_flight"] == 3, "3 holds in flight")
        draining = asyncio.ensure_future(server.drain(STEP))
        await until(lambda: server.draining, "draining")
        # new calls are refused, typed, without running; built-ins still answer
        for client in (c1, c2):
            with pytest.raises(Unavailable) as info:
                await asyncio.wait_for(client.call("whoami"), STEP)
            assert info.value.type_name == "aiordma.Unavailable"
        with pytest.raises(Unavailable):
            async with c1.stream("rows", 1, timeout=STEP) as more:
                await anext(more)
        stats = await asyncio.wait_for(c2.call(STATS_METHOD), STEP)
        assert stats["draining"] is True and stats["methods"]["hold"]["in_flight"] == 3
        assert not draining.done()
        # the calls in flight finish and are answered, the stream to its end
        traced.gate.set()
        assert await asyncio.wait_for(asyncio.gather(running, queued, other), STEP) == [
            "held"] * 3
        assert [i async for i in rows] == list(range(1, 40))
        await asyncio.wait_for(draining, STEP)
        assert traced.ran == {"hold": 3, "rows": 1} and traced.finished == 3
        st = server.stats()["methods"]
        assert (st["whoami"]["refused"], st["rows"]["refused"], st["hold"]["in_flight"]) == (
            2, 1, 0)
        # and then the connections are closed
        with pytest.raises(BrokenResourceError):
            await asyncio.wait_for(c1.call("whoami"), STEP)
        await server.drain(1.0)  # again: nothing left to do


@pytest.mark.usefixtures("over")
async def test_drain_cancels_what_outlives_its_timeout_and_answers_it() -> None:
    traced = Traced()
    async with served(traced) as ([client], server):
        stuck = asyncio.ensure_future(client.call("hold", -1))
        await until(lambda: method_stats(server, "hold")["in_flight"] == 1, "the call arrived")
        await asyncio.wait_for(server.drain(0.1), STEP)
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(stuck, STEP)
        assert info.value.type_name == "CancelledError"
        assert traced.hold_cancelled == 1 and traced.finished == 0
        assert method_stats(server, "hold")["cancelled"] == 1


async def test_drain_checks_its_timeout() -> None:
    server = RpcServer(Traced(), max_in_flight=1, grace=1.0)
    for bad in (-1, float("nan"), float("inf"), "1", None, True):
        with pytest.raises(LocalProtocolError):
            await server.drain(bad)
    assert not server.draining


# -- concurrency limits -----------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_max_concurrency_holds_across_connections_and_queues_in_order() -> None:
    traced = Traced()
    async with served(traced, clients=3) as (clients, server):
        tags = [str(i) for i in range(12)]
        calls = [asyncio.ensure_future(clients[i % 3].call("limited", -1, tag))
                 for i, tag in enumerate(tags)]
        await until(lambda: method_stats(server, "limited")["waiting"] == 10, "10 waiting")
        st = method_stats(server, "limited")
        assert (st["max_concurrency"], st["running"], st["waiting"]) == (LIMIT, LIMIT, 10)
        assert traced.running == LIMIT
        traced.gate.set()
        assert await asyncio.wait_for(asyncio.gather(*calls), STEP) == tags
        assert traced.peak == LIMIT and traced.ran["limited"] == 12
    # one connection: they start in the order they were sent
    traced = Traced()
    async with served(traced) as ([client], _):
        tags = [str(i) for i in range(8)]
        assert await asyncio.wait_for(asyncio.gather(
            *(client.call("limited", 0.01, tag) for tag in tags)), STEP) == tags
        assert traced.order == tags and traced.peak == LIMIT


@pytest.mark.usefixtures("over")
async def test_a_call_waiting_for_its_methods_limit_is_bounded_by_its_deadline() -> None:
    traced = Traced()
    async with served(traced) as ([client], server):
        first = [asyncio.ensure_future(client.call("limited", -1, t)) for t in "ab"]
        await until(lambda: traced.running == LIMIT, "the limit is full")
        with pytest.raises(OperationTimeout):
            await client.call("limited", -1, "late", timeout=0.2)
        await until(lambda: method_stats(server, "limited")["in_flight"] == 2, "its answer")
        st = method_stats(server, "limited")
        assert st["expired"] + st["cancelled"] == 1 and st["waiting"] == 0
        traced.gate.set()
        assert await asyncio.wait_for(asyncio.gather(*first), STEP) == ["a", "b"]
        assert traced.order == ["a", "b"]  # "late" never ran


@pytest.mark.usefixtures("over")
async def test_a_call_waiting_for_its_methods_limit_holds_no_place_of_its_connection() -> None:
    """Connection 2 has one place (max_in_flight 1): its limited call waits for the method's
    limit (full, on connection 1) and its other call still runs at once."""
    traced = Traced()
    async with served(traced, server_limit=LIMIT, clients=2) as ([c1, c2], server):
        held = [asyncio.ensure_future(c1.call("limited", -1, t)) for t in "ab"]
        await until(lambda: traced.running == LIMIT, "the limit is full")
        waiting = asyncio.ensure_future(c2.call("limited", -1, "c"))
        await until(lambda: method_stats(server, "limited")["waiting"] == 1, "c waits")
        server_c2_places = next(s for s in server._sessions.values()
                                if s.ep is not None and len(s.unanswered) == 1).admission
        assert server_c2_places.free == LIMIT  # (c holds none of connection 2's places)
        assert (await asyncio.wait_for(c2.call("whoami"), STEP))["method"] == "whoami"
        traced.gate.set()
        assert await asyncio.wait_for(asyncio.gather(*held, waiting), STEP) == ["a", "b", "c"]


def test_max_concurrency_is_checked() -> None:
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(LocalProtocolError):
            class _Bad(Service):
                @method(max_concurrency=bad)
                async def m(self) -> None:
                    pass


# -- counters -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_stats_count_every_outcome_in_flight_and_latency() -> None:
    traced = Traced()
    async with served(traced) as ([client], server):
        st = method_stats(server, "limited")  # listed before its first call
        assert (st["calls"], st["in_flight"], st["max_concurrency"]) == (0, 0, LIMIT)
        assert st["latency_ms"] == {"count": 0, "p50": None, "p90": None, "p99": None,
                                    "max": None}
        for _ in range(3):
            await asyncio.wait_for(client.call("whoami"), STEP)
        with pytest.raises(RemoteError):
            await asyncio.wait_for(client.call("fail_with", "x"), STEP)
        slow = [await asyncio.wait_for(client.call("hold", 0.05), STEP) for _ in range(4)]
        assert slow == ["held"] * 4
        held = asyncio.ensure_future(client.call("hold", -1))
        await until(lambda: method_stats(server, "hold")["in_flight"] == 1, "held")
        held.cancel()  # the client cancels: the server's task is cancelled and answered
        await until(lambda: method_stats(server, "hold")["in_flight"] == 0, "cancelled")
        s = server.stats()
        who, fail, hold = (s["methods"][n] for n in ("whoami", "fail_with", "hold"))
        assert (who["calls"], who["errors"], who["in_flight"]) == (3, 0, 0)
        assert (fail["calls"], fail["errors"]) == (1, 1)
        assert (hold["calls"], hold["cancelled"], hold["errors"], hold["expired"]) == (5, 1, 0, 0)
        lat = hold["latency_ms"]
        assert lat["count"] == 5 and lat["max"] >= 50 and lat["p50"] >= 50
        assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        assert s["calls"] == 9 and s["connections"] == 1 and s["draining"] is False
        # the same over RPC, from the built-in (which counts itself too)
        remote = await asyncio.wait_for(client.call(STATS_METHOD), STEP)
        assert remote["methods"]["hold"] == server.stats()["methods"]["hold"]
        assert remote["methods"][STATS_METHOD]["calls"] == 1
        print(format_stats(remote, "memory"))


async def test_a_call_whose_deadline_passes_at_the_server_counts_as_expired() -> None:
    """A raw client that sends a deadline and never cancels: the server's clock expires it."""
    rpc = protocols.rpc
    traced = Traced()
    server = RpcServer(traced, max_in_flight=8, grace=1.0)
    a, b = channel_pair()
    serving = asyncio.ensure_future(server.serve_connection(b))
    conn = rpc.RpcConnection(rpc.Role.CLIENT)
    try:
        _, msgs = conn.send_request("hold", (-1,), deadline_ms=50)
        for m in msgs:
            await asyncio.wait_for(a.send(m), STEP)
        conn.receive_message(await asyncio.wait_for(a.recv(), STEP))
        ev = conn.next_event()
        assert isinstance(ev, rpc.Error) and ev.type == "DeadlineExpired"
        st = method_stats(server, "hold")
        assert (st["calls"], st["expired"], st["cancelled"], st["in_flight"]) == (1, 1, 0, 0)
        # The latency (perf_counter, from arrival) counts the wait until the deadline. The
        # deadline is kept in the loop's clock: uvloop's (libuv's) has millisecond steps and
        # is read once per loop iteration, so its timer can fire up to about 2 ms before 50 ms
        # of perf_counter have passed (seen: a run at load 7 failed a bound of exactly 50).
        assert st["latency_ms"]["max"] >= 48
    finally:
        a.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)


async def test_calls_of_a_client_that_left_are_accounted_for() -> None:
    """Calls in flight, one of them never started (its task cancelled before its first
    step), when the client goes: none stays counted in flight."""
    rpc = protocols.rpc
    traced = Traced()
    server = RpcServer(traced, max_in_flight=8, grace=1.0)
    a, b = channel_pair()
    serving = asyncio.ensure_future(server.serve_connection(b))
    conn = rpc.RpcConnection(rpc.Role.CLIENT)
    try:
        async with asyncio.timeout(STEP):  # (no task per send: both arrive in one tick)
            for msg in conn.send_request("hold", (-1,))[1]:
                await a.send(msg)
            await until(lambda: method_stats(server, "hold")["in_flight"] == 1, "running")
            for msg in conn.send_request("hold", (-1,))[1]:
                await a.send(msg)
            await a.send(b"\xff\x00 not a frame")  # (the second never runs a step)
        await asyncio.wait_for(serving, STEP)
        st = method_stats(server, "hold")
        assert (st["calls"], st["in_flight"], st["cancelled"]) == (2, 0, 2)
        assert traced.ran == {"hold": 1}
    finally:
        a.abort()
        await asyncio.wait_for(server.aclose(), STEP)


@pytest.mark.usefixtures("over")
async def test_builtin_names_are_reserved_and_unknown_ones_are_errors() -> None:
    async with served(Traced()) as ([client], _):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.call("aiordma.nothing"), STEP)
        assert info.value.type_name == "AttributeError"
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.call("aiordma.stats", 1), STEP)
        assert info.value.type_name == "TypeError"


def test_the_stats_table() -> None:
    stats = {"calls": 3, "connections": 1, "draining": False, "methods": {
        "add": {"calls": 3, "errors": 1, "cancelled": 0, "expired": 0, "refused": 0,
                "in_flight": 0, "running": None, "waiting": 0, "max_concurrency": None,
                "latency_ms": {"count": 3, "p50": 0.031, "p90": 0.05, "p99": 0.2, "max": 0.2}},
        "slow": {"calls": 0, "errors": 0, "cancelled": 0, "expired": 0, "refused": 0,
                 "in_flight": 0, "running": 0, "waiting": 0, "max_concurrency": 2,
                 "latency_ms": {"count": 0, "p50": None, "p90": None, "p99": None,
                                "max": None}}}}
    table = format_stats(stats, "h:1").splitlines()
    assert table[0] == "h:1: 1 connections, 3 calls, draining: no"
    assert table[1].split() == ["method", "calls", "errors", "cancelled", "expired", "refused",
                                "in", "flight", "running", "waiting", "limit", "p50", "ms",
                                "p90", "ms", "p99", "ms", "max", "ms"]
    assert table[2].split() == ["add", "3", "1", "0", "0", "0", "0", "-", "0", "-", "0.031",
                                "0.050", "0.200", "0.200"]
    assert table[3].split() == ["slow", "0", "0", "0", "0", "0", "0", "0", "0", "2", "-", "-",
                                "-", "-"]
    assert format_stats({"methods": {}}).endswith("(no methods)")


def test_the_stats_command_takes_host_colon_port() -> None:
    import argparse

    from aiordma.cli.command import build_parser, host_port

    assert host_port("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert host_port("[::1]:7000") == ("::1", 7000)
    assert host_port("node-3.example:65535") == ("node-3.example", 65535)
    for bad in ("nope", ":7000", "h:", "h:0", "h:65536", "h:x", "h:-1", "[]:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            host_port(bad)
    args = build_parser().parse_args(["stats", "h:1", "--json"])
    assert args.address == ("h", 1) and args.json and args.timeout == 10.0
