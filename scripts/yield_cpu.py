"""Make a process, its descendants and all their threads yield the CPU to everything else:
``SCHED_IDLE`` (a thread of another process that wakes takes the CPU from them at once), or nice
19 where that policy cannot be set. `make test` (scripts/test-stages.sh) does this to the device
stage's VM once the two-host stage starts beside it.

    .venv/bin/python scripts/yield_cpu.py PID

Threads created afterwards inherit the policy of the thread that creates them. Exit status 0,
also when PID is gone (nothing to do).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


def parents() -> dict[int, int]:
    """pid -> parent pid, of every process now."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                found[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return found


def tree(root: int) -> set[int]:
    """``root`` and its descendants."""
    parent = parents()
    found, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return found


def yield_cpu(root: int) -> int:
    """Set every thread of ``root``'s tree to SCHED_IDLE (else nice 19); the threads set."""
    done = 0
    for pid in tree(root):
        with contextlib.suppress(OSError):
            for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                try:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                except OSError:
                    try:
                        os.setpriority(os.PRIO_PROCESS, tid, 19)
                    except OSError:
                        continue
                done += 1
    return done


if __name__ == "__main__":
    yield_cpu(int(sys.argv[1]))
