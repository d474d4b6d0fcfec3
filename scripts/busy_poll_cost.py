"""What busy polling costs a conversation that is not busy, on a real device.

A client sends 64 B messages to the bench's peer process (``aiordma.bench.peer``, uvloop), one
at a time, each echoed, with ``period`` seconds of ``asyncio.sleep`` after each echo (2 and
4 ms), and prints the client process's CPU time (user + system) and wall time per message,
its reactor's fd wake-ups and the spins that ran out per message. Run it with
``AIORDMA_BUSY_POLL_US=0`` and without, where a device is, e.g. in the VM::

    .venv/bin/python -m harness run -- .venv/bin/python scripts/busy_poll_cost.py
"""

from __future__ import annotations

import asyncio
import os
import time

import msgpack
import uvloop

from aiordma import connect
from aiordma.bench.peer import peer_process

COUNT = 300
WARMUP = 20
STEP = 60.0  # a bound on each echo


async def run(port: int, period: float) -> None:
    ep = await connect("127.0.0.1", port, timeout=STEP, transport="rdma")
    try:
        await ep.send(msgpack.packb(["echo", COUNT + WARMUP]))
        msg = b"x" * 64
        for _ in range(WARMUP):
            await ep.send(msg)
            await asyncio.wait_for(ep.recv(), STEP)
        r = ep._reactor
        o0, w0, s0, t0 = os.times(), r.wakeups, r.spins_run_out, time.perf_counter()
        for _ in range(COUNT):
            await ep.send(msg)
            if await asyncio.wait_for(ep.recv(), STEP) != msg:
                raise RuntimeError("the echo changed a message")
            await asyncio.sleep(period)
        o1, wall = os.times(), time.perf_counter() - t0
        cpu = o1.user - o0.user + o1.system - o0.system
        print(f"busy_poll_us={os.environ.get('AIORDMA_BUSY_POLL_US', 'default')}, a message "
              f"every {period * 1e3:.0f} ms: client CPU {cpu / COUNT * 1e6:.0f} us per message "
              f"(wall {wall / COUNT * 1e6:.0f} us), fd wake-ups {(r.wakeups - w0) / COUNT:.2f}, "
              f"spins run out {(r.spins_run_out - s0) / COUNT:.2f} per message", flush=True)
    finally:
        await ep.aclose()


def main() -> None:
    with peer_process("uvloop") as ports:
        for period in (0.002, 0.004):
            uvloop.run(run(ports.endpoint, period))


if __name__ == "__main__":
    main()
