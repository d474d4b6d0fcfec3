"""``python -m harness``, from the repository's root: ``run [--hosts 2] -- CMD``, ``status``,
``exec 2 -- CMD``, ``rsh HOST CMD...``, ``kill 2``, ``boot 2``, ``bench``."""

from __future__ import annotations

import argparse
import sys

from aiordma import AiordmaError

__all__ = ["build_parser", "main", "strip_dashes"]


def strip_dashes(cmd: list[str]) -> list[str]:
    """A command given after ``--``, without the ``--``."""
    return cmd[1:] if cmd and cmd[0] == "--" else cmd


def cmd_run(args: argparse.Namespace) -> int:
    if args.hosts == 2:
        from .pair import run_pair

        return run_pair(strip_dashes(args.cmd), timeout=args.timeout)
    from .run import run_with_device

    return run_with_device(strip_dashes(args.cmd), force_vm=args.vm, kvm=args.kvm,
                           timeout=args.timeout)


def cmd_status(args: argparse.Namespace) -> int:
    from aiordma.cli.command import print_status

    from .run import vm_route

    print_status()
    route = vm_route()
    print("rxe in a VM: " + (route if isinstance(route, str)
                             else f"possible ({route.kernel.image} in {route.qemu})"))
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    from .remote import exec_on_host2

    return exec_on_host2(strip_dashes(args.cmd), timeout=args.timeout)


def cmd_rsh(args: argparse.Namespace) -> int:
    from .remote import rsh_on_host2

    return rsh_on_host2(args.host, args.cmd)


def cmd_kill(args: argparse.Namespace) -> int:
    from .remote import kill_host2

    kill_host2()
    print("host 2 killed (its QEMU process, SIGKILL)")
    return 0


def cmd_boot(args: argparse.Namespace) -> int:
    from .remote import boot_host2

    print(f"host 2 booted: its agent answered after {boot_host2(timeout=args.timeout):.1f} s")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.across import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from .bench.across import add_arguments

    p = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run CMD where an RDMA device exists: here (rxe made "
                         "if the kernel allows it), else in a VM")
    run.add_argument("--vm", action="store_true", help="use a VM even if the host could do rxe")
    run.add_argument("--kvm", action="store_true", help="boot the VM with KVM (default: TCG)")
    run.add_argument("--timeout", type=float, default=5400.0,
                     help="kill the VM after this many seconds (default %(default)s)")
    run.add_argument("--hosts", type=int, choices=[1, 2], default=1,
                     help="2: two VMs joined by a private link, CMD on host 1, host 2 reached "
                     "by `python -m harness exec 2 -- CMD` (always VMs, even where this host "
                     "has RDMA)")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)

    st = sub.add_parser("status", help="devices here, or why none, and which route (rxe "
                        "here, a VM) is available")
    st.set_defaults(func=cmd_status)

    ex = sub.add_parser("exec", help="on host 1 of a two-VM run: run CMD on host 2 (its "
                        "output and exit status pass through)")
    ex.add_argument("host", type=int, choices=[2])
    ex.add_argument("--timeout", type=float, default=None,
                    help="kill it after this many seconds (default: none; a host 2 that "
                    "stops answering is noticed within 20 s)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    ex.set_defaults(func=cmd_exec)

    rsh = sub.add_parser("rsh", help="on host 1 of a two-VM run: rsh to host 2 (HOST CMD...: "
                         "CMD run by sh there), e.g. Open MPI's launch agent: mpirun --mca "
                         "plm_rsh_agent '.venv/bin/python -m harness rsh'")
    rsh.add_argument("host", help="host 2's link address or name (10.77.0.2, aiordma-host2)")
    rsh.add_argument("cmd", nargs=argparse.REMAINDER)
    rsh.set_defaults(func=cmd_rsh)

    kill = sub.add_parser("kill", help="on host 1 of a two-VM run: make host 2 vanish (its "
                          "QEMU process is SIGKILLed: no FIN, no RST)")
    kill.add_argument("host", type=int, choices=[2])
    kill.set_defaults(func=cmd_kill)

    boot = sub.add_parser("boot", help="on host 1 of a two-VM run: boot host 2 again after a "
                          "kill (returns once its agent answers)")
    boot.add_argument("host", type=int, choices=[2])
    boot.add_argument("--timeout", type=float, default=300.0,
                      help="seconds for its agent to answer (default %(default)s)")
    boot.set_defaults(func=cmd_boot)

    bench = sub.add_parser("bench", help="aiordma bench's areas a-g and perftest across the "
                           "wire of two VMs (servers on host 2, clients on host 1; each row "
                           "proven to cross it by both hosts' counters); boots the pair")
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AiordmaError as exc:
        print(f"harness: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
