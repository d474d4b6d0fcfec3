"""``--start-when FILE``: a pytest run that holds its tests until FILE exists, but for those
marked ``timer_bound``, which run first, at once (``tests/conftest.py``).

``make test`` boots the two-host pair while the device stage's parallel part still runs: the
pair's boot and pytest's start and collection on host 1 (one emulated vCPU) are over, and its
tests that spend their time on timers (netem's, rxe's retransmissions, keepalives) have run, by
the time the other tests may start; scripts/test-stages.sh then creates the file. The wait is
outside every test's own time and timeout. The guests see the repository
over 9p with ``cache=loose``, where a name looked up before it existed can stay missing: so the
file is looked for in a listing of its directory, which asks the host each time.

The wait is bounded (:data:`BOUND`, against a parallel part of 6-14 minutes); past it the run
stops with an error that names the file and the bound, as the harness's other waits do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: Seconds the run waits for the file at most.
BOUND = 2 * 3600.0
#: Seconds between two looks.
POLL = 1.0


def appeared(path: str) -> bool:
    """Whether ``path`` is in a fresh listing of its directory."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        return name in os.listdir(directory)
    except FileNotFoundError:
        return False


def wait_for(path: str, bound: float = BOUND, *, poll: float = POLL,
             clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until ``path`` exists; return the seconds waited.

    Raises:
        TimeoutError: not within ``bound`` seconds; the message names the file and the bound.
    """
    t0 = clock()
    while not appeared(path):
        if clock() - t0 >= bound:
            raise TimeoutError(f"--start-when: {path} did not appear within {bound:.0f} s "
                               f"(it marks the end of the device stage's parallel part: "
                               f"scripts/test-stages.sh)")
        sleep(poll)
    return clock() - t0
