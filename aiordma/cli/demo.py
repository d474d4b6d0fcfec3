"""``aiordma demo``: the device table, then a client and a server exchanging over RDMA.

A listener and a client endpoint in this process, on one device, connected through aiordma's
TCP bootstrap: 64-byte message round trips (percentiles, and completion-channel wake-ups per
round trip), a 4 MiB rendezvous message, and 1 MiB RDMA WRITEs (bandwidth), on the default
asyncio loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import uvloop

import aiordma._reactor.reactor as _reactor
from aiordma import connect, listen
from aiordma.lowlevel import Device, list_devices

from .devices import print_devices as _print_devices


def _pct(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


async def _exchange(device: Device, count: int) -> dict[str, float]:
    async def echo(ep: Any) -> None:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)

    async with await listen(echo, "127.0.0.1", 0, device=device,  # noqa: SIM117
                            transport="rdma") as listener:
        async with await connect("127.0.0.1", listener.port, timeout=60, device=device,
                                 transport="rdma") as ep:
            msg = b"x" * 64
            for _ in range(10):  # warm-up
                await ep.send(msg)
                await ep.recv()
            reactor = ep._reactor
            w0 = reactor.wakeups
            rtts = []
            for _ in range(count):
                t0 = time.perf_counter()
                await ep.send(msg)
                reply = await ep.recv()
                rtts.append(time.perf_counter() - t0)
                if reply != msg:  # (not an assert: python -O would drop the check)
                    raise RuntimeError("the echo changed a message")
            wakeups = (reactor.wakeups - w0) / count

            big = os.urandom(4 << 20)
            t0 = time.perf_counter()
            await ep.send(big)
            if await ep.recv() != big:
                raise RuntimeError("the echo changed the 4 MiB message")
            rdv = 2 * len(big) / (time.perf_counter() - t0) / 1e6

            size, writes = 1 << 20, 16
            src = ep.register(bytearray(os.urandom(size)))
            target = ep.register(bytearray(size))  # in-process peer: expose our own region
            desc = target.expose(write=True)
            t0 = time.perf_counter()
            for _ in range(writes):
                await ep.write(src.whole(), desc)
            elapsed = time.perf_counter() - t0
            if bytes(target.view) != bytes(src.view):
                raise RuntimeError("the RDMA WRITEs did not land")
    rtts.sort()
    return {"p50_us": _pct(rtts, 0.5) * 1e6, "p99_us": _pct(rtts, 0.99) * 1e6,
            "wakeups": wakeups, "write_mbs": size * writes / elapsed / 1e6, "rdv_mbs": rdv}


def run_demo(count: int = 300) -> int:
    devs = list_devices()
    _print_devices(devs)
    print()
    with Device() as device:
        print(f"client and server endpoints over {device.name} port {device.port}, GID "
              f"{device.gid_index} ({device.gid_info.ip}), MTU {device.mtu}:")
        print(f"  {count} round trips of a 64 B message, a 4 MiB message both ways "
              f"(rendezvous), 16 RDMA WRITEs of 1 MiB")
        default = _reactor.DEFAULT_BUSY_POLL_US
        runs = (("asyncio", asyncio.run, default), ("uvloop", uvloop.run, default),
                ("uvloop, busy polling off", uvloop.run, 0.0))
        for name, runner, spin in runs:
            _reactor.DEFAULT_BUSY_POLL_US = spin
            try:
                r = runner(_exchange(device, count))
            finally:
                _reactor.DEFAULT_BUSY_POLL_US = default
            print(f"  {name}:\n    64 B round trip p50 {r['p50_us']:6.0f} us, p99 "
                  f"{r['p99_us']:6.0f} us, {r['wakeups']:.2f} fd wake-ups per round trip; "
                  f"4 MiB message {r['rdv_mbs']:4.1f} MB/s; 1 MiB WRITE {r['write_mbs']:4.1f} MB/s")
    return 0
