"""One rank of a collectives group started by Open MPI's ``mpirun`` across the two hosts
(``test_two_hosts_collectives.py``).

The group forms from ``OMPI_COMM_WORLD_RANK``/``_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``
(passed on with ``mpirun -x``), as a user's script would (``Group.from_env``). It checks every
collective on both sides of the size thresholds (the few-rounds algorithms and the ring ones by
RDMA WRITE), byte for byte against what numpy computes here, and prints
``CHECKED <rank> <world> <hostname>``. With ``--until-broken`` it then runs 256 KiB allreduces
back to back, prints ``STARTED <rank>`` after the first, and when one fails prints
``BROKEN <rank> <type> <is BrokenResourceError> <time.monotonic()> <message>`` and exits 0
(the test compares the time with the moment it killed a host: the same clock on one host).

Every line is printed with a flush: ``mpirun`` forwards them as they come.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time

import numpy as np
import uvloop

import aiordma
from aiordma import Config
from aiordma.services.collectives import Group


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def check(g: Group) -> None:
    n, r = g.world_size, g.rank
    await g.barrier()
    for size in (10, 1 << 20):  # 40 B: recursive doubling; 4 MiB: the ring, by RDMA WRITE
        x = (np.arange(size, dtype=np.float32) % 97) * (r + 1)
        await g.allreduce(x)
        want = (np.arange(size, dtype=np.float32) % 97) * sum(range(1, n + 1))
        assert np.array_equal(x, want), f"allreduce of {size} float32 differs"
    for size in (3, 100_000):  # few-rounds, then the ring allgather
        parts = await g.allgather(np.full(size, r, dtype=np.int32))
        assert [int(p[0]) for p in parts] == list(range(n)) and all(len(p) == size
                                                                   for p in parts)
    for size in (4, 1 << 18):  # in the tree's header; then the pipelined chain
        data = np.arange(size, dtype=np.int64) if r == n - 1 else None
        got = await g.broadcast(data, root=n - 1)
        assert np.array_equal(got, np.arange(size, dtype=np.int64))
    await g.barrier()
    say(f"CHECKED {r} {n} {socket.gethostname()}")


async def main(a: argparse.Namespace) -> None:
    config = Config(keepalive_idle=a.keepalive, keepalive_interval=1,
                    keepalive_probes=a.keepalive) if a.keepalive else None
    g = await Group.from_env(timeout=a.timeout, config=config)
    try:
        await check(g)
        if not a.until_broken:
            await asyncio.wait_for(g.aclose(), a.timeout)  # (graceful: the others' last
            return                                         # messages are delivered)
        x = np.ones(1 << 16, dtype=np.float32)
        first = True
        while True:
            try:
                await g.allreduce(x, timeout=a.timeout)
            except aiordma.AiordmaError as exc:
                t = time.monotonic()
                say(f"BROKEN {g.rank} {type(exc).__name__} "
                    f"{isinstance(exc, aiordma.BrokenResourceError)} {t:.3f} {exc}")
                return
            if first:
                say(f"STARTED {g.rank}")
                first = False
            x[:] = 1.0
    finally:
        g.abort()  # (harmless once closed)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--keepalive", type=int, default=0, metavar="S",
                   help="the endpoints' keepalive: idle S s, then S probes 1 s apart")
    p.add_argument("--until-broken", action="store_true")
    args = p.parse_args()
    (uvloop.run if args.loop == "uvloop" else asyncio.run)(main(args))
    os._exit(0)  # (a rank whose peers vanished: no waiting for their sockets at exit)
