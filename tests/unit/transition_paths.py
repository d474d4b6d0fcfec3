"""Shared by the state-machine tests: shortest legal paths through a transition table."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any


def shortest_paths(table: Mapping[tuple[Any, Any, Any, str], Any], role: Any,
                   start: Any) -> dict[Any, list[tuple[Any, str, Any]]]:
    """For every state reachable from ``start`` for ``role``: the shortest list of
    ``(direction, event, next state)`` steps that gets there through ``table``."""
    paths: dict[Any, list[tuple[Any, str, Any]]] = {start: []}
    todo = deque([start])
    while todo:
        state = todo.popleft()
        for (r, s, direction, name), nxt in table.items():
            if r is role and s is state and nxt not in paths:
                paths[nxt] = [*paths[state], (direction, name, nxt)]
                todo.append(nxt)
    return paths
