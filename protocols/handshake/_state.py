"""The control channel's state machine: everything that affects it lives in this table.

``(role, state, direction, event type) -> next state``. A pair missing from the table is a
protocol error: :class:`LocalProtocolError` when this side tried to send it,
:class:`RemoteProtocolError` when the peer sent it.

Without a shared secret (both sides start in START)::

    Client: START -send Hello-> HELLO_SENT -recv Accept-> ACCEPTED -send Ready-> OPEN
    Server: START -recv Hello-> HELLO_RECEIVED -send Accept-> ACCEPTED -recv Ready-> OPEN

With a shared secret (a side that holds one starts in AUTH_START), challenge-response before
any queue pair is connected::

    Client: AUTH_START -send Hello-> AUTH_HELLO_SENT -recv Challenge-> CHALLENGED
            -send Proof-> PROOF_SENT -recv Accept-> ACCEPTED -send Ready-> OPEN
    Server: AUTH_START -recv Hello-> AUTH_HELLO_RECEIVED -send Challenge-> CHALLENGE_SENT
            -recv Proof-> PROOF_RECEIVED -send Accept-> ACCEPTED -recv Ready-> OPEN

The TCP transport's set-up (version 4) takes the same steps with TcpHello and TcpAccept in
place of Hello and Accept, in states of their own (``TCP_...``), and ends in TCP_OPEN: from
there the byte stream carries :mod:`aiordma.protocols.tcp` frames, not control messages, and
the control connection takes nothing more::

    Client: START -send TcpHello-> TCP_HELLO_SENT -recv TcpAccept-> TCP_ACCEPTED
            -send Ready-> TCP_OPEN
    Server: START -recv TcpHello-> TCP_HELLO_RECEIVED -send TcpAccept-> TCP_ACCEPTED
            -recv Ready-> TCP_OPEN

and with a shared secret AUTH_START -> TCP_AUTH_HELLO_SENT -> TCP_CHALLENGED -> TCP_PROOF_SENT
(client), AUTH_START -> TCP_AUTH_HELLO_RECEIVED -> TCP_CHALLENGE_SENT -> TCP_PROOF_RECEIVED
(server), then TCP_ACCEPTED as above. So an answer of the other transport (an Accept to a
TcpHello) is a protocol error.

So a client with a secret never accepts an Accept that skipped the challenge (a downgrade),
and a server with a secret can only send Accept after a Proof arrived (the connection checks
it). Whether the Hello's nonce and the proofs are right is checked by
:class:`aiordma.protocols.handshake.ControlConnection`, which raises
:class:`~aiordma.protocols.errors.AuthenticationError`; the side then may only Reject.
Either side may Reject/Close instead of going on; in OPEN each side sends one Close
("I will send nothing more; I sent N messages") and the connection is CLOSED when both have.
"""

from __future__ import annotations

from enum import Enum, auto

from .._table import Direction, Role, lookup


class State(Enum):
    START = auto()
    AUTH_START = auto()
    HELLO_SENT = auto()
    AUTH_HELLO_SENT = auto()
    HELLO_RECEIVED = auto()
    AUTH_HELLO_RECEIVED = auto()
    CHALLENGED = auto()
    CHALLENGE_SENT = auto()
    PROOF_SENT = auto()
    PROOF_RECEIVED = auto()
    ACCEPTED = auto()
    OPEN = auto()
    CLOSE_SENT = auto()
    CLOSE_RECEIVED = auto()
    CLOSED = auto()
    # the TCP transport's set-up
    TCP_HELLO_SENT = auto()
    TCP_AUTH_HELLO_SENT = auto()
    TCP_HELLO_RECEIVED = auto()
    TCP_AUTH_HELLO_RECEIVED = auto()
    TCP_CHALLENGED = auto()
    TCP_CHALLENGE_SENT = auto()
    TCP_PROOF_SENT = auto()
    TCP_PROOF_RECEIVED = auto()
    TCP_ACCEPTED = auto()
    TCP_OPEN = auto()


C, S = Role.CLIENT, Role.SERVER
TX, RX = Direction.SEND, Direction.RECV

