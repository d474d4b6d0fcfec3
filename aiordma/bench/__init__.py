"""``aiordma bench``: aiordma and its baselines side by side, on one device, in one run.

Rows (the letters of ``--only``):

* (a) 64 B send/recv round trip, p50 and p99, against ``ib_send_lat -e`` (completion events,
  the fair C limit for an event-driven design) and ``ib_send_lat`` (busy polling);
* (b) RDMA WRITE and READ bandwidth from 4 KiB to 4 MiB against ``ib_write_bw``/``ib_read_bw``;
* (c) 64 B message rate, a window of 64, against ``ib_send_bw -s 64 -t 64``;
* (d) 4 MiB two-sided messages (rendezvous) against ``ib_read_bw``;
* (e) RPC echo, 1, 16 and 64 calls in flight, against asyncio TCP + msgpack
  (:mod:`~aiordma.bench.tcp_baseline`);
* (f) key-value GET, one-sided against RPC;
* (g) per-operation cost with 1, 8 and 64 endpoints;
* (h) collectives: allreduce, broadcast and allgather of aiordma's ``Group`` at 2 and 4 ranks,
  4 KiB to 16 MiB (:mod:`~aiordma.bench.collective_rows`);
* (t) RPC echo over aiordma's TCP transport against asyncio TCP + msgpack (no device needed);
* (i) with ``--host-cpu``, on the host and without a device: CPU time per 64 B message round
  trip and per RPC call over ``aiordma.testing.channel_pair()``, beside asyncio TCP + msgpack
  over loopback (:mod:`~aiordma.bench.host_rows`).

``--peers`` (opt-in; ``scripts/setup-peers.sh`` installs them) adds, in the same run, ucxx's
rows beside (a), (d) and (g) (:mod:`~aiordma.bench.peer_rows`) and Open MPI's
collectives over rxe, shared memory and TCP beside (h), each proven by the peer's own log to
have run on the route it claims (:mod:`~aiordma.bench.peers`).

Every aiordma row runs on the default loop and on uvloop, against a peer process on the same
loop (:mod:`~aiordma.bench.peer`); perftest runs its own server and client processes
(:mod:`~aiordma.bench.perftest`).

Across a link to a second host (:mod:`~aiordma.bench.link`; the repository's harness runs
``python -m harness bench`` across two VMs) rows (a)-(g) and perftest's run with the peer
processes and perftest's servers on host 2, the clients on host 1, each row proven to have
crossed the link by both hosts' counters; with a loss, they run again under ``netem loss P%``.

``--repeat N`` repeats everything N times; the table shows the median and [min..max] of the
repeats, and the ratios and goals use medians. Modules: ``plan`` (counts and sizes),
``measure`` (rows, metrics), ``runner`` (the order of things), ``endpoint_rows`` /
``service_rows`` (aiordma's client side), ``collective_rows`` (area h), ``peers`` /
``peer_rows`` (the peers), ``host_rows`` and ``cputime`` (area i), ``link`` (what a run across two hosts needs), ``report`` (table,
goals, JSON, PNG); ``process`` (helper processes that announce themselves) and ``hostload``
(the load of the machine running a VM).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .link import End, Link
    from .runner import DeviceChoice

__all__ = ["run_bench"]


def _device(local_ip: str | None = None) -> DeviceChoice:
    from aiordma.lowlevel import Device

    from .runner import DeviceChoice

    # the default choice, which aiordma.connect("127.0.0.1", ...) makes; across the wire, the
    # device and GID of host 1's link address, which a connection to host 2 takes
    with Device(local_ip=local_ip) as d:
        return DeviceChoice(d.name, d.gid_index, d.port, d.mtu, d.gid_info.ip)


def _default_busy_poll() -> str:
    """The reactor's default spin length, as ``$AIORDMA_BUSY_POLL_US`` would give it."""
    from aiordma._reactor.reactor import DEFAULT_BUSY_POLL_US

    return f"{DEFAULT_BUSY_POLL_US:g}"


def _version(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr) \
        else None


