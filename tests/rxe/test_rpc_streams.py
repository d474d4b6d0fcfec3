"""RPC stream calls over rxe, the server in another process (``peer_process.py --rpc``, whose
service has ``tests/rpc_services.py``'s ``Streamer`` methods), on both loops (the server's
process runs the test's loop too): a server stream to a slow reader keeps the generator within
the window (counted: what it produced, read back by a unary call, against what the reader
took) and delivers everything in order; client streaming and bidirectional calls round-trip
byte for byte, the client within the server's window; cancelling from the client cancels the
server's generator (its ``finally`` records it, read back); an error mid-stream arrives typed;
a deadline expires typed on both sides; a killed server fails an open stream with
BrokenResourceError promptly. The same properties without a device, in more detail:
tests/unit/test_rpc_streams_over_memory.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from aiordma import BrokenResourceError, OperationTimeout
from aiordma.rpc import RemoteError, RpcClient
from aiordma.rpc import connect as rpc_connect

from ..bounds import PROMPT, STEP, load_factor
from ..rpc_services import pattern
from .peers import killable_peer

SERVER_WINDOW = 4  # the server's stream_window (peer_process.py --stream-window)


def loop_name(request: pytest.FixtureRequest) -> str:
    return "uvloop" if "uvloop" in request.node.callspec.id else "asyncio"


@pytest.fixture(scope="module")
def server_port(rdma_device: Any) -> Iterator[Callable[[str], int]]:
    """The port of a stream server process running the given loop (one per loop, started on
    first use, killed after the module)."""
    with contextlib.ExitStack() as stack:
        ports: dict[str, int] = {}

        def port(loop: str) -> int:
            if loop not in ports:
                peer = stack.enter_context(
                    killable_peer(loop, rpc=True, stream_window=SERVER_WINDOW))
                assert peer.rpc_port is not None
                ports[loop] = peer.rpc_port
            return ports[loop]

        yield port


@contextlib.asynccontextmanager
async def client_of(server_port: Callable[[str], int], request: pytest.FixtureRequest,
                    device: Any) -> Any:
    client = await rpc_connect("127.0.0.1", server_port(loop_name(request)), timeout=STEP,
                               device=device)
    try:
        await asyncio.wait_for(client.call("reset"), STEP)
        yield client
    finally:
        await asyncio.wait_for(client.aclose(), STEP)


async def stats(client: RpcClient) -> dict[str, Any]:
    got: dict[str, Any] = await asyncio.wait_for(client.call("stats"), STEP)
    return got


async def stats_until(client: RpcClient, cond: Callable[[dict[str, Any]], bool],
                      what: str) -> dict[str, Any]:
    """Ask for the server's counts until ``cond`` holds; fails after STEP (a hang guard)."""
    deadline = time.monotonic() + STEP
    while not cond(s := await stats(client)):
        assert time.monotonic() < deadline, f"not within {STEP} s: {what} ({s})"
        await asyncio.sleep(0.01)
    return s


def produced_at_least(n: int, s: dict[str, Any]) -> bool:
    return bool(s["produced"] >= n)


