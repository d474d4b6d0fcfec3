"""``aiordma bench --quick`` end to end on the device: every row measured, with positive
figures, in the JSON it writes, area (h)'s collectives included (2 ranks, checked results), on
both loops (on one under ``--loops one``: the ``test_loops`` fixture).
(No speed is asserted: figures are only checked to exist. The peers, ``--peers``, are opt-in
and not run here.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aiordma.bench.collective_rows import collective_specs
from aiordma.bench.peer import PeerPorts
from aiordma.bench.plan import RUN_AREAS, Plan
from aiordma.bench.report import GOALS, TCP_GOALS
from aiordma.bench.runner import perftest_jobs, python_specs

pytestmark = pytest.mark.serial  # perftest pairs and timings are disturbed by tests running beside them


@pytest.mark.timeout(720)  # about 3.5 minutes in a quiet VM; a busy host (other VMs) doubles it
def test_quick_bench_measures_every_row(rdma_device, tmp_path, test_loops) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, "-m", "aiordma", "bench", "--quick", "--here",
                          "--loops", ",".join(test_loops), "--json", str(path), "--png", ""],
                         capture_output=True, text=True, timeout=690, check=False)
    failures = [line.strip() for line in out.stdout.splitlines()
                if "FAILED" in line or "failed and were not counted" in line]
    assert out.returncode == 0, "\n".join(failures) + "\n" + out.stdout[-2000:] + out.stderr[-3000:]
    doc = json.loads(path.read_text())
    plan = Plan.quick()
    expected = {j.key for j in perftest_jobs(plan, RUN_AREAS)}
    for loop in test_loops:
        expected |= {k for k, _, _ in python_specs(plan, RUN_AREAS, PeerPorts(0, 0, 0, 0),
                                                   loop)}
    collectives = {s.key for s in collective_specs(plan, test_loops, peers=False)}
    expected |= collectives
    rows = {r["key"]: r for r in doc["rows"]}
    assert set(rows) == expected
    assert collectives and all(set(rows[k]["metrics"]) == {"call_us", "call_min_us",
                                                          "call_max_us"} for k in collectives)
    for key, row in rows.items():
        assert not row["failed"], (key, row["errors"])
        # perftest pairs on rxe are run again when one fails (the failure is reported);
        # an aiordma row is never retried, so any error there fails the test.
        assert not row["errors"] or row["system"] == "perftest", (key, row["errors"])
        assert row["metrics"], key
        for name, m in row["metrics"].items():
            assert m["median"] > 0 or name == "wakeups_per_op", (key, name, m)
            assert len(m["samples"]) == 1
        for ratio in row["ratios"]:
            assert ratio["ratio"] is not None and ratio["ratio"] > 0, (key, ratio)
    # the default areas' goals, on each loop (the peers' only in --peers runs, the host's with
    # --host-cpu)
    assert len(doc["goals"]) == len(test_loops) * (len(GOALS) + len(TCP_GOALS))
    assert all(g["ratio"] is not None for g in doc["goals"])
    assert "goals (ratios of medians, or a median against a fixed limit, same run):" in out.stdout
