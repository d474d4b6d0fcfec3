"""The benchmark's bookkeeping without a device: samples and their spread, ratios to
baselines, goal verdicts, the table's text, the JSON document's shape, the plans, and that
every goal names rows the runner produces."""

from __future__ import annotations

import json

import pytest

from aiordma.bench.collective_rows import collective_specs
from aiordma.bench.measure import Results, Versus, percentile
from aiordma.bench.peer import PeerPorts
from aiordma.bench.peer_rows import ucxx_specs
from aiordma.bench.plan import AREAS, Plan
from aiordma.bench.connections import connection_rows, row_key
from aiordma.bench.report import (
    CONN_GOALS,
    GOALS,
    PEER_GOALS,
    Bound,
    Goal,
    evaluate_goals,
    format_table,
    to_json,
    write_png,
)
from aiordma.bench.runner import perftest_jobs, python_specs
from aiordma.cli.command import build_parser

RTT_VS = Versus(metric="p50_us", base="pt.send_lat-e.64", base_metric="t_typical_us",
                factor=2, label="ib_send_lat -e RTT (2 x t_typical)")


def _results() -> Results:
    r = Results()
    for t in (300.0, 200.0, 250.0):  # one way, three repeats: median 250, RTT 500
        r.record("pt.send_lat-e.64", {"t_typical_us": t, "t_p99_us": 2 * t}, area="a",
                 what="64 B round trip, completion events", system="perftest",
                 how="ib_send_lat -s 64 -n 100 -e")
    for p50 in (700.0, 650.0, 800.0):  # median 700: 1.4x the RTT
        r.record("a.rtt64.aiordma.uvloop", {"p50_us": p50, "p99_us": 2 * p50}, area="a",
                 what="64 B round trip", system="aiordma", loop="uvloop", how="100 round trips",
                 versus=[RTT_VS])
    r.record("pt.ib_write_bw.1048576", {"mibs": 20.0}, area="b", what="RDMA WRITE 1 MiB",
             system="perftest", how="ib_write_bw -s 1048576 -n 5")
    r.record("b.write.1048576.aiordma.uvloop", {"mibs": 18.0}, area="b",
             what="RDMA WRITE 1 MiB", system="aiordma", loop="uvloop", how="5 x 1 MiB",
             versus=[Versus(metric="mibs", base="pt.ib_write_bw.1048576", base_metric="mibs",
                            label="ib_write_bw")])
    r.fail("c.rate64.aiordma.uvloop", "TimeoutError: ", area="c", what="64 B messages",
           system="aiordma", loop="uvloop", how="2000 messages")
    return r


def test_percentile_is_nearest_rank() -> None:
    v = sorted(float(i) for i in range(1, 101))
    assert percentile(v, 0.5) == 51.0
    assert percentile(v, 0.99) == 100.0
    assert percentile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_repeats_become_samples_with_median_and_spread() -> None:
    m = _results().rows["a.rtt64.aiordma.uvloop"].metrics["p50_us"]
    assert m.samples == [700.0, 650.0, 800.0]
    assert (m.median, m.min, m.max) == (700.0, 650.0, 800.0)
    assert (m.unit, m.better) == ("us", "lower")


def test_ratios_use_medians_and_the_factor() -> None:
    r = _results()
    assert r.ratio("a.rtt64.aiordma.uvloop", RTT_VS) == pytest.approx(700 / 500)
    assert r.ratio("b.write.1048576.aiordma.uvloop",
                   r.rows["b.write.1048576.aiordma.uvloop"].versus[0]) == pytest.approx(0.9)
    assert r.ratio("a.rtt64.aiordma.asyncio", RTT_VS) is None  # not measured
    assert r.ratio("a.rtt64.aiordma.uvloop",
                   Versus(metric="p50_us", base="nowhere", base_metric="x", label="")) is None


def test_a_zero_baseline_gives_no_ratio() -> None:
    r = Results()
    r.record("base", {"mibs": 0.0}, area="b", what="", system="perftest")
    r.record("mine", {"mibs": 1.0}, area="b", what="", system="aiordma")
    assert r.ratio("mine", Versus(metric="mibs", base="base", base_metric="mibs",
                                  label="")) is None


