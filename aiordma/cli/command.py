"""The ``aiordma`` command: ``devices``, ``rxe status|up|down``, ``serve``, ``kv``, ``stats``,
``demo``, ``bench``. (The VM and two-host harness is the repository's ``python -m harness``,
which is not installed.)"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from aiordma import AiordmaError

from . import rxe
from .devices import print_devices as _print_devices

__all__ = ["add_bench_options", "build_parser", "main"]


def cmd_devices(args: argparse.Namespace) -> int:
    from aiordma.lowlevel import list_devices, no_device_reason, verbs_path

    devs = list_devices()
    if args.json:
        print(json.dumps({"devices": [d.to_json() for d in devs],
                          "reason": None if devs else no_device_reason(),
                          "verbs_path": verbs_path()}, indent=2))
        return 0
    if not devs:
        print(f"no RDMA device: {no_device_reason()}")
        return 1
    _print_devices(devs)
    print(f"verbs path: {verbs_path()}")
    return 0


def cmd_rxe(args: argparse.Namespace) -> int:
    if args.action == "status":
        print_status()
        return 0
    if args.action == "up":
        setup = rxe.rxe_up(args.netdev, address=args.address, name=args.name)
        print(f"{setup.device} on {setup.netdev}")
        return 0
    rxe.rxe_down(args.name, netdev=args.netdev or rxe.DEFAULT_NETDEV)
    return 0


def print_status() -> None:
    """``aiordma rxe status``: the devices here, or why there is none; whether rxe can be
    made here."""
    from aiordma.lowlevel import list_devices, no_device_reason

    devs = []
    try:
        devs = list_devices()
    except AiordmaError as exc:
        print(f"pyverbs: {exc}")
    if devs:
        _print_devices(devs)
    else:
        print(f"no RDMA device here: {no_device_reason()}")
    why = rxe.host_can_make_rxe()
    print(f"rxe on this host: {'possible (aiordma rxe up)' if why is None else 'no: ' + why}")


def cmd_demo(args: argparse.Namespace) -> int:
    if not rxe.host_active_port() and not args.here:
        # No device here: run the same demo once rxe is made on this host.
        argv = [sys.executable, "-m", "aiordma", "demo", args.what, "--here"]
        for name in ("count", "clients", "tasks", "keys", "ops", "loop", "calls", "workers"):
            argv += [f"--{name}", str(getattr(args, name))]
        return rxe.run_here(argv)
    if args.what == "endpoints":
        from .demo import run_demo

        return run_demo(count=args.count)
    if args.what == "microservices":
        from .demo_micro import run_micro_demo

        return run_micro_demo(ops=args.calls, workers=args.workers, loop=args.loop)
    from .demo_kv import run_kv_demo

    return run_kv_demo(clients=args.clients, tasks=args.tasks, keys=args.keys, ops=args.ops,
                       loop=args.loop)


def bench_argv(args: argparse.Namespace, *, json_path: str | None,
               png_path: str | None) -> list[str]:
    """The command that runs this ``aiordma bench`` where the device is: the same options,
    ``--here``, and the files' absolute paths."""
    argv = [sys.executable, "-m", "aiordma", "bench", "--here", "--repeat", str(args.repeat),
            "--only", args.only, "--loops", args.loops, "--json", json_path or "",
            "--png", png_path or ""]
    return argv + (["--quick"] if args.quick else []) + (["--peers"] if args.peers else [])


def cmd_bench(args: argparse.Namespace) -> int:
    import os

    json_path = os.path.abspath(args.json) if args.json else None
    png_path = os.path.abspath(args.png) if args.png else None
    if args.host_cpu:  # area (i): here, on the host, with no device (nor a VM) needed
        if args.peers:
            print("aiordma bench: --host-cpu runs on this host without a device; --peers "
                  "needs one", file=sys.stderr)
            return 2
        from aiordma.bench.host_rows import run_host_bench

        return run_host_bench(quick=args.quick, loops=args.loops.split(","),
                              repeat=args.repeat, json_path=json_path)
    if "i" in args.only:
        print("aiordma bench: area (i) runs on this host without a device: use --host-cpu",
              file=sys.stderr)
        return 2
    if args.peers:
        from aiordma.bench.peers import PeersNotInstalled, find_peers

        try:
            find_peers()  # before anything is set up for nothing
        except PeersNotInstalled as exc:
            print(f"aiordma bench --peers: {exc}", file=sys.stderr)
            return 2
    from aiordma.bench.plan import DEVICE_FREE

    device_free = all(a in DEVICE_FREE for a in args.only if a.isalpha())
    if not device_free and not rxe.host_active_port() and not args.here:
        # No device here: run the same bench once rxe is made on this host.
        return rxe.run_here(bench_argv(args, json_path=json_path, png_path=png_path))
    from aiordma.bench import run_bench

    return run_bench(quick=args.quick, only=args.only, loops=args.loops.split(","),
                     repeat=args.repeat, json_path=json_path, png_path=png_path,
                     peers=args.peers)


