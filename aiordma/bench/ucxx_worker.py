"""ucxx's side of the peer rows, run as a file by the ucxx venv's interpreter (which has ucxx
and numpy, not aiordma), in the environment ``scripts/setup-peers.sh`` prepared (Debian's
UCX 1.13.1, older than ucxx 0.52 supports; ``UCX_TLS=rc_verbs,self``).

``python ucxx_worker.py server --mode blocking`` prints ``READY <port>`` and serves until
terminated. Each connection takes commands, a 24-byte header ``(command, count, size)`` of
little-endian uint64: ``echo`` answers the next ``count`` messages of ``size`` bytes with
themselves, ``sink`` receives ``count`` messages of ``size`` bytes into one buffer and then
sends an 8-byte acknowledgement, ``bye`` ends the connection. These are the commands aiordma's
own peer (:mod:`aiordma.bench.peer`) serves, so both systems do the same work.

``python ucxx_worker.py client --mode blocking --host H --port P ...`` measures, in the
progress mode given, the same three things aiordma's rows measure, and prints one JSON line:

* ``rtt``: 64 B round trips one at a time (as ``a.rtt64``): p50 and p99 in us;
* ``echo``: 64 B round trips, ``in_flight`` tasks on one endpoint (as ``g.endpoints1``):
  wall time per round trip and round trips per second;
* ``bw``: ``bw_count`` messages of ``bw_size`` one way, one at a time, until the server
  acknowledges the last (as ``d.msg``): MiB/s.

Every reply is checked. Every wait on the other process is bounded (``STEP`` seconds).
UCX's own log (``UCX_LOG_LEVEL=info``, set by the bench) names the transports each endpoint
uses; the bench reads it from stderr to prove the figures came over rc_verbs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import struct
import sys
import time
from typing import Any

import numpy as np

STEP = 60.0
HEADER = struct.Struct("<QQQ")
ECHO, SINK, BYE = 1, 2, 3
MODES = ("blocking", "polling")


def _init(mode: str) -> Any:
    import ucxx

    ucxx.init(progress_mode=mode)
    return ucxx


async def _serve_connection(ep: Any) -> None:
    header = np.empty(HEADER.size, np.uint8)
    sink: np.ndarray | None = None
    while True:
        await ep.recv(header)
        cmd, count, size = HEADER.unpack(header.tobytes())
        if cmd == BYE:
            break
        if cmd == ECHO:
            buf = np.empty(size, np.uint8)
            for _ in range(count):
                await ep.recv(buf)
                await ep.send(buf)
        elif cmd == SINK:
            if sink is None or sink.size != size:
                sink = np.empty(size, np.uint8)
            for _ in range(count):
                await ep.recv(sink)
            await ep.send(np.frombuffer(struct.pack("<Q", count), np.uint8).copy())
        else:
            raise ValueError(f"unknown command {cmd}")
    await ep.close()


async def serve(mode: str) -> None:
    ucxx = _init(mode)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    listener = ucxx.create_listener(_serve_connection, 0)
    print(f"READY {listener.port}", flush=True)
    await stop.wait()
    listener.close()


async def _command(ep: Any, cmd: int, count: int = 0, size: int = 0) -> None:
    await asyncio.wait_for(ep.send(np.frombuffer(HEADER.pack(cmd, count, size), np.uint8)
                                   .copy()), STEP)


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s))))]


async def _rtt(ep: Any, warmup: int, iters: int, size: int = 64) -> dict[str, float]:
    msg = np.full(size, 7, np.uint8)
    reply = np.empty(size, np.uint8)
    await _command(ep, ECHO, warmup + iters, size)
    rtts = []
    for i in range(warmup + iters):
        reply.fill(0)
        t0 = time.perf_counter()
        await ep.send(msg)
        await asyncio.wait_for(ep.recv(reply), STEP)
        if i >= warmup:
            rtts.append(time.perf_counter() - t0)
        if not np.array_equal(reply, msg):
            raise RuntimeError("the echo came back different")
    return {"p50_us": _percentile(rtts, 0.5) * 1e6, "p99_us": _percentile(rtts, 0.99) * 1e6}


async def _echo_rate(ep: Any, ops: int, in_flight: int, size: int = 64) -> dict[str, float]:
    warm = 2
    per_task = max(1, ops // in_flight)
    await _command(ep, ECHO, in_flight * (warm + per_task), size)

    async def task(n: int, k: int) -> None:
        msg = np.full(size, k % 251, np.uint8)
        reply = np.empty(size, np.uint8)
        for _ in range(n):
            await ep.send(msg)
            await ep.recv(reply)
            if reply.size != size:
                raise RuntimeError("the echo came back short")

    async def all_tasks(n: int) -> None:
        await asyncio.wait_for(asyncio.gather(*(task(n, k) for k in range(in_flight))), STEP * 5)

    await all_tasks(warm)
    t0 = time.perf_counter()
    await all_tasks(per_task)
    elapsed = time.perf_counter() - t0
    total = per_task * in_flight
    return {"us_per_op": elapsed / total * 1e6, "ops_per_s": total / elapsed}


async def _bandwidth(ep: Any, size: int, count: int) -> dict[str, float]:
    data = np.full(size, 3, np.uint8)
    ack = np.empty(8, np.uint8)
    for n, _timed in ((1, False), (count, True)):
        await _command(ep, SINK, n, size)
        t0 = time.perf_counter()
        for _ in range(n):
            await asyncio.wait_for(ep.send(data), STEP)
        await asyncio.wait_for(ep.recv(ack), STEP)
        elapsed = time.perf_counter() - t0
        if struct.unpack("<Q", ack.tobytes())[0] != n:
            raise RuntimeError("the server acknowledged another count")
    return {"mibs": size * count / elapsed / (1 << 20)}


async def client(a: argparse.Namespace) -> dict[str, Any]:
    ucxx = _init(a.mode)
    ep = await asyncio.wait_for(ucxx.create_endpoint(a.host, a.port), STEP)
    out: dict[str, Any] = {"mode": a.mode, "ucxx": ucxx.__version__,
                           "ucx": ".".join(map(str, ucxx.get_ucx_version())),
                           "active_transports": sorted(ucxx.get_active_transports())}
    out["rtt"] = await _rtt(ep, a.warmup, a.rtt_iters)
    out["echo"] = await _echo_rate(ep, a.echo_ops, a.in_flight)
    out["bw"] = await _bandwidth(ep, a.bw_size, a.bw_count)
    await _command(ep, BYE)
    await asyncio.wait_for(ep.close(), STEP)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rtt-iters", type=int, default=1000)
    p.add_argument("--echo-ops", type=int, default=3200)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--bw-size", type=int, default=4 << 20)
    p.add_argument("--bw-count", type=int, default=8)
    a = p.parse_args()
    if a.role == "server":
        asyncio.run(serve(a.mode))
        return 0
    result = asyncio.run(client(a))
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)  # ucxx's teardown at interpreter exit can outlive the bench's patience


if __name__ == "__main__":
    raise SystemExit(main())
