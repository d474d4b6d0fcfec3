"""Stream calls in the RPC layer over the in-memory channel pair (aiordma.testing): server
streaming to a slow reader within the window, client streaming and bidirectional calls byte
for byte, cancellation from either side (the server's generator observes it), typed errors
mid-stream, deadlines on both sides, the bound on concurrent streams, a broken connection,
and misuse. No device: the same properties over rxe, with the server in another process, are
tests/rxe/test_rpc_streams.py."""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import pytest

from aiordma import BrokenResourceError, ClosedResourceError, LocalProtocolError, OperationTimeout
from aiordma.rpc import RemoteError, RpcStream, Service, method

from ..bounds import STEP
from ..rpc_services import Calc, Streamer, pattern
from ..rpc_services import served_over_memory as served


async def until(cond: Any, what: str) -> None:
    """Let the loop run until ``cond()``; fails after STEP seconds (a hang guard)."""
    async with asyncio.timeout(STEP):
        while not cond():
            await asyncio.sleep(0.001)
    assert cond(), what


# -- server streaming ----------------------------------------------------------------------------


@pytest.mark.usefixtures("over")
@pytest.mark.parametrize("window", [1, 2, 7, 16])
async def test_a_slow_reader_bounds_what_the_generator_produces(window: int) -> None:
    """The generator is never more than ``window`` items ahead of the client's reader, and does
    get that far ahead when the reader pauses (flow control, not lockstep)."""
    svc = Streamer()
    async with served(svc) as (client, _):
        regrant = max(1, window // 2)
        got = []
        async with client.stream("rows", 200, window=window) as rows:
            async for item in rows:
                got.append(item)
                assert svc.produced <= len(got) + window
                if len(got) % regrant == 0 and len(got) < 200 - window:
                    # the reader pauses: the generator fills the window, and stops there
                    await until(lambda: svc.produced == len(got) + window, "ahead by the window")
                    for _ in range(20):
                        await asyncio.sleep(0)
                    assert svc.produced == len(got) + window
        assert got == list(range(200)) and svc.ended == ["returned"]


@pytest.mark.usefixtures("over")
async def test_large_items_travel_out_of_band_in_order() -> None:
    async with served(Streamer()) as (client, _):
        got = [bytes(x) async for x in client.stream("rows", 12, size=200_000, window=3)]
        assert got == [pattern(i, 200_000) for i in range(12)]


@pytest.mark.usefixtures("over")
async def test_streams_and_unary_calls_share_a_connection() -> None:
    async with served(Streamer(), max_streams=8) as (client, _):

        async def read(n: int) -> list[int]:
            return [x async for x in client.stream("rows", n, window=2)]

        streams = [read(n) for n in (0, 1, 5, 50)]
        unary = [client.call("stats") for _ in range(10)]
        got = await asyncio.wait_for(asyncio.gather(*streams, *unary), STEP)
        assert got[:4] == [list(range(n)) for n in (0, 1, 5, 50)]


# -- client streaming and bidirectional ----------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_client_streaming_round_trips_byte_for_byte() -> None:
    import hashlib

    svc = Streamer()
    chunks = [os.urandom(n) for n in (0, 1, 100, 8180, 8181, 70_000, 300_000, 5)] * 3
    async with served(svc, stream_window=4) as (client, _), \
            client.stream_call("upload", "t1", window=4) as call:
        for chunk in chunks:
            await call.send(chunk)
        await call.send_eof()
        got = await asyncio.wait_for(call.result(), STEP)
    assert got == {"tag": "t1", "count": len(chunks), "bytes": sum(map(len, chunks)),
                   "sha256": hashlib.sha256(b"".join(chunks)).hexdigest()}


@pytest.mark.usefixtures("over")
async def test_the_client_is_never_more_than_the_window_ahead_of_the_method() -> None:
    """A method that reads slowly: each send() waits while the server's window is full, so the
    items sent never exceed what the method read plus its window."""
    svc = Streamer()
    sent = 0
    async with served(svc, stream_window=3) as (client, _), \
            client.stream_call("slow_reader", 0.001) as call:
        for i in range(40):
            await call.send(i)
            sent += 1
            assert sent <= svc.read + 3
        await call.send_eof()
        assert await asyncio.wait_for(call.result(), STEP) == 40


@pytest.mark.usefixtures("over")
async def test_bidirectional_items_round_trip() -> None:
    values: list[Any] = [0, -1, 2**63, 1.5, "text", None, True, b"", os.urandom(100_000),
                         [1, [2, {"k": b"v"}]], {"a": 1}]
    async with served(Streamer()) as (client, _), \
            client.stream_call("echo_stream", window=2) as call:
        for v in values[:3]:  # lock step
            await call.send(v)
            assert await asyncio.wait_for(anext(call), STEP) == v

        async def writer() -> None:
            for v in values[3:] * 20:
                await call.send(v)
            await call.send_eof()

        w = asyncio.ensure_future(writer())
        got = [x async for x in call]
        await asyncio.wait_for(w, STEP)
        assert [bytes(x) if isinstance(x, memoryview) else x for x in got] == values[3:] * 20
        assert await call.result() is None


@pytest.mark.usefixtures("over")
async def test_a_method_that_stops_reading_ends_the_call_for_the_sender() -> None:
    svc = Streamer()
    async with served(svc, stream_window=2) as (client, _):
        async with client.stream_call("read_some", 3) as call:
            with pytest.raises(BrokenResourceError, match="result"):
                for i in range(100):
                    await asyncio.wait_for(call.send(i), STEP)
            assert await call.result() == [0, 1, 2]
        assert await client.call("stats")  # the connection goes on


# -- cancellation --------------------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_leaving_async_with_cancels_the_servers_generator() -> None:
    svc = Streamer()
    async with served(svc, client_limit=1) as (client, server):
        async with client.stream("rows", -1, window=4) as rows:
            async for item in rows:
                if item == 10:
                    break
        await until(lambda: svc.ended, "the generator ended")
        assert svc.ended == ["GeneratorExit"] and svc.produced <= 11 + 4
        await until(lambda: server.cancelled == 1, "the call answered as cancelled")
        # its place among the client's max_in_flight (1) is free again
        assert await asyncio.wait_for(client.call("stats"), STEP)


@pytest.mark.usefixtures("over")
async def test_a_stream_dropped_after_break_is_cancelled() -> None:
    """``async for x in client.stream(...): break`` without ``async with``: the call is
    cancelled when the dropped StreamCall is collected."""
    svc = Streamer()
    async with served(svc) as (client, _):
        async for item in client.stream("rows", -1, window=2):
            if item == 3:
                break
        gc.collect()
        await until(lambda: svc.ended, "the generator ended")
        assert svc.ended == ["GeneratorExit"]


@pytest.mark.usefixtures("over")
async def test_aclose_and_a_cancelled_reader() -> None:
    svc = Streamer()
    async with served(svc) as (client, server):
        call = client.stream("slow", 30.0)
        assert await asyncio.wait_for(anext(call), STEP) == 0
        reader = asyncio.ensure_future(anext(call))
        await asyncio.sleep(0.01)
        reader.cancel()  # a cancelled wait leaves the call as it was
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert not svc.ended
        pending = asyncio.ensure_future(anext(call))
        await asyncio.sleep(0.01)
        await call.aclose()
        with pytest.raises(ClosedResourceError):
            await asyncio.wait_for(pending, STEP)
        with pytest.raises(ClosedResourceError):
            await anext(call)
        await until(lambda: svc.ended, "the generator ended")
        assert svc.ended == ["CancelledError"]  # (cancelled in its sleep)
        await until(lambda: server.cancelled == 1, "answered as cancelled")


@pytest.mark.usefixtures("over")
async def test_a_client_that_leaves_cancels_its_streams() -> None:
    svc = Streamer()
    async with served(svc) as (client, _):
        call = client.stream("rows", -1, window=2)
        await anext(call)
        client.abort()
        await until(lambda: svc.ended, "the generator ended")
        with pytest.raises(ClosedResourceError):
            await asyncio.wait_for(anext(call), STEP)


# -- errors and deadlines ------------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_an_error_mid_stream_arrives_typed_after_the_items_before_it() -> None:
    svc = Streamer()
    async with served(svc) as (client, _):
        got = []
        with pytest.raises(RemoteError) as info:
            async for item in client.stream("fail_after", 5, "broken at 5", window=2):
                got.append(item)
        assert got == [0, 1, 2, 3, 4]
        assert (info.value.type_name, info.value.message) == ("ValueError", "broken at 5")
        with pytest.raises(RemoteError):  # again: the call stays failed
            await anext(aiter_of := client.stream("fail_after", 0, "x"))
        with pytest.raises(RemoteError):
            await aiter_of.result()


@pytest.mark.usefixtures("over")
async def test_an_item_that_cannot_travel_fails_the_call_typed() -> None:
    class Bad(Service):
        @method
        async def items(self) -> Any:
            yield 1
            yield {1, 2}  # a set: msgpack cannot carry it

    async with served(Bad()) as (client, _):
        got = []
        with pytest.raises(RemoteError) as info:
            async for item in client.stream("items"):
                got.append(item)
        assert got == [1] and info.value.type_name == "LocalProtocolError"
    async with served(Streamer()) as (client, _), client.stream_call("echo_stream") as call:
        with pytest.raises(LocalProtocolError):
            await call.send({1, 2})  # the client's side: refused before sending
        await call.send(2)
        assert await asyncio.wait_for(anext(call), STEP) == 2  # and the call goes on


@pytest.mark.usefixtures("over")
async def test_a_streams_deadline_expires_typed_on_both_sides() -> None:
    svc = Streamer()
    async with served(svc) as (client, server):
        got = []
        with pytest.raises(OperationTimeout):
            async for item in client.stream("slow", 30.0, timeout=0.3):
                got.append(item)
        assert got == [0]
        await until(lambda: svc.ended, "the generator ended")
        assert svc.ended == ["CancelledError"]
        # the server's own clock: the client reads nothing until past the deadline
        svc.ended.clear()
        async with client.stream("slow", 30.0, timeout=0.3) as call:
            assert await anext(call) == 0
            await until(lambda: svc.ended, "the server's deadline cancelled the generator")
            with pytest.raises(OperationTimeout):
                await asyncio.wait_for(anext(call), STEP)
        assert svc.ended == ["CancelledError"]
        # a client stream's deadline, while it waits for room to send
        async with client.stream_call("slow_reader", 30.0, timeout=0.3) as call:
            with pytest.raises(OperationTimeout):
                for i in range(100):
                    await call.send(i)
        assert server.calls >= 3


# -- limits --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_at_most_max_streams_methods_run_at_once() -> None:
    svc = Streamer()
    async with served(svc, max_streams=2) as (client, _):
        calls = [client.stream("slow", 30.0) for _ in range(4)]
        firsts = [asyncio.ensure_future(anext(c)) for c in calls]
        await until(lambda: sum(f.done() for f in firsts) == 2, "two streams started")
        for _ in range(50):
            await asyncio.sleep(0)
        assert svc.produced == 2  # the other two wait for a place
        await calls[0].aclose()
        await until(lambda: sum(f.done() for f in firsts) == 3, "a third started")
        for c in calls:
            await c.aclose()


@pytest.mark.usefixtures("over")
async def test_a_broken_connection_fails_open_streams() -> None:
    async with served(Streamer()) as (client, server):
        call = client.stream("slow", 30.0)
        up = client.stream_call("slow_reader", 30.0)
        await anext(call)
        await up.send(1)
        next(iter(server._sessions)).abort()  # (the server's end of the connection)
        with pytest.raises(BrokenResourceError):
            await asyncio.wait_for(anext(call), STEP)
        with pytest.raises(BrokenResourceError):
            await asyncio.wait_for(up.send(2), STEP)


# -- misuse --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("over")
async def test_calling_a_method_the_wrong_way_is_a_typed_error() -> None:
    async with served(Streamer()) as (client, _):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(client.call("rows", 3), STEP)
        assert info.value.type_name == "LocalProtocolError" and "stream()" in info.value.message
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(anext(client.stream("stats")), STEP)
        assert info.value.type_name == "LocalProtocolError" and "call()" in info.value.message
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(anext(client.stream("nothing")), STEP)
        assert info.value.type_name == "AttributeError"
        with pytest.raises(LocalProtocolError):
            await client.stream("rows", 3).send(1)  # stream() sends nothing
        async with client.stream_call("upload", "x") as call:
            await call.send_eof()
            with pytest.raises(ClosedResourceError):
                await call.send(b"more")
            assert (await call.result())["count"] == 0
        with pytest.raises(RemoteError) as info:  # the stream parameter is not an argument
            await asyncio.wait_for(client.stream_call("upload", "x", chunks=1).result(), STEP)
        assert info.value.type_name == "TypeError"
        assert await asyncio.wait_for(client.call("stats"), STEP)


@pytest.mark.usefixtures("over")
@pytest.mark.parametrize(("name", "timeout", "window"), [
    (3, None, 16), ("", None, 16), ("rows", -1, 16), ("rows", float("nan"), 16),
    ("rows", None, 0), ("rows", None, True), ("rows", None, 2**32), ("rows", None, "8")])
async def test_stream_refuses_bad_arguments_at_once(name: Any, timeout: Any, window: Any) -> None:
    async with served(Calc()) as (client, server):
        for make in (client.stream, client.stream_call):
            if name == "":
                with pytest.raises((LocalProtocolError, RemoteError)):
                    await make(name, timeout=timeout, window=window).result()
                continue
            with pytest.raises(LocalProtocolError):
                make(name, timeout=timeout, window=window)
        assert server.calls == 0 or name == ""


def test_method_refuses_what_cannot_stream() -> None:
    with pytest.raises(LocalProtocolError):
        def gen(self: Any) -> Any:
            yield 1
        method(gen)
    with pytest.raises(LocalProtocolError):
        def plain(self: Any, items: RpcStream[int]) -> None:
            pass
        method(plain)
    with pytest.raises(LocalProtocolError):
        async def two(self: Any, a: RpcStream[int], b: RpcStream[int]) -> None:
            pass
        method(two)
    with pytest.raises(LocalProtocolError):
        async def positional(self: Any, items: RpcStream[int], /) -> None:
            pass
        method(positional)