def _service(args: argparse.Namespace) -> Any:
    if args.service == "kv":
        from aiordma.services.kv import KvStore

        return KvStore(slots=args.slots, slot_size=args.slot_size, window=args.window)
    from aiordma.services.echo import Echo

    return Echo()


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    import uvloop

    from aiordma import Config
    from aiordma.rpc import serve

    service = _service(args)
    config = Config(handshake_timeout=args.handshake_timeout)

    async def run() -> None:
        async with await serve(service, args.host, args.port, transport=args.transport,
                               config=config) as server:
            print(f"serving {args.service} on {args.host}:{server.port} (transport "
                  f"{args.transport}; Ctrl-C stops)", flush=True)
            await asyncio.Event().wait()

    try:
        (asyncio.run if args.loop == "asyncio" else uvloop.run)(run())
    except KeyboardInterrupt:
        pass
    return 0


def cmd_kv(args: argparse.Namespace) -> int:
    import asyncio

    from aiordma.services import kv

    async def run() -> int:
        async with await kv.connect(args.host, args.port, timeout=args.timeout,
                                    transport=args.transport) as store:
            if args.action == "put":
                value = sys.stdin.buffer.read() if args.value == "-" else args.value.encode()
                await store.put(args.key, value, timeout=args.timeout)
                return 0
            if args.action == "delete":
                if await store.delete(args.key, timeout=args.timeout):
                    return 0
                print(f"aiordma kv: no key {args.key!r}", file=sys.stderr)
                return 1
            value = await store.get(args.key, one_sided=not args.rpc, timeout=args.timeout)
            if value is None:
                print(f"aiordma kv: no key {args.key!r}", file=sys.stderr)
                return 1
            sys.stdout.buffer.write(value + (b"" if args.raw else b"\n"))
            return 0

    if args.loop == "uvloop":
        import uvloop

        return uvloop.run(run())
    return asyncio.run(run())


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for an IPv6 address) as a host and a port.

    Raises:
        argparse.ArgumentTypeError: it is not that.
    """
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def cmd_stats(args: argparse.Namespace) -> int:
    """An RPC server's per-method counters, from its built-in ``aiordma.stats`` method."""
    import asyncio

    from aiordma.rpc import STATS_METHOD, connect
    from aiordma.rpc._stats import format_stats

    host, port = args.address

    async def run() -> Any:
        async with await connect(host, port, timeout=args.timeout,
                                 transport=args.transport) as client:
            return await client.call(STATS_METHOD, timeout=args.timeout)

    stats = asyncio.run(run())
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats, f"{host}:{port}"))
    return 0