def test_a_row_with_only_failures_is_failed_and_keeps_its_errors() -> None:
    r = _results()
    row = r.rows["c.rate64.aiordma.uvloop"]
    assert row.failed and row.errors == ["TimeoutError: "]
    assert not r.rows["a.rtt64.aiordma.uvloop"].failed
    r.fail("a.rtt64.aiordma.uvloop", "boom", area="a", what="", system="aiordma")
    assert not r.rows["a.rtt64.aiordma.uvloop"].failed  # samples from other repeats remain


def test_unknown_metrics_are_refused() -> None:
    with pytest.raises(KeyError):
        Results().record("x", {"furlongs": 1.0}, area="a", what="", system="aiordma")


def test_goals_are_judged_per_loop_at_their_threshold() -> None:
    verdicts = evaluate_goals(_results(), ["asyncio", "uvloop"])
    by = {(g["goal"].split(" vs")[0], g["loop"]): g for g in verdicts}
    rtt = by[("64 B RTT p50", "uvloop")]
    assert rtt["ratio"] == pytest.approx(1.4) and rtt["held"] is True
    write = by[("1 MiB RDMA WRITE bw", "uvloop")]
    assert write["ratio"] == pytest.approx(0.9) and write["held"] is False
    assert by[("64 B RTT p50", "asyncio")]["held"] is None  # not measured on that loop
    assert by[("64 B message rate", "uvloop")]["held"] is None  # the row failed
    assert len(verdicts) == 2 * len(GOALS)


def test_goals_carry_the_spread_of_per_repeat_ratios() -> None:
    by = {(g["goal"].split(" vs")[0], g["loop"]): g
          for g in evaluate_goals(_results(), ["uvloop"])}
    rtt = by[("64 B RTT p50", "uvloop")]
    # repeats pair up: 700/600, 650/400, 800/500 (one way x 2)
    assert rtt["spread"] == pytest.approx([700 / 600, 650 / 400])
    assert rtt["every_repeat"] is True  # all under 3x
    write = by[("1 MiB RDMA WRITE bw", "uvloop")]
    assert write["spread"] == pytest.approx([0.9, 0.9]) and write["every_repeat"] is True
    assert by[("64 B message rate", "uvloop")]["spread"] is None  # failed row


def test_a_spread_across_the_threshold_is_flagged() -> None:
    r = Results()
    for mine, base in ((1.0, 1.0), (2.0, 1.0)):
        r.record("pt.ib_write_bw.1048576", {"mibs": base}, area="b", what="", system="perftest")
        r.record("b.write.1048576.aiordma.uvloop", {"mibs": mine}, area="b", what="",
                 system="aiordma", loop="uvloop")
    (g,) = [g for g in evaluate_goals(r, ["uvloop"]) if g["row"].startswith("b.write")]
    assert g["spread"] == [1.0, 2.0] and g["every_repeat"] is True
    r.record("b.write.1048576.aiordma.uvloop", {"mibs": 0.5}, area="b", what="",
             system="aiordma", loop="uvloop")
    (g,) = [g for g in evaluate_goals(r, ["uvloop"]) if g["row"].startswith("b.write")]
    assert g["spread"] is None  # the baseline lacks a third repeat: no pairing
    r.record("pt.ib_write_bw.1048576", {"mibs": 1.0}, area="b", what="", system="perftest")
    (g,) = [g for g in evaluate_goals(r, ["uvloop"]) if g["row"].startswith("b.write")]
    assert g["spread"] == [0.5, 2.0] and g["every_repeat"] is False
    text = format_table(r, header=[], goals=[g])
    assert "[0.50x..2.00x] (repeats disagree)" in text


def test_a_bound_judges_the_median_against_a_fixed_limit() -> None:
    r = Results()
    for rate, mib in ((140.0, 120.0), (170.0, 126.0), (160.0, 125.0)):  # medians 160, 125
        r.record("s.pool.conns1000.aiordma.uvloop", {"setups_per_s": rate, "rss_mib": mib},
                 area="s", what="1000 connections", system="aiordma", loop="uvloop")
    goals = (Bound(name="rate", row="s.pool.conns1000.aiordma.{loop}", metric="setups_per_s",
                   op=">=", threshold=150),
             Bound(name="rss", row="s.pool.conns1000.aiordma.{loop}", metric="rss_mib",
                   op="<=", threshold=125))
    rate, rss = evaluate_goals(r, ["asyncio", "uvloop"], goals)  # (no asyncio row: left out)
    assert (rate["value"], rate["held"], rate["spread"]) == (160.0, True, [140.0, 170.0])
    assert rate["every_repeat"] is False  # 140 < 150 <= 160, 170
    assert (rss["value"], rss["held"], rss["every_repeat"]) == (125.0, True, False)
    text = format_table(r, header=[], goals=[rate, rss])
    assert ("held         rate [uvloop]: 160 conn/s [140..170] (repeats disagree) "
            "(goal >= 150 conn/s)") in text
    assert "held         rss [uvloop]: 125 MiB [120..126]" in text
    json.dumps(to_json(r, settings={}, environment={}, goals=[rate, rss]))  # (as is)


