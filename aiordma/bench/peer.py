"""The far end of the benchmark, in its own process (as perftest's server is).

``python -m aiordma.bench.peer --loop uvloop`` serves, on one event loop:

* an endpoint listener whose connections take commands, each a msgpack ``[mode, count]``
  message: ``region`` registers a 4 MiB buffer and answers its descriptor (read and write
  access, msgpack of ``RemoteBuffer.to_wire()``); ``echo`` answers the next ``count`` messages
  with themselves; ``sink`` receives ``count`` messages into one 4 MiB buffer (rendezvous
  ones by RDMA READ straight into it) and answers ``b"ok"``. Buffers are made on demand, so
  64 connections that only echo stay small;
* the echo service (:mod:`aiordma.services.echo`) and the key-value service (:mod:`aiordma.services.kv`) by
  ``aiordma.rpc``;
* the asyncio TCP + msgpack echo RPC baseline (:mod:`aiordma.bench.tcp_baseline`).

It prints ``READY endpoint=<port> echo=<port> kv=<port> tcp=<port>`` and serves until it is
terminated. With ``--tcp-only`` (a host without an RDMA device: area t) it serves only the echo
service, over aiordma's TCP transport, and the baseline (``endpoint=0 kv=0``). ``--host ADDR`` serves on that address instead of 127.0.0.1 (the far host's, across
a link: :func:`remote_peer_process` starts it there), ``--keepalive S`` gives its endpoints a
keepalive of S s idle and S probes (:func:`patient`). With ``AIORDMA_BENCH_PROFILE_DIR`` set
it runs under cProfile and writes ``peer-<loop>.prof`` there when terminated (the server side
of a profile).
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
from typing import TYPE_CHECKING

import msgpack
import uvloop

from .process import announced

if TYPE_CHECKING:
    from aiordma import Config

    from .link import Link

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


def patient(keepalive: int) -> Config | None:
    """The endpoints' configuration with a keepalive of ``keepalive`` s idle, then as many
    probes 1 s apart (None: the default, for 0). Across the wire both ends use one: a host
    with one emulated vCPU busy with rxe's packet work has failed to answer the default's
    probes for 3 s (see the README's "Across two machines")."""
    if not keepalive:
        return None
    from aiordma import Config

    return Config(keepalive_idle=keepalive, keepalive_interval=1, keepalive_probes=keepalive)


async def _serve_tcp_only(host: str) -> None:
    """The echo service over aiordma's TCP transport, and the baseline: no device needed."""
    from aiordma.rpc import serve
    from aiordma.services.echo import Echo

    from .tcp_baseline import serve_tcp_echo

    async with await serve(Echo(), host, 0, transport="tcp") as echo:
        tcp = await serve_tcp_echo(host, 0)
        print(f"{READY} endpoint=0 echo={echo.port} kv=0 "
              f"tcp={tcp.sockets[0].getsockname()[1]}", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        tcp.close()


async def _serve(host: str = "127.0.0.1", keepalive: int = 0) -> None:
    import aiordma
    from aiordma.rpc import serve
    from aiordma.services.echo import Echo
    from aiordma.services.kv import KvStore

    from .tcp_baseline import serve_tcp_echo

    config = patient(keepalive)
    async with await aiordma.listen(serve_connection, host, 0, config=config,
                                    transport="rdma") as listener, \
            await serve(Echo(), host, 0, config=config) as echo, \
            await serve(KvStore(), host, 0, config=config) as kv:
        tcp = await serve_tcp_echo(host, 0)
        tcp_port = tcp.sockets[0].getsockname()[1]
        print(f"{READY} endpoint={listener.port} echo={echo.port} kv={kv.port} tcp={tcp_port}",
              flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        tcp.close()


@dataclass(frozen=True, slots=True)
class PeerPorts:
    """Where a peer process serves: its ports, on ``host`` (its address: 127.0.0.1 here,
    host 2's link address across the wire)."""

    endpoint: int
    echo: int
    kv: int
    tcp: int
    host: str = "127.0.0.1"


@contextlib.contextmanager
def peer_process(loop: str, *, timeout: float = 120.0,
                 tcp_only: bool = False) -> Iterator[PeerPorts]:
    """Start the peer on ``loop`` in a new process (``tcp_only``: see the module); its ports.
    Terminated (then killed) after.

    Raises:
        AiordmaError: it did not say READY within ``timeout`` seconds.
    """
    with announced(peer_command(loop, tcp_only=tcp_only), READY, timeout=timeout,
                   env=dict(os.environ)) as line:
        yield parse_ready(line)


def parse_ready(line: str, host: str = "127.0.0.1") -> PeerPorts:
    """The ports of the peer's ``READY endpoint=<port> echo=<port> kv=<port> tcp=<port>``
    line, served on ``host``.

    Raises:
        ValueError: it is not such a line.
    """
    words = line.split()
    if not words or words[0] != READY:
        raise ValueError(f"not the peer's READY line: {line!r}")
    ports = {k: int(v) for k, _, v in (w.partition("=") for w in words[1:])}
    try:
        return PeerPorts(ports["endpoint"], ports["echo"], ports["kv"], ports["tcp"], host)
    except KeyError as exc:
        raise ValueError(f"the peer's READY line lacks {exc}: {line!r}") from None


#: The keepalive (s idle, then as many probes) both ends use across the wire (:func:`patient`),
#: as the two-host tests that move megabytes do.
ACROSS_KEEPALIVE = 10


def peer_command(loop: str, *, host: str = "127.0.0.1", keepalive: int = 0,
                 tcp_only: bool = False) -> list[str]:
    """The peer's command line."""
    return [sys.executable, "-m", "aiordma.bench.peer", "--loop", loop,
            *(["--host", host] if host != "127.0.0.1" else []),
            *(["--keepalive", str(keepalive)] if keepalive else []),
            *(["--tcp-only"] if tcp_only else [])]


@contextlib.contextmanager
def remote_peer_process(loop: str, *, link: Link, keepalive: int = ACROSS_KEEPALIVE,
                        timeout: float = 240.0) -> Iterator[PeerPorts]:
    """Start the peer on ``loop`` on the far host of ``link``, listening on that host's link
    address; its ports. Killed (its process group) after.

    Raises:
        AiordmaError: it did not say READY within ``timeout`` seconds (a Python start with
            aiordma imported takes 5-10 s under emulation on a busy machine), or exited, or
            the far host does not answer.
    """
    host = link.there.address
    with link.start(peer_command(loop, host=host, keepalive=keepalive)) as proc:
        yield parse_ready(proc.expect(READY, timeout), host)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop")
    p.add_argument("--host", default="127.0.0.1", help="the address to serve on")
    p.add_argument("--keepalive", type=int, default=0, metavar="S",
                   help="the endpoints' keepalive: idle S s, then S probes 1 s apart")
    p.add_argument("--tcp-only", action="store_true",
                   help="only the echo service over aiordma's TCP transport, and the baseline")
    a = p.parse_args()
    main = _serve_tcp_only(a.host) if a.tcp_only else _serve(a.host, a.keepalive)
    profile_dir = os.environ.get("AIORDMA_BENCH_PROFILE_DIR")
    if profile_dir:
        import cProfile

        with cProfile.Profile() as prof:
            (uvloop.run if a.loop == "uvloop" else asyncio.run)(main)
        prof.dump_stats(os.path.join(profile_dir, f"peer-{a.loop}.prof"))
    else:
        (uvloop.run if a.loop == "uvloop" else asyncio.run)(main)
    sys.exit(0)
