"""Allreduce across two hosts, aiordma beside Open MPI: 4 ranks, 2 on each host of
``python -m harness run --hosts 2``, every system started by Open MPI's ``mpirun``.

Run on host 1 of the pair, from the repository's root::

    .venv/bin/python -m harness run --hosts 2 -- \
        .venv/bin/python -m harness.bench.collective_wire

One ``mpirun`` per system, each with ``--host H1:2,H2:2 --map-by slot`` (ranks 0-1 on host 1,
2-3 on host 2) and ``python -m harness rsh`` as its launch agent (host 2's command agent, in
place of ssh), mpirun's own connections kept to the link (``oob_tcp_if_include eth0``):

* **aiordma**: :mod:`~aiordma.bench.collective_worker` (a
  :class:`~aiordma.services.collectives.Group` formed from mpirun's variables and the
  ``MASTER_ADDR``/``MASTER_PORT`` passed with ``-x``), on one event loop;
* **Open MPI over rxe**: :mod:`~aiordma.bench.mpi_worker` (mpi4py's
  ``Allreduce(IN_PLACE, ...)``, Debian's ``/usr/bin/python3``) with the route of
  :func:`~aiordma.bench.peers.mpirun_argv` (``pml cm``, ``mtl ofi``, libfabric's
  ``verbs;ofi_rxm`` on rxe0), proven by :func:`~aiordma.bench.peers.mpi_route`;
* **Open MPI over TCP** (context): ``ob1`` with the ``tcp`` BTL on eth0 for every pair of
  ranks, the two on one host included.

Both rank programs time and check the same cases the same way
(:mod:`~aiordma.bench.collective_cases`: a barrier before each call, a call's time is the
slowest rank's, every result checked element by element). Beside each system's proof: on which
host each rank ran (their files say), and how much host 1's eth0 and rxe0 counters moved during
its launch (RoCE traffic shows in both; Open MPI over TCP moves eth0 only).

The parsing, checks and the table are pure (``tests/unit/test_bench_collective_wire.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiordma.bench
from aiordma import AiordmaError
from aiordma.bench.collective_rows import _run_group, _tail, merge_ranks
from aiordma.bench.peers import (
    PeerRouteError,
    PeersNotInstalled,
    find_peers,
    mpi_route,
    mpirun_argv,
)
from aiordma.bench.plan import KIB, MIB, size_name

from ..remote import NotTwoHostsError, RemoteProcess, host_addresses

__all__ = ["SIZES", "SYSTEMS", "WireRow", "format_table", "host_args", "main", "parse_sizes",
           "placement", "run"]

SIZES = (8, 64 * KIB, MIB, 4 * MIB)
"""Bytes per rank (float32): a few-rounds size, the threshold region, two ring sizes."""

SYSTEMS = {"aiordma": "aiordma", "ompi-rxe": "Open MPI over rxe", "ompi-tcp": "Open MPI over TCP"}
"""Key -> the column's label, in the table's order."""

#: Open MPI's rank program (a file: mpirun runs Debian's python3 on it, without the venv).
MPI_WORKER = Path(aiordma.bench.__file__).with_name("mpi_worker.py")

DEVICE, NETDEV = "rxe0", "eth0"  # what ``python -m harness run --hosts 2`` makes on each host
#: The ranks' keepalive (idle S s, then S probes): the default (3 s) broke a healthy link once
#: between two loaded 1-vCPU hosts (README, "Across two machines"), as in the mpirun test.
KEEPALIVE = 10
_COUNTERS = {"eth0 tx bytes": f"/sys/class/net/{NETDEV}/statistics/tx_bytes",
             "eth0 rx bytes": f"/sys/class/net/{NETDEV}/statistics/rx_bytes"}
#: rxe's counters (sent_pkts, rcvd_pkts, and its retries, sequence errors, RNR NAKs...): all
#: read, each under its own name.
_RXE_COUNTERS = f"/sys/class/infiniband/{DEVICE}/ports/1/hw_counters"


@dataclass(frozen=True, slots=True, kw_only=True)
class WireRow:
    """One system at one size: the figures (us) or why there are none, and how it was
    measured."""

    system: str  # a key of SYSTEMS
    nbytes: int
    call_us: float | None = None
    call_min_us: float | None = None
    call_max_us: float | None = None
    calls: int = 0
    calls_us: tuple[float, ...] = ()  # each timed call's (slowest rank's) time
    error: str | None = None
    how: str = ""


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"8,64K,1M,4M"`` (or plain bytes) -> bytes per rank, each a whole number of float32.

    Raises:
        ValueError: an empty list, a size that is not a positive multiple of 4, or a word that
            is not a size.
    """
    out = []
    for word in (w.strip() for w in text.split(",")):
        scale = {"K": KIB, "M": MIB}.get(word[-1:].upper(), 1) if word else 1
        digits = word[:-1] if scale > 1 else word
        if not digits.isdigit():
            raise ValueError(f"not a size: {word!r} (bytes, or with K or M, e.g. 64K)")
        n = int(digits) * scale
        if n <= 0 or n % 4:
            raise ValueError(f"{word}: not a positive whole number of float32 (4 bytes)")
        out.append(n)
    if not out:
        raise ValueError("no sizes")
    return tuple(out)


