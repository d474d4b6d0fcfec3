"""The RPC layer's behaviour over the in-memory channel pair (aiordma.testing): calls, typed
remote errors, deadlines that cancel the server's task, cancellation, admission at
max_in_flight, ordering under backpressure, closing and aborting either side, a client that
breaks the protocol. No device: the RPC layer depends only on the channel seam, and the
channel contract is checked against real endpoints in tests/rxe/test_channel_contract.py."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

import pytest

from aiordma import BrokenResourceError, ClosedResourceError, OperationTimeout, protocols
from aiordma._places import Places
from aiordma.rpc import RemoteError, RpcClient, RpcServer, Service, Unavailable, method
from aiordma.rpc._server import CHUNK
from aiordma.rpc._method import admitted as _admitted
from aiordma.testing import channel_pair

from ..bounds import STEP
from ..rpc_services import Calc, Gauge, PlainChannel
from ..rpc_services import served_over_memory as served
from .rpc_builds import rpc_layer_build  # noqa: F401  # (each test with both builds)


@pytest.mark.usefixtures("over")
async def test_calls_errors_deadlines_and_large_values() -> None:
    calc = Calc()
    async with served(calc) as (client, server):
        assert await asyncio.wait_for(client.call("add", 1, 2), STEP) == 3
        assert await asyncio.wait_for(client.add(a=40, b=2), STEP) == 42
        assert await asyncio.wait_for(
            asyncio.gather(*(client.add(i, i) for i in range(40))), STEP) == [
            2 * i for i in range(40)]
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.fail("boom"), STEP)
        assert (info.value.type_name, info.value.message) == ("ValueError", "boom")
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.not_exported(), STEP)
        assert info.value.type_name == "AttributeError"
        with pytest.raises(OperationTimeout):
            await client.call("sleep", 30.0, timeout=0.2)
        await asyncio.wait_for(calc.cancelled.wait(), STEP)  # the server's task was cancelled
        big = os.urandom(1 << 20)  # out of band, past eager_max
        assert bytes(await asyncio.wait_for(client.echo(big), STEP)) == big
        nested = {"k": [1, 2.5, "x", None, True], "blob": os.urandom(100)}
        assert await asyncio.wait_for(client.echo(nested), STEP) == nested
        assert server.calls == 47


class Bounded(Service):
    """Methods with bounds of their own, called with a deadline."""

    @method
    async def own_timeout(self) -> None:
        async with asyncio.timeout(0.01):  # (its own: an ordinary error, not the deadline)
            await asyncio.sleep(30)

    @method
    async def shrug(self) -> str:
        try:  # (a method that lets the deadline's cancellation go)
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0)  # (no cancellation left behind: this await is not cancelled)
        return "late"


@pytest.mark.usefixtures("over")
async def test_a_deadline_and_the_bounds_a_method_keeps_itself() -> None:
    """The server bounds a method by the caller's deadline with a timer (_method's
    within_deadline), the client its wait for the answer: a method's own timeout is an
    ordinary error (not the deadline's), one that swallows the deadline's cancellation
    still ends without a cancellation left behind, and the connection goes on serving."""
    async with served(Bounded()) as (client, _):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.call("own_timeout", timeout=5.0), STEP)
        assert info.value.type_name == "TimeoutError"
        with pytest.raises(OperationTimeout):
            await asyncio.wait_for(client.call("shrug", timeout=0.1), STEP)
        for _ in range(3):
            with pytest.raises(RemoteError):
                await asyncio.wait_for(client.call("own_timeout", timeout=5.0), STEP)
        await asyncio.sleep(0.01)  # (a cancellation left behind in this task would land here)


@pytest.mark.usefixtures("over")
async def test_a_deadline_already_spent_always_expires() -> None:
    """timeout=0 is a bound already spent: the call expires even where its answer could come
    back within the loop's next turn (over memory, answered inline), and the connection goes
    on serving."""
    async with served(Calc()) as (client, _):
        for _ in range(50):
            with pytest.raises(OperationTimeout):
                await asyncio.wait_for(client.call("add", 1, 2, timeout=0), STEP)
        assert await asyncio.wait_for(client.call("add", 1, 2, timeout=5), STEP) == 3


@pytest.mark.usefixtures("over")
async def test_a_cancelled_caller_cancels_the_servers_task() -> None:
    calc = Calc()
    async with served(calc) as (client, server):
        call = asyncio.ensure_future(client.sleep(30.0))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(calc.cancelled.wait(), STEP)
        assert await asyncio.wait_for(client.add(2, 2), STEP) == 4
        assert server.cancelled == 1


@pytest.mark.usefixtures("over")
async def test_admission_at_the_servers_max_in_flight() -> None:
    """The server runs at most its max_in_flight calls per connection, queues the rest, and
    answers them all."""
    gauge = Gauge()
    async with served(gauge, server_limit=3, client_limit=16) as (client, _):
        ids = await asyncio.wait_for(asyncio.gather(*(client.hold(0.02) for _ in range(12))),
                                     STEP)
        assert len(set(ids)) == 1 and gauge.peak[ids[0]] == 3


@pytest.mark.usefixtures("over")
async def test_timed_out_calls_leave_room_for_new_ones() -> None:
    async with served(Calc(), server_limit=1, client_limit=1) as (client, _):
        for _ in range(3):
            with pytest.raises(OperationTimeout):
                await client.call("sleep", 30.0, timeout=0.1)
            assert await asyncio.wait_for(client.add(1, 2), STEP) == 3


@pytest.mark.usefixtures("over")
async def test_requests_keep_their_order_under_backpressure() -> None:
    """A server whose receive buffer is empty and whose slots are few: requests wait for the
    sender's writer task, none overtakes another, every answer is right."""
    async with served(Calc(), recv_buffer=0, slots=2) as (client, _):
        got = await asyncio.wait_for(asyncio.gather(*(client.add(i, 1) for i in range(300))),
                                     STEP)
        assert got == [i + 1 for i in range(300)]


def counting_sends(channel: Any) -> list[int]:
    """Count the messages ``channel`` sends (both ways of sending), in a one-item list."""
    count = [0]
    send, send_nowait = channel.send, channel.send_nowait

    async def counted_send(data: Any) -> None:
        await send(data)
        count[0] += 1

    def counted_send_nowait(data: Any) -> bool:
        sent: bool = send_nowait(data)
        count[0] += sent
        return sent

    channel.send, channel.send_nowait = counted_send, counted_send_nowait
    return count


async def test_calls_made_in_one_tick_travel_as_one_message_and_come_back_in_chunks() -> None:
    """64 calls started together: the first request leaves at once, the other 63 as one batch
    at the tick's end; the server serves them CHUNK at a time, each chunk's answers in one
    message (64 messages each way without batching). A call alone costs one message each
    way."""
    a, b = channel_pair()
    requests, answers = counting_sends(a), counting_sends(b)
    server = RpcServer(Calc(), max_in_flight=64, grace=1.0)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, max_in_flight=64)
    try:
        got = await asyncio.wait_for(asyncio.gather(*(client.add(i, 1) for i in range(64))),
                                     STEP)
        assert got == [i + 1 for i in range(64)]
        # (the 64 // CHUNK chunks, and at most the lone first call's and a split chunk's)
        assert requests[0] == 2 and 64 // CHUNK <= answers[0] <= 64 // CHUNK + 2, answers
        before = requests[0], answers[0]
        assert await asyncio.wait_for(client.add(2, 2), STEP) == 4
        assert (requests[0], answers[0]) == (before[0] + 1, before[1] + 1)
    finally:
        client.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)


