"""Every failure is named, even when pytest's own report breaks (issue 36): each pytest run
here is a real one, on a small tree with this project's ``tests/conftest.py``, writing a junit
XML file that ``scripts/test_summary.py`` (the last thing ``make test`` prints) reads.

The crash seen at load 13-21: CPython 3.11.7's ``SystemError: AST constructor recursion depth
mismatch`` while pytest formatted a failure; the xdist worker died with an INTERNALERROR and
six failures went unnamed. Its trigger (python/cpython#106905, fixed in 3.11.8): an
``ast.parse()`` run by a finalizer during another ``ast.parse()``'s AST construction, as when
the garbage collector collects an asyncio future whose exception nobody retrieved while pytest
parses the test's source (the future logs its exception; 3.11's traceback module parses lines
for its carets). ``GARBAGE_THAT_PARSES`` below makes that happen at every collection.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from .test_suite_rules import pytest_run, suite

SUMMARY = Path(__file__).resolve().parents[2] / "scripts" / "test_summary.py"
summary = runpy.run_path(str(SUMMARY))

#: Affected interpreters: 3.11.0-3.11.7 (this project's venv runs 3.11.7).
AFFECTED = (3, 11) <= sys.version_info[:3] < (3, 11, 8)

GARBAGE_THAT_PARSES = '''
import ast
import gc


class Reparses:
    """Garbage in a cycle whose finalizer parses a line and leaves more of itself."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        ast.parse("x = [(1, 2)]")
        Reparses()


def test_fails_while_garbage_parses():
    gc.set_threshold(10)
    Reparses()
    assert 1 + 1 == 3


def test_passes():
    pass
'''

CRASHES_WHILE_REPORTED = '''
import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and "crash" in item.name:
        raise SystemError("AST constructor recursion depth mismatch (a stand-in)")
    return report
