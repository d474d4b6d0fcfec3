"""``scripts/yield_cpu.py`` without a device: a real process tree (a parent, its child, a
grandchild with a second thread) is set to SCHED_IDLE, every thread of it, and a process outside
the tree is left alone; a pid that is gone is no error."""

from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

from ..bounds import STEP

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "yield_cpu.py"
yield_cpu = runpy.run_path(str(SCRIPT))["yield_cpu"]

# a child that starts a grandchild with two threads, then sleeps
PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c",
                  "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start();"
                  " time.sleep(60)"])
time.sleep(60)
"""


def tasks(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def children(pid: int) -> list[int]:
    return [int(c) for t in tasks(pid)
            for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]


def test_every_thread_of_the_tree_is_set_and_nothing_else() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + STEP
        kids: list[int] = []
        while not (kids := children(parent.pid)) or len(tasks(kids[0])) < 2:
            assert time.monotonic() < deadline, "the grandchild never started its thread"
            time.sleep(0.05)
        every = tasks(parent.pid) + tasks(kids[0])
        assert yield_cpu(parent.pid) == len(every)
        for tid in every:
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE, tid
        assert os.sched_getscheduler(outside.pid) == os.SCHED_OTHER
    finally:
        for p in (parent, outside):
            p.kill()
            p.wait(STEP)
        for kid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, 9)


def test_a_pid_that_is_gone_is_no_error() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(STEP)
    assert yield_cpu(gone.pid) == 0
    done = subprocess.run([sys.executable, str(SCRIPT), str(gone.pid)], timeout=STEP,
                          check=False)
    assert done.returncode == 0