def _environment(dev: DeviceChoice | None) -> dict[str, Any]:
    import uvloop

    from aiordma.lowlevel import verbs_path

    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": dev and dev.name, "port": dev and dev.port,
        "gid_index": dev and dev.gid_index, "gid_ip": dev and dev.gid_ip,
        "mtu": dev and dev.mtu,
        "kernel": platform.release(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "uvloop": uvloop.__version__,
        "perftest": _version(["ib_send_lat", "-V"]),
        "busy_poll_us": os.environ.get("AIORDMA_BUSY_POLL_US") or _default_busy_poll(),
        "verbs_path": verbs_path() if dev is not None else None,
        "loadavg_start": list(os.getloadavg()),
        # the machine running the VMs (aiordma.bench.hostload), or this one outside a VM
        "host_loadavg_start": _host_load(),
        # set by `aiordma bench` when it re-ran itself where a device is (e.g. in a VM)
        "launcher_loadavg": os.environ.get("AIORDMA_BENCH_HOST_LOAD"),
    }


def _host_load() -> list[float] | None:
    from .hostload import host_load

    load = host_load()
    return None if load is None else list(load)


def _end(end: End) -> dict[str, Any]:
    return {"address": end.address, "device": end.device, "port": end.port,
            "gid_index": end.gid_index, "netdev": end.netdev}


def _load_words(env: dict[str, Any]) -> str:
    start, end = env["host_loadavg_start"], env.get("host_loadavg_end")
    return f"{start[0]:.2f} at the start" + (f", {end[0]:.2f} at the end" if end else "")