async def test_plain_def_methods_run_inline_answer_typed_and_batch() -> None:
    """A plain ``def`` method runs inline in the connection's task (no task of its own), sees
    its caller through current_endpoint(), sets context variables only in its own copy, fails
    with a typed remote error, and mixes with ``async def`` calls. A lone inline call costs one
    message each way; 64 made in one tick, two requests (the first alone, then one batch) and
    an answer per chunk the server serves."""
    calc = Calc()
    a, b = channel_pair()
    requests, answers = counting_sends(a), counting_sends(b)
    server = RpcServer(calc, max_in_flight=64, grace=1.0)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, max_in_flight=64)
    try:
        assert await asyncio.wait_for(client.mul(6, 7), STEP) == 42
        assert (requests[0], answers[0]) == (1, 1)
        assert calc.inline_tasks == [None]  # no task: it ran in the channel's wake-up
        assert await asyncio.wait_for(client.caller(), STEP) == b.id
        assert await asyncio.wait_for(client.tag(), STEP) == "untouched"
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.fail_now("gone"), STEP)
        assert info.value.type_name == "KeyError" and "gone" in info.value.message

        before = requests[0], answers[0]
        got = await asyncio.wait_for(asyncio.gather(*(client.mul(i, 3) for i in range(64))),
                                     STEP)
        assert got == [3 * i for i in range(64)]
        sent = requests[0] - before[0], answers[0] - before[1]
        assert sent[0] == 2 and 64 // CHUNK <= sent[1] <= 64 // CHUNK + 2, sent

        mixed = [client.mul(i, 2) if i % 2 else client.add(i, 2) for i in range(40)]
        got = await asyncio.wait_for(asyncio.gather(*mixed), STEP)
        assert got == [i * 2 if i % 2 else i + 2 for i in range(40)]
        assert len(calc.inline_tasks) == 1 + 64 + 20 and server.calls == 1 + 1 + 1 + 1 + 64 + 40
    finally:
        client.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)