def test_issue_37s_goals_name_rows_of_area_s() -> None:
    keys = {row_key(n, pool, loop) for n, pool in connection_rows(Plan())
            for loop in ("asyncio", "uvloop")}
    for g in CONN_GOALS:
        for loop in ("asyncio", "uvloop"):
            assert g.row.format(loop=loop) in keys
            if isinstance(g, Goal):
                assert g.optional and g.versus.base.format(loop=loop) in keys
    limits = {g.metric: g.threshold for g in CONN_GOALS if isinstance(g, Bound)}
    assert limits == {"pin_beyond_pool_kib_per_conn": 64, "mrs_per_conn": 1, "rss_mib": 150,
                      "setups_per_s": 150}


@pytest.mark.parametrize(("op", "ratio", "held"), [
    ("<=", 1.5, True), ("<=", 1.5001, False), (">=", 0.95, True), (">=", 0.9499, False)])
def test_a_ratio_at_the_threshold_holds(op: str, ratio: float, held: bool) -> None:
    threshold = 1.5 if op == "<=" else 0.95
    goal = Goal(name="g", row="r", versus=RTT_VS, op=op, threshold=threshold)
    assert goal.judge(ratio) is held


def test_the_table_shows_spread_ratios_failures_and_verdicts() -> None:
    r = _results()
    text = format_table(r, header=["HEADER"], goals=evaluate_goals(r, ["uvloop"]))
    assert text.startswith("HEADER")
    assert "(a) 64 B send/recv round trip" in text
    assert "p50 700 us [650..800]" in text  # median [min..max] of three repeats
    assert "1.40x ib_send_lat -e RTT (2 x t_typical)" in text
    assert "0.90x ib_write_bw" in text
    assert "FAILED: TimeoutError" in text
    assert "held         64 B RTT p50" in text and "NOT held" in text
    assert "not measured" in text
    assert "ib_send_lat -s 64 -n 100 -e" in text  # how the baseline was run


def test_json_document_shape() -> None:
    r = _results()
    goals = evaluate_goals(r, ["uvloop"])
    doc = json.loads(json.dumps(to_json(r, settings={"quick": True}, environment={"cpus": 2},
                                        goals=goals)))
    assert doc["schema"] == "aiordma-bench/1"
    assert doc["settings"] == {"quick": True} and doc["environment"] == {"cpus": 2}
    rows = {row["key"]: row for row in doc["rows"]}
    assert list(rows) == list(r.rows)  # order kept
    rtt = rows["a.rtt64.aiordma.uvloop"]
    assert {"area", "what", "system", "loop", "how", "failed", "errors", "metrics",
            "ratios", "outputs"} <= set(rtt)
    assert rtt["metrics"]["p50_us"] == {"unit": "us", "better": "lower", "median": 700.0,
                                        "min": 650.0, "max": 800.0,
                                        "samples": [700.0, 650.0, 800.0]}
    assert rtt["ratios"][0]["ratio"] == pytest.approx(1.4)
    assert rtt["ratios"][0]["factor"] == 2
    assert rows["c.rate64.aiordma.uvloop"]["failed"] is True
    assert rows["c.rate64.aiordma.uvloop"]["metrics"] == {}
    assert {g["loop"] for g in doc["goals"]} == {"uvloop"}


def _all_keys(plan: Plan, *, peers: bool) -> set[str]:
    loops = ["asyncio", "uvloop"]
    keys = {j.key for j in perftest_jobs(plan, "".join(AREAS))}
    for loop in loops:
        keys |= {k for k, _, _ in python_specs(plan, "".join(AREAS), PeerPorts(1, 2, 3, 4),
                                               loop, peers=peers)}
    keys |= {s.key for s in collective_specs(plan, loops, peers=peers)}
    if peers:
        keys |= {k for k, _ in ucxx_specs(plan, "".join(AREAS))}
    return keys


