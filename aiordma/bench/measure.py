"""What a benchmark run records: rows of metrics, each metric a list of samples (one per
repeat), summarised as median, min and max; and what a row is compared with.

Pure data and arithmetic: no I/O, no device (unit-tested).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["UNITS", "Metric", "Results", "Row", "Versus", "failure", "percentile"]

Better = Literal["lower", "higher"]

UNITS: dict[str, tuple[str, Better]] = {
    "p50_us": ("us", "lower"),
    "p99_us": ("us", "lower"),
    "t_typical_us": ("us", "lower"),  # perftest: one way (half a round trip)
    "t_p99_us": ("us", "lower"),  # perftest: one way
    "mibs": ("MiB/s", "higher"),
    "msgs_per_s": ("msg/s", "higher"),
    "ops_per_s": ("op/s", "higher"),
    "us_per_op": ("us", "lower"),
    "wakeups_per_op": ("wake-ups/op", "lower"),
    "hit": ("share", "higher"),
    "call_us": ("us", "lower"),  # a collective: the slowest rank's time, median of the calls
    "call_min_us": ("us", "lower"),  # the fastest of those calls
    "call_max_us": ("us", "lower"),  # the slowest of those calls
    "cpu_us_per_op": ("us CPU", "lower"),  # user + system, every process taking part
    "user_us_per_op": ("us CPU", "lower"),
    "system_us_per_op": ("us CPU", "lower"),
    # area (s): many connections to one server (aiordma.bench.connections)
    "setups_per_s": ("conn/s", "higher"),
    "setup_server_cpu_ms": ("ms CPU", "lower"),  # the server's, per set-up of the burst
    "setup_client_cpu_ms": ("ms CPU", "lower"),  # this process's, per set-up of the burst
    "rss_kib_per_conn": ("KiB", "lower"),  # the server's RSS growth per connection
    "pin_kib_per_conn": ("KiB", "lower"),  # the server's pinned memory per connection
    "server_qps": ("QPs", "lower"),  # the kernel's count for the server, N open
    "server_mrs": ("MRs", "lower"),
    "left_after_close": ("objects", "lower"),  # still held beyond the baseline after close
    "echo_ms": ("ms", "lower"),  # one 64 B echo on every connection at once
    "echo_server_cpu_us": ("us CPU", "lower"),  # the server's, per echo of those
    "echo_client_cpu_us": ("us CPU", "lower"),  # this process's, per echo of those
    "echo_packets": ("packets", "lower"),  # RDMA packets sent (both ends), per echo of those
    "rtt_p50_us": ("us", "lower"),  # 64 B round trips on one connection, all N open
    "rss_mib": ("MiB", "lower"),  # the server's RSS growth for all N
    "pin_beyond_pool_kib_per_conn": ("KiB", "lower"),  # pinned less the pool's slots, per conn
    "mrs_per_conn": ("MRs", "lower"),  # the server's MRs over N
    "echo_rate_per_s": ("echo/s", "higher"),  # 64 B echoes pipelined on that one
}
"""Every metric's unit and which way is better."""


def failure(exc: BaseException) -> str:
    """A failed row's error in words: the first error inside a task group's
    ``ExceptionGroup`` (the rows run their workers in one), else the error itself."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (``q`` in 0..1)."""
    if not sorted_values:
        raise ValueError("no values")
    i = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values))))
    return sorted_values[i]


@dataclass(slots=True, kw_only=True)
class Metric:
    """One measured quantity of a row: a sample per repeat."""

    unit: str
    better: Better
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)


@dataclass(frozen=True, slots=True, kw_only=True)
class Versus:
    """A row's ``metric`` against ``base``'s ``base_metric`` times ``factor``.

    ``label`` names the baseline in the table (e.g. "ib_send_lat -e RTT (2 x t_typical)").
    """

    metric: str
    base: str
    base_metric: str
    label: str
    factor: float = 1.0


