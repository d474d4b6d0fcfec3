"""The benchmark's report: a table with ratios, the goals' verdicts, a JSON document and an
optional PNG (when matplotlib is importable).

Pure except for writing the files: tested without a device.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from typing import Any

from .collective_cases import BATCH, COLLECTIVES, CONCURRENT
from .connections import row_key
from .measure import UNITS, Results, Row, Versus
from .plan import AREAS, Plan, size_name

__all__ = ["CONN_GOALS", "GOALS", "HOST_GOALS", "PEER_GOALS", "TCP_GOALS", "Bound", "Goal",
           "evaluate_goals", "format_table", "to_json", "write_png"]

SCHEMA = "aiordma-bench/1"
_OPS = {"<=": operator.le, ">=": operator.ge}  # a goal's comparison, by its op


@dataclass(frozen=True, slots=True, kw_only=True)
class Goal:
    """``row``'s metric against a baseline, compared with ``threshold`` by ``op``; ``row`` and
    ``versus.base`` may hold ``{loop}``, and the goal is judged on each loop.

    ``also``: other baselines (e.g. a peer's other progress mode); the goal is judged against
    the best of them by median (lowest for a "lower is better" metric). ``optional``: judged
    only in runs that have the row and a baseline (the peers' goals, in ``--peers`` runs).
    """

    name: str
    row: str
    versus: Versus
    op: str  # "<=" or ">="
    threshold: float
    also: tuple[str, ...] = ()
    optional: bool = False

    def judge(self, ratio: float) -> bool:
        return _OPS[self.op](ratio, self.threshold)


GOALS = (  # issue 13's goals (its stretch goal for the round trip is 1.5x)
    Goal(name="64 B RTT p50 vs ib_send_lat -e RTT (2 x t_typical)", row="a.rtt64.aiordma.{loop}",
         versus=Versus(metric="p50_us", base="pt.send_lat-e.64", base_metric="t_typical_us",
                       factor=2, label="ib_send_lat -e RTT"), op="<=", threshold=3.0),
    Goal(name="1 MiB RDMA WRITE bw vs ib_write_bw", row="b.write.1048576.aiordma.{loop}",
         versus=Versus(metric="mibs", base="pt.ib_write_bw.1048576", base_metric="mibs",
                       label="ib_write_bw"), op=">=", threshold=0.95),
    Goal(name="4 MiB two-sided message bw vs ib_read_bw", row="d.msg.aiordma.{loop}",
         versus=Versus(metric="mibs", base="pt.ib_read_bw.4194304", base_metric="mibs",
                       label="ib_read_bw"), op=">=", threshold=0.90),
    Goal(name="64 B message rate vs ib_send_bw", row="c.rate64.aiordma.{loop}",
         versus=Versus(metric="msgs_per_s", base="pt.ib_send_bw.64", base_metric="msgs_per_s",
                       label="ib_send_bw"), op=">=", threshold=0.50),
    Goal(name="RPC echo throughput, 64 in flight, vs asyncio TCP", row="e.rpc64.aiordma.{loop}",
         versus=Versus(metric="ops_per_s", base="e.rpc64.tcp.{loop}", base_metric="ops_per_s",
                       label="asyncio TCP"), op=">=", threshold=1.5),
    Goal(name="RPC echo p50, 1 in flight, vs asyncio TCP", row="e.rpc1.aiordma.{loop}",
         versus=Versus(metric="p50_us", base="e.rpc1.tcp.{loop}", base_metric="p50_us",
                       label="asyncio TCP"), op="<=", threshold=1.0),
    Goal(name="per-op cost, 64 endpoints vs 1", row="g.endpoints64.aiordma.{loop}",
         versus=Versus(metric="us_per_op", base="g.endpoints1.aiordma.{loop}",
                       base_metric="us_per_op", label="1 endpoint"), op="<=", threshold=1.2),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """``row``'s ``metric`` (its median, in the metric's unit) against a fixed ``threshold``
    by ``op``, judged on each loop where the run has the row; its spread is the metric's own
    [min..max] over the repeats."""

    name: str
    row: str
    metric: str
    op: str  # "<=" or ">="
    threshold: float

    def judge(self, value: float) -> bool:
        return _OPS[self.op](value, self.threshold)


def _conn_goals() -> tuple[Goal | Bound, ...]:
    """Issue 37's goals, on area (s)'s rows with both ends on pools (the configuration the
    issue built for a server with many clients; the default ``Config``'s rows are in the
    table beside them): the server's registered memory beyond the pool <= 64 KiB and <= 1 MR
    per connection at 1,000, its RSS growth for 1,000 <= 150 MiB, >= 150 set-ups/s at 256 and
    1,000 (16 in flight), and the per-op cost on one connection with 1,000 open <= 1.3x with
    one (the round trip's time, the pipelined rate's inverse)."""
    big = row_key(1000, True, "{loop}")
    goals: list[Goal | Bound] = [
        Bound(name="server's pinned memory beyond the pool per connection, 1,000 on pools "
                   "(KiB)", row=big, metric="pin_beyond_pool_kib_per_conn", op="<=",
              threshold=64),
        Bound(name="server's MRs per connection, 1,000 on pools", row=big,
              metric="mrs_per_conn", op="<=", threshold=1),
        Bound(name="server's RSS growth for 1,000 connections on pools (MiB)", row=big,
              metric="rss_mib", op="<=", threshold=150)]
    for n, which in ((256, "256"), (1000, "1,000")):
        goals.append(Bound(name=f"set-up rate, 16 in flight, {which} on pools (conn/s)",
                           row=row_key(n, True, "{loop}"), metric="setups_per_s", op=">=",
                           threshold=150))
    one = row_key(1, True, "{loop}")
    goals += [
        Goal(name="64 B RTT p50 on one connection, 1,000 open vs 1 (pools)", row=big,
             versus=Versus(metric="rtt_p50_us", base=one, base_metric="rtt_p50_us",
                           label="1 open"), op="<=", threshold=1.3, optional=True),
        Goal(name="pipelined 64 B echoes/s on one connection, 1,000 open vs 1 (pools; "
                  "1/1.3x the cost)", row=big,
             versus=Versus(metric="echo_rate_per_s", base=one, base_metric="echo_rate_per_s",
                           label="1 open"), op=">=", threshold=round(1 / 1.3, 3),
             optional=True)]
    return tuple(goals)


CONN_GOALS = _conn_goals()
"""Issue 37's; judged where the run has area (s)'s rows."""

TCP_GOALS = tuple(  # issue 35: the transport seam costs nothing over TCP
    Goal(name=f"RPC echo throughput over aiordma's TCP transport, {n} in flight, vs asyncio TCP",
         row=f"t.rpc{n}.aiordma.{{loop}}",
         versus=Versus(metric="ops_per_s", base=f"t.rpc{n}.tcp.{{loop}}",
                       base_metric="ops_per_s", label="asyncio TCP"),
         op=">=", threshold=0.9, optional=True) for n in (1, 16, 64))


def _peer_goals() -> tuple[Goal, ...]:
    """The goals against the peers. Issue 34's (which extend issue 16's allreduce goals):
    allreduce, broadcast and allgather against Open MPI over the same rxe device, 2 and 4 ranks,
    at most 1.0x up to 64 KiB and 0.8x from 1 MiB; reduce_scatter and alltoall at most 1.0x at
    every size; 8 allreduces of 1 MiB started together at least 1.5x faster than one after
    another (4 ranks). Issue 16's against ucxx: the 64 B round trip and the 64-in-flight echo
    rate against ucxx's best progress mode."""
    goals = []
    for collective in COLLECTIVES:
        for world in (2, 4):
            for nbytes in Plan().coll_sizes:
                limit = 1.0 if nbytes <= 64 << 10 or collective in (
                    "reduce_scatter", "alltoall") else 0.8
                key = f"h.{collective}.{world}r.{nbytes}"
                goals.append(Goal(
                    name=f"{collective} {size_name(nbytes)}, {world} ranks, time vs Open MPI "
                         f"over rxe",
                    row=f"{key}.aiordma.{{loop}}",
                    versus=Versus(metric="call_us", base=f"{key}.ompi-rxe",
                                  base_metric="call_us", label="Open MPI over rxe"),
                    op="<=", threshold=limit, optional=True))
    world, nbytes = Plan().coll_concurrent
    together, one_by_one = CONCURRENT
    goals.append(Goal(
        name=f"{BATCH} allreduces of {size_name(nbytes)} at once vs one after another, "
             f"{world} ranks (time; 1.5x faster)",
        row=f"h.{together}.{world}r.{nbytes}.aiordma.{{loop}}",
        versus=Versus(metric="call_us", base=f"h.{one_by_one}.{world}r.{nbytes}.aiordma.{{loop}}",
                      base_metric="call_us", label="one after another"),
        op="<=", threshold=round(1 / 1.5, 3), optional=True))
    goals.append(Goal(
        name="64 B RTT p50 vs ucxx (best mode)", row="a.rtt64.aiordma.{loop}",
        versus=Versus(metric="p50_us", base="a.rtt64.ucxx-blocking", base_metric="p50_us",
                      label="ucxx"), also=("a.rtt64.ucxx-polling",),
        op="<=", threshold=1.0, optional=True))
    goals.append(Goal(
        name="64 B echo rate, 64 in flight, vs ucxx (best mode)",
        row="g.endpoints1.aiordma.{loop}",
        versus=Versus(metric="ops_per_s", base="g.endpoints1.ucxx-blocking",
                      base_metric="ops_per_s", label="ucxx"),
        also=("g.endpoints1.ucxx-polling",), op=">=", threshold=1.5, optional=True))
    return tuple(goals)


