"""Deterministic cost of one RPC call's Python work: instructions per call under callgrind.

Usage: python scripts/rpc_icount.py [--loop asyncio|uvloop] [--in-flight K] [--kind def|async]
                                    [--over memory|tcp]
       python scripts/rpc_icount.py --count [...]   # handles run and loop turns per call

An RPC echo of 64 B over ``aiordma.testing.channel_pair()`` (no device), ``K`` calls in flight,
served by a plain ``def`` method (answered inline) or an ``async def`` one (a task per call).
``--over tcp``: over the TCP transport's channels on loopback instead (``tcp_pairs()``, both
ends in this process), where a message wakes its reader from the socket's own callback.
The figure is ``(Ir(N2) - Ir(N1)) / (N2 - N1)``: two runs under ``valgrind --tool=callgrind``
that differ only in the number of timed calls, so start-up, imports and warm-up cancel out.
With ``PYTHONHASHSEED=0`` two runs of the same code agree to a few instructions per call, where
wall and CPU time on a shared host vary by tens of percent. ``--count`` runs once without
valgrind and prints, per call, the event loop's turns and the handles it ran, by callback
(asyncio only: it patches asyncio's pure-Python ``Handle._run`` and ``_run_once``).

To compare two versions of the code, run this file with each on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

PAYLOAD = b"x" * 64
COUNTS: collections.Counter[str] = collections.Counter()


def _count_handles() -> None:
    from asyncio import base_events, events

    run, turn = events.Handle._run, base_events.BaseEventLoop._run_once

    def _run(self: Any) -> None:
        cb = self._callback
        COUNTS[getattr(cb, "__qualname__", None) or type(cb).__name__] += 1
        run(self)

    def _run_once(self: Any) -> None:
        COUNTS["(loop turns)"] += 1
        turn(self)

    events.Handle._run = _run  # type: ignore[method-assign]
    base_events.BaseEventLoop._run_once = _run_once  # type: ignore[method-assign]


async def _echo(calls: int, in_flight: int, kind: str, over: str = "memory") -> None:
    from aiordma.testing import channel_pair, tcp_pairs

    if over == "tcp":
        async with tcp_pairs() as (a, b):
            await _echo_over(a, b, calls, in_flight, kind)
    else:
        await _echo_over(*channel_pair(), calls, in_flight, kind)


async def _echo_over(a: Any, b: Any, calls: int, in_flight: int, kind: str) -> None:
    from aiordma.rpc import RpcClient, RpcServer, Service, method

    class Echo(Service):
        @method
        def echo(self, x: Any) -> Any:
            return x

    class AsyncEcho(Service):
        @method
        async def echo(self, x: Any) -> Any:
            return x

    server = RpcServer(Echo() if kind == "def" else AsyncEcho(), max_in_flight=64, grace=1.0)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, 64)

    async def worker(n: int) -> None:
        for _ in range(n):
            await client.call("echo", PAYLOAD)

    try:
        await asyncio.gather(*(worker(20) for _ in range(in_flight)))  # warm-up
        COUNTS.clear()
        await asyncio.gather(*(worker(calls // in_flight) for _ in range(in_flight)))
    finally:
        client.abort()
        a.abort()
        b.abort()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


def _run(loop: str, coro: Any) -> None:
    import uvloop

    (uvloop.run if loop == "uvloop" else asyncio.run)(coro)


def _instructions(args: argparse.Namespace, calls: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
               __file__, "--run", str(calls), "--loop", args.loop, "--in-flight",
               str(args.in_flight), "--kind", args.kind, "--over", args.over]
        subprocess.run(cmd, check=True, capture_output=True,
                       env={**os.environ, "PYTHONHASHSEED": "0"})
        with open(out) as f:
            m = re.search(r"^summary: (\d+)", f.read(), re.MULTILINE)
    if m is None:
        raise SystemExit("callgrind wrote no summary")
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--in-flight", type=int, default=1)
    ap.add_argument("--kind", choices=("def", "async"), default="def")
    ap.add_argument("--over", choices=("memory", "tcp"), default="memory")
    ap.add_argument("--calls", type=int, nargs=2, default=(640, 3200), metavar=("N1", "N2"))
    ap.add_argument("--count", action="store_true", help="handles and loop turns per call")
    ap.add_argument("--run", type=int, help=argparse.SUPPRESS)  # (one run, under valgrind)
    args = ap.parse_args()
    if args.run is not None:
        _run(args.loop, _echo(args.run, args.in_flight, args.kind, args.over))
        return
    if args.count:
        _count_handles()
        calls = args.calls[1] // args.in_flight * args.in_flight
        _run(args.loop, _echo(calls, args.in_flight, args.kind, args.over))
        for name, n in COUNTS.most_common():
            print(f"{n / calls:8.3f}  {name}")
        return
    n1, n2 = args.calls
    ir1, ir2 = _instructions(args, n1), _instructions(args, n2)
    over = "channel_pair" if args.over == "memory" else "tcp_pairs"
    print(f"RPC echo over {over}, {args.loop}, {args.in_flight} in flight, {args.kind} "
          f"method: {(ir2 - ir1) / (n2 - n1):,.0f} instructions per call")


if __name__ == "__main__":
    main()