'''
THREE = ("def test_fails_first():\n    assert 0\n\n\ndef test_passes():\n    pass\n\n\n"
         "def test_crash_while_reported():\n    assert 0\n")


def run_summary(*paths: Path, status: int = 0) -> tuple[int, list[str]]:
    stages = [summary["read"](p) for p in paths]
    lines = summary["report"](stages, status)
    return (0 if all(s.green for s in stages) and not status else 1), lines


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_failure_whose_report_meets_the_ast_bug_is_named(tmp_path: Path, workers: list[str]
                                                           ) -> None:
    root = suite(tmp_path, {"tests/unit/test_garbage.py": GARBAGE_THAT_PARSES})
    junit = root / "junit-unit.xml"
    rc, out = pytest_run(root, f"--junitxml={junit}", *workers)
    assert rc == 1, out  # (tests failed; not 3, an INTERNALERROR)
    assert "INTERNALERROR" not in out, out
    assert "FAILED tests/unit/test_garbage.py::test_fails_while_garbage_parses" in out, out
    code, lines = run_summary(junit)
    assert code == 1
    assert lines == [f"[summary] unit: 1 passed, 1 failed, 0 errors, 0 skipped ({junit})",
                     ("[summary]   FAILED tests/unit/test_garbage.py::"
                     "test_fails_while_garbage_parses"),
                     ("[summary] NOT GREEN: 1 failed or errored, 0 unfinished, 0 stage(s) "
                     "without a report, 0 INTERNALERROR(s)")]


def test_without_the_projects_conftest_the_same_tree_crashes_pytest(tmp_path: Path) -> None:
    """The control: pytest alone, on the same test, on an affected interpreter."""
    if not AFFECTED:
        pytest.skip(f"CPython {sys.version.split()[0]} has the fix of python/cpython#106905")
    root = suite(tmp_path, {"tests/unit/test_garbage.py": GARBAGE_THAT_PARSES})
    (root / "tests" / "conftest.py").unlink()
    junit = root / "junit.xml"
    rc, out = pytest_run(root, f"--junitxml={junit}")
    assert rc == 3, out  # INTERNALERROR
    assert "SystemError: AST constructor recursion depth mismatch" in out, out
    assert "FAILED tests/unit/test_garbage.py" not in out  # pytest named nothing


# (xdist: the three tests on one worker, in order, so that which of them is unfinished when
# the worker dies does not depend on timing: with the tests spread over both workers, a loaded
# CI host once had the other worker still running test_passes then, unfinished too)
@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]],
                         ids=["serial", "xdist"])
def test_a_test_whose_report_crashes_pytest_is_named_with_the_cause(
        tmp_path: Path, workers: list[str]) -> None:
    root = suite(tmp_path, {"tests/unit/conftest.py": CRASHES_WHILE_REPORTED,
                            "tests/unit/test_three.py": THREE})
    junit = root / "build" / "junit-device.xml"
    rc, out = pytest_run(root, f"--junitxml={junit}", *workers)
    assert "INTERNALERROR" in out, out
    if not workers:  # (xdist's controller goes on after a worker's INTERNALERROR: exit status 1)
        assert rc == 3 and "short test summary" not in out, out  # pytest printed no summary
    assert rc != 0, out
    code, lines = run_summary(junit, root / "build" / "junit-two-hosts.xml", status=rc)
    assert code == 1
    assert lines[1:5] == [
        "[summary]   FAILED tests/unit/test_three.py::test_fails_first",
        ("[summary]   pytest INTERNALERROR: SystemError: AST constructor recursion depth mismatch"
        " (a stand-in)"),
        ("[summary]   UNFINISHED tests/unit/test_three.py::test_crash_while_reported (started, "
        "never reported: the process running or reporting it died)"),
        (f"[summary] two-hosts: NO REPORT ({root / 'build' / 'junit-two-hosts.xml'} absent: the "
        "stage did not run, or died before pytest wrote it)")], lines
    assert lines[-1].startswith("[summary] NOT GREEN: 1 failed or errored, 1 unfinished, "
                                "1 stage(s) without a report, 1 INTERNALERROR(s)")


def test_a_green_run_says_so_and_require_rdma_is_shown(tmp_path: Path) -> None:
    root = suite(tmp_path, {"tests/unit/test_u.py": "def test_u():\n    pass\n"})
    junit = root / "junit-unit.xml"
    rc, out = pytest_run(root, f"--junitxml={junit}")
    assert rc == 0, out
    code, lines = run_summary(junit)
    assert (code, lines[-1]) == (0, "[summary] all 1 stages green")
    assert run_summary(junit, status=2)[1][-1].startswith("[summary] NOT GREEN: exit status 2")
    # no device test ran: --require-rdma's verdict is no test's, and is kept beside the file
    rc, out = pytest_run(root, f"--junitxml={junit}", "--require-rdma")
    assert rc == 1, out
    code, lines = run_summary(junit)
    assert code == 1
    assert "[summary]   PROBLEM --require-rdma: no device test ran" in lines


def test_ids_fall_back_to_class_and_name_and_an_unreadable_file_is_no_report(
        tmp_path: Path) -> None:
    xml = tmp_path / "junit-old.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.rxe.test_x" '
                   'name="test_y[uvloop]"><failure message="x"/></testcase>'
                   '<testcase classname="tests.rxe.test_x" name="test_z"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    half = tmp_path / "junit-half.xml"
    half.write_text("<testsuites><testsuite><testc")
    code, lines = run_summary(xml, half)
    assert code == 1
    assert lines[:3] == [
        f"[summary] old: 0 passed, 1 failed, 0 errors, 1 skipped ({xml})",
        "[summary]   FAILED tests/rxe/test_x.py::test_y[uvloop]",
        (f"[summary] half: NO REPORT ({half} absent: the stage did not run, or died before "
        "pytest wrote it)")]


def test_the_makefile_prints_the_summary_last_over_every_stage() -> None:
    """``make test``'s recipe ends in the summary of the four stages' files, whatever their
    status (.ci/run relies on the summary being the last thing printed)."""
    root = Path(__file__).resolve().parents[2]
    make = (root / "Makefile").read_text()
    recipe = make[make.index("\ntest: setup"):].split("\n\n")[0]
    assert recipe.rstrip().endswith(
        "rc=$$?; $(PY) scripts/test_summary.py --status $$rc $(JUNIT); exit $$rc")
    stages = {"scripts/test-stages.sh": ["build/junit-unit.xml"],
              "scripts/device-tests.sh": ["build/junit-device.xml",
                                          "build/junit-device-serial.xml"],
              "scripts/two-host-tests.sh": ["build/junit-two-hosts.xml"]}
    for script, files in stages.items():
        text = (root / script).read_text()
        for name in files:
            assert f"--junitxml={name}" in text, script
            assert name in make