def _transport_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--transport", choices=["auto", "rdma", "tcp"], default="auto",
                        help=f"{what} (default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiordma", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("devices", help="RDMA devices, ports, MTUs and GIDs")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=cmd_devices)

    r = sub.add_parser("rxe", help="Soft-RoCE on this host: status, up, down")
    rs = r.add_subparsers(dest="action", required=True)
    rs.add_parser("status", help="devices here, or why none, and whether rxe can be made here")
    up = rs.add_parser("up", help="create an rxe device (root; kernel with rdma_rxe)")
    up.add_argument("--netdev", help="bind to this interface instead of a new dummy one")
    up.add_argument("--address", default=rxe.DEFAULT_ADDR,
                    help="address of the dummy interface (default %(default)s)")
    up.add_argument("--name", default=rxe.DEFAULT_RXE)
    down = rs.add_parser("down", help="remove the rxe device (and our dummy interface)")
    down.add_argument("--name", default=rxe.DEFAULT_RXE)
    down.add_argument("--netdev")
    r.set_defaults(func=cmd_rxe)

    srv = sub.add_parser("serve", help="serve a service over RDMA (and TCP): kv or echo")
    srv.add_argument("service", choices=["kv", "echo"])
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on; its RoCE GID picks the device")
    srv.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    srv.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    srv.add_argument("--slots", type=int, default=4096, help="kv: table slots")
    srv.add_argument("--slot-size", type=int, default=512,
                     help="kv: bytes per slot (key + value up to this minus 24 are one-sided)")
    srv.add_argument("--window", type=int, default=4, help="kv: slots per one-sided lookup")
    srv.add_argument("--handshake-timeout", type=float, default=10.0, metavar="S",
                     help="seconds a client's set-up may take (Config.handshake_timeout)")
    _transport_option(srv, "which clients it takes: auto (RDMA and TCP; TCP only without a "
                      "device), rdma or tcp")
    srv.set_defaults(func=cmd_serve)

    kvp = sub.add_parser("kv", help="a key-value client: get, put, delete")
    kvp.add_argument("action", choices=["get", "put", "delete"])
    kvp.add_argument("key")
    kvp.add_argument("value", nargs="?", help="put: the value ('-': read stdin)")
    kvp.add_argument("--host", default="127.0.0.1")
    kvp.add_argument("--port", type=int, required=True)
    kvp.add_argument("--rpc", action="store_true", help="get by RPC, not by RDMA READ")
    kvp.add_argument("--raw", action="store_true", help="get: no newline after the value")
    kvp.add_argument("--timeout", type=float, default=10.0)
    kvp.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    _transport_option(kvp, "auto (RDMA where both ends have a device, else TCP), rdma or tcp")
    kvp.set_defaults(func=cmd_kv)

    stp = sub.add_parser("stats", help="an RPC server's per-method counters (calls, errors, "
                         "cancelled, expired, refused, in flight, latency percentiles)")
    stp.add_argument("address", type=host_port, metavar="HOST:PORT")
    stp.add_argument("--json", action="store_true", help="machine-readable output")
    stp.add_argument("--timeout", type=float, default=10.0,
                     help="seconds to connect, and for the answer (default %(default)s)")
    _transport_option(stp, "auto (RDMA where both ends have a device, else TCP), rdma or tcp")
    stp.set_defaults(func=cmd_stats)

    demo = sub.add_parser("demo", help="a key-value server and clients over RDMA (or: "
                          "endpoints, a loopback exchange; microservices, replicas behind a "
                          "pool, one killed)")
    demo.add_argument("what", nargs="?", choices=["kv", "endpoints", "microservices"],
                      default="kv")
    demo.add_argument("--clients", type=int, default=4, help="kv: client connections")
    demo.add_argument("--tasks", type=int, default=4, help="kv: workers per connection")
    demo.add_argument("--keys", type=int, default=500, help="kv: keys loaded first")
    demo.add_argument("--ops", type=int, default=4000, help="kv: operations in the mixed run")
    demo.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    demo.add_argument("--count", type=int, default=300, help="endpoints: round trips per loop")
    demo.add_argument("--calls", type=int, default=600, help="microservices: calls in the run")
    demo.add_argument("--workers", type=int, default=12,
                      help="microservices: tasks making calls")
    demo.add_argument("--here", action="store_true",
                      help="run as things are (do not make rxe on this host first)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="aiordma against perftest, asyncio TCP and (--peers) "
                           "ucxx and Open MPI: a table with ratios and goals, JSON, PNG")
    add_bench_options(bench)
    bench.add_argument("--here", action="store_true",
                       help="run as things are (do not make rxe on this host first)")
    bench.add_argument("--peers", action="store_true", help="also run ucxx (beside a, d, g) "
                       "and Open MPI (beside h) on the same device; install them first with "
                       "scripts/setup-peers.sh")
    bench.add_argument("--host-cpu", action="store_true", help="only area (i): CPU time per "
                       "message round trip and RPC call on this host, no device, beside "
                       "asyncio TCP + msgpack")
    bench.set_defaults(func=cmd_bench)
    return p


def add_bench_options(bench: argparse.ArgumentParser) -> None:
    """The options of ``aiordma bench`` that every run of it takes (the developer harness's
    bench across two VMs takes them too)."""
    bench.add_argument("--quick", action="store_true", help="small counts: a smoke test")
    bench.add_argument("--only", default="abcdefght", help="areas to run, e.g. a,b,e (default "
                       "all but i)")
    bench.add_argument("--repeat", type=int, default=1, help="runs of everything (median, "
                       "min, max)")
    bench.add_argument("--loops", default="asyncio,uvloop", help="default %(default)s")
    bench.add_argument("--json", default="aiordma-bench.json", help="'' for none "
                       "(default %(default)s)")
    bench.add_argument("--png", default="aiordma-bench.png", help="'' for none; needs "
                       "matplotlib (default %(default)s)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "kv" and args.action == "put" and args.value is None:
        parser.error("kv put needs a value ('-' reads it from stdin)")
    try:
        return int(args.func(args) or 0)
    except AiordmaError as exc:
        print(f"aiordma: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
