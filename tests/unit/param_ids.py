"""Test ids that are the same in every process: pytest-xdist's workers must collect the same
ids, and ``repr`` of an object, a memoryview or a function names its address."""

from __future__ import annotations

import re
from typing import Any

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def stable_repr(value: Any) -> str:
    """``repr(value)`` without the addresses in it."""
    return _ADDRESS.sub("", repr(value))
