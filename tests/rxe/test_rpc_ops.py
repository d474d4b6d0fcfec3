"""Call metadata, interceptors, deadline propagation and server operations over rxe, the server
in another process (``ops_peer.py``, serving ``tests/rpc_ops_services.py``'s ``Traced``), on
both loops (the server's process runs the test's loop too):

* metadata and interceptors reach both sides: the client's interceptor adds a token, the
  server's checks it, swaps it for a user the method sees, stamps and times the answer, whose
  metadata the client reads (unary, beside an out-of-band value, and a stream); a client
  without the token is refused typed and the method does not run (counted by the server);
* a method's call to another service (a connection of its own, to its own process) carries
  what is left of its caller's deadline, and none with ``ignore_caller_deadline()``;
* ``drain()`` (started by SIGHUP) completes the calls in flight, running, queued behind the
  server's ``max_in_flight`` and a stream, refuses new ones typed while its built-in counters
  still answer, and refuses new connections; the process's own counts say what ran;
* ``@method(max_concurrency=2)`` holds across three connections (counted by the service, and
  by the server's counters while the calls wait); a waiting call's deadline bounds it;
* the counters over RPC and ``aiordma stats HOST:PORT`` (table and JSON) agree with the calls
  made.

The same behaviour in more detail, without a device: tests/unit/test_rpc_meta_over_memory.py
and test_rpc_ops_over_memory.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from aiordma import BrokenResourceError, OperationTimeout
from aiordma.rpc import STATS_METHOD, RemoteError, RpcClient, Unavailable
from aiordma.rpc import connect as rpc_connect

from ..bounds import STEP
from ..rpc_ops_services import LIMIT, recording, with_token
from .peers import _read_line, _start_announced


def loop_name(request: pytest.FixtureRequest) -> str:
    return "uvloop" if "uvloop" in request.node.callspec.id else "asyncio"


class OpsServer:
    """A running ``ops_peer.py``: its port and process."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc, self.port = proc, port

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def drained(self) -> dict[str, Any]:
        """After SIGHUP: the process's ``DRAINED`` line (its service's counts), and its exit."""
        line = _read_line(self.proc, STEP)
        assert line.startswith("DRAINED "), f"ops_peer.py said {line!r}"
        assert self.proc.wait(timeout=STEP) == 0
        got: dict[str, Any] = json.loads(line.split(" ", 1)[1])
        return got


@contextlib.contextmanager
def ops_server(request: pytest.FixtureRequest, *options: str) -> Iterator[OpsServer]:
    script = os.path.join(os.path.dirname(__file__), "ops_peer.py")
    proc, lines = _start_announced([sys.executable, script, "--loop", loop_name(request),
                                    *options], 1, 120.0)
    try:
        assert lines[0].startswith("RPC "), f"ops_peer.py said {lines[0]!r}"
        yield OpsServer(proc, int(lines[0].split()[1]))
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


async def connect(server: OpsServer, device: Any, **kw: Any) -> RpcClient:
    return await rpc_connect("127.0.0.1", server.port, timeout=STEP, device=device, **kw)


async def until(client: RpcClient, cond: Callable[[dict[str, Any]], bool],
                what: str) -> dict[str, Any]:
    """The server's counters (its built-in), asked until ``cond`` holds (bounded by STEP)."""
    deadline = time.monotonic() + STEP
    while not cond(s := await asyncio.wait_for(client.call(STATS_METHOD), STEP)):
        assert time.monotonic() < deadline, f"not within {STEP} s: {what} ({s})"
        await asyncio.sleep(0.01)
    return s