PEER_GOALS = _peer_goals()

HOST_GOALS = tuple(  # issue 33's goal for the host-side figure, on each RPC row of area (i)
    Goal(name=f"host CPU per RPC call, {n} in flight, vs asyncio TCP + msgpack (same process)",
         row=f"i.rpc{n}.aiordma.{{loop}}",
         versus=Versus(metric="cpu_us_per_op", base=f"i.rpc{n}.tcp.{{loop}}",
                       base_metric="cpu_us_per_op", label="asyncio TCP CPU"),
         op="<=", threshold=0.5, optional=True)
    for n in Plan().cpu_in_flight)
"""``aiordma bench --host-cpu`` judges these (a device run has none of their rows)."""


def _best_base(results: Results, g: Goal, loop: str) -> str:
    """The baseline ``g`` is judged against: the best-by-median of its candidates that were
    measured (the first candidate when none was)."""
    candidates = [b.format(loop=loop) for b in (g.versus.base, *g.also)]
    measured = [(v, b) for b in candidates
                if (v := results.value(b, g.versus.base_metric)) is not None]
    if not measured:
        return candidates[0]
    lower = UNITS[g.versus.base_metric][1] == "lower"
    return (min if lower else max)(measured)[1]


def _bound(results: Results, g: Bound, row: str, loop: str) -> dict[str, Any]:
    """The verdict of an absolute goal (see :class:`Bound`)."""
    value = results.value(row, g.metric)
    metric = results.rows[row].metrics.get(g.metric)
    spread = [metric.min, metric.max] if metric is not None and metric.samples else None
    return {"goal": g.name, "loop": loop, "row": row, "metric": g.metric, "op": g.op,
            "threshold": g.threshold, "value": value, "unit": UNITS[g.metric][0],
            "spread": spread, "held": None if value is None else g.judge(value),
            "every_repeat": None if spread is None else _same_side(g, (spread[0], spread[1]))}