def host_args(h1: str, h2: str, rsh_agent: str) -> list[str]:
    """mpirun's options for 4 ranks, 2 per host, ranks 0-1 on host 1, host 2 reached by
    ``rsh_agent``, mpirun's own connections on the link only."""
    return ["--host", f"{h1}:2,{h2}:2", "--map-by", "slot", "--mca", "plm_rsh_agent", rsh_agent,
            "--mca", "oob_tcp_if_include", NETDEV]


def aiordma_argv(mpirun: str, hosts: list[str], *, master: str, port: int, python: str,
                 worker: list[str]) -> list[str]:
    """mpirun for aiordma's rank program (``worker``: its arguments)."""
    return [mpirun, "--allow-run-as-root", "-np", "4", "--bind-to", "none", *hosts,
            "-x", f"MASTER_ADDR={master}", "-x", f"MASTER_PORT={port}", "-x", "PATH",
            python, "-m", "aiordma.bench.collective_worker", *worker]


def across(argv: list[str], hosts: list[str], *, yield_when_idle: bool = False) -> list[str]:
    """One-host ``mpirun`` argv (:func:`~.peers.mpirun_argv`) made to span the two hosts;
    ``yield_when_idle``: Open MPI's ranks yield the CPU while they poll (two ranks share a
    host's one vCPU here, and mpirun, told of 2 slots per host, does not know)."""
    extra = ["--mca", "mpi_yield_when_idle", "1"] if yield_when_idle else []
    return [argv[0], *hosts, *extra, *argv[1:]]


def placement(docs: dict[int, dict[str, Any]], world: int = 4) -> str:
    """Where the ranks ran, from their files: ``"ranks 0-1 on A, 2-3 on B"``.

    Raises:
        PeerRouteError: a rank is missing or did not say, or the ranks are not 2 on each of
            two hosts.
    """
    hosts = [docs.get(r, {}).get("host") for r in range(world)]
    if None in hosts or world != 4 or hosts[0] != hosts[1] or hosts[2] != hosts[3] \
            or hosts[0] == hosts[2]:
        raise PeerRouteError(f"the ranks were not 2 on each host: {hosts}")
    return f"ranks 0-1 on {hosts[0]}, 2-3 on {hosts[2]}"


def counters() -> dict[str, int]:
    """Host 1's link and rxe counters now (missing files count 0)."""
    paths = [*_COUNTERS.items(), *((f"rxe0 {p.name}", str(p)) for p in
                                   sorted(Path(_RXE_COUNTERS).glob("*")))]
    out = {"rxe0 sent_pkts": 0, "rxe0 rcvd_pkts": 0}
    for name, path in paths:
        try:
            out[name] = int(Path(path).read_text())
        except (OSError, ValueError):
            out[name] = 0
    return out


def moved(before: dict[str, int], after: dict[str, int]) -> str:
    """``"host 1 eth0 tx 12.3 MB, rx 12.1 MB; rxe0 sent 12,000 pkts, rcvd 11,900"``, then
    any other rxe counter that moved (``; rxe0 also: rcvd_seq_err +12``)."""
    d = {k: after[k] - before.get(k, 0) for k in after}
    text = (f"host 1 eth0 tx {d['eth0 tx bytes'] / 1e6:.1f} MB, rx "
            f"{d['eth0 rx bytes'] / 1e6:.1f} MB; rxe0 sent {d['rxe0 sent_pkts']:,} pkts, "
            f"rcvd {d['rxe0 rcvd_pkts']:,}")
    others = [f"{k.removeprefix('rxe0 ')} +{v:,}" for k, v in d.items() if v and
              k.startswith("rxe0 ") and k not in ("rxe0 sent_pkts", "rxe0 rcvd_pkts")]
    return text + (f"; rxe0 also: {', '.join(others)}" if others else "")


def rows_from(system: str, sizes: Sequence[int], merged: dict[tuple[str, str, int], Any],
              run: str, how: str, failure: str | None = None,
              ended: str = "") -> list[WireRow]:
    """The table's rows of one launch (``merged``: :func:`~.collective_rows.merge_ranks`);
    ``failure`` (e.g. the route not proven) fails every row; ``ended``: how the launch ended,
    for the sizes no rank reported."""
    rows = []
    for n in sizes:
        got = merged.get((run, "allreduce", n), "not run: the launch ended before this size"
                         + (f" ({ended})" if ended else ""))
        if failure is not None:
            got = failure
        if isinstance(got, str):
            rows.append(WireRow(system=system, nbytes=n, error=got, how=how))
        else:
            rows.append(WireRow(system=system, nbytes=n, call_us=got["call_us"],
                                call_min_us=got["call_min_us"], call_max_us=got["call_max_us"],
                                calls=len(got["calls_us"]), calls_us=tuple(got["calls_us"]),
                                how=how))
    return rows


