"""Per-method counters of an RPC server: what :meth:`~aiordma.rpc.RpcServer.stats` returns,
the built-in ``aiordma.stats`` method answers and ``aiordma stats HOST:PORT`` prints.

The server counts as it goes, with a few integer increments and one clock read per call (the
arrival time is read once per received message); percentiles are computed only when asked,
over the latencies of a method's last :data:`WINDOW` answers.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

__all__ = ["LATENCY_BUCKETS", "WINDOW", "LatencyHistogram", "MethodStats", "format_stats"]

WINDOW = 1024
"""How many of a method's latest answers its latency percentiles are over (a power of 2)."""
_MASK = WINDOW - 1


LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""The upper bounds (seconds) of a :class:`LatencyHistogram`'s buckets: 100 us to a minute,
about three per decade (an RPC round trip is tens of microseconds on a NIC, milliseconds on
Soft-RoCE under emulation)."""


class LatencyHistogram:
    """Latencies counted into buckets since it was made, for an exported histogram (e.g.
    Prometheus's): ``counts[i]`` is how many were at most ``bounds[i]`` and above the bound
    before; the last count is those above every bound. Kept only when asked for (see
    :mod:`aiordma.rpc.metrics`): one ``bisect`` and two additions per observation."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations at most that)`` for every bound, then
        ``(inf, all of them)``: the buckets as Prometheus exports them."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class MethodStats:
    """One method's counters on one server (all connections). Every call received is counted
    in ``calls``; once answered, in ``answered`` and in at most one of ``errors`` (the method
    or an interceptor raised, or the answer could not be sent), ``cancelled`` (the client
    cancelled or left), ``expired`` (its deadline passed at the server) and ``refused``
    (not run: the server was draining or closing, or an interceptor refused it with
    :class:`~aiordma.rpc.Unavailable`); the others succeeded. ``latencies`` holds the seconds
    from a request's arrival to its answer, for the last :data:`WINDOW` answers (a ring,
    indexed by ``answered``). ``histogram``: the same latencies since it was set, in buckets
    (:class:`LatencyHistogram`), or None (the default: only an exporter asks for it)."""

    __slots__ = ("answered", "calls", "cancelled", "errors", "expired", "histogram", "latencies",
                 "refused")

    def __init__(self) -> None:
        self.calls = 0
        self.answered = 0
        self.errors = 0
        self.cancelled = 0
        self.expired = 0
        self.refused = 0
        self.latencies = [0.0] * WINDOW
        self.histogram: LatencyHistogram | None = None

    def record(self, seconds: float) -> None:
        """One answer that took ``seconds`` since its request arrived (the server inlines
        this on its hot paths)."""
        self.latencies[self.answered & _MASK] = seconds
        self.answered += 1
        if self.histogram is not None:
            self.histogram.observe(seconds)

    def snapshot(self, max_concurrency: int | None = None, waiting: int = 0,
                 running: int | None = None) -> dict[str, Any]:
        """The counters as plain values (they travel over RPC):

        ``calls``, ``errors``, ``cancelled``, ``expired``, ``refused`` (see the class),
        ``in_flight`` (received and not answered yet), ``max_concurrency`` (None: no limit),
        ``running`` and ``waiting`` (a limited method's calls inside it and queued for it;
        None and 0 without a limit), and ``latency_ms``: ``p50``, ``p90``, ``p99`` and
        ``max`` over the last ``count`` answers (None when there were none).
        """
        n = min(self.answered, WINDOW)
        window = sorted(self.latencies[:n]) if self.answered <= WINDOW else sorted(
            self.latencies)
        latency: dict[str, Any] = {"count": n}
        for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
            latency[name] = _ms(window[min(n - 1, int(q * n))]) if n else None
        latency["max"] = _ms(window[-1]) if n else None
        return {"calls": self.calls, "errors": self.errors, "cancelled": self.cancelled,
                "expired": self.expired, "refused": self.refused,
                "in_flight": self.calls - self.answered, "max_concurrency": max_concurrency,
                "running": running, "waiting": waiting, "latency_ms": latency}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


_COLUMNS = [("calls", "calls"), ("errors", "errors"), ("cancelled", "cancelled"),
            ("expired", "expired"), ("refused", "refused"), ("in_flight", "in flight"),
            ("running", "running"), ("waiting", "waiting"), ("max_concurrency", "limit")]
_LATENCY = [("p50", "p50 ms"), ("p90", "p90 ms"), ("p99", "p99 ms"), ("max", "max ms")]


def format_stats(stats: dict[str, Any], where: str = "") -> str:
    """A server's :meth:`~aiordma.rpc.RpcServer.stats` as a table (``aiordma stats``)."""
    by = stats.get("transports") or {}
    over = f" ({', '.join(f'{k} {v}' for k, v in sorted(by.items()))})" if by else ""
    head = (f"{where + ': ' if where else ''}{stats.get('connections', 0)} connections{over}, "
            f"{stats.get('calls', 0)} calls, draining: {'yes' if stats.get('draining') else 'no'}")
    methods: dict[str, Any] = stats.get("methods", {})
    names = ["method", *(title for _, title in _COLUMNS), *(title for _, title in _LATENCY)]
    rows = [names]
    for name in sorted(methods):
        m = methods[name]
        cells = [name]
        cells += ["-" if m.get(key) is None else str(m.get(key)) for key, _ in _COLUMNS]
        lat = m.get("latency_ms", {})
        cells += ["-" if lat.get(key) is None else f"{lat[key]:.3f}" for key, _ in _LATENCY]
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(names))]
    lines = [head]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    if not methods:
        lines.append("(no methods)")
    return "\n".join(lines)
