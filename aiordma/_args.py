"""Checking the arguments of public calls: the one rule.

A caller's bad argument, whether of a type the call cannot take or of the right type with a
value it cannot take (a negative port, a NaN timeout, ``True`` for a count, a slice past a
region), raises :class:`~aiordma.LocalProtocolError` (also a ``ValueError``) naming it, before
anything is done (no socket, no device, nothing posted or sent). What happened on the wire or
the device raises another :class:`~aiordma.AiordmaError`; using what this process closed,
:class:`~aiordma.ClosedResourceError`. (Python's own ``TypeError`` for a missing or unknown
parameter is not aiordma's to change.) The README's error section states the rule; the
tests that hold every entry point to it are ``tests/unit/test_arguments.py`` and
``tests/rxe/test_arguments.py``.
"""

from __future__ import annotations

import math
from typing import Any

from aiordma._errors import LocalProtocolError

__all__ = ["byte_view", "check_bool", "check_host", "check_int", "check_optional_int",
           "check_port", "check_seconds", "check_type", "check_word"]


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
                  zero_ok: bool = False, high: float | None = None) -> float | None:
    """A duration: a finite number of seconds, positive (or 0 where ``zero_ok``: a bound
    already spent, which expires at once), at most ``high`` where given."""
    if value is None and none_ok:
        return None
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok)
            or (high is not None and value > high)):
        kind = "non-negative" if zero_ok else "positive"
        most = f" of at most {high:g}" if high is not None else ""
        raise LocalProtocolError(f"{name} must be a {kind}, finite number of seconds{most}"
                                 f"{' or None' if none_ok else ''}, not {value!r:.80}")
    return float(value)


def check_int(value: Any, *, name: str, low: int = 1, high: int | None = None) -> int:
    if (not isinstance(value, int) or isinstance(value, bool) or value < low
            or (high is not None and value > high)):
        span = f"{low}..{high}" if high is not None else f"at least {low}"
        raise LocalProtocolError(f"{name} must be an integer {span}, not {value!r:.80}")
    return value


def check_optional_int(value: Any, *, name: str, low: int = 1,
                       high: int | None = None) -> int | None:
    return None if value is None else check_int(value, name=name, low=low, high=high)


def check_bool(value: Any, *, name: str) -> bool:
    """A flag: ``True`` or ``False`` (not 0, 1 or another truthy object)."""
    if not isinstance(value, bool):
        raise LocalProtocolError(f"{name} must be True or False, not {value!r:.80}")
    return value


def check_type(value: Any, cls: type | tuple[type, ...], *, name: str, what: str) -> Any:
    """``value`` if it is a ``cls``; ``what`` says what is wanted, for the message."""
    if not isinstance(value, cls):
        raise LocalProtocolError(f"{name} must be {what}, not {type(value).__name__} "
                                 f"{value!r:.80}")
    return value


_WORD_LOW, _WORD_HIGH = -(1 << 63), (1 << 64) - 1


def check_word(value: Any, *, name: str) -> int:
    """An atomic's 64-bit operand: an integer that a signed or an unsigned 64-bit word holds
    (-2**63 .. 2**64 - 1), returned as the unsigned word (mod 2**64)."""
    if (not isinstance(value, int) or isinstance(value, bool)
            or not _WORD_LOW <= value <= _WORD_HIGH):
        raise LocalProtocolError(f"{name} must be an integer in -2**63..2**64-1 (a 64-bit "
                                 f"word, signed or not), not {value!r:.80}")
    return value & _WORD_HIGH


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