class Seen(Service):
    """``seen()``: how many answer messages the server had sent when it ran (inline)."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = answers

    @method
    def seen(self) -> int:
        return self.answers[0]


async def test_a_batch_is_served_in_chunks_whose_answers_leave_before_the_rest() -> None:
    """A batch of 64 requests is served CHUNK at a time, and each chunk's answers leave before
    the next chunk is served: so the client works on the first answers while the server
    serves the rest (without chunks, the 63 of the batch all ran before any answer left)."""
    a, b = channel_pair()
    answers = counting_sends(b)
    server = RpcServer(Seen(answers), max_in_flight=64, grace=1.0)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, max_in_flight=64)
    try:
        seen = await asyncio.wait_for(asyncio.gather(*(client.seen() for _ in range(64))), STEP)
        assert seen == sorted(seen)  # (served in order)
        per_answer = Counter(seen)  # calls served while so many answers had left
        assert max(per_answer.values()) <= CHUNK and len(per_answer) >= 64 // CHUNK, seen
    finally:
        client.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)


class DrainsAfter(Service):
    """``seen()`` counts its calls; the ``after``-th starts a drain of ``server``."""

    def __init__(self, after: int) -> None:
        self.after, self.calls = after, 0
        self.server: RpcServer | None = None
        self.draining: asyncio.Task[None] | None = None

    @method
    def seen(self) -> int:
        self.calls += 1
        if self.calls == self.after and self.server is not None:
            self.draining = asyncio.ensure_future(self.server.drain(STEP))
        return self.calls


async def test_requests_left_for_a_later_turn_are_refused_once_a_drain_begins() -> None:
    """A drain that begins between two chunks of a batch: the chunk served is answered, the
    rest of the batch is refused with Unavailable (the method did not run), as requests not
    yet read are; nothing is lost to a closed connection."""
    service = DrainsAfter(after=CHUNK)
    a, b = channel_pair()
    server = service.server = RpcServer(service, max_in_flight=64, grace=1.0)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, max_in_flight=64)
    try:
        await asyncio.wait_for(client.seen(), STEP)  # (the next 64 go as one batch)
        service.calls, service.after = 0, CHUNK
        got = await asyncio.wait_for(asyncio.gather(*(client.seen() for _ in range(64)),
                                                    return_exceptions=True), STEP)
        ran = [g for g in got if isinstance(g, int)]
        assert ran == list(range(1, len(ran) + 1)) and CHUNK <= len(ran) < 64, got
        assert all(isinstance(g, Unavailable) for g in got[len(ran):]), got
        assert service.calls == len(ran)
        assert service.draining is not None
        await asyncio.wait_for(service.draining, STEP)
    finally:
        client.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)


async def test_the_ready_path_and_the_task_path_read_the_same() -> None:
    """Over a ReadyChannel (the in-memory pair) the server and the client take each message in
    the channel's wake-up: a ``def`` method runs there, with no task. Over a channel that is
    only a MessageChannel they read with a task each: the method runs in the connection's
    task. The answers are the same, one by one and 64 at once."""
    from aiordma.transport import ReadyChannel

    for plain in (False, True):
        calc = Calc()
        a, b = channel_pair()
        assert isinstance(a, ReadyChannel)
        ca, cb = (PlainChannel(a), PlainChannel(b)) if plain else (a, b)
        assert isinstance(cb, ReadyChannel) is not plain
        server = RpcServer(calc, max_in_flight=64, grace=1.0)
        serving = asyncio.ensure_future(server.serve_connection(cb))
        client = RpcClient(ca, max_in_flight=64)
        try:
            assert await asyncio.wait_for(client.mul(6, 7), STEP) == 42
            assert calc.inline_tasks == [serving if plain else None]
            got = await asyncio.wait_for(
                asyncio.gather(*(client.mul(i, 3) for i in range(64))), STEP)
            assert got == [i * 3 for i in range(64)]
            assert await asyncio.wait_for(client.add(2, 2), STEP) == 4
        finally:
            client.abort()
            await asyncio.wait_for(server.aclose(), STEP)
            await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)


def test_method_takes_functions_only() -> None:
    """@method takes an ``async def`` or a ``def``; anything else is refused, typed."""
    from aiordma import LocalProtocolError
    from aiordma.rpc import method

    async def agen():  # type: ignore[no-untyped-def]
        yield 1

    def gen():  # type: ignore[no-untyped-def]
        yield 1

    for bad in (gen, len, "name", 3):
        with pytest.raises(LocalProtocolError):
            method(bad)  # type: ignore[type-var]
    assert method(agen) is agen  # an async generator streams (tests/unit/test_rpc_streams_*)


@pytest.mark.usefixtures("over")
async def test_a_closed_client_says_closed() -> None:
    async with served(Calc()) as (client, _):
        pending = asyncio.ensure_future(client.sleep(30.0))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(client.aclose(), STEP)
        with pytest.raises(ClosedResourceError):
            await asyncio.wait_for(pending, STEP)
        with pytest.raises(ClosedResourceError):
            await asyncio.wait_for(client.add(1, 2), STEP)


@pytest.mark.usefixtures("over")
async def test_a_server_that_goes_away_fails_pending_calls_as_broken() -> None:
    async with served(Calc()) as (client, server):
        pending = asyncio.ensure_future(client.sleep(30.0))
        await asyncio.sleep(0.05)
        server.abort()
        with pytest.raises(BrokenResourceError):
            await asyncio.wait_for(pending, STEP)
        with pytest.raises(BrokenResourceError):
            await asyncio.wait_for(client.add(1, 2), STEP)


@pytest.mark.usefixtures("over")
async def test_shutdown_finishes_calls_in_flight_and_refuses_new_ones() -> None:
    calc = Calc()
    async with served(calc, grace=STEP) as (client, server):
        call = asyncio.ensure_future(client.sleep(0.3))
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(server.aclose())
        await asyncio.sleep(0.05)
        with pytest.raises((Unavailable, BrokenResourceError)) as info:
            await asyncio.wait_for(client.add(1, 1), STEP)
        if isinstance(info.value, RemoteError):
            assert info.value.type_name == "aiordma.Unavailable"
        assert await asyncio.wait_for(call, STEP) == "slept"
        await asyncio.wait_for(closing, STEP)
        assert calc.finished_slow == 1


async def test_garbage_from_a_client_ends_its_connection_only() -> None:
    """A client that sends bytes that are not an RPC frame: the server drops that connection
    (its end sees the end of the stream) and records why, typed; another client of the same
    server is served."""
    server = RpcServer(Calc(), max_in_flight=8, grace=1.0)
    bad, bad_server_end = channel_pair()
    good, good_server_end = channel_pair()
    serving = [asyncio.ensure_future(server.serve_connection(c))
               for c in (bad_server_end, good_server_end)]
    client = RpcClient(good, max_in_flight=8)
    try:
        await asyncio.wait_for(bad.send(b"\xff\x00 not a frame"), STEP)
        assert await asyncio.wait_for(bad.recv(), STEP) is None  # dropped (a graceful close)
        assert server.protocol_errors == 1
        assert isinstance(server.last_protocol_error, protocols.errors.RemoteProtocolError)
        assert await asyncio.wait_for(client.add(20, 22), STEP) == 42
        assert server.protocol_errors == 1
    finally:
        client.abort()
        bad.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.wait_for(asyncio.gather(*serving, return_exceptions=True), STEP)


async def test_a_cancel_right_behind_its_request_is_answered() -> None:
    """A client may send a Cancel in the message right after its Request: the server, which
    takes both before its call's task has run a step, still answers the call (the answer is
    what frees the id on the client; a task cancelled before its first step would never send
    it), and its shutdown is not held up by that task."""
    rpc = protocols.rpc
    server = RpcServer(Calc(), max_in_flight=8, grace=10 * STEP)  # (a wait for grace fails)
    a, b = channel_pair()
    serving = asyncio.ensure_future(server.serve_connection(b))
    conn = rpc.RpcConnection(rpc.Role.CLIENT)
    try:
        async with asyncio.timeout(STEP):  # (no task per send: both arrive in one tick)
            for event in (rpc.Request(id=1, method="sleep", args=(30.0,)), rpc.Cancel(id=1)):
                for msg in conn.send(event):
                    await a.send(msg)
        conn.receive_message(await asyncio.wait_for(a.recv(), STEP))
        assert conn.next_event() == rpc.Error(id=1, type="CancelledError",
                                              message="the call was cancelled")
        assert conn.in_flight == frozenset() and server.cancelled == 1
    finally:
        a.abort()
        await asyncio.wait_for(server.aclose(), STEP)
        await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)


async def test_calls_dropped_before_they_ran_do_not_hold_up_shutdown() -> None:
    """A request followed by garbage: the server starts the call, then drops the connection
    before the call's task ran a step (so the task never runs). Shutting the server down
    afterwards does not wait ``grace`` for that task."""
    rpc = protocols.rpc
    server = RpcServer(Calc(), max_in_flight=8, grace=10 * STEP)  # (a wait for grace fails)
    a, b = channel_pair()
    serving = asyncio.ensure_future(server.serve_connection(b))
    try:
        async with asyncio.timeout(STEP):  # (no task per send: both arrive in one tick)
            for msg in rpc.RpcConnection(rpc.Role.CLIENT).send(
                    rpc.Request(id=1, method="sleep", args=(30.0,))):
                await a.send(msg)
            await a.send(b"\xff\x00 not a frame")
        assert await asyncio.wait_for(a.recv(), STEP) is None  # dropped
        await asyncio.wait_for(serving, STEP)
        assert server.calls == 1
    finally:
        a.abort()
        await asyncio.wait_for(server.aclose(), STEP)


def test_the_host_benchmark_runs_and_reports_every_figure() -> None:
    """scripts/host_bench.py (the host figures of docs/reports/) runs and prints each figure."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "host_bench.py"
    out = subprocess.run([sys.executable, str(script), "--calls", "128"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    figures = re.findall(r"^(RPC .*): ([0-9.]+) us", out, re.MULTILINE)
    assert len(figures) == 9, out
    assert all(float(v) > 0 for _, v in figures)


async def test_admission_hands_places_on_in_order_and_through_cancellations() -> None:
    """The server's admission (aiordma._places.Places, a semaphore without its price): waiters
    get places in arrival order; one cancelled while waiting leaves the queue; one cancelled after it was handed a
    place passes the place on; every place comes back."""
    adm = Places(1)
    gate = asyncio.Event()
    order: list[str] = []

    async def hold() -> str:
        await gate.wait()
        return "a"

    async def note(x: str) -> str:
        order.append(x)
        return x

    first = asyncio.ensure_future(_admitted(adm, hold, (), {}))
    await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(_admitted(adm, note, (x,), {})) for x in "bcd"]
    await asyncio.sleep(0)
    assert (adm.free, len(adm.waiters)) == (0, 3)
    waiting[1].cancel()  # "c", still waiting: leaves the queue
    await asyncio.sleep(0)
    assert len(adm.waiters) == 2
    gate.set()
    await asyncio.sleep(0)  # "first" ends and hands its place to "b", which has not run yet
    assert first.result() == "a" and not waiting[0].done()
    waiting[0].cancel()  # so "b" passes the place on to "d"
    assert await asyncio.wait_for(waiting[2], STEP) == "d"
    for t in waiting[:2]:
        with pytest.raises(asyncio.CancelledError):
            await t
    assert order == ["d"] and (adm.free, len(adm.waiters)) == (1, 0)


async def test_admission_survives_a_waiter_dropped_before_its_cancellation_ran() -> None:
    """A waiter cancelled, then passed over by a release before its task ran: nothing breaks,
    and the place is not lost."""
    adm = Places(1)
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def quick() -> str:
        return "ok"

    first = asyncio.ensure_future(_admitted(adm, hold, (), {}))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(_admitted(adm, quick, (), {}))
    await asyncio.sleep(0)
    gate.set()  # "first" runs before the waiter's task: its release drops the cancelled place
    waiter.cancel()  # its place future is cancelled now; its task runs after "first"
    await asyncio.wait_for(first, STEP)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (adm.free, len(adm.waiters)) == (1, 0)
    assert await asyncio.wait_for(_admitted(adm, quick, (), {}), STEP) == "ok"
