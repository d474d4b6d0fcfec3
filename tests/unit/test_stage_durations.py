"""scripts/stage_durations.py: a stage's summed durations, per worker, by file, slowest."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stage_durations.py"
script = runpy.run_path(str(SCRIPT))

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3" time="9.0">
<testcase classname="tests.rxe.test_a" name="test_one" time="4.5">
  <properties><property name="nodeid" value="tests/rxe/test_a.py::test_one[uvloop]"/></properties>
</testcase>
<testcase classname="tests.rxe.test_a" name="test_two" time="1.5"/>
<testcase classname="tests.rxe.test_b" name="test_three" time="6.0"/>
</testsuite></testsuites>
"""


def test_sums_by_worker_and_by_file_slowest_first(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "junit-device.xml"
    path.write_text(JUNIT)
    assert script["main"]([str(path), "--workers", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("3 tests, durations summed 12.0 s; over 2 worker(s) 6.0 s")
    assert out[1:4] == ["by file:", "       6.0 s  tests/rxe/test_a.py",
                        "       6.0 s  tests/rxe/test_b.py"]
    assert out[4:] == ["slowest tests:", "       6.0 s  tests/rxe/test_b.py::test_three",
                       "       4.5 s  tests/rxe/test_a.py::test_one[uvloop]"]
