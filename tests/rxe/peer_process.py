"""The far end for two-process device tests: a listener in its own process.

Run as ``python tests/rxe/peer_process.py [--die-after N]``; it prints ``PORT <n>`` and serves
connections one after another. For each connection it exposes a 64 KiB region (read, write,
atomic), sends its descriptor first (msgpack of ``RemoteBuffer.to_wire()``), then answers every
message in order: tag 0 is echoed back unchanged; tag 1 (offset u32, length u32) is answered
with ``region[offset:offset + length]``, read when the request is processed.
``--die-after N`` makes the process SIGKILL itself after N messages (peer-death tests).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import msgpack
import uvloop

import aiordma

REGION = 1 << 16


async def main(die_after: int | None) -> None:
    seen = 0

    async def handler(ep: aiordma.Endpoint) -> None:
        nonlocal seen
        region = bytearray(REGION)
        mr = ep.register(region)
        await ep.send(msgpack.packb(mr.expose(read=True, write=True, atomic=True).to_wire()))
        while (msg := await ep.recv()) is not None:
            seen += 1
            if die_after is not None and seen >= die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if msg[:1] == b"\x01":
                off = int.from_bytes(msg[1:5], "little")
                n = int.from_bytes(msg[5:9], "little")
                await ep.send(region[off:off + n])
            else:
                await ep.send(msg)

    listener = await aiordma.listen(handler, "127.0.0.1", 0)
    print(f"PORT {listener.port}", flush=True)
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--die-after", type=int)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    a = p.parse_args()
    (uvloop.run if a.loop == "uvloop" else asyncio.run)(main(a.die_after))
    sys.exit(0)
