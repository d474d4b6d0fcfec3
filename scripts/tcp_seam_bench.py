"""The TCP transport's own cost, no device needed: a 64 B message round trip over an aiordma
TCP channel (``aiordma.connect(..., transport="tcp")``) against the same over plain asyncio
streams (length-prefixed frames, ``TCP_NODELAY``), the echoing peer in another process, on
asyncio and on uvloop. What is left of the RPC row's gap to asyncio TCP + msgpack at one call
in flight (``aiordma bench --only t``) is the RPC layer's, not the transport's; its Python
work per call is ``scripts/host_bench.py``'s.

Usage: python scripts/tcp_seam_bench.py [--count N] [--repeat R]

Prints, per loop and path, the p50 round trip and this process's CPU time per round trip
(the client's side only), the median of ``R`` runs of ``N`` round trips each.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import struct
import subprocess
import sys
import time

LEN = struct.Struct("<I")
PAYLOAD = b"x" * 64


async def _peer(kind: str) -> None:
    """Echo every message, over aiordma's TCP transport or plain streams; print the port."""
    if kind == "aiordma":
        import aiordma

        async def handle(ch: object) -> None:
            while (m := await ch.recv()) is not None:  # type: ignore[attr-defined]
                await ch.send(m)  # type: ignore[attr-defined]

        listener = await aiordma.listen(handle, "127.0.0.1", 0, transport="tcp")
        port = listener.port
    else:
        async def handle_streams(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while True:
                    (n,) = LEN.unpack(await r.readexactly(4))
                    w.write(LEN.pack(n) + await r.readexactly(n))
                    await w.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                w.close()

        server = await asyncio.start_server(handle_streams, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    await asyncio.Event().wait()


async def _client(kind: str, port: int, count: int) -> tuple[float, float]:
    """p50 round trip and CPU per round trip, both in microseconds."""
    if kind == "aiordma":
        import aiordma

        ch = await aiordma.connect("127.0.0.1", port, transport="tcp", timeout=30)

        async def once() -> None:
            await ch.send(PAYLOAD)
            await ch.recv()
    else:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        async def once() -> None:
            w.write(LEN.pack(len(PAYLOAD)) + PAYLOAD)
            await w.drain()
            (n,) = LEN.unpack(await r.readexactly(4))
            await r.readexactly(n)
    for _ in range(200):
        await once()
    lat = []
    c0 = time.process_time()
    for _ in range(count):
        t0 = time.perf_counter()
        await once()
        lat.append(time.perf_counter() - t0)
    cpu = (time.process_time() - c0) / count * 1e6
    lat.sort()
    return lat[len(lat) // 2] * 1e6, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--count", type=int, default=5000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--peer", choices=["aiordma", "streams"], help=argparse.SUPPRESS)
    p.add_argument("--loop", default="asyncio", help=argparse.SUPPRESS)
    a = p.parse_args()
    import uvloop

    run = {"asyncio": asyncio.run, "uvloop": uvloop.run}
    if a.peer:
        run[a.loop](_peer(a.peer))
        return
    for loop in ("asyncio", "uvloop"):
        for kind in ("aiordma", "streams"):
            peer = subprocess.Popen([sys.executable, __file__, "--peer", kind, "--loop", loop],
                                    stdout=subprocess.PIPE, text=True)
            try:
                assert peer.stdout is not None
                port = int(peer.stdout.readline())
                runs = [run[loop](_client(kind, port, a.count)) for _ in range(a.repeat)]
            finally:
                peer.kill()
                peer.wait(timeout=30)
            p50 = statistics.median(x[0] for x in runs)
            cpu = statistics.median(x[1] for x in runs)
            name = "aiordma TCP channel" if kind == "aiordma" else "asyncio streams"
            print(f"{loop:8} {name:20} p50 {p50:6.1f} us   client CPU {cpu:5.1f} us per round "
                  f"trip ({a.repeat} x {a.count})", flush=True)


if __name__ == "__main__":
    main()
