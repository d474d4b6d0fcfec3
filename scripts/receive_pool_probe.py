"""What the receive side of N queue pairs holds: per-QP receive slots against one shared pool.

    python scripts/receive_pool_probe.py [N,...]        # default 32,256
    # where this host has no RDMA device, in the VM:
    .venv/bin/python -m harness run -- .venv/bin/python scripts/receive_pool_probe.py 32,256

For each N, in this process, N receiving queue pairs are created and connected (each to a
sender), first each with its own receive slots as an endpoint has them today (72 slots of
8 KiB in one registration, all posted), then all on one SharedReceivePool (512 slots of 8 KiB,
one registration, posted once). It prints the growth of ``VmPin`` (memory pinned for
registrations) and ``VmRSS`` per receiving queue pair, the kernel's MR, QP and SRQ counts
for this pid (``rdma -j resource show``), and the time per queue pair to create, register,
post and connect. A probe of the receive side only: endpoints do not use the pool yet, and
their send slots are not counted. Used for docs/reports/2026-11-26-receive-pool.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from aiordma._endpoint.qp import QueuePair
from aiordma._endpoint.receive_pool import SharedReceivePool
from aiordma.lowlevel import CompletionReactor, Device, MemoryRegion

SLOT = 8192
OWN_SLOTS = 64 + 8  # Config's data_slots + ctrl_slots
POOL = 512


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def kernel(kind: str) -> int:
    out = subprocess.run(["rdma", "-j", "resource", "show", kind], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return sum(1 for e in json.loads(out or "[]") if e.get("pid") == os.getpid())


async def one(device: Device, n: int, pooled: bool) -> str:
    reactor = CompletionReactor(device, cqe=8192)
    pin0, rss0, mr0 = status_kib("VmPin"), status_kib("VmRSS"), kernel("mr")
    t0 = time.perf_counter()
    pool = SharedReceivePool(device, reactor, buffers=POOL, slot_size=SLOT) if pooled else None
    qps, regions = [], []
    for _ in range(n):
        s = QueuePair(device, reactor, max_recv_wr=1)
        r = (QueuePair(device, reactor, srq=pool.srq) if pool is not None
             else QueuePair(device, reactor, max_recv_wr=OWN_SLOTS))
        s.connect(r.local_address())
        r.connect(s.local_address())
        if pool is None:  # (a queue pair in RESET takes no receives)
            mr = MemoryRegion(device, bytearray(OWN_SLOTS * SLOT))
            r.prepare_slots(1 << 32, mr.address, SLOT, mr.lkey, OWN_SLOTS)
            for i in range(OWN_SLOTS):
                r.post_slot(i)
            regions.append(mr)
        qps += [s, r]
    took = time.perf_counter() - t0
    pin, rss = status_kib("VmPin") - pin0, status_kib("VmRSS") - rss0
    mrs, qpn, srqs = kernel("mr") - mr0, kernel("qp"), kernel("srq")
    for qp in qps:
        qp.close()
    if pool is not None:
        pool.close()
    for mr in regions:
        mr.close()
    reactor.close()
    left = (kernel("qp"), kernel("srq"), kernel("mr") - mr0)
    what = f"pool of {POOL}" if pooled else f"{OWN_SLOTS} own slots"
    return (f"N={n:4d} {what:>14}: pinned {pin / n:7.1f} KiB/QP, RSS {rss / n:7.1f} KiB/QP, "
            f"MRs {mrs} ({mrs / n:.2f}/QP), QPs {qpn}, SRQs {srqs}, "
            f"{1000 * took / n:.1f} ms/QP; left after close (qp, srq, mr): {left}")


async def main() -> None:
    counts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32,256").split(",")]
    device = Device()
    try:
        for n in counts:
            for pooled in (False, True):
                print(await one(device, n, pooled), flush=True)
    finally:
        device.close()


if __name__ == "__main__":
    asyncio.run(main())