def test_every_peer_goal_and_baseline_names_rows_the_runner_produces() -> None:
    for plan in (Plan(), Plan.quick()):
        keys = _all_keys(plan, peers=True)
        for g in PEER_GOALS:
            rows = {g.row.format(loop=loop) for loop in ("asyncio", "uvloop")}
            if plan == Plan.quick() and not rows <= keys:
                assert g.row.startswith("h.")  # quick: 2 ranks, 64 KiB and 1 MiB only
                continue
            assert rows <= keys, g.name
            assert {b.format(loop=loop) for b in (g.versus.base, *g.also)
                    for loop in ("asyncio", "uvloop")} <= keys, g.name
        for loop in ("asyncio", "uvloop"):  # every aiordma row's baselines, with the peers
            for _, meta, _ in python_specs(plan, "".join(AREAS), PeerPorts(1, 2, 3, 4), loop,
                                           peers=True):
                for v in meta["versus"]:
                    assert v.base in keys, v
        for spec in collective_specs(plan, ["uvloop"], peers=True):
            for v in spec.versus:
                assert v.base in keys, v


def test_peer_goals_are_judged_only_where_their_rows_exist() -> None:
    r = _results()
    assert len(evaluate_goals(r, ["uvloop"])) == len(GOALS)  # no peer rows: no peer goals
    for mode, p50 in (("blocking", 900.0), ("polling", 500.0)):
        r.record(f"a.rtt64.ucxx-{mode}", {"p50_us": p50}, area="a", what="64 B round trip",
                 system=f"ucxx {mode}", proof="UCX endpoints over rc_verbs/rxe0:1 only")
    key = "h.allreduce.2r.65536"
    r.record(f"{key}.aiordma.uvloop", {"call_us": 3000.0}, area="h", what="", system="aiordma",
             loop="uvloop")
    r.declare(f"{key}.ompi-rxe", area="h", what="", system="Open MPI over rxe")  # failed
    by = {g["goal"]: g for g in evaluate_goals(r, ["uvloop"])}
    rtt = by["64 B RTT p50 vs ucxx (best mode)"]
    assert rtt["baseline"] == "a.rtt64.ucxx-polling"  # the better of the two modes
    assert rtt["ratio"] == pytest.approx(700 / 500) and rtt["held"] is False
    assert rtt["best_of"] == ["a.rtt64.ucxx-blocking", "a.rtt64.ucxx-polling"]
    assert by["allreduce 64 KiB, 2 ranks, time vs Open MPI over rxe"]["held"] is None
    assert "allreduce 1 MiB, 2 ranks, time vs Open MPI over rxe" not in by  # no rows
    assert "64 B echo rate, 64 in flight, vs ucxx (best mode)" not in by
    text = format_table(r, header=[], goals=list(by.values()))
    assert "against a.rtt64.ucxx-polling (goal <= 1.0x)" in text
    assert "route: UCX endpoints over rc_verbs/rxe0:1 only" in text
    r.record(f"{key}.ompi-rxe", {"call_us": 2000.0}, area="h", what="", system="Open MPI")
    (g,) = [g for g in evaluate_goals(r, ["uvloop"]) if g["row"].startswith("h.")]
    assert g["ratio"] == pytest.approx(1.5) and g["held"] is False and g["spread"] == [1.5, 1.5]


def test_a_declared_row_keeps_its_place_and_fails_until_measured() -> None:
    r = Results()
    r.declare("h.x.ompi-rxe", area="h", what="x", system="Open MPI over rxe")
    r.record("h.x.aiordma.uvloop", {"call_us": 1.0}, area="h", what="x", system="aiordma")
    assert list(r.rows) == ["h.x.ompi-rxe", "h.x.aiordma.uvloop"]
    assert r.rows["h.x.ompi-rxe"].failed
    r.record("h.x.ompi-rxe", {"call_us": 2.0}, area="h", what="x", system="Open MPI over rxe",
             proof="p")
    assert not r.rows["h.x.ompi-rxe"].failed and r.rows["h.x.ompi-rxe"].proofs == ["p"]
    doc = to_json(r, settings={}, environment={}, goals=[])
    assert doc["rows"][0]["proofs"] == ["p"]