async def test_metadata_and_interceptors_reach_both_sides(
        rdma_device: Any, request: pytest.FixtureRequest) -> None:
    log: list[Any] = []
    with ops_server(request, "--auth") as server:
        client = await connect(server, rdma_device, interceptors=[
            with_token("good"), recording(log, "client")])
        stranger = await connect(server, rdma_device)
        try:
            blob = os.urandom(1 << 20)  # out of band (rendezvous), beside the metadata
            result, md = await asyncio.wait_for(client.call_with_metadata(
                "whoami", blob, metadata={"echo-id": "r-17", "trace.parent": b"\x01\x02"},
                timeout=STEP), STEP)
            assert result["metadata"] == {"echo-id": "r-17", "trace.parent": b"\x01\x02",
                                          "user": "alice"}  # the token swapped by auth
            # (a deadline travels in whole milliseconds, rounded up: up to 1 ms above STEP)
            assert bytes(result["args"][0]) == blob and 0 < result["remaining"] <= STEP + 0.001
            assert md["echo-id"] == "r-17" and md["auth"] == "ok"
            assert md["server-pid"] == str(server.proc.pid) and float(md["server-ms"]) >= 0
            assert log == [("client", "in", "whoami", {"echo-id": "r-17",
                                                       "trace.parent": b"\x01\x02",
                                                       "token": "good"}, True),
                           ("client", "out", "whoami")]
            async with client.stream("rows", 30, metadata={"a": "1"}, window=4,
                                     timeout=STEP) as rows:
                assert [i async for i in rows] == list(range(30))
            assert rows.answer_metadata["sent"] == "30"
            assert rows.answer_metadata["saw"] == "a,user"  # (the method's view)
            # no token: refused by the server's interceptor, typed, the method not run
            with pytest.raises(RemoteError) as info:
                await asyncio.wait_for(stranger.call("whoami", metadata={"echo-x": "y"}), STEP)
            assert (info.value.type_name, info.value.metadata["auth"]) == (
                "PermissionError", "refused")
            counts = await asyncio.wait_for(client.call("counts"), STEP)
            assert counts["ran"] == {"whoami": 1, "rows": 1}
            assert counts["intercepted"] == [["whoami", ["echo-id", "token", "trace.parent"]],
                                             ["rows", ["a", "token"]],
                                             ["whoami", ["echo-x"]], ["counts", ["token"]]]
        finally:
            client.abort()
            stranger.abort()


async def test_a_deadline_propagates_to_the_calls_a_method_makes(
        rdma_device: Any, request: pytest.FixtureRequest) -> None:
    ms = 0.001  # (a deadline travels in whole milliseconds, rounded up)
    with ops_server(request) as server:
        client = await connect(server, rdma_device)
        try:
            relay = client.call  # relay(name, port=...): a connection of its own, to itself
            seen = await asyncio.wait_for(relay("relay", "whoami", port=server.port,
                                                timeout=30), STEP)
            assert 0 < seen["remaining"] <= 30 + ms
            seen = await asyncio.wait_for(relay("relay", "whoami", port=server.port,
                                                inner_timeout=3, timeout=30), STEP)
            assert 0 < seen["remaining"] <= 3 + ms
            seen = await asyncio.wait_for(relay("relay", "whoami", port=server.port,
                                                ignore=True, timeout=30), STEP)
            assert seen["remaining"] is None
            # the deadline passes in the inner call: both give up, the inner method cancelled
            with pytest.raises(OperationTimeout):
                await asyncio.wait_for(relay("relay", "hold", 30.0, port=server.port,
                                             timeout=4.0), STEP)
            s = await until(client, lambda s: s["methods"]["hold"]["in_flight"] == 0,
                            "the inner hold answered")
            hold = s["methods"]["hold"]
            assert hold["calls"] == 1 and hold["expired"] + hold["cancelled"] == 1
            counts = await asyncio.wait_for(client.call("counts"), STEP)
            assert (counts["hold_cancelled"], counts["finished"]) == (1, 0)
        finally:
            client.abort()


async def test_drain_completes_the_calls_in_flight_and_refuses_new_ones(
        rdma_device: Any, request: pytest.FixtureRequest) -> None:
    with ops_server(request, "--max-in-flight", "1") as server:
        c1 = await connect(server, rdma_device)
        c2 = await connect(server, rdma_device)
        try:
            running = asyncio.ensure_future(c1.call("hold", -1, timeout=STEP))
            queued = asyncio.ensure_future(c1.call("hold", 0, timeout=STEP))  # behind it
            limited = asyncio.ensure_future(c2.call("limited", -1, "a", timeout=STEP))
            rows = c2.stream("rows", 40, window=2, timeout=STEP)
            assert await asyncio.wait_for(anext(rows), STEP) == 0
            await until(c2, lambda s: (s["methods"]["hold"]["in_flight"],
                                       s["methods"]["limited"]["in_flight"],
                                       s["methods"]["rows"]["in_flight"]) == (2, 1, 1),
                        "four calls in flight")
            server.signal(signal.SIGHUP)
            s = await until(c1, lambda s: s["draining"], "draining")
            assert s["methods"]["hold"]["in_flight"] == 2
            for client in (c1, c2):
                with pytest.raises(Unavailable):
                    await asyncio.wait_for(client.call("whoami"), STEP)
            with pytest.raises(BrokenResourceError):  # no new connections
                await asyncio.wait_for(connect(server, rdma_device), STEP)
            assert not any(t.done() for t in (running, queued, limited))
            server.signal(signal.SIGUSR2)  # the gate opens: the calls in flight end
            assert await asyncio.wait_for(asyncio.gather(running, queued, limited), STEP) == [
                "held", "held", "a"]
            assert [i async for i in rows] == list(range(1, 40))
            counts = await asyncio.to_thread(server.drained)
            assert counts["ran"] == {"hold": 2, "limited": 1, "rows": 1}  # no whoami ran
            assert counts["finished"] == 2
            with pytest.raises(BrokenResourceError):
                await asyncio.wait_for(c1.call("whoami"), STEP)
        finally:
            c1.abort()
            c2.abort()