def run_bench(*, quick: bool = False, only: str = "abcdefght", loops: list[str] | None = None,
              repeat: int = 1, json_path: str | None = None, png_path: str | None = None,
              peers: bool = False, link: Link | None = None, loss: float = 0.0) -> int:
    """Run the benchmark here (a device must be present, unless every area asked for is one
    that needs none: area t); print the table, write the files.

    Args:
        link: across it, to a second host (areas a-g; no peers): servers there, clients
            here (:mod:`~aiordma.bench.link`; the repository's harness makes one between two
            VMs).
        loss: with ``link``, each repeat's rows again with this many percent of the frames
            lost on both hosts' ends of it.

    Returns:
        0 if every row was measured, 1 if a row failed outright (goals do not change it).

    Raises:
        PeersNotInstalled: ``peers`` was asked for and they are not installed (at once,
            before anything runs).
        ValueError: ``link`` with the peers or area (h), or ``loss`` without it (or out of
            [0, 100)); area (i) in ``only`` (it runs on the host: :mod:`.host_rows`).
    """
    # Imported here, so that ``python -m aiordma.bench.peer`` does not import itself twice.
    from .measure import Results
    from .peers import find_peers
    from .plan import DEVICE_FREE, RUN_AREAS, Plan
    from .report import evaluate_goals, format_table, to_json, write_json, write_png
    from .runner import run_all

    if "i" in only:
        raise ValueError("area (i) runs on this host, without a device: aiordma bench "
                         "--host-cpu")
    if link is not None and (peers or "h" in only):
        raise ValueError("across two hosts the bench runs areas (a)-(g), without the peers")
    if loss and link is None:
        raise ValueError("loss is set on the link between two hosts")
    if not 0 <= loss < 100:
        raise ValueError(f"loss is a percentage of frames in [0, 100), not {loss:g}")
    installed = find_peers() if peers else None  # fails at once when they are missing
    loops = loops or ["asyncio", "uvloop"]
    areas = "".join(a for a in RUN_AREAS if a in only)
    plan = Plan.quick() if quick else Plan()
    hosts = 1 if link is None else 2
    needs_device = link is not None or any(a not in DEVICE_FREE for a in areas)
    dev = _device(None if link is None else link.here.address) if needs_device else None
    where = ("no RDMA device needed (areas " + areas + ")" if dev is None else
             f"{dev.name} port {dev.port} GID {dev.gid_index} ({dev.gid_ip}), MTU {dev.mtu}")
    env = _environment(dev)
    env["hosts"] = hosts
    if link is not None:
        env["wire"] = {"host1": _end(link.here), "host2": _end(link.there),
                       "loss_percent": loss}
    results = Results()
    t0 = time.monotonic()
    if installed is not None:
        env["peers"] = {"ucxx": installed.ucxx, "ucx": installed.ucx,
                        "ucx_min_supported": installed.ucx_min_supported,
                        "open_mpi": installed.open_mpi, "mpi4py": installed.mpi4py,
                        "libfabric": installed.libfabric}
    print(f"aiordma bench on {where}; {'quick' if quick else 'full'} plan, areas {areas}, loops "
          f"{', '.join(loops)}, {repeat} repeat(s)"
          + (", with the peers" if installed else "")
          + (f", across the wire: {link.describe()}" if link is not None else "")
          + (f"; then again with {loss:g} % loss" if loss else ""), flush=True)
    run_all(plan, areas=areas, loops=loops, repeat=repeat, dev=dev, results=results,
            peers=installed, link=link, loss=loss)
    env["loadavg_end"] = list(os.getloadavg())
    env["host_loadavg_end"] = _host_load()
    env["seconds"] = round(time.monotonic() - t0, 1)
    goals = evaluate_goals(results, loops)
    header = [
        "",
        (f"aiordma bench: {where}, "
         f"kernel {env['kernel']}, {env['cpus']} CPUs, Python {env['python']}, uvloop "
         f"{env['uvloop']}, perftest {env['perftest']}, {env['date_utc']}"),
        f"verbs path: {env['verbs_path']}",
        (f"plan: {'quick' if quick else 'full'}; {repeat} repeat(s): figures are the median "
         f"[min..max] of the repeats; ratios are of medians; load average "
         f"{env['loadavg_start'][0]:.2f} at the start, {env['loadavg_end'][0]:.2f} at the end"
         + (f" (launching host: {env['launcher_loadavg']})" if env["launcher_loadavg"] else "")
         + (f"; the machine running the VMs: {_load_words(env)}"
            if env["host_loadavg_start"] and env["host_loadavg_start"] != env["loadavg_start"]
            else "")
         + f"; {env['seconds']:.0f} s; busy polling (adaptive) up to "
           f"{env['busy_poll_us']} us"),
        ("units: perftest's MB/sec is 2**20 B/s (MiB/s); perftest latencies are one way "
         "(half a round trip)"),
    ]
    if link is not None:
        header.append(f"across the wire: {link.describe()}; each row's route says what the "
                      "link's counters saw" + (f"; rows ending '{loss:g} % loss' ran under "
                                               f"netem loss {loss:g} % on both hosts' link"
                                               if loss else ""))
    if installed is not None:
        header.append(f"peers: {installed.ucxx_note} (its check lowered by "
                      f"scripts/setup-peers.sh); Open MPI {installed.open_mpi}, mpi4py "
                      f"{installed.mpi4py}, libfabric {installed.libfabric}")
    # Line by line: in the VM a single write above 32 KiB reaches the host cut at 32 KiB (seen
    # with the peers' table, about 70 KiB), while many smaller writes arrive whole.
    for line in format_table(results, header=header, goals=goals).splitlines():
        print(line)
    sys.stdout.flush()
    settings = {"quick": quick, "areas": areas, "loops": loops, "repeat": repeat,
                "peers": peers, "hosts": hosts, "loss_percent": loss, "plan": asdict(plan),
                "argv": sys.argv}
    if json_path:
        write_json(to_json(results, settings=settings, environment=env, goals=goals),
                   json_path)
        print(f"\nJSON: {json_path}")
    if png_path:
        try:
            why = write_png(results, goals, png_path)
        except Exception as exc:  # noqa: BLE001  # the plot is optional; the figures are not
            why = f"{type(exc).__name__}: {exc}"
        print(f"PNG: {png_path}" if why is None else f"PNG not written: {why}")
    return 1 if any(r.failed for r in results.rows.values()) else 0
