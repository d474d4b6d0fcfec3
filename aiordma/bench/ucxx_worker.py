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

``--probe N`` instead makes ``N`` round trips, times nothing, and prints the JSON line with
the transports only: the bench runs it with UCX's info log on, whose endpoint lines prove the
route, and the timed run with that log off.

Driven as ucxx's own benchmark (``ucxx.benchmarks.send_recv``, backend ``ucxx-async`` with
``--reuse-alloc``) drives it: every buffer allocated once, outside the timed loops, and wrapped
once in ucxx's ``Array`` (``ep.send``/``ep.recv`` wrap anything else on every call), and a
bare ``await ep.send(buf)`` / ``await ep.recv(buf)`` per message. The hang guard is one
deadline around each measured part (``asyncio.timeout``, no task), never a ``wait_for`` per
message (on Python 3.11 that is a task per receive, which cost more than ucxx's own work).
Every reply is checked; the transports UCX had active are read after the timed parts.
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

STEP = 60.0  # bound on connecting and closing
HEADER = struct.Struct("<QQQ")
ECHO, SINK, BYE = 1, 2, 3
MODES = ("blocking", "polling")


def _init(mode: str) -> Any:
    import ucxx

    ucxx.init(progress_mode=mode)
    return ucxx


def _buffer(size: int, fill: int | None = None) -> tuple[np.ndarray, Any]:
    """A buffer of ``size`` bytes and its ucxx ``Array``, made once and reused."""
    from ucxx._lib.arr import Array

    data = np.empty(size, np.uint8) if fill is None else np.full(size, fill, np.uint8)
    return data, Array(data)


async def _serve_connection(ep: Any) -> None:
    header, header_arr = _buffer(HEADER.size)
    ack, ack_arr = _buffer(8)
    sink: tuple[np.ndarray, Any] | None = None
    while True:
        await ep.recv(header_arr)
        cmd, count, size = HEADER.unpack(header.tobytes())
        if cmd == BYE:
            break
        if cmd == ECHO:
            _, buf = _buffer(size)
            for _ in range(count):
                await ep.recv(buf)
                await ep.send(buf)
        elif cmd == SINK:
            if sink is None or sink[0].size != size:
                sink = _buffer(size)
            for _ in range(count):
                await ep.recv(sink[1])
            ack[:] = np.frombuffer(struct.pack("<Q", count), np.uint8)
            await ep.send(ack_arr)
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


class _Commands:
    """The client's command header, one buffer reused."""

    def __init__(self) -> None:
        self.data, self.arr = _buffer(HEADER.size)

    async def send(self, ep: Any, cmd: int, count: int = 0, size: int = 0) -> None:
        self.data[:] = np.frombuffer(HEADER.pack(cmd, count, size), np.uint8)
        await ep.send(self.arr)


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s))))]


async def _rtt(ep: Any, cmd: _Commands, warmup: int, iters: int,
               size: int = 64) -> dict[str, float]:
    msg, msg_arr = _buffer(size, 7)
    reply, reply_arr = _buffer(size)
    await cmd.send(ep, ECHO, warmup + iters, size)
    rtts = []
    for i in range(warmup + iters):
        reply.fill(0)
        t0 = time.perf_counter()
        await ep.send(msg_arr)
        await ep.recv(reply_arr)
        t1 = time.perf_counter()
        if i >= warmup:
            rtts.append(t1 - t0)
        if not np.array_equal(reply, msg):
            raise RuntimeError("the echo came back different")
    return {"p50_us": _percentile(rtts, 0.5) * 1e6, "p99_us": _percentile(rtts, 0.99) * 1e6}


async def _echo_rate(ep: Any, cmd: _Commands, ops: int, in_flight: int,
                     size: int = 64) -> dict[str, float]:
    warm = 2
    per_task = max(1, ops // in_flight)
    await cmd.send(ep, ECHO, in_flight * (warm + per_task), size)
    buffers = [(_buffer(size, k % 251), _buffer(size)) for k in range(in_flight)]

    async def task(n: int, k: int) -> None:
        (_, msg_arr), (reply, reply_arr) = buffers[k]
        for _ in range(n):
            await ep.send(msg_arr)
            await ep.recv(reply_arr)
        # the server echoes each message: every task's last reply is some task's message
        if reply[0] != reply[-1] or int(reply[0]) not in range(min(in_flight, 251)):
            raise RuntimeError("an echo came back different")

    async def all_tasks(n: int) -> None:
        await asyncio.gather(*(task(n, k) for k in range(in_flight)))

    await all_tasks(warm)
    t0 = time.perf_counter()
    await all_tasks(per_task)
    elapsed = time.perf_counter() - t0
    total = per_task * in_flight
    return {"us_per_op": elapsed / total * 1e6, "ops_per_s": total / elapsed}


async def _bandwidth(ep: Any, cmd: _Commands, size: int, count: int) -> dict[str, float]:
    _, data_arr = _buffer(size, 3)
    ack, ack_arr = _buffer(8)
    elapsed = 0.0
    for n in (1, count):  # one untimed, then the timed ones
        await cmd.send(ep, SINK, n, size)
        t0 = time.perf_counter()
        for _ in range(n):
            await ep.send(data_arr)
        await ep.recv(ack_arr)
        elapsed = time.perf_counter() - t0
        if struct.unpack("<Q", ack.tobytes())[0] != n:
            raise RuntimeError("the server acknowledged another count")
    return {"mibs": size * count / elapsed / (1 << 20)}


async def _probe(ep: Any, cmd: _Commands, n: int) -> None:
    await _rtt(ep, cmd, 0, n)


async def client(a: argparse.Namespace) -> dict[str, Any]:
    ucxx = _init(a.mode)
    async with asyncio.timeout(STEP):
        ep = await ucxx.create_endpoint(a.host, a.port)
    cmd = _Commands()
    out: dict[str, Any] = {"mode": a.mode, "ucxx": ucxx.__version__,
                           "ucx": ".".join(map(str, ucxx.get_ucx_version()))}
    # One bound per part (no task per message): a peer that stops answering ends the run.
    if a.probe:
        async with asyncio.timeout(a.deadline):
            await _probe(ep, cmd, a.probe)
    else:
        async with asyncio.timeout(a.deadline):
            out["rtt"] = await _rtt(ep, cmd, a.warmup, a.rtt_iters)
        async with asyncio.timeout(a.deadline):
            out["echo"] = await _echo_rate(ep, cmd, a.echo_ops, a.in_flight)
        async with asyncio.timeout(a.deadline):
            out["bw"] = await _bandwidth(ep, cmd, a.bw_size, a.bw_count)
    out["active_transports"] = sorted(ucxx.get_active_transports())
    async with asyncio.timeout(STEP):
        await cmd.send(ep, BYE)
        await ep.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--probe", type=int, default=0,
                   help="only this many round trips, untimed (the route's proof)")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds for each measured part")
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