def _ms(us: float | None) -> str:
    if us is None:
        return "-"
    ms = us / 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def format_table(rows: Sequence[WireRow], *, base: str = "ompi-rxe") -> str:
    """A markdown table: per size, each system's median and best call in ms, the worst beside
    them, and the median's ratio to ``base``'s; a failed row says why."""
    lines = ["| size per rank | system | median ms | best ms | worst ms | vs Open MPI over rxe | "
             + "how measured |", "|---|---|---|---|---|---|---|"]
    ref = {r.nbytes: r.call_us for r in rows if r.system == base and r.call_us}
    order = {k: i for i, k in enumerate(SYSTEMS)}
    for r in sorted(rows, key=lambda r: (r.nbytes, order.get(r.system, len(order)))):
        name = SYSTEMS.get(r.system, r.system)
        if r.error is not None:
            lines.append(f"| {size_name(r.nbytes)} | {name} | FAILED | | | | {r.error} |")
            continue
        ratio = (f"{r.call_us / ref[r.nbytes]:.2f}x" if r.call_us and ref.get(r.nbytes)
                 and r.system != base else "")
        lines.append(f"| {size_name(r.nbytes)} | {name} | {_ms(r.call_us)} | "
                     f"{_ms(r.call_min_us)} | {_ms(r.call_max_us)} | {ratio} | {r.how} |")
    return "\n".join(lines)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def read_ranks(folder: str, world: int = 4, *, tries: int = 3) -> dict[int, dict[str, Any]]:
    """The ranks' files, each one whole. Host 2's ranks write through their own VM's 9p page
    cache (``cache=loose``), and host 1 once read one of their files empty after mpirun had
    ended: the ranks now fsync before the rename, and what host 1 still cannot read after
    ``tries`` seconds is read on host 2 (``cat`` through its agent)."""
    docs: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        for r in range(world):
            if r not in docs:
                try:
                    docs[r] = json.loads((Path(folder) / f"rank-{r}.json").read_text())
                except (OSError, ValueError):
                    pass
        if len(docs) == world:
            return docs
        time.sleep(1)
    for r in (r for r in range(world) if r not in docs):
        try:
            with RemoteProcess(["cat", str(Path(folder).resolve() / f"rank-{r}.json")]) as cat:
                if cat.wait(60) == 0:
                    docs[r] = json.loads(cat.stdout)
        except (AiordmaError, ValueError):
            pass  # (merge_ranks says which ranks wrote nothing)
    return docs