async def test_a_methods_concurrency_limit_holds_across_connections(
        rdma_device: Any, request: pytest.FixtureRequest) -> None:
    with ops_server(request) as server:
        clients = [await connect(server, rdma_device) for _ in range(3)]
        try:
            tags = [str(i) for i in range(12)]
            calls = [asyncio.ensure_future(clients[i % 3].call("limited", -1, t, timeout=STEP))
                     for i, t in enumerate(tags)]
            s = await until(clients[0], lambda s: s["methods"]["limited"]["waiting"] == 10,
                            "ten calls waiting")  # (in flight from their arrival on)
            lim = s["methods"]["limited"]
            assert (lim["max_concurrency"], lim["running"], lim["waiting"]) == (LIMIT, LIMIT, 10)
            counts = await asyncio.wait_for(clients[0].call("counts"), STEP)
            assert counts["running"] == LIMIT and counts["ran"]["limited"] == LIMIT
            # a waiting call is bounded by its deadline, and never runs
            with pytest.raises(OperationTimeout):
                await clients[1].call("limited", -1, "late", timeout=1.0)
            server.signal(signal.SIGUSR2)
            assert await asyncio.wait_for(asyncio.gather(*calls), STEP) == tags
            counts = await asyncio.wait_for(clients[0].call("counts"), STEP)
            assert counts["peak"] == LIMIT and counts["ran"]["limited"] == 12
            assert "late" not in counts["order"]
            # one connection's calls start in the order they were sent
            await asyncio.wait_for(clients[2].call("reset"), STEP)
            tags = [str(i) for i in range(8)]
            assert await asyncio.wait_for(asyncio.gather(
                *(clients[2].call("limited", 0.02, t) for t in tags)), STEP) == tags
            counts = await asyncio.wait_for(clients[2].call("counts"), STEP)
            assert counts["order"] == tags and counts["peak"] == LIMIT
        finally:
            for c in clients:
                c.abort()


async def test_the_counters_over_rpc_and_the_stats_command(
        rdma_device: Any, request: pytest.FixtureRequest) -> None:
    with ops_server(request) as server:
        client = await connect(server, rdma_device)
        try:
            for _ in range(5):
                await asyncio.wait_for(client.call("whoami"), STEP)
            for _ in range(2):
                with pytest.raises(RemoteError):
                    await asyncio.wait_for(client.call("fail_with", "x"), STEP)
            await asyncio.wait_for(client.call("hold", 0.05), STEP)
            s = await asyncio.wait_for(client.call(STATS_METHOD), STEP)
            m = s["methods"]
            assert (m["whoami"]["calls"], m["whoami"]["errors"]) == (5, 0)
            assert (m["fail_with"]["calls"], m["fail_with"]["errors"]) == (2, 2)
            assert m["hold"]["latency_ms"]["max"] >= 50 and s["connections"] == 1
        finally:
            client.abort()
        # The command, one Python start-up (seconds in the VM) per run: its table against the
        # asyncio server, its JSON against the uvloop one (the counters are each loop's, above).
        where = f"127.0.0.1:{server.port}"
        cmd = [sys.executable, "-m", "aiordma", "stats", where, "--timeout", str(STEP)]
        if loop_name(request) == "asyncio":
            table = await asyncio.to_thread(subprocess.run, cmd, capture_output=True,
                                            text=True, timeout=2 * STEP, check=False)
            assert table.returncode == 0, table.stderr
            lines = table.stdout.splitlines()
            assert lines[0].startswith(f"{where}: ") and "draining: no" in lines[0]
            rows = {line.split()[0]: line.split() for line in lines[2:]}
            assert rows["whoami"][1:3] == ["5", "0"] and rows["fail_with"][1:3] == ["2", "2"]
            return
        got = await asyncio.to_thread(subprocess.run, [*cmd, "--json"], capture_output=True,
                                      text=True, timeout=2 * STEP, check=False)
        assert got.returncode == 0, got.stderr
        m = json.loads(got.stdout)["methods"]
        assert m["whoami"]["calls"] == 5 and m["fail_with"]["errors"] == 2
        assert m[STATS_METHOD]["calls"] == 2  # the client's, this one (counted)