def evaluate_goals(results: Results, loops: list[str],
                   goals: tuple[Goal | Bound, ...] = (GOALS + PEER_GOALS + TCP_GOALS
                                                      + HOST_GOALS + CONN_GOALS)
                   ) -> list[dict[str, Any]]:
    """One verdict per goal and loop: ``held`` is True/False, or None when not measured.
    Optional goals are left out where the run has not their row or any baseline row; a
    :class:`Bound` where it has not its row."""
    out = []
    for g in goals:
        for loop in loops:
            row = g.row.format(loop=loop)
            if isinstance(g, Bound):
                if row in results.rows:
                    out.append(_bound(results, g, row, loop))
                continue
            bases = [b.format(loop=loop) for b in (g.versus.base, *g.also)]
            if g.optional and (row not in results.rows
                               or not any(b in results.rows for b in bases)):
                continue
            v = Versus(metric=g.versus.metric, base=_best_base(results, g, loop),
                       base_metric=g.versus.base_metric, factor=g.versus.factor,
                       label=g.versus.label)
            ratio = results.ratio(row, v)
            spread = results.ratio_range(row, v)
            out.append({"goal": g.name, "loop": loop, "row": row, "baseline": v.base,
                        "op": g.op, "threshold": g.threshold, "ratio": ratio,
                        "spread": None if spread is None else list(spread),
                        "held": None if ratio is None else g.judge(ratio),
                        "every_repeat": (None if spread is None else
                                         _same_side(g, spread)),
                        "best_of": bases if g.also else None})
    return out