@dataclass(slots=True, kw_only=True)
class Row:
    """One line of the benchmark: a system (aiordma, perftest, tcp) doing one thing.

    Attributes:
        key: unique, dotted: area, what, system, loop (e.g. ``a.rtt64.aiordma.uvloop``).
        area: the issue's letter, ``a`` to ``g``.
        what: what is measured, in words.
        system: ``aiordma``, ``perftest`` or ``asyncio TCP``.
        loop: ``asyncio`` or ``uvloop`` for Python rows, None for C.
        how: the settings the figures were measured with.
        metrics: name -> :class:`Metric`.
        versus: the comparisons shown next to this row.
        errors: one message per failed run (a perftest pair is tried again; a row with no
            samples failed outright).
        outputs: what an external tool printed, one per repeat (perftest's report).
        proofs: for a peer's row, what its own logs say carried the data (e.g. "UCX
            endpoints over rc_verbs/rxe0:1 only"); across the wire, what the link's
            counters saw; one per repeat.
        loads: the 1-minute load average of the machine running the VMs (or this one) as
            each repeat of the row started, where known.
    """

    key: str
    area: str
    what: str
    system: str
    loop: str | None
    how: str
    metrics: dict[str, Metric] = field(default_factory=dict)
    versus: list[Versus] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    proofs: list[str] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return not any(m.samples for m in self.metrics.values())


class Results:
    """Rows in the order first seen; repeats add samples to the same row."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def _row(self, key: str, *, area: str, what: str, system: str, loop: str | None,
             how: str, versus: list[Versus] | None) -> Row:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = Row(key=key, area=area, what=what, system=system,
                                       loop=loop, how=how, versus=list(versus or []))
        return row

    def declare(self, key: str, *, area: str, what: str, system: str,
                loop: str | None = None, how: str = "",
                versus: list[Versus] | None = None) -> Row:
        """Make row ``key`` now, without figures, so that the table lists rows in this order
        (a declared row never measured shows as failed)."""
        return self._row(key, area=area, what=what, system=system, loop=loop, how=how,
                         versus=versus)

    def record(self, key: str, values: dict[str, float], *, area: str, what: str,
               system: str, loop: str | None = None, how: str = "",
               versus: list[Versus] | None = None, output: str | None = None,
               proof: str | None = None, load: float | None = None) -> Row:
        """Add one repeat's ``values`` (metric name, from :data:`UNITS`, -> value) to row
        ``key``; ``output``: what the tool printed, kept for the JSON; ``proof``: what
        carried the data, by the peer's own account (or the link's counters); ``load``: the
        machine's load average as the row started."""
        row = self._row(key, area=area, what=what, system=system, loop=loop, how=how,
                        versus=versus)
        if load is not None:
            row.loads.append(load)
        if output is not None:
            row.outputs.append(output)
        if proof is not None:
            row.proofs.append(proof)
        for name, value in values.items():
            unit, better = UNITS[name]
            m = row.metrics.setdefault(name, Metric(unit=unit, better=better))
            m.samples.append(float(value))
        return row

    def fail(self, key: str, error: str, *, area: str, what: str, system: str,
             loop: str | None = None, how: str = "",
             versus: list[Versus] | None = None, output: str | None = None,
             load: float | None = None) -> Row:
        """Note that one repeat of row ``key`` failed with ``error``."""
        row = self._row(key, area=area, what=what, system=system, loop=loop, how=how,
                        versus=versus)
        row.errors.append(error)
        if load is not None:
            row.loads.append(load)
        if output is not None:
            row.outputs.append(output)
        return row

    def value(self, key: str, metric: str) -> float | None:
        """The median of ``key``'s ``metric``, or None if it was not measured."""
        row = self.rows.get(key)
        m = row.metrics.get(metric) if row else None
        return m.median if m and m.samples else None

    def ratio(self, key: str, v: Versus) -> float | None:
        """``key``'s metric over the baseline's (times its factor), from medians."""
        mine, base = self.value(key, v.metric), self.value(v.base, v.base_metric)
        if mine is None or base is None or base * v.factor == 0:
            return None
        return mine / (base * v.factor)

    def ratio_range(self, key: str, v: Versus) -> tuple[float, float] | None:
        """The smallest and largest of the per-repeat ratios (repeat ``i`` of ``key`` over
        repeat ``i`` of the baseline), or None unless both have a sample in every repeat."""
        row, base_row = self.rows.get(key), self.rows.get(v.base)
        mine = row.metrics.get(v.metric) if row else None
        base = base_row.metrics.get(v.base_metric) if base_row else None
        if (mine is None or base is None or not mine.samples
                or len(mine.samples) != len(base.samples)):
            return None
        if any(b * v.factor == 0 for b in base.samples):
            return None
        each = [m / (b * v.factor) for m, b in zip(mine.samples, base.samples, strict=True)]
        return min(each), max(each)
