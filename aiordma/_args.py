"""Checking the arguments of public calls: the one rule (``aiordma.protocols.errors``): a bad
argument raises :class:`~aiordma.LocalProtocolError` (also a ``ValueError``) naming it, before
anything is done (no socket, no device)."""

from __future__ import annotations

import math
from typing import Any

from ._errors import LocalProtocolError

__all__ = ["byte_view", "check_host", "check_int", "check_optional_int", "check_port", "check_seconds"]


def check_host(host: Any, *, name: str = "host", empty_ok: bool = False) -> str:
    if not isinstance(host, str) or (not host and not empty_ok) or "\x00" in host:
        raise LocalProtocolError(f"{name} must be a host name or address string, not "
                                 f"{host!r:.80}")
    return host


def check_port(port: Any, *, zero_ok: bool = False, name: str = "port") -> int:
    low = 0 if zero_ok else 1
    if not isinstance(port, int) or isinstance(port, bool) or not low <= port <= 65535:
        raise LocalProtocolError(f"{name} must be an integer in {low}..65535, not {port!r:.80}")
    return port


def check_seconds(value: Any, *, name: str = "timeout", none_ok: bool = False,
                  zero_ok: bool = False) -> float | None:
    """A duration: a finite number of seconds, positive (or 0 where ``zero_ok``: a bound
    already spent, which expires at once)."""
    if value is None and none_ok:
        return None
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok)):
        kind = "non-negative" if zero_ok else "positive"
        raise LocalProtocolError(f"{name} must be a {kind}, finite number of seconds"
                                 f"{' or None' if none_ok else ''}, not {value!r:.80}")
    return float(value)


def check_int(value: Any, *, name: str, low: int = 1, high: int | None = None) -> int:
    if (not isinstance(value, int) or isinstance(value, bool) or value < low
            or (high is not None and value > high)):
        span = f"{low}..{high}" if high is not None else f"at least {low}"
        raise LocalProtocolError(f"{name} must be an integer {span}, not {value!r:.80}")
    return value


def check_optional_int(value: Any, *, name: str, low: int = 1) -> int | None:
    return None if value is None else check_int(value, name=name, low=low)


def byte_view(data: Any, what: str) -> memoryview:
    """``data`` as a contiguous 1-D memoryview of bytes.

    Raises:
        LocalProtocolError: not a bytes-like object, or not contiguous.
    """
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise LocalProtocolError(f"{what} takes a bytes-like object, not "
                                 f"{type(data).__name__}") from exc
    if not view.contiguous:
        raise LocalProtocolError(f"{what} needs a contiguous buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