def _same_side(goal: Goal | Bound, spread: tuple[float, float]) -> bool:
    """Whether every repeat's ratio (a Bound's: figure) gives the same verdict (the spread
    lies on one side of the threshold: the verdict is not a matter of which repeat is looked
    at)."""
    return goal.judge(spread[0]) == goal.judge(spread[1])


def _num(x: float) -> str:
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _loads(loads: list[float]) -> str:
    """The load averages a row started at: one, or the range over its repeats."""
    lo, hi = min(loads), max(loads)
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}"


def _figure(row: Row, name: str) -> str:
    m = row.metrics[name]
    text = f"{_num(m.median)} {m.unit}"
    if len(m.samples) > 1:
        text += f" [{_num(m.min)}..{_num(m.max)}]"
    return text


METRIC_LABELS = {"p50_us": "p50", "p99_us": "p99", "t_typical_us": "t_typical (one way)",
                 "t_p99_us": "p99 (one way)", "mibs": "bandwidth", "msgs_per_s": "rate",
                 "ops_per_s": "throughput", "us_per_op": "per op",
                 "wakeups_per_op": "fd wake-ups", "hit": "answered by the READ",
                 "call_us": "per call", "call_min_us": "fastest call",
                 "call_max_us": "slowest call", "cpu_us_per_op": "CPU per op",
                 "user_us_per_op": "user", "system_us_per_op": "system"}


def format_table(results: Results, *, header: list[str], goals: list[dict[str, Any]]) -> str:
    """The whole report as text: settings, rows by area (median [min..max] of the repeats),
    each aiordma row's ratios to its baselines, then the goals."""
    lines = list(header)
    by_area: dict[str, list[Row]] = {}
    for row in results.rows.values():
        by_area.setdefault(row.area, []).append(row)
    for area in sorted(by_area):
        lines += ["", f"({area}) {AREAS.get(area, '')}"]
        for row in by_area[area]:
            who = row.system + (f" {row.loop}" if row.loop else "")
            load = f"; load {_loads(row.loads)}" if row.loads else ""
            lines.append(f"  {row.what} -- {who}  ({row.how}{load})")
            if row.failed:
                lines.append(f"      FAILED: {row.errors[-1] if row.errors else 'no figures'}")
                continue
            figs = "; ".join(f"{METRIC_LABELS.get(n, n)} {_figure(row, n)}"
                             for n, m in row.metrics.items() if m.samples)
            lines.append(f"      {figs}")
            for v in row.versus:
                r = results.ratio(row.key, v)
                if r is not None:
                    lines.append(f"      {METRIC_LABELS.get(v.metric, v.metric)}: "
                                 f"{r:.2f}x {v.label}")
            if row.proofs:
                lines.append(f"      route: {row.proofs[-1]}")
            if row.errors:
                lines.append(f"      ({len(row.errors)} run(s) failed and were not counted: "
                             f"{row.errors[-1]})")
    lines += ["", ("goals (ratios of medians, or a median against a fixed limit, same run): "
                     "in brackets the [min..max] of the per-repeat ratios or figures")]
    for g in goals:
        verdict = {True: "held", False: "NOT held", None: "not measured"}[g["held"]]
        if "value" in g:  # (a Bound: the figure itself against a fixed limit)
            figure = "-" if g["value"] is None else f"{_num(g['value'])} {g['unit']}"
            if g["spread"] is not None:
                figure += f" [{_num(g['spread'][0])}..{_num(g['spread'][1])}]"
                if g["every_repeat"] is False:
                    figure += " (repeats disagree)"
            lines.append(f"  {verdict:<12} {g['goal']} [{g['loop']}]: {figure} "
                         f"(goal {g['op']} {_num(g['threshold'])} {g['unit']})")
            continue
        ratio = "-" if g["ratio"] is None else f"{g['ratio']:.2f}x"
        if g.get("spread") is not None:
            lo, hi = g["spread"]
            ratio += f" [{lo:.2f}x..{hi:.2f}x]"
            if g["every_repeat"] is False:
                ratio += " (repeats disagree)"
        if g.get("best_of"):
            ratio += f" against {g['baseline']}"
        lines.append(f"  {verdict:<12} {g['goal']} [{g['loop']}]: {ratio} "
                     f"(goal {g['op']} {g['threshold']}x)")
    return "\n".join(lines)


