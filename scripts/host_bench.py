"""Host-side micro-benchmark of the RPC path's Python work, no device needed.

Usage: python scripts/host_bench.py [--calls N] [--cpu] [--metadata]

Prints, per figure, the best of three runs:
- the RPC protocol's four steps for one call (the client encodes a request with a 64 B
  argument, the server takes it and encodes the answer, the client takes that), sans-I/O;
- an RPC echo of 64 B over ``aiordma.testing.channel_pair()`` (the in-memory channel with an
  endpoint's semantics), at 1 and 64 calls in flight, on asyncio and on uvloop, served by the
  echo service (a plain ``def`` method: inline) and by the same method as an ``async def`` (a
  task per call).

``--cpu`` measures the process's CPU time instead of the wall clock: on a shared host, time
the process spent waiting for a core is left out (the figures are single-threaded: nothing
waits for anything else). ``--metadata`` adds the same figures for calls that carry two
metadata entries each way (code from wire version 5 on).

The device's share (verbs calls, completions, the kernel's rxe work) is not in these figures:
they show the Python work per call, which ``aiordma bench`` mixes with the device's.
To compare two versions of the code, run this file with each on ``PYTHONPATH`` (from a
directory that holds no ``aiordma``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

PAYLOAD = b"x" * 64
METADATA = {"request-id": "r-0123456789", "trace.parent": "00-0af7651916cd43dd-01"}
clock = time.perf_counter


def protocol_steps(calls: int, metadata: bool = False) -> float:
    """Microseconds for the four protocol steps of one call (best of three runs); with
    ``metadata``, the request and the answer carry :data:`METADATA`."""
    from aiordma.protocols import rpc as proto

    md: Any = METADATA if metadata else None
    extra: Any = {"metadata": md} if metadata else {}
    best = float("inf")
    for _ in range(3):
        client = proto.RpcConnection(proto.Role.CLIENT)
        server = proto.RpcConnection(proto.Role.SERVER)
        t = clock()
        for _ in range(calls):
            _, msgs = client.send_request("echo", (PAYLOAD,), {}, 1000, **extra)
            for m in msgs:
                server.receive_message(m)
            ev: Any = server.next_event()
            for m in server.send_response(ev.id, ev.args[0], *([md] if metadata else [])):
                client.receive_message(m)
            client.next_event()
        best = min(best, (clock() - t) / calls * 1e6)
    return best


async def _echo(calls: int, in_flight: int, kind: str, metadata: bool = False) -> float:
    from aiordma.rpc import RpcClient, RpcServer, Service, method
    from aiordma.services.echo import Echo
    from aiordma.testing import channel_pair

    class AsyncEcho(Service):
        @method
        async def echo(self, value: Any) -> Any:
            if metadata:
                from aiordma.rpc import current_call

                current_call().answer_metadata.update(METADATA)
            return value

    a, b = channel_pair()
    server = RpcServer(Echo() if kind == "def" else AsyncEcho(), max_in_flight=64, grace=1)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, max_in_flight=64)

    async def worker(n: int) -> None:
        for _ in range(n):
            await client.call("echo", PAYLOAD)

    async def worker_md(n: int) -> None:
        for _ in range(n):
            await client.call_with_metadata("echo", PAYLOAD, metadata=METADATA)

    work = worker_md if metadata else worker
    try:
        await asyncio.gather(*(work(10) for _ in range(in_flight)))  # warm-up
        t = clock()
        await asyncio.gather(*(work(calls // in_flight) for _ in range(in_flight)))
        return (clock() - t) / (calls // in_flight * in_flight) * 1e6
    finally:
        client.abort()
        a.abort()
        b.abort()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


def echo(calls: int, in_flight: int, loop: str, kind: str, metadata: bool = False) -> float:
    import uvloop

    run: Any = uvloop.run if loop == "uvloop" else asyncio.run
    return min(run(_echo(calls, in_flight, kind, metadata)) for _ in range(3))


def main() -> None:
    global clock
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--cpu", action="store_true", help="the process's CPU time, not the wall "
                    "clock's")
    ap.add_argument("--metadata", action="store_true", help="also calls with metadata")
    args = ap.parse_args()
    import aiordma

    if args.cpu:
        clock = time.process_time
    print(f"aiordma from {aiordma.__file__}" + (" (CPU time)" if args.cpu else ""))
    print(f"RPC protocol, 4 steps per call: {protocol_steps(args.calls):.1f} us")
    if args.metadata:
        print(f"RPC protocol, 4 steps per call, with metadata: "
              f"{protocol_steps(args.calls, True):.1f} us")
    for loop in ("asyncio", "uvloop"):
        for in_flight in (1, 64):
            for kind in ("def", "async def"):
                us = echo(args.calls, in_flight, loop, kind)
                print(f"RPC echo over channel_pair, {loop}, {in_flight} in flight, {kind} method:"
                      f" {us:.1f} us/call")
                if args.metadata and kind == "async def":
                    us = echo(args.calls, in_flight, loop, kind, True)
                    print(f"RPC echo over channel_pair, {loop}, {in_flight} in flight, {kind} "
                          f"method, with metadata: {us:.1f} us/call")


if __name__ == "__main__":
    main()
