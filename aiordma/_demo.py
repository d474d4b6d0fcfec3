"""``aiordma demo``: the device table, then a loopback exchange over RDMA with its timings.

Two RC queue pairs on one device, connected to each other, driven by one completion reactor:
64-byte SEND ping-pongs (round-trip percentiles and fd wake-ups per round trip) and 1 MiB
RDMA WRITEs (bandwidth), on the default asyncio loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import time

import uvloop

from ._cli import _print_devices
from ._device import Device, list_devices
from ._memory import MemoryRegion
from ._qp import connect_pair
from ._reactor import CompletionReactor


def _pct(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


async def _exchange(device: Device, count: int) -> dict[str, float]:
    reactor = CompletionReactor(device)
    a, b = connect_pair(device, reactor)
    try:
        src = MemoryRegion(device, bytearray(b"x" * 64))
        rbuf_a = MemoryRegion(device, bytearray(64))
        rbufs_b = [MemoryRegion(device, bytearray(64)) for _ in range(2)]

        async def echo() -> None:
            # Keep a receive posted at all times: a SEND that finds none waits out an RNR NAK.
            nxt = b.recv_future(rbufs_b[0].whole())
            for i in range(count):
                wc = await nxt
                if i + 1 < count:
                    nxt = b.recv_future(rbufs_b[(i + 1) % 2].whole())
                await b.send(rbufs_b[i % 2][0:wc.byte_len])

        server = asyncio.ensure_future(echo())
        rtts = []
        w0 = reactor.wakeups
        for _ in range(count):
            t0 = time.perf_counter()
            reply = a.recv_future(rbuf_a.whole())
            await a.send(src.whole())
            wc = await reply
            rtts.append(time.perf_counter() - t0)
            assert wc.byte_len == 64 and bytes(rbuf_a.view) == bytes(src.view)
        wakeups = (reactor.wakeups - w0) / count
        await server

        size, writes = 1 << 20, 16
        big = MemoryRegion(device, bytearray(b"w" * size))
        target = MemoryRegion(device, bytearray(size), remote_write=True)
        desc = target.expose(write=True)
        t0 = time.perf_counter()
        for _ in range(writes):
            await a.write(big.whole(), desc)
        elapsed = time.perf_counter() - t0
        assert bytes(target.view) == bytes(big.view)
        rtts.sort()
        return {"p50_us": _pct(rtts, 0.5) * 1e6, "p99_us": _pct(rtts, 0.99) * 1e6,
                "wakeups": wakeups, "write_mbs": size * writes / elapsed / 1e6}
    finally:
        reactor.close()  # closes its queue pairs first


def run_demo(count: int = 300) -> int:
    devs = list_devices()
    _print_devices(devs)
    print()
    with Device() as device:
        print(f"loopback over {device.name} port {device.port}, GID {device.gid_index} "
              f"({device.gid_info.ip}), MTU {device.mtu}: {count} round trips of 64 B SEND, "
              f"then 16 x 1 MiB RDMA WRITE")
        for name, runner in (("asyncio", asyncio.run), ("uvloop", uvloop.run)):
            r = runner(_exchange(device, count))
            print(f"  {name:8s} round trip p50 {r['p50_us']:8.1f} us  p99 {r['p99_us']:8.1f} us"
                  f"  fd wake-ups/round trip {r['wakeups']:.2f}  1 MiB WRITE "
                  f"{r['write_mbs']:.1f} MB/s")
    return 0