@pytest.mark.parametrize(("count", "size"), [(160, 64), (24, 100_000)])
async def test_a_server_stream_to_a_slow_reader_stays_within_the_window(
        rdma_device: Any, server_port: Any, request: pytest.FixtureRequest, count: int,
        size: int) -> None:
    """Every item arrives, in order, byte for byte; the generator never produced more than
    the window ahead of what the reader took, and did get that far ahead while it paused."""
    window = 8
    async with client_of(server_port, request, rdma_device) as client:
        taken = 0
        async with client.stream("rows", count, size=size, window=window,
                                 timeout=10 * STEP) as rows:
            async for item in rows:
                assert bytes(item) == pattern(taken, size)
                taken += 1
                if taken % (window // 2) == 0 and taken <= count - window:
                    # the reader pauses after returning credits: the generator fills the
                    # window and stops there
                    ahead = taken + window
                    s = await stats_until(client, functools.partial(produced_at_least, ahead),
                                          "the generator ahead by the window")
                    assert s["produced"] == ahead
                else:
                    assert (await stats(client))["produced"] <= taken + window
        assert taken == count
        assert (await stats(client))["ended"] == ["returned"]


async def test_client_streaming_and_bidirectional_round_trip_byte_for_byte(
        rdma_device: Any, server_port: Any, request: pytest.FixtureRequest) -> None:
    sizes = [0, 1, 100, 8180, 8181, 65_536, 300_000, 7]
    chunks = [os.urandom(n) for n in sizes * 2]
    async with client_of(server_port, request, rdma_device) as client:
        async with client.stream_call("upload", "device", timeout=10 * STEP) as up:
            for chunk in chunks:
                await up.send(chunk)
            await up.send_eof()
            got = await up.result()
        assert got == {"tag": "device", "count": len(chunks), "bytes": sum(sizes) * 2,
                       "sha256": hashlib.sha256(b"".join(chunks)).hexdigest()}

        # a slow reader: the client's sends wait for the server's window
        await asyncio.wait_for(client.call("reset"), STEP)
        sent = 0
        async with client.stream_call("slow_reader", 0.05, timeout=10 * STEP) as up:
            for i in range(20):
                await up.send(i)
                sent += 1
                assert sent - (await stats(client))["read"] <= SERVER_WINDOW
            await up.send_eof()
            assert await up.result() == 20

        async with client.stream_call("echo_stream", window=3, timeout=10 * STEP) as both:
            for chunk in chunks[:4]:  # lock step
                await both.send(chunk)
                assert bytes(await asyncio.wait_for(anext(both), STEP)) == chunk

            async def writer() -> None:
                for chunk in chunks:
                    await both.send(chunk)
                await both.send_eof()

            w = asyncio.ensure_future(writer())
            echoed = [bytes(x) async for x in both]
            await asyncio.wait_for(w, STEP)
        assert echoed == chunks


async def test_cancelling_from_the_client_cancels_the_servers_generator(
        rdma_device: Any, server_port: Any, request: pytest.FixtureRequest) -> None:
    async with client_of(server_port, request, rdma_device) as client:
        async with client.stream("rows", -1, window=4) as rows:  # for ever
            async for item in rows:
                if item == 10:
                    break
        s = await stats_until(client, lambda s: s["ended"], "the generator ended")
        assert s["ended"] == ["GeneratorExit"] and s["produced"] <= 11 + 4

        # a reader task cancelled inside ``async with``: leaving it cancels the call
        async def read_for_ever() -> None:
            async with client.stream("slow", 30.0) as slow:
                async for _ in slow:
                    pass

        before = s["produced"]
        reader = asyncio.ensure_future(read_for_ever())
        await stats_until(client, lambda s: s["produced"] > before, "the second one started")
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        s = await stats_until(client, lambda s: len(s["ended"]) == 2, "it ended")
        assert s["ended"][1] == "CancelledError"  # (in its sleep)


async def test_an_error_mid_stream_reaches_the_client_typed(
        rdma_device: Any, server_port: Any, request: pytest.FixtureRequest) -> None:
    async with client_of(server_port, request, rdma_device) as client:
        got = []
        with pytest.raises(RemoteError) as info:
            async for item in client.stream("fail_after", 5, "broken at 5", window=2,
                                            timeout=STEP):
                got.append(item)
        assert got == [0, 1, 2, 3, 4]
        assert (info.value.type_name, info.value.message) == ("ValueError", "broken at 5")
        assert (await stats(client))["ended"] == ["ValueError"]


async def test_a_streams_deadline_expires_typed_on_both_sides(
        rdma_device: Any, server_port: Any, request: pytest.FixtureRequest) -> None:
    # the deadline must outlast the first item's way here: 2 s x the load factor
    # (tests/bounds.py), as the 30 s the generator then sleeps outlasts the deadline
    deadline = 2.0 * load_factor()
    async with client_of(server_port, request, rdma_device) as client:
        got = []
        with pytest.raises(OperationTimeout):
            async for item in client.stream("slow", 30.0, timeout=deadline):
                got.append(item)
        assert got == [0]
        s = await stats_until(client, lambda s: s["ended"], "the generator ended")
        assert s["ended"] == ["CancelledError"]
        # the server's clock alone: the client reads nothing until the server gave up
        async with client.stream("slow", 30.0, timeout=deadline) as call:
            assert await asyncio.wait_for(anext(call), STEP) == 0
            s = await stats_until(client, lambda s: len(s["ended"]) == 2, "the server's deadline")
            assert s["ended"][1] == "CancelledError"
            with pytest.raises(OperationTimeout):
                await asyncio.wait_for(anext(call), STEP)


async def test_a_killed_server_fails_an_open_stream_promptly(
        rdma_device: Any, request: pytest.FixtureRequest) -> None:
    with killable_peer(loop_name(request), rpc=True, stream_window=SERVER_WINDOW) as peer:
        client = await rpc_connect("127.0.0.1", peer.rpc_port or 0, timeout=STEP,
                                   device=rdma_device)
        try:
            down = client.stream("slow", 30.0)
            assert await asyncio.wait_for(anext(down), STEP) == 0
            up = client.stream_call("slow_reader", 30.0)
            for i in range(SERVER_WINDOW):  # the method reads one and sleeps: the window fills
                await asyncio.wait_for(up.send(i), STEP)
            reading = asyncio.ensure_future(anext(down))
            sending = asyncio.ensure_future(up.send("blocked"))
            await asyncio.sleep(0.2)
            assert not reading.done() and not sending.done(), "both should be waiting"
            k = load_factor()
            killed = peer.kill()
            for pending in (reading, sending):
                with pytest.raises(BrokenResourceError):
                    await asyncio.wait_for(pending, STEP)
            late = time.monotonic() - killed
            assert late < PROMPT * k, f"the stream failed {late:.2f} s after the kill"
        finally:
            client.abort()
