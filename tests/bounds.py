"""The bounds the tests put on waits.

:data:`STEP` bounds a single await that depends on a peer, a device or another process:
generous, because Python runs several times slower under the VM's software emulation. A bound,
never a rate: a test that hits it has hung, not been slow.

On a busy machine everything takes longer, by about the load per CPU (at a 1-minute load
average of 17 on 2 CPUs, a step of the device suite took up to ~10x its quiet time). So a wait
that must not fail on a slow machine scales with the load, the way the harness's boot bound
does, through the same function (``harness.boot.load_bound``): :func:`load_factor` is
1 + load / CPUs, and :func:`hang_guard` is a bound times it. In a VM of the harness the load is
the machine's that runs it (``aiordma.bench.hostload.host_load``), over the guest's CPUs (a
pair's guests have one each: the factor is larger there, so more generous). Timed promises of
the fault catalogue (docs/faults.md) keep their wall-clock bound, multiplied by this factor
when the test asserts it; every other test asserts invariants, not times.
"""

from __future__ import annotations

from aiordma.bench.hostload import host_load
from harness.boot import BootBound, load_bound

STEP = 60.0

#: Seconds: the fault catalogue's promise (docs/faults.md) for a survivor noticing a dead,
#: aborted or closed peer, on a quiet machine: its pending operations fail typed within it.
#: Measured 55-151 ms quiet; asserted as :func:`prompt` (x the load factor): at host load 9 a
#: stream failed after 2.14 s, at 8-11 a killed rank's survivors after 2.4 and 5.6 s, each
#: with the promised error.
PROMPT = 2.0


def _load() -> float | None:
    """The machine's 1-minute load average (None: ``os.getloadavg()`` here)."""
    loads = host_load()
    return loads[0] if loads else None


def scaled(base: float) -> BootBound:
    """``base`` seconds x (1 + the machine's load / CPUs), now; ``describe()`` says so."""
    return load_bound(base, load=_load())


def load_factor() -> float:
    """1 + the machine's load / CPUs, now (1.0 on an idle machine)."""
    return scaled(1.0).seconds


def prompt() -> float:
    """:data:`PROMPT` x the load factor now: the bound a timed promise is asserted with."""
    return PROMPT * load_factor()


def hang_guard(base: float = STEP) -> float:
    """A hang guard of ``base`` seconds (default :data:`STEP`) scaled by the load now."""
    return scaled(base).seconds
