"""Which event loop a device test runs on when each runs on one (``--loops one``).

Every async test is written for both loops, the default asyncio loop and uvloop: pytest-asyncio
makes one item per loop (``test_x[asyncio]``, ``test_x[uvloop]``), and the tests that run
their own loop take a ``loop`` parameter of the same two names. Under the VM's software
emulation a device test costs seconds, and most of the suite's device time is spent proving
the same behaviour twice, once per loop. ``--loops one`` keeps one of the two items of each
device test, chosen by a hash of the test's id without the loop and a seed (``make test``
passes the commit's hash; a case with an item on one loop only keeps it), so that:

* the choice is stable: the same commit and seed pick the same loop for a test, on CI and on a
  developer's machine;
* about half of the tests run on each loop in every run, and a test's loop changes with the
  commit, so over a few commits each test runs on both;
* the tests whose subject is the loop integration itself, marked ``both_loops`` (the
  endpoint's and the completion channel's contract, the loopback, the compiled fast path, the
  immediates, peer death), keep both in every run.

``--loops both`` (pytest's default here) runs every test on both loops. Pure logic, no
pytest: ``tests/unit/test_suite_rules.py`` runs pytest on trees that use it.
"""

from __future__ import annotations

import zlib

__all__ = ["LOOP_NAMES", "kept_loop", "loop_and_base"]

LOOP_NAMES = ("asyncio", "uvloop")


def loop_and_base(nodeid: str, loop: str | None) -> tuple[str, str] | None:
    """``(loop, the node id without it)`` for a test item that runs on ``loop``, or None for
    one that runs on no named loop (``loop`` None or not one of :data:`LOOP_NAMES`)."""
    if loop not in LOOP_NAMES:
        return None
    head, bracket, ids = nodeid.partition("[")
    tokens = ids[:-1].split("-") if bracket else []
    if loop not in tokens:
        return None
    tokens.remove(loop)
    return loop, head + (f"[{'-'.join(tokens)}]" if tokens else "")


def kept_loop(base: str, seed: str) -> str:
    """The loop that the test ``base`` (its id without the loop) keeps under ``seed``."""
    return LOOP_NAMES[zlib.crc32(f"{seed}\0{base}".encode()) % len(LOOP_NAMES)]
