"""The bench's 64 B message-rate row (area (c)) with each side's CPU time per message.

Starts the bench's peer process (``aiordma.bench.peer``) on the loop named, runs
:func:`aiordma.bench.endpoint_rows.message_rate` against it ``rounds`` times (20,000
messages each), and prints the rate, then per message the CPU time (user / system, from
``/proc``) of this process (the sender) and of the peer (the sink), and the wall time. Run it
where a device is, e.g. in the VM, with ``AIORDMA_BUSY_POLL_US=0`` to keep spins out of the
CPU figures::

    .venv/bin/python -m harness run -- .venv/bin/python scripts/message_rate_cpu.py uvloop 3
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from aiordma.bench import peer
from aiordma.bench.cputime import CpuTimes, process_times
from aiordma.bench.endpoint_rows import message_rate
from aiordma.bench.plan import Plan
from aiordma.bench.process import announced_process


def main(loop: str, rounds: int) -> None:
    if loop == "uvloop":
        import uvloop

        uvloop.install()
    plan = Plan(rate_count=20_000, warmup=10)
    n = plan.rate_count + 4 * plan.warmup  # (the row's untimed messages count here too)
    with announced_process(peer.peer_command(loop), peer.READY, timeout=120,
                           env=dict(os.environ)) as (line, proc):
        port = peer.parse_ready(line).endpoint
        for r in range(rounds):
            me, sink = process_times(os.getpid()), process_times(proc.pid)
            t0 = time.perf_counter()
            out = asyncio.run(message_rate(port, plan))
            wall = time.perf_counter() - t0
            me, sink = process_times(os.getpid()) - me, process_times(proc.pid) - sink

            def per(t: CpuTimes) -> str:
                return f"{t.user / n * 1e6:.0f} / {t.system / n * 1e6:.0f}"

            print(f"{loop} round {r + 1}: {out['msgs_per_s']:,.0f} msg/s; per message: "
                  f"sender CPU {per(me)} us (user / system), sink {per(sink)} us, "
                  f"wall {wall / n * 1e6:.0f} us", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "uvloop",
         int(sys.argv[2]) if len(sys.argv) > 2 else 2)
