"""The bench's RPC echo row (area (e)) with as many calls as asked, for A/B runs.

The bench's row makes 2,000 calls; at 64 in flight that is under a second in the test VM, and
the two sides may or may not have fallen into taking turns on whole batches by then, so its
figure is bimodal (docs/reports/2026-11-27-rpc-chunks.md). This runs
:func:`aiordma.bench.service_rows.rpc_echo` against the bench's peer process (started on the
same loop, with this process's environment, so ``AIORDMA_BUSY_POLL_US`` reaches both) and
prints one line per run: the tag, the loop, the calls in flight, calls/s and p50. Run it
where a device is, e.g. in the VM, from the tree to measure (``PYTHONPATH=<tree>``)::

    .venv/bin/python -m harness run -- .venv/bin/python scripts/rpc_rate.py uvloop 64 8000 new
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

from aiordma.bench.peer import peer_process
from aiordma.bench.plan import Plan
from aiordma.bench.service_rows import rpc_echo


def main(loop: str, in_flight: int, calls: int, tag: str) -> None:
    plan = dataclasses.replace(Plan(), rpc_calls=calls)
    with peer_process(loop) as ports:
        if loop == "uvloop":
            import uvloop

            uvloop.install()
        got = asyncio.run(rpc_echo(ports.echo, plan, in_flight))
    print(f"{tag:10} {loop:8} {in_flight:3} in flight: {got['ops_per_s']:7.0f} calls/s, "
          f"p50 {got['p50_us']:7.0f} us", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: rpc_rate.py LOOP IN_FLIGHT CALLS TAG")
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