def to_json(results: Results, *, settings: dict[str, Any], environment: dict[str, Any],
            goals: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON document: settings, environment, rows (with every sample), ratios, goals."""
    rows = []
    for row in results.rows.values():
        rows.append({
            "key": row.key, "area": row.area, "what": row.what, "system": row.system,
            "loop": row.loop, "how": row.how, "failed": row.failed, "errors": row.errors,
            "metrics": {n: {"unit": m.unit, "better": m.better, "median": m.median,
                            "min": m.min, "max": m.max, "samples": m.samples}
                        for n, m in row.metrics.items() if m.samples},
            "ratios": [{"metric": v.metric, "baseline": v.base,
                        "baseline_metric": v.base_metric, "factor": v.factor,
                        "label": v.label, "ratio": results.ratio(row.key, v)}
                       for v in row.versus],
            "outputs": row.outputs,
            "proofs": row.proofs,
            "loads": row.loads,
        })
    return {"schema": SCHEMA, "settings": settings, "environment": environment,
            "rows": rows, "goals": goals}


def write_json(doc: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def write_png(results: Results, goals: list[dict[str, Any]], path: str) -> str | None:
    """Bandwidth by size (b) and the goals' ratios, if matplotlib is importable; else the
    reason it was not written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, (bw, gl) = plt.subplots(1, 2, figsize=(13, 5))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in results.rows.values():
        m = row.metrics.get("mibs")
        if row.area != "b" or m is None or not m.samples:
            continue
        key, _, tag = row.key.partition("@")  # (a row under loss: "...@loss1%")
        op, size = key.split(".")[1:3] if row.system != "perftest" else (
            "write" if "write" in key else "read", key.split(".")[2])
        name = f"{op} {row.system}" + (f" {row.loop}" if row.loop else "") + \
            (f" {tag}" if tag else "")
        series.setdefault(name, []).append((int(size), m.median))
    for name, pts in sorted(series.items()):
        pts.sort()
        bw.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    bw.set_xscale("log", base=2)
    bw.set_xlabel("bytes per operation")
    bw.set_ylabel("MiB/s (median)")
    bw.set_title("(b) RDMA WRITE / READ bandwidth")
    bw.legend(fontsize=7)
    judged = [g for g in goals if g["ratio"] is not None]
    labels = [f"{g['goal']} [{g['loop']}]" for g in judged]
    gl.barh(range(len(judged)), [g["ratio"] for g in judged],
            color=["tab:green" if g["held"] else "tab:red" for g in judged])
    for i, g in enumerate(judged):
        gl.plot([g["threshold"]] * 2, [i - 0.4, i + 0.4], color="black")
    gl.set_yticks(range(len(judged)), labels, fontsize=7)
    gl.set_xlabel("ratio to baseline (black: goal)")
    gl.set_title("goals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
