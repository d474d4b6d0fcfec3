"""The far end for two-process device tests: a listener in its own process.

Run as ``python tests/rxe/peer_process.py [--die-after N]``; it prints ``PORT <n>`` and serves
connections one after another. For each connection it exposes a 64 KiB region (read, write,
atomic), sends its descriptor first (msgpack of ``RemoteBuffer.to_wire()``), then answers every
message in order: tag 0 is echoed back unchanged; tag 1 (offset u32, length u32) is answered
with ``region[offset:offset + length]``, read when the request is processed.
``--die-after N`` makes the process SIGKILL itself after N messages (peer-death tests).

Additions for the fault catalogue (tests/rxe/test_faults_*.py):

* tag 2 (n u32) is answered with an n-byte message (byte i is ``i % 251``): a peer-to-test
  rendezvous of any size; tag 3 makes the handler stop reading (its peer's sends then wait).
* ``--recv-buffer N``: the listener's ``Config.recv_buffer`` (0: a handler that stops reading
  stops its peer's sends once the receive slots are full).
* ``--rpc`` also serves :class:`Sleeper` (with the stream tests' methods,
  ``tests/rpc_services.py``'s ``Streamer``) by RPC on a second port and prints ``RPC <port>``
  after the ``PORT`` line; ``--stream-window N`` is its server's ``stream_window``.
* ``--host ADDR``: listen there (default 127.0.0.1), e.g. on host 2 of a two-VM run;
  ``--keepalive S``: its connections' keepalive idle S s, then S probes 1 s apart (the RPC
  server's too).
* ``--region N``: each connection's exposed region is N bytes (default 64 KiB), e.g. for a
  one-sided READ still in flight when host 2 vanishes.
* ``--call PORT`` is a client instead: it calls ``hold(3600)`` on the RPC server at PORT,
  prints ``CALLING`` once the request is sent, and waits (until killed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import os
import signal
import sys

import msgpack
import uvloop

import aiordma
from aiordma.rpc import method

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.rpc_services import Streamer  # (run as a script: the root is on the path now)

REGION = 1 << 16


def pattern(n: int) -> bytes:
    """The n-byte message a tag-2 request is answered with (byte i is i % 251)."""
    return (bytes(range(251)) * (n // 251 + 1))[:n]


class Sleeper(Streamer):
    """The RPC service of ``--rpc`` (a server to kill mid-call) and of the callers' target;
    the stream tests' methods too."""

    @method
    async def add(self, a: int, b: int) -> int:
        return a + b

    @method
    async def hold(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "held"


async def call_forever(port: int) -> None:
    client = await aiordma.rpc.connect("127.0.0.1", port, timeout=60)
    call = asyncio.ensure_future(client.call("hold", 3600.0))
    while not client._waiting:  # the request is queued; give it a moment to go out
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    print("CALLING", flush=True)
    await call  # until killed


async def main(die_after: int | None, rpc: bool = False, recv_buffer: int | None = None,
               stream_window: int = 16, host: str = "127.0.0.1",
               keepalive: int = 0, region_size: int = REGION) -> None:
    seen = 0

    async def handler(ep: aiordma.Endpoint) -> None:
        nonlocal seen
        region = bytearray(region_size)
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
            elif msg[:1] == b"\x02":
                await ep.send(pattern(int.from_bytes(msg[1:5], "little")))
            elif msg[:1] == b"\x03":
                await asyncio.Event().wait()  # stop reading
            else:
                await ep.send(msg)

    config = aiordma.Config() if recv_buffer is None else aiordma.Config(recv_buffer=recv_buffer)
    if keepalive:  # the liveness channel's bound (two-host tests: a loaded 1-vCPU host)
        config = dataclasses.replace(config, keepalive_idle=keepalive, keepalive_interval=1,
                                     keepalive_probes=keepalive)
    listener = await aiordma.listen(handler, host, 0, config=config)
    print(f"PORT {listener.port}", flush=True)
    if rpc:
        server = await aiordma.rpc.serve(Sleeper(), host, 0, stream_window=stream_window,
                                         config=config)
        print(f"RPC {server.port}", flush=True)
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests ask where it is stuck
    p = argparse.ArgumentParser()
    p.add_argument("--die-after", type=int)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--rpc", action="store_true")
    p.add_argument("--call", type=int, metavar="PORT")
    p.add_argument("--recv-buffer", type=int)
    p.add_argument("--stream-window", type=int, default=16)
    p.add_argument("--keepalive", type=int, default=0, metavar="S", help="keepalive idle S s, "
                   "then S probes 1 s apart (default: Config's)")
    p.add_argument("--region", type=int, default=REGION, metavar="N",
                   help="bytes of each connection's exposed region")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (two-host tests: "
                   "host 2's link address)")
    a = p.parse_args()
    run = uvloop.run if a.loop == "uvloop" else asyncio.run
    run(call_forever(a.call) if a.call else main(a.die_after, a.rpc, a.recv_buffer,
                                                 a.stream_window, a.host, a.keepalive,
                                                 a.region))
    sys.exit(0)
