"""Area (i), ``aiordma bench --host-cpu``, without a device: the CPU arithmetic, the clocks it
reads, the rows and goals it makes, and a tiny run of it for real (channel pairs, asyncio TCP
over loopback, a server process)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from aiordma.bench import host_rows
from aiordma.bench.cputime import CpuTimes, own_times, parse_proc_stat, per_op, process_times
from aiordma.bench.host_rows import host_specs, run_host_rows
from aiordma.bench.measure import UNITS, Results
from aiordma.bench.plan import Plan
from aiordma.bench.report import HOST_GOALS, evaluate_goals, format_table
from aiordma.cli.command import main

# /proc/<pid>/stat of a process whose command holds a space and a parenthesis (proc(5));
# utime 250 and stime 75 ticks are the 14th and 15th fields.
STAT = ("4242 (py (x) y) S 1 4242 4242 0 -1 4194560 5000 0 0 0 250 75 0 0 20 0 3 0 "
        "12345 200000000 9000 18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 1 0 0")


def test_cpu_times_add_and_subtract() -> None:
    a, b = CpuTimes(1.5, 0.25), CpuTimes(0.5, 0.125)
    assert a - b == CpuTimes(1.0, 0.125) and a + b == CpuTimes(2.0, 0.375)
    assert (a - b).total == pytest.approx(1.125)


def test_proc_stat_is_read_past_the_command() -> None:
    assert parse_proc_stat(STAT, 100) == CpuTimes(2.5, 0.75)
    assert parse_proc_stat(STAT, 250) == CpuTimes(1.0, 0.3)
    for bad in ("", "4242 no parentheses 1 2 3", "4242 (py) S 1 2"):
        with pytest.raises(ValueError, match="not a /proc"):
            parse_proc_stat(bad, 100)
    with pytest.raises(ValueError, match="positive"):
        parse_proc_stat(STAT, 0)


def test_per_op_arithmetic() -> None:
    out = per_op(CpuTimes(0.03, 0.01), 0.08, 2000)
    assert out == pytest.approx({"cpu_us_per_op": 20.0, "user_us_per_op": 15.0,
                                 "system_us_per_op": 5.0, "us_per_op": 40.0})
    assert set(out) <= set(UNITS)
    with pytest.raises(ValueError, match="needs operations"):
        per_op(CpuTimes(1.0, 0.0), 1.0, 0)
    with pytest.raises(ValueError, match="negative"):
        per_op(CpuTimes(1.0, 0.0) - CpuTimes(2.0, 0.0), 1.0, 10)
    with pytest.raises(ValueError, match="empty"):
        per_op(CpuTimes(1.0, 0.0), 0.0, 10)


def test_both_clocks_see_the_cpu_this_process_burns() -> None:
    own0, proc0 = own_times(), process_times(os.getpid())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:
        pass
    own, proc = own_times() - own0, process_times(os.getpid()) - proc0
    assert own.total == pytest.approx(0.3, abs=0.05)
    assert proc.total == pytest.approx(own.total, abs=0.05)  # 10 ms ticks
    with pytest.raises(OSError):
        process_times(2**22 + 12345)  # above pid_max's ceiling: no such process


def test_rows_compare_with_both_tcp_baselines_and_goals_name_real_rows() -> None:
    plan = Plan()
    keys: set[str] = set()
    for loop in ("asyncio", "uvloop"):
        specs = host_specs(plan, loop, server=({"rpc": 1, "frames": 2}, 3))
        mine = [k for k, _, _ in specs]
        assert len(mine) == len(set(mine)) == 3 * (1 + len(plan.cpu_in_flight))
        keys |= set(mine)
        for key, meta, _ in specs:
            assert meta["area"] == "i" and meta["loop"] == loop
            bases = {v.base for v in meta["versus"]}
            if meta["system"] == "aiordma":
                assert bases == {key.replace(".aiordma.", ".tcp."),
                                 key.replace(".aiordma.", ".tcp2.")}
            else:
                assert bases == set()
        # without a server process, the two-process rows are left out
        alone = host_specs(plan, loop)
        assert {k.split(".")[2] for k, _, _ in alone} == {"aiordma", "tcp"}
        assert all(v.base in {k for k, _, _ in alone} for _, m, _ in alone
                   for v in m["versus"] if ".tcp." in v.base)
    for g in HOST_GOALS:
        for loop in ("asyncio", "uvloop"):
            assert g.row.format(loop=loop) in keys and g.versus.base.format(loop=loop) in keys


def test_a_device_run_refuses_area_i(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--only", "ai", "--json", "", "--png", ""]) == 2
    assert "--host-cpu" in capsys.readouterr().err
    assert main(["bench", "--host-cpu", "--peers", "--json", "", "--png", ""]) == 2
    assert "--peers needs one" in capsys.readouterr().err


TINY = Plan(cpu_ops=40, cpu_warmup=4, cpu_in_flight=(1, 4), rpc_payload=64, row_timeout=60.0)


def test_a_tiny_run_measures_every_row_for_real() -> None:
    results = Results()
    run_host_rows(TINY, loops=["asyncio", "uvloop"], repeat=1, results=results)
    assert len(results.rows) == 2 * 3 * 3
    for row in results.rows.values():
        assert not row.failed, (row.key, row.errors)
        m = {name: metric.median for name, metric in row.metrics.items()}
        assert m["cpu_us_per_op"] == pytest.approx(m["user_us_per_op"] + m["system_us_per_op"])
        assert m["us_per_op"] > 0 and m["cpu_us_per_op"] >= 0
    table = format_table(results, header=[], goals=evaluate_goals(results, ["uvloop"],
                                                                  HOST_GOALS))
    assert "(i) CPU per operation on this host" in table
    assert "x asyncio TCP CPU" in table and "x asyncio TCP, 2 processes CPU" in table
    assert "host CPU per RPC call, 1 in flight" in table
    assert "64 in flight" not in table  # (not in this plan: its goal is not judged)


def test_the_command_runs_here_and_writes_json(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_rows.Plan, "quick", classmethod(lambda cls: TINY))
    path = tmp_path / "host.json"
    assert main(["bench", "--host-cpu", "--quick", "--loops", "asyncio", "--json",
                 str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["settings"]["host_cpu"] is True and doc["settings"]["loops"] == ["asyncio"]
    assert len(doc["environment"]["loadavg_start"]) == 3
    assert {r["key"] for r in doc["rows"]} == {
        f"i.{name}.{who}.asyncio" for name in ("rtt64", "rpc1", "rpc4")
        for who in ("aiordma", "tcp", "tcp2")}
    assert all(not r["failed"] for r in doc["rows"])
