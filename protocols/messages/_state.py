"""An endpoint's lifecycle: everything that decides whether it may still send lives here.

``(state, event) -> next state``; a pair missing from the table is a
:class:`~aiordma.protocols.errors.LocalProtocolError` (the driver asked for something the state does
not allow: a bug). Events:

``close``
    this side's application called ``aclose()``: no new messages; queued ones still go out.
``close_sent``
    this side sent its Close ("I sent N messages") on the control channel.
``peer_close``
    the peer's Close arrived: it sends no more messages after its N; messages this side had
    queued and not yet posted are dropped (nobody would read them).
``fail``
    the peer, the network, the device or a protocol violation broke the connection.
``release``
    this side released every resource (``abort()``, or the end of ``aclose()``).

::

    OPEN --close--> CLOSING --close_sent--> CLOSE_SENT --peer_close--> CLOSED
    OPEN --peer_close--> PEER_CLOSED --close_sent--> CLOSED     (the answering side)
    CLOSING --peer_close--> PEER_CLOSED                         (both closed at once)
    any state but RELEASED --fail--> BROKEN;  any state --release--> RELEASED

Who may post what (see :mod:`aiordma.protocols.messages`): new messages only in OPEN; queued
messages in OPEN and CLOSING; control frames (DONE, CREDIT) in every state but BROKEN and
RELEASED, since a peer may still be reading this side's messages, or sending its own, after a
Close went either way.
"""

from __future__ import annotations

from enum import Enum, auto

from ..errors import LocalProtocolError


class Lifecycle(Enum):
    __hash__ = object.__hash__  # identity hash: looked up on every state check

    OPEN = auto()
    CLOSING = auto()
    CLOSE_SENT = auto()
    PEER_CLOSED = auto()
    CLOSED = auto()
    BROKEN = auto()
    RELEASED = auto()


L = Lifecycle

TRANSITIONS: dict[tuple[Lifecycle, str], Lifecycle] = {
    (L.OPEN, "close"): L.CLOSING,
    (L.OPEN, "peer_close"): L.PEER_CLOSED,
    (L.CLOSING, "close"): L.CLOSING,
    (L.CLOSING, "close_sent"): L.CLOSE_SENT,
    (L.CLOSING, "peer_close"): L.PEER_CLOSED,
    (L.CLOSE_SENT, "close"): L.CLOSE_SENT,
    (L.CLOSE_SENT, "peer_close"): L.CLOSED,
    (L.PEER_CLOSED, "close"): L.PEER_CLOSED,
    (L.PEER_CLOSED, "close_sent"): L.CLOSED,
    (L.CLOSED, "close"): L.CLOSED,
}
for _s in Lifecycle:
    if _s is not L.RELEASED:
        TRANSITIONS[(_s, "fail")] = L.BROKEN
    TRANSITIONS[(_s, "release")] = L.RELEASED
TRANSITIONS[(L.BROKEN, "close")] = L.BROKEN

SENDING = frozenset({L.OPEN})
"""States in which a new message may be queued."""
FLUSHING = frozenset({L.OPEN, L.CLOSING})
"""States in which queued messages are posted."""
LIVE = frozenset({L.OPEN, L.CLOSING, L.CLOSE_SENT, L.PEER_CLOSED, L.CLOSED})
"""States in which control frames (DONE, CREDIT) are posted and completions are taken."""


def next_lifecycle(state: Lifecycle, event: str) -> Lifecycle:
    """The state after ``event``, or :class:`LocalProtocolError` if the table has no such pair."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise LocalProtocolError(f"{event} is not allowed in state {state.name}") from None