# (role, state, direction, event name) -> next state
TRANSITIONS: dict[tuple[Role, State, Direction, str], State] = {
    # without a shared secret
    (C, State.START, TX, "Hello"): State.HELLO_SENT,
    (C, State.HELLO_SENT, RX, "Accept"): State.ACCEPTED,
    (C, State.HELLO_SENT, RX, "Reject"): State.CLOSED,
    (S, State.START, RX, "Hello"): State.HELLO_RECEIVED,
    (S, State.HELLO_RECEIVED, TX, "Accept"): State.ACCEPTED,
    (S, State.HELLO_RECEIVED, TX, "Reject"): State.CLOSED,
    # with a shared secret: challenge-response first
    (C, State.AUTH_START, TX, "Hello"): State.AUTH_HELLO_SENT,
    (C, State.AUTH_HELLO_SENT, RX, "Challenge"): State.CHALLENGED,
    (C, State.AUTH_HELLO_SENT, RX, "Reject"): State.CLOSED,
    (C, State.CHALLENGED, TX, "Proof"): State.PROOF_SENT,
    (C, State.PROOF_SENT, RX, "Accept"): State.ACCEPTED,
    (C, State.PROOF_SENT, RX, "Reject"): State.CLOSED,
    (S, State.AUTH_START, RX, "Hello"): State.AUTH_HELLO_RECEIVED,
    (S, State.AUTH_HELLO_RECEIVED, TX, "Challenge"): State.CHALLENGE_SENT,
    (S, State.AUTH_HELLO_RECEIVED, TX, "Reject"): State.CLOSED,
    (S, State.CHALLENGE_SENT, RX, "Proof"): State.PROOF_RECEIVED,
    (S, State.PROOF_RECEIVED, TX, "Accept"): State.ACCEPTED,
    (S, State.PROOF_RECEIVED, TX, "Reject"): State.CLOSED,
    # both: the client confirms, or cannot use the answer (e.g. the server's proof is wrong)
    (C, State.ACCEPTED, TX, "Ready"): State.OPEN,
    (C, State.ACCEPTED, TX, "Reject"): State.CLOSED,
    (S, State.ACCEPTED, RX, "Ready"): State.OPEN,
    (S, State.ACCEPTED, RX, "Reject"): State.CLOSED,
    # the TCP transport: the same steps with TcpHello and TcpAccept
    (C, State.START, TX, "TcpHello"): State.TCP_HELLO_SENT,
    (C, State.TCP_HELLO_SENT, RX, "TcpAccept"): State.TCP_ACCEPTED,
    (C, State.TCP_HELLO_SENT, RX, "Reject"): State.CLOSED,
    (S, State.START, RX, "TcpHello"): State.TCP_HELLO_RECEIVED,
    (S, State.TCP_HELLO_RECEIVED, TX, "TcpAccept"): State.TCP_ACCEPTED,
    (S, State.TCP_HELLO_RECEIVED, TX, "Reject"): State.CLOSED,
    (C, State.AUTH_START, TX, "TcpHello"): State.TCP_AUTH_HELLO_SENT,
    (C, State.TCP_AUTH_HELLO_SENT, RX, "Challenge"): State.TCP_CHALLENGED,
    (C, State.TCP_AUTH_HELLO_SENT, RX, "Reject"): State.CLOSED,
    (C, State.TCP_CHALLENGED, TX, "Proof"): State.TCP_PROOF_SENT,
    (C, State.TCP_PROOF_SENT, RX, "TcpAccept"): State.TCP_ACCEPTED,
    (C, State.TCP_PROOF_SENT, RX, "Reject"): State.CLOSED,
    (S, State.AUTH_START, RX, "TcpHello"): State.TCP_AUTH_HELLO_RECEIVED,
    (S, State.TCP_AUTH_HELLO_RECEIVED, TX, "Challenge"): State.TCP_CHALLENGE_SENT,
    (S, State.TCP_AUTH_HELLO_RECEIVED, TX, "Reject"): State.CLOSED,
    (S, State.TCP_CHALLENGE_SENT, RX, "Proof"): State.TCP_PROOF_RECEIVED,
    (S, State.TCP_PROOF_RECEIVED, TX, "TcpAccept"): State.TCP_ACCEPTED,
    (S, State.TCP_PROOF_RECEIVED, TX, "Reject"): State.CLOSED,
    (C, State.TCP_ACCEPTED, TX, "Ready"): State.TCP_OPEN,
    (C, State.TCP_ACCEPTED, TX, "Reject"): State.CLOSED,
    (S, State.TCP_ACCEPTED, RX, "Ready"): State.TCP_OPEN,
    (S, State.TCP_ACCEPTED, RX, "Reject"): State.CLOSED,
}
for _role in Role:
    TRANSITIONS.update({
        (_role, State.OPEN, TX, "Close"): State.CLOSE_SENT,
        (_role, State.OPEN, RX, "Close"): State.CLOSE_RECEIVED,
        (_role, State.CLOSE_SENT, RX, "Close"): State.CLOSED,
        (_role, State.CLOSE_RECEIVED, TX, "Close"): State.CLOSED,
    })

START_STATES = (State.START, State.AUTH_START)
"""Where a connection begins: AUTH_START when it holds a shared secret, else START."""


def next_state(role: Role, state: State, direction: Direction, event: str) -> State:
    """The state after ``event`` goes ``direction`` in ``state``, or a typed protocol error."""
    return lookup(TRANSITIONS, role, state, direction, event)
