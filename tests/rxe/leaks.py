"""Leak checks for the device tests: what a process holds, before and after.

Three counts, taken for this process and for any server process a test talks to:

* the kernel's: its ``ctx``, ``pd``, ``cq``, ``qp`` and ``mr`` objects, as ``rdma resource
  show`` lists them (:mod:`tests.restrack`);
* the process's open file descriptors (``/proc/<pid>/fd``);
* for this process, aiordma's own bookkeeping too (:func:`aiordma.lowlevel.resource_counts`:
  contexts, PDs, completion channels, CQs, QPs, MRs, endpoints, fd readers).

After the work, none may be above where it was (fewer is not this work's leak: a socket of an
earlier connection still closing when the baseline was taken, or what a test that failed before
left behind, collected meanwhile). Both counts are needed: aiordma's
bookkeeping can say "closed" while the kernel still holds an object (a close that failed
half-way), and the kernel can have destroyed an object that aiordma still counts (pyverbs
destroying it behind aiordma's back: a CQ's close took its queue pairs with it, until the
reactor closed them first). Where the counts are not meant to return (a device loss),
:func:`disagreement` checks that they moved together.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from aiordma.lowlevel import resource_counts

from ..restrack import KINDS, kernel_counts

SETTLE = 20.0  # bound on the counts coming back once the work is closed: a hang guard


@dataclass(frozen=True, slots=True)
class Held:
    """What one process held at one moment."""

    pid: int
    kernel: dict[str, int]
    fds: tuple[str, ...]  # what each open fd is (its /proc link), sorted
    own: dict[str, int] | None  # aiordma's counts: this process only

    def __str__(self) -> str:
        own = f"; aiordma's {self.own}" if self.own is not None else ""
        return f"pid {self.pid}: kernel's {self.kernel}, {len(self.fds)} fds{own}"


def _fds(pid: int) -> tuple[str, ...]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    return tuple(sorted(out))


def held(*pids: int) -> list[Held]:
    """A snapshot of each pid (this process's includes aiordma's counts)."""
    me = os.getpid()
    wanted = list(pids) or [me]
    kernel = kernel_counts(wanted)
    return [Held(pid, kernel[pid], _fds(pid), resource_counts() if pid == me else None)
            for pid in wanted]


def differences(before: Held, now: Held) -> list[str]:
    """What ``now`` holds beyond ``before`` (empty: back to the baseline, or below it)."""
    out = [f"kernel {k}: {now.kernel[k]}, {v} before" for k, v in before.kernel.items()
           if now.kernel[k] > v]
    if len(now.fds) > len(before.fds):
        extra = sorted((Counter(now.fds) - Counter(before.fds)).elements())
        out.append(f"{len(now.fds)} fds open, {len(before.fds)} before (new: {extra})")
    if before.own is not None and now.own is not None:
        out += [f"aiordma {k}: {now.own[k]}, {v} before" for k, v in before.own.items()
                if now.own[k] > v]
    return out


def disagreement(before: Held, now: Held) -> list[str]:
    """Where the kernel's counts of this process moved differently from aiordma's between
    ``before`` and ``now`` (empty: they moved together). Used where the counts are not meant
    to return, e.g. across a device loss (the lost device's context goes)."""
    if before.own is None or now.own is None:
        return []
    return [f"the kernel's {k} went {before.kernel[k]} -> {now.kernel[k]}, aiordma's {own} "
            f"{before.own[own]} -> {now.own[own]}" for k, own in KINDS.items()
            if now.kernel[k] - before.kernel[k] != now.own[own] - before.own[own]]


def _problems(before: Iterable[Held]) -> tuple[list[Held], list[str]]:
    base = list(before)
    now = held(*(b.pid for b in base))
    problems = [f"pid {b.pid}: {d}" for b, n in zip(base, now, strict=True)
                for d in differences(b, n)]
    return now, problems


def wait_back(before: Iterable[Held], timeout: float = SETTLE) -> list[Held]:
    """Wait (bounded) until every process in ``before`` is back to its baseline (the kernel's
    counts, the fds and, for this process, aiordma's counts); AssertionError naming what is
    not, else the final snapshots. For code outside an event loop."""
    base = list(before)
    deadline = time.monotonic() + timeout
    while True:
        now, problems = _problems(base)
        if not problems:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"not back to the baseline within {timeout} s: {problems}")
        time.sleep(0.1)


async def back(before: Iterable[Held], timeout: float = SETTLE) -> list[Held]:
    """:func:`wait_back` from inside an event loop (the loop keeps running: closes finish)."""
    base = list(before)
    deadline = time.monotonic() + timeout
    while True:
        now, problems = await asyncio.to_thread(_problems, base)
        if not problems:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"not back to the baseline within {timeout} s: {problems}")
        await asyncio.sleep(0.1)


async def kernel_back(pid: int, before: dict[str, int], timeout: float = SETTLE
                      ) -> dict[str, int]:
    """Wait (bounded) until the kernel lists no more objects of ``pid`` of each kind in
    ``before`` than ``before`` says (fewer is not this work's leak: see the module's
    documentation); AssertionError naming both counts after ``timeout``. Returns the last."""
    deadline = time.monotonic() + timeout
    while True:
        now = (await asyncio.to_thread(kernel_counts, [pid], tuple(before)))[pid]
        if all(now[kind] <= count for kind, count in before.items()):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"the kernel lists {now} of pid {pid} {timeout} s on, more "
                                 f"than {before} before the work")
        await asyncio.sleep(0.1)


async def snapshot(*pids: int) -> list[Held]:
    """:func:`held` from inside an event loop."""
    return await asyncio.to_thread(held, *pids)


async def released(pid: int, timeout: float = SETTLE) -> dict[str, int]:
    """Wait (bounded) until the kernel lists no verbs object of ``pid`` (a process that died:
    the kernel releases what it held once its files are closed); AssertionError if it still
    does after ``timeout``. Returns the last counts (all 0)."""
    return await kernel_back(pid, dict.fromkeys(KINDS, 0), timeout)


def wait_released(pid: int, timeout: float = SETTLE) -> dict[str, int]:
    """:func:`released` for code outside an event loop."""
    deadline = time.monotonic() + timeout
    while True:
        counts = kernel_counts([pid])[pid]
        if not any(counts.values()):
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"the kernel still holds {counts} of pid {pid} {timeout} s on")
        time.sleep(0.1)
