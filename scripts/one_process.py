"""Issue 33's rows with both ends in one process: aiordma over the device against asyncio TCP.

A user's first comparison puts the server and the client in one process: this serves, in one
process and on the loop named, aiordma's endpoint echo (the bench peer's
``serve_connection``), the RPC echo service, and the asyncio TCP baselines
(:mod:`aiordma.bench.tcp_baseline`: length-prefixed frames, and msgpack RPC), then runs
against them, ``rounds`` times, aiordma and TCP alternating:

- a 64 B round trip, one at a time (p50 of :func:`aiordma.bench.endpoint_rows.ping_pong`,
  against the same count of TCP frame round trips);
- an RPC echo of 64 B, 64 calls in flight (calls/s of
  :func:`aiordma.bench.service_rows.rpc_echo` against ``tcp_echo``).

It prints each round's figures and, at the end, the ratios of the medians with the spread of
the per-round ratios. Run it where a device is, e.g. in the VM::

    .venv/bin/python -m harness run -- .venv/bin/python scripts/one_process.py uvloop 3
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import aiordma
from aiordma.bench.endpoint_rows import ping_pong
from aiordma.bench.measure import percentile
from aiordma.bench.peer import serve_connection
from aiordma.bench.plan import Plan
from aiordma.bench.service_rows import rpc_echo, tcp_echo
from aiordma.bench.tcp_baseline import TcpFrames, serve_tcp_echo, serve_tcp_frames
from aiordma.rpc import serve
from aiordma.services.echo import Echo

STEP = 60.0


async def _tcp_rtt(port: int, plan: Plan, size: int = 64) -> dict[str, float]:
    """``size`` B frames echoed one at a time, as many as :func:`ping_pong` makes."""
    msg = b"x" * size
    conn = await asyncio.wait_for(TcpFrames.connect("127.0.0.1", port), STEP)
    try:
        for _ in range(plan.warmup):
            await conn.round_trip(msg)
        rtts = []
        for _ in range(plan.rtt_iters):
            t0 = time.perf_counter()
            if len(await conn.round_trip(msg)) != size:
                raise RuntimeError("the echo came back short")
            rtts.append(time.perf_counter() - t0)
    finally:
        await conn.aclose()
    rtts.sort()
    return {"p50_us": percentile(rtts, 0.5) * 1e6}


async def main(rounds: int) -> None:
    plan = Plan()
    async with await aiordma.listen(serve_connection, "127.0.0.1", 0,
                                    transport="rdma") as listener, \
            await serve(Echo(), "127.0.0.1", 0) as echo:
        rpc_tcp, frames = await serve_tcp_echo(), await serve_tcp_frames()
        tcp_port = rpc_tcp.sockets[0].getsockname()[1]
        frames_port = frames.sockets[0].getsockname()[1]
        rtt: dict[str, list[float]] = {"aiordma": [], "tcp": []}
        rate: dict[str, list[float]] = {"aiordma": [], "tcp": []}
        try:
            for r in range(rounds):
                rtt["aiordma"].append((await ping_pong(listener.port, plan))["p50_us"])
                rtt["tcp"].append((await _tcp_rtt(frames_port, plan))["p50_us"])
                rate["aiordma"].append((await rpc_echo(echo.port, plan, 64))["ops_per_s"])
                rate["tcp"].append((await tcp_echo(tcp_port, plan, 64))["ops_per_s"])
                print(f"round {r + 1}: 64 B RTT p50 aiordma {rtt['aiordma'][-1]:,.0f} us, "
                      f"TCP {rtt['tcp'][-1]:,.0f} us; RPC echo 64 in flight aiordma "
                      f"{rate['aiordma'][-1]:,.0f} calls/s, TCP {rate['tcp'][-1]:,.0f}",
                      flush=True)
        finally:
            for s in (rpc_tcp, frames):
                s.close()
                await s.wait_closed()
    for name, rows, unit in (("64 B RTT p50, aiordma / TCP", rtt, "time"),
                             ("RPC echo 64 in flight, aiordma / TCP", rate, "calls/s")):
        per = [a / t for a, t in zip(rows["aiordma"], rows["tcp"])]
        med = statistics.median(rows["aiordma"]) / statistics.median(rows["tcp"])
        print(f"{name} ({unit}): {med:.2f}x [{min(per):.2f}..{max(per):.2f}]", flush=True)


if __name__ == "__main__":
    loop = sys.argv[1] if len(sys.argv) > 1 else "uvloop"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    print(f"both ends in one process, {loop}, {n} rounds", flush=True)
    if loop == "uvloop":
        import uvloop

        uvloop.run(main(n))
    else:
        asyncio.run(main(n))
