"""Comparing values that went through an RPC round trip."""

from __future__ import annotations

from typing import Any


def normal(v: Any) -> Any:
    """What a value looks like after a round trip: tuples as lists, buffers as bytes, arrays as
    (dtype, shape, bytes)."""
    if type(v).__name__ == "ndarray":  # numpy only if the value is one
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (list, tuple)):
        return [normal(x) for x in v]
    if isinstance(v, dict):
        return {k: normal(x) for k, x in v.items()}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    return v
