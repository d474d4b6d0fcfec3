"""``--start-when FILE`` (tests/start_gate.py, tests/conftest.py), without a device: the wait
ends when the file is listed, gives up at its bound naming the file, and a real pytest run
holds its tests until the file appears."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .. import start_gate
from .test_suite_rules import suite

RECORDS_ITS_START = """
import time

import pytest

def test_records_when_it_ran():
    with open({out!r}, "w") as f:
        f.write(repr(time.time()))

@pytest.mark.timer_bound
def test_that_need_not_wait():
    with open({early!r}, "w") as f:
        f.write(repr(time.time()))
"""


def test_the_wait_ends_once_the_file_is_listed(tmp_path: Path) -> None:
    go = tmp_path / "go"
    assert not start_gate.appeared(str(go))
    timer = threading.Timer(0.3, go.touch)
    timer.start()
    try:
        waited = start_gate.wait_for(str(go), bound=30, poll=0.05)
    finally:
        timer.cancel()
    assert go.exists() and 0.2 < waited < 30


def test_the_wait_gives_up_at_its_bound_naming_the_file(tmp_path: Path) -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(TimeoutError, match=r"never-made did not appear within 90 s"):
        start_gate.wait_for(str(tmp_path / "never-made"), bound=90, poll=10,
                            clock=lambda: now[0], sleep=sleep)
    assert now[0] == 90  # it looked until the bound, not past it


def test_a_missing_directory_is_not_an_error(tmp_path: Path) -> None:
    assert not start_gate.appeared(str(tmp_path / "no-such-dir" / "go"))


def test_a_run_holds_its_tests_until_the_file_appears(tmp_path: Path) -> None:
    """The timer_bound test, second in the file, runs first, at once; the other waits."""
    out, early = tmp_path / "ran-at", tmp_path / "early-ran-at"
    go = tmp_path / "go"
    (tmp_path / "tree").mkdir()
    root = suite(tmp_path / "tree", {
        "tests/unit/test_u.py": RECORDS_ITS_START.format(out=str(out), early=str(early))})
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                             "-s", "tests", "--start-when", str(go)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2.0)  # (a test that ran already would have written its file by now, too)
        made = time.time()
        go.touch()
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert float(early.read_text()) < made <= float(out.read_text()), output
    assert f"--start-when: {go} appeared after" in output, output
