"""CPU time per operation: what one or two processes spent, user and system, over a count of
operations, read from the kernel's accounting (Linux).

This process is read with ``getrusage(RUSAGE_SELF)`` (every thread; microseconds), another
process from ``/proc/<pid>/stat`` (its ``utime`` and ``stime``, every thread, in clock ticks:
10 ms at the usual ``CLK_TCK`` of 100, so a figure needs a few seconds of the other process's
CPU to be good to a per cent). The arithmetic is pure (unit-tested).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

__all__ = ["CpuTimes", "own_times", "parse_proc_stat", "per_op", "process_times"]


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """CPU seconds spent in user space and in the kernel (a reading, or a difference of two)."""

    user: float
    system: float

    @property
    def total(self) -> float:
        return self.user + self.system

    def __add__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user + other.user, self.system + other.system)

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user - other.user, self.system - other.system)


def own_times() -> CpuTimes:
    """This process's CPU time so far, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return CpuTimes(r.ru_utime, r.ru_stime)


def parse_proc_stat(text: str, ticks_per_second: int) -> CpuTimes:
    """A process's CPU time from its ``/proc/<pid>/stat`` line.

    The second field, the command in parentheses, may itself hold spaces and parentheses, so
    the fields are counted from the last ``)``: ``utime`` and ``stime`` are the 14th and 15th
    fields of the line (proc(5)), the 12th and 13th after the command.

    Raises:
        ValueError: not such a line, or ``ticks_per_second`` is not positive.
    """
    if ticks_per_second <= 0:
        raise ValueError(f"ticks per second must be positive, not {ticks_per_second}")
    head, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or "(" not in head or len(fields) < 13:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    utime, stime = int(fields[11]), int(fields[12])
    return CpuTimes(utime / ticks_per_second, stime / ticks_per_second)


def process_times(pid: int) -> CpuTimes:
    """Process ``pid``'s CPU time so far, every thread (clock-tick resolution).

    Raises:
        OSError: no such process (or no ``/proc``).
    """
    with open(f"/proc/{pid}/stat") as f:
        return parse_proc_stat(f.read(), os.sysconf("SC_CLK_TCK"))


def per_op(cpu: CpuTimes, wall: float, ops: int) -> dict[str, float]:
    """The bench's metrics for ``ops`` operations that took ``cpu`` (the processes' CPU time
    over them) and ``wall`` seconds: microseconds of CPU per operation in all, in user space
    and in the kernel, and wall time per operation.

    Raises:
        ValueError: no operations, a negative time (readings taken in the wrong order), or
            no wall time.
    """
    if ops <= 0:
        raise ValueError(f"CPU per operation needs operations, not {ops}")
    if cpu.user < 0 or cpu.system < 0 or wall <= 0:
        raise ValueError(f"a negative or empty time: {cpu}, wall {wall} s")
    scale = 1e6 / ops
    return {"cpu_us_per_op": cpu.total * scale, "user_us_per_op": cpu.user * scale,
            "system_us_per_op": cpu.system * scale, "us_per_op": wall * scale}
