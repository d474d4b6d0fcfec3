"""Sentinels returned instead of events (never ``None``)."""

from __future__ import annotations

from typing import Final


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


NEED_DATA: Final = _Sentinel("NEED_DATA")
"""``next_event()`` has no complete event yet: feed more bytes."""
