"""The ``aiordma`` command: ``devices``, ``rxe status|up|down|run``, ``serve``, ``kv``,
``stats``, ``demo``, ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from aiordma import AiordmaError

from .show import print_devices as _print_devices

__all__ = ["main"]


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
    from . import rxe

    if args.action == "status":
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
        route = rxe.vm_route()
        print("rxe in a VM: " + (route if isinstance(route, str)
                                 else f"possible ({route.kernel.image} in {route.qemu})"))
        return 0
    if args.action == "up":
        setup = rxe.rxe_up(args.netdev, address=args.address, name=args.name)
        print(f"{setup.device} on {setup.netdev}")
        return 0
    if args.action == "down":
        rxe.rxe_down(args.name, netdev=args.netdev or rxe.DEFAULT_NETDEV)
        return 0
    if args.action == "_guest":
        return rxe.guest_main(_strip_dashes(args.cmd))
    if args.action == "exec":
        from .remote import exec_on_host2

        return exec_on_host2(_strip_dashes(args.cmd), timeout=args.timeout)
    if args.action == "rsh":
        from .remote import rsh_on_host2

        return rsh_on_host2(args.host, args.cmd)
    if args.action in ("kill", "boot"):
        from .remote import boot_host2, kill_host2

        if args.action == "kill":
            kill_host2()
            print("host 2 killed (its QEMU process, SIGKILL)")
        else:
            print(f"host 2 booted: its agent answered after {boot_host2():.1f} s")
        return 0
    # run
    if args.hosts == 2:
        from .vm_pair import run_pair

        return run_pair(_strip_dashes(args.cmd), timeout=args.timeout)
    return rxe.run_with_device(_strip_dashes(args.cmd), force_vm=args.vm, kvm=args.kvm,
                                timeout=args.timeout)


def _strip_dashes(cmd: list[str]) -> list[str]:
    return cmd[1:] if cmd and cmd[0] == "--" else cmd


def cmd_demo(args: argparse.Namespace) -> int:
    from . import rxe

    if not rxe.host_active_port() and not args.here:
        # No device here: run the same demo where there is one (this host via rxe, or a VM).
        argv = [sys.executable, "-m", "aiordma", "demo", args.what, "--here"]
        for name in ("count", "clients", "tasks", "keys", "ops", "loop", "calls", "workers"):
            argv += [f"--{name}", str(getattr(args, name))]
        return rxe.run_with_device(argv)
    if args.what == "endpoints":
        from .demo import run_demo

        return run_demo(count=args.count)
    if args.what == "microservices":
        from .demo_micro import run_micro_demo

        return run_micro_demo(ops=args.calls, workers=args.workers, loop=args.loop)
    from .demo_kv import run_kv_demo

    return run_kv_demo(clients=args.clients, tasks=args.tasks, keys=args.keys, ops=args.ops,
                       loop=args.loop)


def bench_argv(args: argparse.Namespace, *, json_path: str | None, png_path: str | None,
               only: str) -> list[str]:
    """The command that runs this ``aiordma bench`` where the device is (in a VM, or on host 1
    of a two-VM run): the same options, ``--here``, and the files' absolute paths (the VMs
    share the file system, and can write under the current directory)."""
    argv = [sys.executable, "-m", "aiordma", "bench", "--here", "--repeat", str(args.repeat),
            "--only", only, "--loops", args.loops, "--json", json_path or "",
            "--png", png_path or ""]
    if args.hosts == 2:
        argv += ["--hosts", "2"] + (["--loss", f"{args.loss:g}"] if args.loss else [])
    return argv + (["--quick"] if args.quick else []) + (["--peers"] if args.peers else [])


COLLECTIVE_WIRE = ("aiordma rxe run --hosts 2 -- .venv/bin/python -m "
                   "aiordma.tools.bench.collective_wire")
"""The allreduce across the two hosts, aiordma beside Open MPI, each under mpirun."""


def areas_across(only: str) -> str:
    """The areas of ``--only`` that ``--hosts 2`` runs: (a)-(g); (h), the collectives, is
    not run across the wire by the bench's rows (the two-host tests run a group under
    mpirun; :data:`COLLECTIVE_WIRE` times it beside Open MPI)."""
    return "".join(a for a in only if a in "abcdefg")


def pair_timeout(*, quick: bool, repeat: int, loss: float) -> float:
    """Seconds after which ``aiordma bench --hosts 2`` kills both VMs: an hour and a half per
    repeat (a quarter of that with ``--quick``), twice that with loss. Each row has its own
    bound; this one is for a VM that stalls."""
    return (1350.0 if quick else 5400.0) * repeat * (2 if loss else 1)


def cmd_bench(args: argparse.Namespace) -> int:
    import os

    from . import rxe

    json_path = os.path.abspath(args.json) if args.json else None
    png_path = os.path.abspath(args.png) if args.png else None
    only = args.only
    if args.loss and args.hosts != 2:
        print("aiordma bench: --loss needs --hosts 2 (it is set on the link between the two "
              "hosts)", file=sys.stderr)
        return 2
    if not 0 <= args.loss < 100:
        print(f"aiordma bench: --loss is a percentage of frames, from 0 up to (not including) "
              f"100, not {args.loss:g}", file=sys.stderr)
        return 2
    if args.hosts == 2:
        only = areas_across(args.only)
        if args.peers or not only:
            print("aiordma bench --hosts 2: runs areas (a)-(g) and perftest across the wire; "
                  "the peers (--peers) and the collectives (h) are not run there (the "
                  f"allreduce across the two hosts, beside Open MPI: {COLLECTIVE_WIRE})",
                  file=sys.stderr)
            return 2
        if only != "".join(a for a in args.only if a.isalpha()):
            print("aiordma bench --hosts 2: area (h) is left out (not run across the wire; "
                  f"the allreduce beside Open MPI there: {COLLECTIVE_WIRE})", flush=True)
    if args.peers:
        from .bench.peers import PeersNotInstalled, find_peers

        try:
            find_peers()  # before a VM boots for nothing
        except PeersNotInstalled as exc:
            print(f"aiordma bench --peers: {exc}", file=sys.stderr)
            return 2
    if args.hosts == 2 and not os.environ.get("AIORDMA_AGENT"):
        if args.here:
            print("aiordma bench --hosts 2 --here: not on host 1 of a two-VM run (`aiordma rxe "
                  "run --hosts 2 -- CMD`); without --here it boots one", file=sys.stderr)
            return 2
        # Two VMs joined by a private link, this bench as host 1's command.
        from .vm_pair import run_pair

        os.environ["AIORDMA_BENCH_HOST_LOAD"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        return run_pair(bench_argv(args, json_path=json_path, png_path=png_path, only=only),
                        timeout=pair_timeout(quick=args.quick, repeat=args.repeat,
                                             loss=args.loss))
    if args.hosts == 1 and not rxe.host_active_port() and not args.here:
        # No device here: run the same bench where there is one (this host via rxe, or a VM,
        # which shares the file system and can write under the current directory). The
        # host's load goes along: the table names the conditions it was measured in.
        os.environ["AIORDMA_BENCH_HOST_LOAD"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        return rxe.run_with_device(bench_argv(args, json_path=json_path, png_path=png_path,
                                              only=only))
    from .bench import run_bench

    return run_bench(quick=args.quick, only=only, loops=args.loops.split(","),
                     repeat=args.repeat, json_path=json_path, png_path=png_path,
                     peers=args.peers, hosts=args.hosts, loss=args.loss)


def _service(args: argparse.Namespace) -> Any:
    if args.service == "kv":
        from aiordma.services.kv import KvStore

        return KvStore(slots=args.slots, slot_size=args.slot_size, window=args.window)
    from aiordma.services.echo import Echo

    return Echo()


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    import uvloop

    from aiordma.rpc import serve

    service = _service(args)

    async def run() -> None:
        async with await serve(service, args.host, args.port) as server:
            print(f"serving {args.service} on {args.host}:{server.port} (Ctrl-C stops)",
                  flush=True)
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
        async with await kv.connect(args.host, args.port, timeout=args.timeout) as store:
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
        async with await connect(host, port, timeout=args.timeout) as client:
            return await client.call(STATS_METHOD, timeout=args.timeout)

    stats = asyncio.run(run())
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats, f"{host}:{port}"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiordma", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("devices", help="RDMA devices, ports, MTUs and GIDs")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=cmd_devices)

    r = sub.add_parser("rxe", help="Soft-RoCE harness: status, up, down, run -- CMD, "
                       "exec 2 -- CMD, kill 2, boot 2")
    rs = r.add_subparsers(dest="action", required=True)
    rs.add_parser("status", help="devices here, or why none, and which route is available")
    up = rs.add_parser("up", help="create an rxe device (root; kernel with rdma_rxe)")
    up.add_argument("--netdev", help="bind to this interface instead of a new dummy one")
    up.add_argument("--address", default=_default("DEFAULT_ADDR"),
                    help="address of the dummy interface (default %(default)s)")
    up.add_argument("--name", default="rxe0")
    down = rs.add_parser("down", help="remove the rxe device (and our dummy interface)")
    down.add_argument("--name", default="rxe0")
    down.add_argument("--netdev")
    run = rs.add_parser("run", help="run CMD where an RDMA device exists (host, else a VM)")
    run.add_argument("--vm", action="store_true", help="use a VM even if the host could do rxe")
    run.add_argument("--kvm", action="store_true", help="boot the VM with KVM (default: TCG)")
    run.add_argument("--timeout", type=float, default=5400.0,
                     help="kill the VM after this many seconds (default %(default)s)")
    run.add_argument("--hosts", type=int, choices=[1, 2], default=1,
                     help="2: two VMs joined by a private link, CMD on host 1, host 2 reached "
                     "by `aiordma rxe exec 2 -- CMD` (always VMs, even where this host has "
                     "RDMA)")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    ex = rs.add_parser("exec", help="on host 1 of a two-VM run: run CMD on host 2 (its output "
                       "and exit status pass through)")
    ex.add_argument("host", type=int, choices=[2])
    ex.add_argument("--timeout", type=float, default=None,
                    help="kill it after this many seconds (default: none)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    rsh = rs.add_parser("rsh", help="on host 1 of a two-VM run: rsh to host 2 (HOST CMD...: "
                        "CMD run by sh there), e.g. Open MPI's launch agent: mpirun --mca "
                        "plm_rsh_agent '.venv/bin/aiordma rxe rsh'")
    rsh.add_argument("host", help="host 2's link address or name (10.77.0.2, aiordma-host2)")
    rsh.add_argument("cmd", nargs=argparse.REMAINDER)
    kill = rs.add_parser("kill", help="on host 1 of a two-VM run: make host 2 vanish (its QEMU "
                         "process is SIGKILLed: no FIN, no RST)")
    kill.add_argument("host", type=int, choices=[2])
    boot = rs.add_parser("boot", help="on host 1 of a two-VM run: boot host 2 again after a "
                         "kill (returns once its agent answers)")
    boot.add_argument("host", type=int, choices=[2])
    guest = rs.add_parser("_guest", help=argparse.SUPPRESS)
    guest.add_argument("cmd", nargs=argparse.REMAINDER)
    r.set_defaults(func=cmd_rxe)

    srv = sub.add_parser("serve", help="serve a service over RDMA: kv or echo")
    srv.add_argument("service", choices=["kv", "echo"])
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on; its RoCE GID picks the device")
    srv.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    srv.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    srv.add_argument("--slots", type=int, default=4096, help="kv: table slots")
    srv.add_argument("--slot-size", type=int, default=512,
                     help="kv: bytes per slot (key + value up to this minus 24 are one-sided)")
    srv.add_argument("--window", type=int, default=4, help="kv: slots per one-sided lookup")
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
    kvp.set_defaults(func=cmd_kv)

    stp = sub.add_parser("stats", help="an RPC server's per-method counters (calls, errors, "
                         "cancelled, expired, refused, in flight, latency percentiles)")
    stp.add_argument("address", type=host_port, metavar="HOST:PORT")
    stp.add_argument("--json", action="store_true", help="machine-readable output")
    stp.add_argument("--timeout", type=float, default=10.0,
                     help="seconds to connect, and for the answer (default %(default)s)")
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
    demo.add_argument("--here", action="store_true", help="do not look for a device elsewhere")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="aiordma against perftest, asyncio TCP and (--peers) "
                           "ucxx and Open MPI: a table "
                           "with ratios and goals, JSON, PNG")
    bench.add_argument("--quick", action="store_true", help="small counts: a smoke test")
    bench.add_argument("--only", default="abcdefgh", help="areas to run, e.g. a,b,e (default "
                       "all)")
    bench.add_argument("--repeat", type=int, default=1, help="runs of everything (median, "
                       "min, max)")
    bench.add_argument("--loops", default="asyncio,uvloop", help="default %(default)s")
    bench.add_argument("--json", default="aiordma-bench.json", help="'' for none "
                       "(default %(default)s)")
    bench.add_argument("--png", default="aiordma-bench.png", help="'' for none; needs "
                       "matplotlib (default %(default)s)")
    bench.add_argument("--here", action="store_true", help="do not look for a device elsewhere")
    bench.add_argument("--peers", action="store_true", help="also run ucxx (beside a, d, g) "
                       "and Open MPI (beside h) on the same device; install them first with "
                       "scripts/setup-peers.sh")
    bench.add_argument("--hosts", type=int, choices=[1, 2], default=1,
                       help="2: areas a-g and perftest across the wire of two VMs joined by a "
                       "private link (servers on host 2, clients on host 1; each row proven "
                       "to cross it by both hosts' counters); boots the pair unless run on "
                       "its host 1")
    bench.add_argument("--loss", type=float, default=0.0, metavar="PERCENT",
                       help="with --hosts 2: each repeat's rows again under netem loss of "
                       "PERCENT %% on both hosts' link, each compared with its row without")
    bench.set_defaults(func=cmd_bench)
    return p


def _default(name: str) -> str:
    from . import rxe

    return str(getattr(rxe, name))


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
