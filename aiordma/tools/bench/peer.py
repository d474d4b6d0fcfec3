"""The far end of the benchmark, in its own process (as perftest's server is).

``python -m aiordma.tools.bench.peer --loop uvloop`` serves, on one event loop:

* an endpoint listener whose connections take commands, each a msgpack ``[mode, count]``
  message: ``region`` registers a 4 MiB buffer and answers its descriptor (read and write
  access, msgpack of ``RemoteBuffer.to_wire()``); ``echo`` answers the next ``count`` messages
  with themselves; ``sink`` receives ``count`` messages into one 4 MiB buffer (rendezvous
  ones by RDMA READ straight into it) and answers ``b"ok"``. Buffers are made on demand, so
  64 connections that only echo stay small;
* the echo service (:mod:`aiordma.services.echo`) and the key-value service (:mod:`aiordma.services.kv`) by
  ``aiordma.rpc``;
* the asyncio TCP + msgpack echo RPC baseline (:mod:`aiordma.tools.bench.tcp_baseline`).

It prints ``READY endpoint=<port> echo=<port> kv=<port> tcp=<port>`` and serves until it is
terminated. With ``AIORDMA_BENCH_PROFILE_DIR`` set it runs under cProfile and writes
``peer-<loop>.prof`` there when terminated (the server side of a profile).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack
import uvloop

from ..process import announced

REGION = 4 << 20
READY = "READY"


async def serve_connection(ep: object) -> None:
    """One connection's commands (see the module docstring)."""
    import aiordma

    assert isinstance(ep, aiordma.Endpoint)
    sink: bytearray | None = None
    while (cmd := await ep.recv()) is not None:
        mode, count = msgpack.unpackb(cmd)
        if mode == "region":
            region = ep.register(bytearray(REGION))  # closed with the endpoint
            await ep.send(msgpack.packb(region.expose(read=True, write=True).to_wire()))
        elif mode == "echo":
            for _ in range(count):
                msg = await ep.recv()
                if msg is None:
                    return
                await ep.send(msg)
        elif mode == "sink":
            sink = sink or bytearray(REGION)
            for _ in range(count):
                if await ep.recv_into(sink) < 0:
                    return
            await ep.send(b"ok")
        else:
            raise ValueError(f"unknown command {mode!r}")


async def _serve() -> None:
    import aiordma
    from aiordma.rpc import serve
    from aiordma.services.echo import Echo
    from aiordma.services.kv import KvStore

    from .tcp_baseline import serve_tcp_echo

    async with await aiordma.listen(serve_connection, "127.0.0.1", 0) as listener, \
            await serve(Echo(), "127.0.0.1", 0) as echo, \
            await serve(KvStore(), "127.0.0.1", 0) as kv:
        tcp = await serve_tcp_echo("127.0.0.1", 0)
        tcp_port = tcp.sockets[0].getsockname()[1]
        print(f"{READY} endpoint={listener.port} echo={echo.port} kv={kv.port} tcp={tcp_port}",
              flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        tcp.close()


@dataclass(frozen=True, slots=True)
class PeerPorts:
    endpoint: int
    echo: int
    kv: int
    tcp: int


@contextlib.contextmanager
def peer_process(loop: str, *, timeout: float = 120.0) -> Iterator[PeerPorts]:
    """Start the peer on ``loop`` in a new process; its ports. Terminated (then killed) after.

    Raises:
        AiordmaError: it did not say READY within ``timeout`` seconds.
    """
    cmd = [sys.executable, "-m", "aiordma.tools.bench.peer", "--loop", loop]
    with announced(cmd, READY, timeout=timeout, env=dict(os.environ)) as line:
        ports = dict(part.split("=") for part in line.split()[1:])
        yield PeerPorts(**{k: int(v) for k, v in ports.items()})


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop")
    a = p.parse_args()
    profile_dir = os.environ.get("AIORDMA_BENCH_PROFILE_DIR")
    if profile_dir:
        import cProfile

        with cProfile.Profile() as prof:
            (uvloop.run if a.loop == "uvloop" else asyncio.run)(_serve())
        prof.dump_stats(os.path.join(profile_dir, f"peer-{a.loop}.prof"))
    else:
        (uvloop.run if a.loop == "uvloop" else asyncio.run)(_serve())
    sys.exit(0)
