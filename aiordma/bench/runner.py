"""Runs the benchmark: perftest pairs and aiordma rows side by side, repeat after repeat.

Order per repeat: the perftest rows, ucxx's rows (``--peers``), then every aiordma row on the
default loop, then on uvloop (each against a peer process on the same loop), then the
collectives of area (h), aiordma's then Open MPI's (``--peers``), so that every system sees the
same conditions within a repeat. Every row is bounded by a time limit; a row that fails or
times out is recorded as failed, and the run goes on.

Across a link (a :class:`~aiordma.bench.link.Link` to a second host), areas (a)-(g) only:
the peer processes and perftest's servers run on host 2, the clients here on host 1; each row
is bracketed by snapshots of both hosts' counters and must show that its payload crossed the
link (else it fails: its figures would be one device's). With ``loss``, each repeat then runs
the same rows again under ``netem loss`` on both hosts (keys ending ``@loss<P>%``), each
compared with its row without loss.

Each row notes the load average of the machine running the VMs as it starts
(:func:`aiordma.bench.hostload.host_load`): the machine is shared, and the figures move with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvloop

from aiordma import AiordmaError, Config

from . import endpoint_rows as er
from . import service_rows as sr
from .collective_rows import run_collective_rows
from .connections import run_connection_rows
from .hostload import host_load
from .link import Link, NotCrossed, Payload
from .measure import Results, Versus, failure
from .peer import (
    ACROSS_KEEPALIVE,
    PeerPorts,
    patient,
    peer_process,
    remote_peer_process,
    serve_connection,
)
from .peer_rows import UCXX_MODES, run_ucxx_rows, ucxx_key
from .peers import PeerInstall
from .perftest import (
    Across,
    PerftestError,
    RemoteServer,
    check_against_wall_clock,
    parse_bandwidth,
    parse_latency,
    pinning,
    run_pair,
)
from .plan import DEVICE_FREE, Plan, size_name

__all__ = ["DeviceChoice", "PerftestJob", "failure", "loss_tag", "lossy_spec", "perftest_jobs",
           "python_specs", "run_all"]

LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    name: str
    gid_index: int
    port: int
    mtu: int
    gid_ip: str | None


def _say(msg: str) -> None:
    print(msg, flush=True)


def _brief(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in values.items())


# -- perftest ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PerftestJob:
    key: str
    area: str
    what: str
    tool: str
    args: list[str]
    kind: str  # "lat" or "bw"
    payload: Payload  # what the client sends and receives at least (the link's check)

    @property
    def headline(self) -> tuple[str, ...]:
        """The metrics a row under loss is compared on with the same row without."""
        return ("t_typical_us",) if self.kind == "lat" else (
            ("msgs_per_s",) if self.tool == "ib_send_bw" else ("mibs",))


def perftest_jobs(plan: Plan, areas: str) -> list[PerftestJob]:
    """The perftest runs the rows of ``areas`` are compared with (one run serves every row
    that needs it: (d) shares (b)'s ``ib_read_bw`` at 4 MiB)."""
    jobs: list[PerftestJob] = []
    if "a" in areas:
        for flag, name in (("-e", "completion events"), ("", "busy polling")):
            jobs.append(PerftestJob(f"pt.send_lat{flag}.64", "a", f"64 B round trip, {name}",
                                    "ib_send_lat", ["-s", "64", "-n", str(plan.rtt_iters),
                                                    *([flag] if flag else [])], "lat",
                                    Payload(64 * plan.rtt_iters, 64 * plan.rtt_iters)))
    if "b" in areas or "d" in areas:
        area = "b" if "b" in areas else "d"
        for tool, op in (("ib_write_bw", "WRITE"), ("ib_read_bw", "READ")):
            if area == "d" and tool == "ib_write_bw":
                continue
            for size in plan.bw_sizes if area == "b" else (plan.rdv_size,):
                moved = size * plan.bw_iters(size)
                jobs.append(PerftestJob(f"pt.{tool}.{size}", area,
                                        f"RDMA {op} {size_name(size)}", tool,
                                        ["-s", str(size), "-n", str(plan.bw_iters(size))], "bw",
                                        Payload(moved, 0) if op == "WRITE" else
                                        Payload(0, moved)))
    if "c" in areas:
        jobs.append(PerftestJob("pt.ib_send_bw.64", "c", "64 B messages one way", "ib_send_bw",
                                ["-s", "64", "-n", str(plan.rate_count), "-t",
                                 str(plan.rate_window)], "bw", Payload(64 * plan.rate_count, 0)))
    return jobs


#: perftest pairs on rxe fail now and then (a fresh-clone CI run saw ``ib_send_lat -e`` fail once
#: where every other run passed); each failure is recorded, and the pair is run again. Not
#: under loss: there a pair that fails or times out is what loss did (and a retry would triple
#: a wait of minutes).
_PERFTEST_ATTEMPTS = 3


def _load() -> float | None:
    """The 1-minute load average of the machine running the VMs (or this one), now."""
    load = host_load()
    return None if load is None else load[0]


def _perftest_rows(plan: Plan, areas: str, dev: DeviceChoice, results: Results, *,
                   link: Link | None = None, loss: float = 0.0) -> None:
    across = None
    if link is not None:
        start_there = link.start
        across = Across(address=link.there.address, device=link.there.device,
                        gid_index=link.there.gid_index,
                        start=lambda argv: RemoteServer(start_there(argv)))
    cpus = pinning() if across is None else None
    pinned = (", server on host 2, client on host 1 (one vCPU each: not pinned)" if across
              else f", server on CPU {cpus[0]}, client on CPU {cpus[1]}" if cpus
              else ", not pinned")
    for job in perftest_jobs(plan, areas):
        how = f"{job.tool} {' '.join(job.args)}{pinned}"
        meta: dict[str, Any] = {"area": job.area, "what": job.what, "system": "perftest",
                                "how": how}
        key = job.key
        if loss:
            key, meta = lossy_spec(job.key, meta, loss, job.headline)
        attempts = 1 if loss else _PERFTEST_ATTEMPTS
        for attempt in range(1, attempts + 1):
            t0 = time.perf_counter()
            load = _load()
            try:
                before = link.snapshot() if link is not None else None
                values, out = _perftest_once(job, dev, plan, cpus, across)
                proof = None if link is None or before is None else \
                    link.crossed(before, job.payload, mtu=dev.mtu)
            except (PerftestError, AiordmaError, OSError, subprocess.SubprocessError) as exc:
                out = getattr(exc, "output", "")
                tail = " | ".join(out.strip().splitlines()[-2:])
                results.fail(key, f"{exc}: {tail}" if tail else str(exc), output=out,
                             load=load, **meta)
                _say(f"  [{job.area}] {meta['what']}, {how}: FAILED, attempt {attempt} of "
                     f"{attempts} ({exc})")
                if getattr(exc, "missing", False) or isinstance(exc, NotCrossed):
                    break
                continue
            results.record(key, values, output=out, proof=proof, load=load, **meta)
            _say(f"  [{job.area}] {meta['what']}, {how}: {_brief(values)} "
                 f"({time.perf_counter() - t0:.1f} s)")
            break


def _perftest_once(job: PerftestJob, dev: DeviceChoice, plan: Plan,
                   cpus: tuple[int, int] | None,
                   across: Across | None = None) -> tuple[dict[str, float], str]:
    """One run of ``job``'s pair: its figures and output, or :class:`PerftestError`."""
    out, seconds = run_pair(job.tool, job.args, device=dev.name, gid_index=dev.gid_index,
                            timeout=plan.perftest_timeout, cpus=cpus, across=across)
    try:
        if job.kind == "lat":
            lat = parse_latency(out)
            check_against_wall_clock(lat, seconds)
            values = {"t_typical_us": lat.t_typical, "t_p99_us": lat.p99}
        else:
            bw = parse_bandwidth(out)
            check_against_wall_clock(bw, seconds)
            values = {"mibs": bw.bw_avg}
            if job.tool == "ib_send_bw":
                values["msgs_per_s"] = bw.msg_rate * 1e6
    except PerftestError as exc:
        raise PerftestError(str(exc), exc.output or out) from None
    if min(values.values()) <= 0:
        raise PerftestError("perftest reported a zero figure", out)
    return values, out


# -- aiordma (and the TCP baseline) ----------------------------------------------------------

Make = Callable[[], Awaitable[dict[str, float]]]


def _versus_ucxx(area: str, metric: str) -> list[Versus]:
    return [Versus(metric=metric, base=ucxx_key(area, mode), base_metric=metric,
                   label=f"ucxx {mode}") for mode in UCXX_MODES]


def python_specs(plan: Plan, areas: str, ports: PeerPorts, loop: str, *,
                 peers: bool = False, config: Config | None = None,
                 across: bool = False) -> list[tuple[str, dict[str, Any], Make]]:
    """(key, row metadata, measurement) for every Python row of ``areas`` on ``loop``; with
    ``peers``, the rows ucxx's rows compare with name them as baselines too.

    Each row's metadata holds its ``payload`` (:class:`~aiordma.bench.link.Payload`,
    the link's check) and ``headline`` (the metrics a row under loss is compared on), which
    are not the table's: :func:`_python_rows` takes them out. The peer is at ``ports.host``,
    the clients' endpoints use ``config``; ``across`` (the link): without the row whose peer
    is in this process (its traffic cannot leave the device).
    """
    specs: list[tuple[str, dict[str, Any], Make]] = []
    ep = ports.endpoint
    at: dict[str, Any] = {"host": ports.host, "config": config}

    def add(key: str, area: str, what: str, how: str, make: Make, payload: Payload,
            versus: list[Versus] | None = None, system: str = "aiordma") -> None:
        specs.append((f"{key}.{system.split()[-1].lower()}.{loop}",
                      {"area": area, "what": what, "system": system, "loop": loop,
                       "how": how + (f"; server on host 2 ({ports.host})" if across else ""), "versus": versus or [], "payload": payload,
                       "headline": HEADLINE[area]}, make))

    if "a" in areas:
        vs = [Versus(metric="p50_us", base="pt.send_lat-e.64", base_metric="t_typical_us",
                     factor=2, label="ib_send_lat -e RTT (2 x t_typical)"),
              Versus(metric="p50_us", base="pt.send_lat.64", base_metric="t_typical_us",
                     factor=2, label="ib_send_lat RTT (2 x t_typical)")]
        how = f"{plan.rtt_iters} round trips after {plan.warmup}, echo peer in another process"
        moved = 64 * plan.rtt_iters
        add("a.rtt64", "a", "64 B round trip", how, lambda: er.ping_pong(ep, plan, **at),
            Payload(moved, moved), vs + (_versus_ucxx("a", "p50_us") if peers else []))
        if not across:
            add("a.rtt64-inproc", "a", "64 B round trip, peer in this process",
                f"{plan.rtt_iters} round trips, listener in the same process",
                lambda: _in_process_ping_pong(plan), Payload(moved, moved), vs[:1])
    if "b" in areas:
        for op, tool in (("write", "ib_write_bw"), ("read", "ib_read_bw")):
            for size in plan.bw_sizes:
                how = f"{plan.bw_iters(size)} x {size_name(size)}, {plan.bw_window} in flight"
                moved = size * plan.bw_iters(size)
                add(f"b.{op}.{size}", "b", f"RDMA {op.upper()} {size_name(size)}", how,
                    lambda op=op, size=size: er.onesided_bandwidth(ep, plan, op, size, **at),  # type: ignore[misc]
                    Payload(moved, 0) if op == "write" else Payload(0, moved),
                    [Versus(metric="mibs", base=f"pt.{tool}.{size}", base_metric="mibs",
                            label=tool)])
    if "c" in areas:
        add("c.rate64", "c", "64 B messages one way",
            f"{plan.rate_count} messages, window = the peer's {plan.rate_window} receive slots",
            lambda: er.message_rate(ep, plan, **at), Payload(64 * plan.rate_count, 0),
            [Versus(metric="msgs_per_s", base="pt.ib_send_bw.64", base_metric="msgs_per_s",
                    label=f"ib_send_bw -t {plan.rate_window}")])
    if "d" in areas:
        moved = plan.rdv_size * plan.rdv_count
        add("d.msg", "d", f"{size_name(plan.rdv_size)} messages one way (rendezvous)",
            f"{plan.rdv_count} messages, one at a time, peer recv_into (RDMA READ)",
            lambda: er.rendezvous_bandwidth(ep, plan, **at), Payload(moved, 0),
            [Versus(metric="mibs", base=f"pt.ib_read_bw.{plan.rdv_size}", base_metric="mibs",
                    label="ib_read_bw")] + (_versus_ucxx("d", "mibs") if peers else []))
        add("d.msgreg", "d", f"{size_name(plan.rdv_size)} messages one way, from a registered "
            f"region", f"{plan.rdv_count} messages, one at a time, send(region.whole()), peer "
            f"recv_into (RDMA READ)",
            lambda: er.rendezvous_bandwidth(ep, plan, registered=True, **at), Payload(moved, 0),
            [Versus(metric="mibs", base=f"pt.ib_read_bw.{plan.rdv_size}", base_metric="mibs",
                    label="ib_read_bw")])
    if "e" in areas:
        moved = plan.rpc_calls * plan.rpc_payload
        for n in plan.rpc_in_flight:
            how = f"{plan.rpc_calls} calls of echo({plan.rpc_payload} B), {n} in flight"
            tcp_key = f"e.rpc{n}.tcp.{loop}"
            add(f"e.rpc{n}", "e", f"RPC echo, {n} in flight", how,
                lambda n=n: sr.rpc_echo(ports.echo, plan, n, **at),  # type: ignore[misc]
                Payload(moved, moved),
                [Versus(metric="ops_per_s", base=tcp_key, base_metric="ops_per_s",
                        label="asyncio TCP throughput"),
                 Versus(metric="p50_us", base=tcp_key, base_metric="p50_us",
                        label="asyncio TCP p50")])
            add(f"e.rpc{n}", "e", f"RPC echo, {n} in flight", how,
                lambda n=n: sr.tcp_echo(ports.tcp, plan, n, host=ports.host),  # type: ignore[misc]
                Payload(moved, moved, roce=False), system="asyncio TCP")
    if "f" in areas:
        for n in plan.kv_in_flight:
            rpc_key = f"f.get{n}.rpc.aiordma.{loop}"
            for one_sided in (False, True):
                path = "one-sided" if one_sided else "rpc"
                vs = [Versus(metric="p50_us", base=rpc_key, base_metric="p50_us",
                             label="RPC GET p50"),
                      Versus(metric="ops_per_s", base=rpc_key, base_metric="ops_per_s",
                             label="RPC GET throughput")] if one_sided else []
                add(f"f.get{n}.{path}", "f", f"KV GET {path}, {n} in flight",
                    f"{plan.kv_gets} GETs over {plan.kv_keys} keys of {plan.kv_value} B",
                    lambda o=one_sided, n=n: sr.kv_get(ports.kv, plan, one_sided=o,  # type: ignore[misc]
                                                       in_flight=n, **at),
                    Payload(plan.kv_keys * plan.kv_value, plan.kv_gets * plan.kv_value), vs)
    if "t" in areas:
        moved = plan.rpc_calls * plan.rpc_payload
        for n in plan.rpc_in_flight:
            how = (f"{plan.rpc_calls} calls of echo({plan.rpc_payload} B), {n} in flight, "
                   f"connect(transport='tcp')")
            tcp_key = f"t.rpc{n}.tcp.{loop}"
            add(f"t.rpc{n}", "t", f"RPC echo over aiordma's TCP transport, {n} in flight", how,
                lambda n=n: sr.rpc_echo(ports.echo, plan, n, transport="tcp", **at),  # type: ignore[misc]
                Payload(moved, moved, roce=False),
                [Versus(metric="ops_per_s", base=tcp_key, base_metric="ops_per_s",
                        label="asyncio TCP throughput"),
                 Versus(metric="p50_us", base=tcp_key, base_metric="p50_us",
                        label="asyncio TCP p50")])
            add(f"t.rpc{n}", "t", f"RPC echo over aiordma's TCP transport, {n} in flight",
                f"{plan.rpc_calls} calls of echo({plan.rpc_payload} B), {n} in flight",
                lambda n=n: sr.tcp_echo(ports.tcp, plan, n, host=ports.host),  # type: ignore[misc]
                Payload(moved, moved, roce=False), system="asyncio TCP")
    if "g" in areas:
        first = plan.scale_endpoints[0]
        for n in plan.scale_endpoints:
            vs = [Versus(metric="us_per_op", base=f"g.endpoints{first}.aiordma.{loop}",
                         base_metric="us_per_op", label=f"{first} endpoint(s)")] \
                if n != first else (_versus_ucxx("g", "ops_per_s") if peers else [])
            ops = max(1, plan.scale_ops // plan.scale_in_flight) * plan.scale_in_flight
            add(f"g.endpoints{n}", "g", f"64 B round trips over {n} endpoint(s)",
                f"{plan.scale_ops} round trips, {plan.scale_in_flight} in flight "
                f"({plan.scale_in_flight // n} per endpoint)",
                lambda n=n: er.scaling(ep, plan, n, **at), Payload(64 * ops, 64 * ops), vs)  # type: ignore[misc]
    return specs


#: The metrics a row under loss is compared on with the same row without, by area.
HEADLINE: dict[str, tuple[str, ...]] = {
    "a": ("p50_us",), "b": ("mibs",), "c": ("msgs_per_s",), "d": ("mibs",),
    "e": ("ops_per_s", "p50_us"), "f": ("ops_per_s", "p50_us"), "g": ("us_per_op",),
    "t": ("ops_per_s", "p50_us")}


def loss_tag(loss: float) -> str:
    """The end of the keys of rows run under ``loss`` % loss: ``@loss1%``."""
    return f"@loss{loss:g}%"


def lossy_spec(key: str, meta: dict[str, Any], loss: float,
               headline: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """Row ``key`` run again under ``loss`` % loss: its key and metadata. Its baselines are the
    lossy runs of its own baselines, and it is compared with itself without loss on its
    ``headline`` metrics."""
    tag = loss_tag(loss)
    versus = [Versus(metric=m, base=key, base_metric=m, label="without loss")
              for m in headline]
    versus += [Versus(metric=v.metric, base=v.base + tag, base_metric=v.base_metric,
                      factor=v.factor, label=f"{v.label} at {loss:g} % loss")
               for v in meta.get("versus", [])]
    return key + tag, {**meta, "what": f"{meta['what']}, {loss:g} % loss", "versus": versus}


async def _in_process_ping_pong(plan: Plan) -> dict[str, float]:
    import aiordma

    async with await aiordma.listen(serve_connection, "127.0.0.1", 0,
                                    transport="rdma") as listener:
        return await er.ping_pong(listener.port, plan)


async def _python_rows(specs: list[tuple[str, dict[str, Any], Make]], plan: Plan,
                       results: Results, *, link: Link | None = None, mtu: int = 1024,
                       loss: float = 0.0) -> None:
    for key, meta, make in specs:
        meta = dict(meta)
        payload, headline = meta.pop("payload"), meta.pop("headline")
        if loss:
            key, meta = lossy_spec(key, meta, loss, headline)
        label = f"  [{meta['area']}] {meta['system']} {meta['loop']}: {meta['what']}"
        t0 = time.perf_counter()
        load = _load()
        proof = None
        try:
            # (the snapshots block the loop; no connection of the row is open then)
            before = link.snapshot() if link is not None else None
            async with asyncio.timeout(plan.row_timeout):
                values = await make()
            if link is not None and before is not None:
                proof = link.crossed(before, payload, mtu=mtu)
        except Exception as exc:  # noqa: BLE001  # a failed row is reported, the run goes on
            why = failure(exc)
            results.fail(key, why, load=load, **meta)
            _say(f"{label}: FAILED ({why})")
            continue
        results.record(key, values, proof=proof, load=load, **meta)
        _say(f"{label}: {_brief(values)} ({time.perf_counter() - t0:.1f} s)")


def run_all(plan: Plan, *, areas: str, loops: list[str], repeat: int, dev: DeviceChoice | None,
            results: Results, peers: PeerInstall | None = None, link: Link | None = None,
            loss: float = 0.0) -> None:
    """Every row of ``areas``, ``repeat`` times, into ``results``; with ``peers``, ucxx's rows
    (areas a, d, g) and Open MPI's (h) too; with ``link``, across it (areas a-g; servers on
    host 2), and with ``loss`` each repeat's rows again under that loss (see the module).
    ``dev`` None: no device (areas that need none only: the peers serve TCP only)."""
    if link is not None and (peers is not None or "h" in areas):
        raise ValueError("across the link: areas (a)-(g), without the peers")
    if loss and link is None:
        raise ValueError("loss is set on the link between two hosts")
    python_areas = "".join(a for a in areas if a in "abcdefgt")
    if dev is None and any(a not in DEVICE_FREE for a in areas):
        raise ValueError(f"areas {areas} need an RDMA device; without one, only "
                         f"{DEVICE_FREE} run")
    config = None if link is None else patient(ACROSS_KEEPALIVE)
    with contextlib.ExitStack() as stack:
        # aiordma's peer processes serve areas (a) to (g) only (a start costs seconds in the VM)
        if not python_areas:
            ports = {}
        elif link is None:
            ports = {loop: stack.enter_context(peer_process(loop, tcp_only=dev is None))
                     for loop in loops}
        else:
            ports = {loop: stack.enter_context(remote_peer_process(
                loop, link=link, keepalive=ACROSS_KEEPALIVE)) for loop in loops}
        for r in range(repeat):
            _say(f"repeat {r + 1} of {repeat}:")
            for lost in [0.0] + ([loss] if loss else []):
                with link.lossy(lost) if link is not None else contextlib.nullcontext():
                    if lost:
                        _say(f" the same rows with netem loss {lost:g} % on both hosts' link:")
                    if dev is not None:
                        _perftest_rows(plan, areas, dev, results, link=link, loss=lost)
                    if dev is not None and peers is not None and any(a in areas for a in "adg"):
                        run_ucxx_rows(plan, areas=areas, dev=dev, results=results, peers=peers)
                    for loop, loop_ports in ports.items():
                        specs = python_specs(plan, python_areas, loop_ports, loop,
                                             peers=peers is not None, config=config,
                                             across=link is not None)
                        LOOPS[loop](_python_rows(specs, plan, results, link=link,
                                                 mtu=1024 if dev is None else dev.mtu,
                                                 loss=lost))
            if "h" in areas and dev is not None:
                run_collective_rows(plan, loops=loops, dev=dev, results=results, peers=peers)
            if "s" in areas and dev is not None and link is None:
                run_connection_rows(plan, loops=loops, results=results)
