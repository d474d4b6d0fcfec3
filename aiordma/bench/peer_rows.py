"""ucxx's rows (``--peers``): the same three things aiordma's rows measure, in ucxx's blocking
and polling progress modes, each beside the aiordma row it compares with:

* (a) ``a.rtt64.ucxx-<mode>``: 64 B round trip, one at a time (aiordma: ``a.rtt64``);
* (d) ``d.msg.ucxx-<mode>``: 4 MiB messages one way, one at a time (aiordma: ``d.msg``);
* (g) ``g.endpoints1.ucxx-<mode>``: 64 B round trips, 64 in flight on one endpoint
  (aiordma: ``g.endpoints1``).

Per mode, a ucxx server process and a client process (:mod:`aiordma.bench.ucxx_worker`,
run by the ucxx venv's interpreter in the environment ``scripts/setup-peers.sh`` wrote),
twice: a short run with UCX's info log, which must show every endpoint of both processes on
rc_verbs over the bench's device (:func:`aiordma.bench.peers.ucx_route`), then the timed run
in the same environment with the log silent, whose active transports must be rc_verbs (and
self) only (:func:`aiordma.bench.peers.ucx_transports_route`); otherwise the rows fail. ucxx
is driven as its own benchmark drives it (buffers made and wrapped once, a bare await per
message, one deadline per measured part: see the worker).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from aiordma import AiordmaError

from .hostload import host_load
from .measure import Results
from .peers import (
    PeerInstall,
    PeerRouteError,
    ucx_route,
    ucx_transports_route,
    ucxx_environment,
)
from .plan import Plan, size_name
from .process import announced

__all__ = ["UCXX_MODES", "run_ucxx_rows", "ucxx_specs"]

UCXX_MODES = ("blocking", "polling")
PARTS = {"a": "rtt", "d": "bw", "g": "echo"}  # area -> the client's figure


def ucxx_key(area: str, mode: str) -> str:
    return {"a": "a.rtt64", "d": "d.msg", "g": "g.endpoints1"}[area] + f".ucxx-{mode}"


def ucxx_specs(plan: Plan, areas: str, note: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(key, row metadata) of ucxx's rows for ``areas``; ``note`` (the UCX version caveat)
    goes into each row's ``how``."""
    specs = []
    for mode in UCXX_MODES:
        tail = (f"; progress mode {mode}, buffers made once, UCX's log silent"
                + (f"; {note}" if note else ""))
        if "a" in areas:
            specs.append((ucxx_key("a", mode), {
                "area": "a", "what": "64 B round trip",
                "how": f"{plan.rtt_iters} round trips after {plan.warmup}, echo server in "
                       f"another process{tail}"}))
        if "d" in areas:
            specs.append((ucxx_key("d", mode), {
                "area": "d", "what": f"{size_name(plan.rdv_size)} messages one way "
                                     f"(rendezvous)",
                "how": f"{plan.rdv_count} messages, one at a time, server recv into one "
                       f"buffer{tail}"}))
        if "g" in areas:
            specs.append((ucxx_key("g", mode), {
                "area": "g", "what": "64 B round trips over 1 endpoint(s)",
                "how": f"{plan.scale_ops} round trips, {plan.scale_in_flight} in flight "
                       f"({plan.scale_in_flight} per endpoint){tail}"}))
    return [(k, {**m, "system": f"ucxx {k.rsplit('-', 1)[1]}", "loop": None})
            for k, m in specs]


#: Round trips of the short run whose UCX info log proves the route (nothing is timed).
PROBE_ROUND_TRIPS = 20


def _worker(peers: PeerInstall, role: str, mode: str) -> list[str]:
    return [peers.venv_python, str(Path(__file__).with_name("ucxx_worker.py")), role,
            "--mode", mode]


def _client_args(plan: Plan) -> list[str]:
    return ["--warmup", str(plan.warmup), "--rtt-iters", str(plan.rtt_iters),
            "--echo-ops", str(plan.scale_ops), "--in-flight", str(plan.scale_in_flight),
            "--bw-size", str(plan.rdv_size), "--bw-count", str(plan.rdv_count),
            "--deadline", str(plan.row_timeout)]