def test_every_goal_names_rows_the_runner_produces() -> None:
    for plan in (Plan(), Plan.quick()):
        keys = {j.key for j in perftest_jobs(plan, "".join(AREAS))}
        for loop in ("asyncio", "uvloop"):
            keys |= {k for k, _, _ in python_specs(plan, "".join(AREAS), PeerPorts(1, 2, 3, 4),
                                                   loop)}
        for g in GOALS:
            for loop in ("asyncio", "uvloop"):
                assert g.row.format(loop=loop) in keys
                assert g.versus.base.format(loop=loop) in keys
        for loop in ("asyncio", "uvloop"):  # and every row's own baselines
            for _, meta, _ in python_specs(plan, "".join(AREAS), PeerPorts(1, 2, 3, 4), loop):
                for v in meta["versus"]:
                    assert v.base in keys, v


def test_python_rows_come_on_each_loop_and_keys_are_unique() -> None:
    plan = Plan.quick()
    specs = [k for loop in ("asyncio", "uvloop")
             for k, _, _ in python_specs(plan, "abcdefg", PeerPorts(1, 2, 3, 4), loop)]
    assert len(specs) == len(set(specs))
    assert {k.rsplit(".", 1)[1] for k in specs} == {"asyncio", "uvloop"}
    assert python_specs(plan, "", PeerPorts(1, 2, 3, 4), "uvloop") == []


def test_areas_select_perftest_jobs() -> None:
    plan = Plan.quick()
    assert [j.key for j in perftest_jobs(plan, "a")] == ["pt.send_lat-e.64", "pt.send_lat.64"]
    assert [j.key for j in perftest_jobs(plan, "d")] == ["pt.ib_read_bw.4194304"]
    both = [j.key for j in perftest_jobs(plan, "bd")]
    assert both.count("pt.ib_read_bw.4194304") == 1  # (d) shares (b)'s run
    assert perftest_jobs(plan, "efg") == []
    lat = perftest_jobs(plan, "a")[0]
    assert lat.args == ["-s", "64", "-n", str(plan.rtt_iters), "-e"]


def test_plans() -> None:
    full, quick = Plan(), Plan.quick()
    assert quick.rtt_iters < full.rtt_iters and quick.bw_bytes < full.bw_bytes
    assert set(quick.bw_sizes) <= set(full.bw_sizes)
    assert {1 << 20, 4 << 20} <= set(quick.bw_sizes)  # the sizes the goals name
    assert full.bw_iters(4 << 20) == 8 and quick.bw_iters(4 << 20) == quick.min_iters
    assert quick.rdv_count == quick.bw_iters(quick.rdv_size)
    for plan in (full, quick):
        assert all(plan.scale_in_flight % n == 0 for n in plan.scale_endpoints)


def test_cli_bench_options() -> None:
    args = build_parser().parse_args(["bench", "--quick", "--only", "a,e", "--repeat", "3",
                                      "--json", "x.json", "--png", ""])
    assert (args.quick, args.only, args.repeat, args.json, args.png) == (True, "a,e", 3,
                                                                         "x.json", "")
    d = build_parser().parse_args(["bench"])
    assert not d.quick and d.repeat == 1 and d.only == "abcdefght" and not d.peers
    assert d.loops == "asyncio,uvloop"


def test_png_is_optional(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = _results()
    path = tmp_path / "b.png"
    why = write_png(r, evaluate_goals(r, ["uvloop"]), str(path))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert why == "matplotlib is not installed" and not path.exists()
    else:
        assert why is None and path.stat().st_size > 0


def test_issue_34s_collective_goals() -> None:
    by = {g.name: g for g in PEER_GOALS}
    for name, limit in (("allgather 4 KiB, 4 ranks", 1.0), ("broadcast 16 MiB, 2 ranks", 0.8),
                        ("allreduce 64 KiB, 2 ranks", 1.0), ("allreduce 1 MiB, 4 ranks", 0.8),
                        ("reduce_scatter 16 MiB, 4 ranks", 1.0), ("alltoall 4 KiB, 2 ranks", 1.0)):
        g = by[f"{name}, time vs Open MPI over rxe"]
        assert (g.op, g.threshold, g.optional) == ("<=", limit, True)
        assert g.versus.base.endswith(".ompi-rxe")
    (batch,) = [g for g in PEER_GOALS if g.row.startswith("h.allreduce_x8_gather.4r.")]
    assert batch.versus.base == "h.allreduce_x8_loop.4r.1048576.aiordma.{loop}"
    assert batch.op == "<=" and 1 / batch.threshold == pytest.approx(1.5, rel=1e-3)
