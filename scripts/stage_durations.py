"""Where a test stage's time went, from the junit XML file it wrote (every test's duration):
the sum of the durations, that sum over the workers (the stage's wall time if no worker was
ever idle), the file totals and the slowest tests. Compare the first line's ideal with the
stage's own "in N s" to see the idle share (a long test started last, a worker waiting).

    .venv/bin/python scripts/stage_durations.py build/junit-device.xml [--workers 2] [--top 15]

The ids are the ``nodeid`` property tests/conftest.py gives each test (else class and name),
as in scripts/test_summary.py.
"""

from __future__ import annotations

import argparse
import runpy
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

test_id = runpy.run_path(str(Path(__file__).with_name("test_summary.py")))["test_id"]


def durations(path: Path) -> dict[str, float]:
    """Each test's duration in seconds (setup, call and teardown: junitxml's ``time``)."""
    return {test_id(case): float(case.get("time") or 0.0)
            for case in ET.parse(path).getroot().iter("testcase")}


def report(times: dict[str, float], workers: int, top: int) -> list[str]:
    total = sum(times.values())
    by_file: dict[str, float] = defaultdict(float)
    for tid, t in times.items():
        by_file[tid.split("::", 1)[0]] += t
    lines = [(f"{len(times)} tests, durations summed {total:.1f} s; over {workers} worker(s) "
              f"{total / workers:.1f} s (the stage's wall time if no worker was ever idle)")]
    lines.append("by file:")
    lines += [f"  {t:8.1f} s  {name}" for name, t in
              sorted(by_file.items(), key=lambda kv: -kv[1])[:top]]
    lines.append("slowest tests:")
    lines += [f"  {t:8.1f} s  {tid}" for tid, t in
              sorted(times.items(), key=lambda kv: -kv[1])[:top]]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    print("\n".join(report(durations(args.junit), args.workers, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
