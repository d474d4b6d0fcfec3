"""What every table-driven state machine in protocols/ shares: the two roles, the two
directions, and the lookup that turns a pair missing from a table into a typed error."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, auto
from typing import TypeVar

from .errors import LocalProtocolError, RemoteProtocolError

S = TypeVar("S", bound=Enum)


class Role(Enum):
    """Which side a connection is: the CLIENT opens (and, in RPC, calls); the SERVER answers."""

    # Members are singletons compared by identity: hash them by identity too. Enum's own
    # __hash__ is a Python function (hash of the name), paid on every table lookup.
    __hash__ = object.__hash__

    CLIENT = auto()
    SERVER = auto()


class Direction(Enum):
    __hash__ = object.__hash__  # as Role's

    SEND = auto()
    RECV = auto()


def lookup(table: Mapping[tuple[Role, S, Direction, str], S], role: Role, state: S,
           direction: Direction, event: str) -> S:
    """The state after ``event`` goes ``direction`` in ``state``.

    Raises:
        LocalProtocolError: ``direction`` is SEND and the combination is not in ``table``.
        RemoteProtocolError: ``direction`` is RECV and the combination is not in ``table``.
    """
    try:
        return table[(role, state, direction, event)]
    except KeyError:
        verb = "send" if direction is Direction.SEND else "receive"
        msg = f"{role.name.lower()} cannot {verb} {event} in state {state.name}"
        if direction is Direction.SEND:
            raise LocalProtocolError(msg) from None
        raise RemoteProtocolError(msg) from None
