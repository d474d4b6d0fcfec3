"""``scripts/fault_catalogue.py`` without a device: the catalogue's table regenerated from a
small tree of tests, a page with the hand-written table, and junit files of two runs made by
real pytest runs of that tree (one green, one with a case failing); written into the page and
regenerated from itself, the same table; and this repository's own catalogue names only tests
that exist."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

from ..bounds import hang_guard
from .test_suite_rules import suite

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fault_catalogue.py"
catalogue = runpy.run_path(str(SCRIPT))

PAGE = """# Faults

## The catalogue

Intro.

| fault or bad input | outcome asserted | tests (cases per loop) |
|---|---|---|
| a peer dies | every pending receive fails `BrokenResourceError` within 2 s | `test_death.py::test_pending_fail` (both loops), `test_alone` |
| garbage | refused | `test_garbage.py`; and `test_limits_hold` (no device); `aclose` |

## Leaks

After the table.
"""

DEATH = """import os
import pytest


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_pending_fail(loop):
    assert loop
    took = 0.5
    assert took <= 2.0  # catalogue
    assert os.environ.get("BREAK") != loop


def test_alone():
    with pytest.raises(ZeroDivisionError):
        1 / 0
"""
GARBAGE = "def test_one():\n    assert True\n\n\ndef test_two():\n    assert 1\n"
LIMITS = ("def _hold(x):\n    assert x == [1, 1]  # catalogue\n\n\n"
          "def test_limits_hold():\n    assert [1] * 2\n    _hold([1] * 2)\n")


def tree(tmp_path: Path) -> Path:
    # (device-free tests: in tests/rxe, this project's conftest would want a device)
    return suite(tmp_path, {"tests/unit/test_death.py": DEATH,
                            "tests/unit/test_garbage.py": GARBAGE,
                            "tests/unit/test_limits.py": LIMITS, "docs/faults.md": PAGE})


def run_tree(root: Path, junit: Path, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests",
                    f"--junitxml={junit}"], cwd=root, env=env, capture_output=True,
                   timeout=hang_guard(), check=False)


def regenerate(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--doc",
                           str(root / "docs" / "faults.md"), *args], capture_output=True,
                          text=True, timeout=hang_guard(), check=False)


def test_the_table_is_regenerated_from_the_tests_and_the_runs(tmp_path: Path) -> None:
    root = tree(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "BREAK"}
    run_tree(root, root / "run1.xml", env)
    run_tree(root, root / "run2.xml", {**env, "BREAK": "uvloop"})  # one case fails
    done = regenerate(root, "--run", f"one={root / 'run1.xml'}", "--run",
                      f"two={root / 'run2.xml'}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "| fault | promise | test | assertion behind it | one | two |",
        "|---|---|---|---|---|---|",
        ("| a peer dies | every pending receive fails `BrokenResourceError` within 2 s | "
        "`tests/unit/test_death.py::test_pending_fail` | `assert took <= 2.0` (2 of 3) "
        "| pass | FAIL |"),
        ("|  |  | `tests/unit/test_death.py::test_alone` | "
        "`pytest.raises(ZeroDivisionError)` (no assert) | pass | pass |"),
        "| garbage | refused | `tests/unit/test_garbage.py` | (the file's 2 tests) | pass | pass |",
        ("|  |  | `tests/unit/test_limits.py::test_limits_hold` | "
        "`assert x == [1, 1]` (in `_hold`) | pass | pass |")]
    # written into the page, in the table's place; regenerated from itself: the same
    before = (root / "docs" / "faults.md").read_text()
    assert regenerate(root, "--run", f"one={root / 'run1.xml'}", "--run",
                      f"two={root / 'run2.xml'}", "--write").returncode == 0
    page = (root / "docs" / "faults.md").read_text()
    assert page.split("| fault |")[0] == before.split("| fault or bad input |")[0]
    assert page.endswith("\n## Leaks\n\nAfter the table.\n")
    again = regenerate(root, "--run", f"one={root / 'run1.xml'}", "--run",
                       f"two={root / 'run2.xml'}")
    assert again.stdout == done.stdout


def test_a_test_that_no_file_defines_is_named_and_fails_the_run(tmp_path: Path) -> None:
    root = tree(tmp_path)
    page = root / "docs" / "faults.md"
    page.write_text(PAGE.replace("`test_alone`", "`test_alone`, `test_gone_away`"))
    done = regenerate(root)
    assert done.returncode == 1
    assert "defined by no test file: test_gone_away" in done.stderr
    assert "| `tests/unit/test_death.py::test_alone` |" in done.stdout  # (no run columns)


def test_a_file_takes_the_worst_outcome_of_its_tests() -> None:
    file_outcome = catalogue["file_outcome"]
    run = {"tests/rxe/test_a.py::test_x": "pass", "tests/rxe/test_a.py::test_y": "FAIL"}
    assert file_outcome(run, "tests/rxe/test_a.py") == "FAIL"
    assert file_outcome(run, "tests/rxe/test_b.py") == "-"


def test_this_repositorys_catalogue_names_only_tests_that_exist() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=hang_guard(), check=False)
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()[2:]
    assert len(rows) >= 40 and all(row.count("`tests/") >= 1 for row in rows)
