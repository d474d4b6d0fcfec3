"""``python -m harness bench``: ``aiordma bench``'s areas (a)-(g) and perftest across the wire
of two VMs, the servers on host 2 and the clients on host 1, each row proven to have crossed
the link by both hosts' counters (:mod:`.wire`); ``--loss P`` runs each repeat's rows again
under ``netem loss P%`` on both hosts' link.

On this machine it boots the pair (:func:`harness.pair.run_pair`) with itself as host 1's
command (``--here``); on host 1 it runs :func:`aiordma.bench.run_bench` with a
:class:`~.wire.Wire` as its link. The collectives, area (h), are not run across the wire by
the bench's rows: :data:`COLLECTIVE_WIRE` times the allreduce across the two hosts beside
Open MPI.
"""

from __future__ import annotations

import argparse
import os
import sys

from aiordma.cli.command import add_bench_options

__all__ = ["COLLECTIVE_WIRE", "add_arguments", "areas_across", "bench_argv", "pair_timeout",
           "run"]

COLLECTIVE_WIRE = ("python -m harness run --hosts 2 -- .venv/bin/python -m "
                   "harness.bench.collective_wire")
"""The allreduce across the two hosts, aiordma beside Open MPI, each under mpirun."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``aiordma bench``'s options, and ``--loss`` and ``--here``."""
    add_bench_options(p)
    p.add_argument("--loss", type=float, default=0.0, metavar="PERCENT",
                   help="each repeat's rows again under netem loss of PERCENT %% on both "
                   "hosts' link, each compared with its row without")
    p.add_argument("--here", action="store_true",
                   help="run on host 1 of a two-VM run (without it, the pair is booted)")


def areas_across(only: str) -> str:
    """The areas of ``--only`` run across the wire: (a)-(g); (h), the collectives, is not
    (the two-host tests run a group under mpirun; :data:`COLLECTIVE_WIRE` times it beside
    Open MPI)."""
    return "".join(a for a in only if a in "abcdefg")


def pair_timeout(*, quick: bool, repeat: int, loss: float) -> float:
    """Seconds after which the bench's pair of VMs is killed: an hour and a half per repeat
    (a quarter of that with ``--quick``), twice that with loss. Each row has its own bound;
    this one is for a VM that stalls."""
    return (1350.0 if quick else 5400.0) * repeat * (2 if loss else 1)


def bench_argv(args: argparse.Namespace, *, json_path: str | None, png_path: str | None,
               only: str) -> list[str]:
    """Host 1's command: this bench with the same options, ``--here``, and the files'
    absolute paths (the VMs share the file system, and can write under the current
    directory)."""
    argv = [sys.executable, "-m", "harness", "bench", "--here", "--repeat", str(args.repeat),
            "--only", only, "--loops", args.loops, "--json", json_path or "",
            "--png", png_path or ""]
    return (argv + (["--loss", f"{args.loss:g}"] if args.loss else [])
            + (["--quick"] if args.quick else []))


def _refuse(msg: str) -> int:
    print(f"harness bench: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """The command (see the module); its exit status (2: options it cannot run)."""
    json_path = os.path.abspath(args.json) if args.json else None
    png_path = os.path.abspath(args.png) if args.png else None
    if not 0 <= args.loss < 100:
        return _refuse(f"--loss is a percentage of frames, from 0 up to (not including) 100, "
                       f"not {args.loss:g}")
    only = areas_across(args.only)
    if not only:
        return _refuse("runs areas (a)-(g) and perftest across the wire; the collectives (h) "
                       f"are not run there (the allreduce across the two hosts, beside Open "
                       f"MPI: {COLLECTIVE_WIRE})")
    if only != "".join(a for a in args.only if a.isalpha()):
        print("harness bench: area (h) is left out (not run across the wire; the allreduce "
              f"beside Open MPI there: {COLLECTIVE_WIRE})", flush=True)
    if not os.environ.get("AIORDMA_AGENT"):
        if args.here:
            return _refuse("--here: not on host 1 of a two-VM run (`python -m harness run "
                           "--hosts 2 -- CMD`); without --here it boots one")
        from ..pair import run_pair

        # The load of the machine launching the pair goes along: the table names it.
        os.environ["AIORDMA_BENCH_HOST_LOAD"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        return run_pair(bench_argv(args, json_path=json_path, png_path=png_path, only=only),
                        timeout=pair_timeout(quick=args.quick, repeat=args.repeat,
                                             loss=args.loss))
    from aiordma.bench import run_bench

    from .wire import Wire

    return run_bench(quick=args.quick, only=only, loops=args.loops.split(","),
                     repeat=args.repeat, json_path=json_path, png_path=png_path,
                     link=Wire(), loss=args.loss)
