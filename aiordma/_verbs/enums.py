"""Verbs constants as plain ints, read from pyverbs once (enum members compare slowly on the
hot path, and callers need not import pyverbs)."""

from __future__ import annotations

from aiordma._verbs.load import require_pyverbs

__all__ = ["value"]

_cache: dict[str, int] = {}


def value(name: str) -> int:
    """``IBV_<name>`` as an int: ``value("WR_SEND")``, ``value("ACCESS_REMOTE_READ")``.

    Raises:
        DeviceError: pyverbs is not available.
        AttributeError: pyverbs has no such constant.
    """
    v = _cache.get(name)
    if v is None:
        require_pyverbs()
        import pyverbs.libibverbs_enums as e

        v = _cache[name] = int(getattr(e, f"IBV_{name}"))
    return v