def _run(peers: PeerInstall, plan: Plan, mode: str, dev: Any, *, log_level: str,
         client_args: list[str]) -> tuple[dict[str, Any], str, str]:
    """A ucxx server and a client in ``mode``, UCX's log at ``log_level``: (the client's JSON
    line, the client's output, the server's stderr). Raises RuntimeError."""
    env = ucxx_environment(peers, dev.name, dev.port, log_level=log_level)
    host = dev.gid_ip or "127.0.0.1"
    with tempfile.TemporaryFile("w+") as server_log:
        with announced(_worker(peers, "server", mode), "READY", timeout=120.0, env=env,
                       stderr=server_log) as line:
            port = int(line.split()[1])
            argv = _worker(peers, "client", mode) + ["--host", host, "--port", str(port)]
            try:
                client = subprocess.run(argv + client_args, env=env, capture_output=True,
                                        text=True, timeout=plan.row_timeout, check=False)
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"the ucxx client did not finish in {exc.timeout} s") \
                    from None
        server_log.seek(0)
        server_text = server_log.read()
    lines = client.stdout.strip().splitlines()
    if client.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = " | ".join((client.stdout + client.stderr).strip().splitlines()[-3:])
        raise RuntimeError(f"the ucxx client failed (status {client.returncode}): {tail}")
    return json.loads(lines[-1]), client.stdout + client.stderr, server_text


def _one_mode(peers: PeerInstall, plan: Plan, mode: str, dev: Any) -> tuple[dict[str, Any],
                                                                           str, str]:
    """ucxx in ``mode``: a short run with UCX's info log, whose endpoint lines in both
    processes must show the route, then the timed run with the log silent, whose active
    transports must agree: (the timed client's figures, the route's proof, its output).
    Raises RuntimeError or PeerRouteError."""
    _, probe_out, probe_server = _run(peers, plan, mode, dev, log_level="info",
                                      client_args=["--probe", str(PROBE_ROUND_TRIPS)])
    logged = ucx_route(probe_out, dev.name, dev.port)
    ucx_route(probe_server, dev.name, dev.port)  # the server's endpoint too
    figures, output, _ = _run(peers, plan, mode, dev, log_level="error",
                              client_args=_client_args(plan))
    active = ucx_transports_route(figures.get("active_transports", []))
    proof = (f"{logged}, client and server, in a {PROBE_ROUND_TRIPS}-round-trip run with "
             f"UCX's info log; the timed run (log silent): {active}")
    return figures, proof, output


def run_ucxx_rows(plan: Plan, *, areas: str, dev: Any, results: Results,
                  peers: PeerInstall) -> None:
    """One repeat of ucxx's rows for ``areas`` (a, d, g), both progress modes."""
    specs = ucxx_specs(plan, areas, peers.ucxx_note)
    for mode in UCXX_MODES:
        mine = [(k, m) for k, m in specs if k.endswith(f"-{mode}")]
        if not mine:
            continue
        t0 = time.perf_counter()
        load = host_load()  # (the machine running the VM: the figures move with it)
        at = None if load is None else load[0]
        try:
            figures, proof, output = _one_mode(peers, plan, mode, dev)
        except (AiordmaError, RuntimeError, PeerRouteError, OSError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            for key, meta in mine:
                results.fail(key, why, load=at, **meta)
            print(f"  [peers] ucxx {mode}: FAILED ({why})", flush=True)
            continue
        for i, (key, meta) in enumerate(mine):
            results.record(key, figures[PARTS[meta["area"]]], proof=proof, load=at,
                           output=None if i else output, **meta)
        brief = "; ".join(f"{p} " + ", ".join(f"{k} {v:.4g}" for k, v in figures[p].items())
                          for p in ("rtt", "echo", "bw"))
        print(f"  [peers] ucxx {mode}: {brief} ({time.perf_counter() - t0:.1f} s; {proof})",
              flush=True)
