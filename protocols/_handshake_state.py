"""The control channel's state machine: everything that affects it lives in this table.

``(role, state, direction, event type) -> next state``. A pair missing from the table is a
protocol error: :class:`LocalProtocolError` when this side tried to send it,
:class:`RemoteProtocolError` when the peer sent it.

Client: START -send Hello-> HELLO_SENT -recv Accept-> ACCEPTED -send Ready-> OPEN
Server: START -recv Hello-> HELLO_RECEIVED -send Accept-> ACCEPTED -recv Ready-> OPEN
Either side may Reject/Close instead of going on; in OPEN each side sends one Close
("I will send nothing more; I sent N messages") and the connection is CLOSED when both have.
"""

from __future__ import annotations

from enum import Enum, auto

from ._table import Direction, Role, lookup


class State(Enum):
    START = auto()
    HELLO_SENT = auto()
    HELLO_RECEIVED = auto()
    ACCEPTED = auto()
    OPEN = auto()
    CLOSE_SENT = auto()
    CLOSE_RECEIVED = auto()
    CLOSED = auto()


C, S = Role.CLIENT, Role.SERVER
TX, RX = Direction.SEND, Direction.RECV

# (role, state, direction, event name) -> next state
TRANSITIONS: dict[tuple[Role, State, Direction, str], State] = {
    (C, State.START, TX, "Hello"): State.HELLO_SENT,
    (C, State.HELLO_SENT, RX, "Accept"): State.ACCEPTED,
    (C, State.HELLO_SENT, RX, "Reject"): State.CLOSED,
    (C, State.ACCEPTED, TX, "Ready"): State.OPEN,
    (C, State.ACCEPTED, TX, "Reject"): State.CLOSED,  # the client cannot use the answer
    (S, State.START, RX, "Hello"): State.HELLO_RECEIVED,
    (S, State.HELLO_RECEIVED, TX, "Accept"): State.ACCEPTED,
    (S, State.HELLO_RECEIVED, TX, "Reject"): State.CLOSED,
    (S, State.ACCEPTED, RX, "Ready"): State.OPEN,
    (S, State.ACCEPTED, RX, "Reject"): State.CLOSED,
}
for _role in Role:
    TRANSITIONS.update({
        (_role, State.OPEN, TX, "Close"): State.CLOSE_SENT,
        (_role, State.OPEN, RX, "Close"): State.CLOSE_RECEIVED,
        (_role, State.CLOSE_SENT, RX, "Close"): State.CLOSED,
        (_role, State.CLOSE_RECEIVED, TX, "Close"): State.CLOSED,
    })


def next_state(role: Role, state: State, direction: Direction, event: str) -> State:
    """The state after ``event`` goes ``direction`` in ``state``, or a typed protocol error."""
    return lookup(TRANSITIONS, role, state, direction, event)