def _launch(label: str, cmd: list[str], timeout: float,
            out_dir: str) -> tuple[int | None, str, dict[int, dict[str, Any]], str, float]:
    """Run one mpirun (its process group killed at ``timeout``): exit status, output, the
    ranks' files, host 1's counters' movement, seconds."""
    print(f"[wire] {label}: {' '.join(cmd)}", flush=True)
    before, t0 = counters(), time.monotonic()
    status, out = _run_group(cmd, timeout, out_dir)
    took, after = time.monotonic() - t0, counters()
    docs = read_ranks(out_dir)
    print(f"[wire] {label}: mpirun status {status} after {took:.1f} s; {moved(before, after)}",
          flush=True)
    return status, out, docs, moved(before, after), took


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Every system's launch in turn (on host 1 of the pair); the report as a dict."""
    started = _now()
    try:
        h1, h2 = host_addresses()
    except NotTwoHostsError as exc:
        raise SystemExit(f"{exc}; run it so: .venv/bin/python -m harness run --hosts 2 -- "
                         ".venv/bin/python -m harness.bench.collective_wire") from None
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("Open MPI's mpirun is not installed: bash scripts/setup-peers.sh")
    hosts = host_args(h1, h2, f"{sys.executable} -m harness rsh")
    worker = ["--sizes", ",".join(map(str, a.sizes)), "--collectives", "allreduce",
              "--warmup", str(a.warmup), "--calls", str(a.calls)]
    timing = f"{a.calls} calls after {a.warmup} warm-up, barrier before each, slowest rank"
    rows: list[WireRow] = []
    launches: dict[str, Any] = {}
    for system in a.systems:
        # (the ranks on host 2 write there too: the current directory is shared, /tmp is not)
        with tempfile.TemporaryDirectory(prefix=".aiordma-wire-", dir=a.tmp or os.getcwd()) as d:
            if system == "aiordma":
                cmd = aiordma_argv(mpirun, hosts, master=h1, port=_free_port(),
                                   python=sys.executable,
                                   worker=[*worker, "--out", d, "--loops", a.loop,
                                           "--keepalive", str(KEEPALIVE)])
                run_key, how = a.loop, f"Group ({a.loop}), mpirun 2+2; {timing}"
            else:
                transport = system.removeprefix("ompi-")
                try:
                    peers = find_peers()
                except PeersNotInstalled as exc:
                    rows += rows_from(system, a.sizes, {}, transport, "", str(exc))
                    continue
                program = [peers.mpi_python, str(MPI_WORKER),
                           *worker, "--out", d, "--transport", transport,
                           "--case-timeout", f"{a.case_timeout:g}"]
                cmd = across(mpirun_argv(peers, transport, 4, device=DEVICE, netdev=NETDEV,
                                         program=program), hosts, yield_when_idle=a.ompi_yield)
                route = ("pml cm + mtl ofi, libfabric verbs;ofi_rxm on rxe0"
                         if transport == "rxe" else "ob1 + tcp BTL on eth0 (same host too)")
                route += ", mpi_yield_when_idle 1" if a.ompi_yield else ""
                run_key, how = transport, f"mpi4py Allreduce, {route}, mpirun 2+2; {timing}"
            status, out, docs, wire, took = _launch(system, cmd, a.timeout, d)
        ended = f"mpirun status {status}: {_tail(out)}"
        merged = merge_ranks(docs, 4, ended)
        failure, proof = None, []
        try:
            proof.append(placement(docs))
            if system != "aiordma":
                proof.append(mpi_route(run_key, out, 4, device=DEVICE,
                                       mapped=docs.get(0, {}).get("mapped", [])))
        except PeerRouteError as exc:
            proof.append(f"route not proven: {exc}")
            if len(docs) == 4:  # (else the rows say what the ranks that wrote nothing did)
                failure = proof[-1]
        proof.append(wire)
        mine = rows_from(system, a.sizes, merged, run_key, how, failure, ended)
        rows += mine
        for r in mine:
            print(f"[wire] {system} {size_name(r.nbytes)}: " + (
                f"FAILED ({r.error})" if r.error else f"{_ms(r.call_us)} ms median "
                f"[{_ms(r.call_min_us)}..{_ms(r.call_max_us)}]"), flush=True)
        launches[system] = {"command": cmd, "status": status, "seconds": round(took, 1),
                            "proof": proof, "output_tail": out.strip().splitlines()[-40:]}
        print(f"[wire] {system}: {'; '.join(proof)}"
              + (f" -- {failure}" if failure else ""), flush=True)
        if status != 0:
            print(f"[wire] {system}: last lines: {_tail(out, 15)}", flush=True)
    return {"started": started, "finished": _now(),
            # (the guest's: the machine running the VMs is not visible from here)
            "host1_loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
            "sizes": list(a.sizes), "rows": [asdict(r) for r in rows], "launches": launches,
            "table": format_table(rows)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (checked: sizes, systems, counts)."""
    p = argparse.ArgumentParser(
        prog="python -m harness.bench.collective_wire",
        description="Allreduce of 4 ranks, 2 per host, across the two hosts of "
                    "`python -m harness run --hosts 2`: aiordma and Open MPI (mpi4py), each started "
                    "by mpirun; run on host 1.")
    p.add_argument("--sizes", type=parse_sizes, default=SIZES,
                   help="bytes per rank, e.g. 8,64K,1M,4M (the default)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop",
                   help="aiordma's event loop (default uvloop)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--calls", type=int, default=5, help="timed calls per size (default 5)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds for one mpirun, its process group killed then (default 900)")
    p.add_argument("--case-timeout", type=float, default=300.0,
                   help="seconds for one size on an Open MPI rank; then the job ends (default "
                        "300)")
    p.add_argument("--ompi-yield", action="store_true",
                   help="Open MPI's ranks yield the CPU while polling (mpi_yield_when_idle 1)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--tmp", default=None, help="directory for the ranks' files, one both "
                   "hosts see (default: the current directory; each VM's /tmp is its own)")
    a = p.parse_args(argv)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in a.systems if s not in SYSTEMS]
    if unknown or not a.systems:
        p.error(f"--systems: unknown {unknown} (choose from {', '.join(SYSTEMS)})")
    if a.warmup < 0 or a.calls < 1 or a.timeout <= 0 or a.case_timeout <= 0:
        p.error("--warmup must be >= 0, --calls >= 1, --timeout and --case-timeout > 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    report = run(a)
    report["command"] = " ".join(["python -m harness.bench.collective_wire",
                                  *(sys.argv[1:] if argv is None else argv)])
    print(report["table"])
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["error"] is None for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
