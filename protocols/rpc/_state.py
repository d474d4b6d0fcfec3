"""The RPC protocol's per-call state machine: everything that affects it lives in this module.

Each call is named by its id and has a state on each side. ``(role, state, direction, event
type) -> next state`` in :data:`TRANSITIONS` is the whole rule; a combination missing from it is a
protocol error: :class:`LocalProtocolError` when this side tried to send it,
:class:`RemoteProtocolError` when the peer sent it. A refused event changes nothing.

Client (the side that sends requests)::

    NONE --send Request--> WAITING --recv Response/Error--> DONE
                           WAITING --send Cancel--> CANCEL_SENT --recv Response/Error--> DONE

Server (the side that answers)::

    NONE --recv Request--> RUNNING --send Response/Error--> DONE
                           RUNNING --recv Cancel--> CANCELLED --send Response/Error--> DONE

The server answers every call it received, a cancelled one included (typically with an Error
whose type is ``"CancelledError"``, or with the result if the work finished anyway): the answer
is what frees the id on the client. A Cancel and an answer may cross on the wire, which is why a
client in CANCEL_SENT accepts either answer, and why a server ignores a Cancel for a call it has
already answered.

**Ids only grow.** The client gives each new call an id above every id it used before (gaps are
allowed), and the transport keeps order, so the server receives ids in increasing order. That
is what lets each side tell, without remembering finished calls, a finished call from one never
seen:

* a call in the table is in the state it records (WAITING, CANCEL_SENT, RUNNING, CANCELLED);
* a call not in the table whose id is at or below the *horizon* (the client: the highest id it
  sent; the server: the highest id it received) is DONE: it was answered and forgotten;
* any other id is NONE: never used.

Consequences: a Request whose id is not above the previous one is a duplicate (or a replay) and
meets DONE/RUNNING/CANCELLED, where receiving a Request is not allowed; a second answer for a call
meets DONE; an answer for a call never sent meets NONE. Both kinds of Cancel the server cannot
act on are consumed silently (:data:`IGNORED`, not delivered as events), and counted separately:
one for a DONE call crossed its answer (normal), one for a NONE call is a peer's bug (harmless).

**In-flight limit.** The server refuses (RemoteProtocolError) a Request that would make more
than ``max_in_flight`` calls RUNNING or CANCELLED. The client counts a call from sending its
Request until receiving its answer, which is never shorter than the server's count (the server
forgets a call when sending the answer, before the client gets it); so a client that refuses
(LocalProtocolError) to exceed the server's limit never trips it.
"""

from __future__ import annotations

from enum import Enum, auto

from .._table import Direction, Role, lookup
from ..errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "EVENTS",
    "IGNORED",
    "MAX_ID",
    "TRANSITIONS",
    "CallState",
    "Calls",
    "Direction",
    "Role",
    "next_state",
]

MAX_ID = (1 << 63) - 1
"""The largest call id (ids are 0..2**63-1, so they fit a signed 64-bit integer)."""

EVENTS = ("Request", "Response", "Error", "Cancel")
"""The names of the events that travel on the wire."""


class CallState(Enum):
    """The state of one call id on one side (see the module docstring)."""

    __hash__ = object.__hash__  # identity, as aiordma.protocols._table.Role's (hot: every message)

    NONE = auto()  # never used
    WAITING = auto()  # client: request sent, no answer yet
    CANCEL_SENT = auto()  # client: request and cancel sent, no answer yet
    RUNNING = auto()  # server: request received, not answered
    CANCELLED = auto()  # server: request and cancel received, not answered
    DONE = auto()  # answered (and forgotten: not stored)


C, S = Role.CLIENT, Role.SERVER
TX, RX = Direction.SEND, Direction.RECV
N, W, CS = CallState.NONE, CallState.WAITING, CallState.CANCEL_SENT
R, X, D = CallState.RUNNING, CallState.CANCELLED, CallState.DONE

# (role, state, direction, event name) -> next state
TRANSITIONS: dict[tuple[Role, CallState, Direction, str], CallState] = {
    (C, N, TX, "Request"): W,
    (C, W, RX, "Response"): D,
    (C, W, RX, "Error"): D,
    (C, W, TX, "Cancel"): CS,
    (C, CS, RX, "Response"): D,  # the answer crossed the cancel
    (C, CS, RX, "Error"): D,
    (S, N, RX, "Request"): R,
    (S, R, TX, "Response"): D,
    (S, R, TX, "Error"): D,
    (S, R, RX, "Cancel"): X,
    (S, X, TX, "Response"): D,  # the work finished anyway
    (S, X, TX, "Error"): D,
    (S, D, RX, "Cancel"): D,  # crossed the answer: ignored
    (S, N, RX, "Cancel"): N,  # never seen: ignored (and counted)
}

IGNORED: frozenset[tuple[Role, CallState, Direction, str]] = frozenset({
    (S, D, RX, "Cancel"),
    (S, N, RX, "Cancel"),
})
"""Legal received events that change nothing and are not delivered to the application."""

_STORED = frozenset({W, CS, R, X})  # the states kept in the table; DONE and NONE are derived


def next_state(role: Role, state: CallState, direction: Direction, event: str) -> CallState:
    """The state after ``event`` goes ``direction`` in ``state``, or a typed protocol error.

    Raises:
        LocalProtocolError: ``direction`` is SEND and the combination is not in the table.
        RemoteProtocolError: ``direction`` is RECV and the combination is not in the table.
    """
    return lookup(TRANSITIONS, role, state, direction, event)


class Calls:
    """The calls of one side: their states, the id horizon, the in-flight limit, counters.

    Args:
        role: which side this is.
        max_in_flight: the most calls in flight at once. For a server, its own limit; for a
            client, the server's limit (the client refuses to exceed it).
    """

    def __init__(self, role: Role, max_in_flight: int) -> None:
        self.role = role
        self.max_in_flight = max_in_flight
        self._states: dict[int, CallState] = {}
        self._horizon = -1  # the highest request id sent (client) or received (server)
        self.cancels_after_answer = 0  # Cancels that crossed the answer (server)
        self.unknown_cancels = 0  # Cancels for ids never seen (server; a peer's bug)
        # the hot paths' shortcuts, from TRANSITIONS: a client sends requests and receives
        # answers, a server the other way round; every stored state takes an answer to DONE
        self._request_direction = TX if role is C else RX
        self._request_state = W if role is C else R
        self._answer_direction = RX if role is C else TX

    @property
    def next_id(self) -> int:
        """The id a client's next call gets (one above every id used so far)."""
        return self._horizon + 1

    @property
    def in_flight(self) -> frozenset[int]:
        """The ids of calls that are not answered yet."""
        return frozenset(self._states)

    def state(self, call_id: int) -> CallState:
        """The state of ``call_id`` on this side."""
        stored = self._states.get(call_id)
        if stored is not None:
            return stored
        return CallState.DONE if call_id <= self._horizon else CallState.NONE

    def check(self, call_id: int, direction: Direction, event: str) -> CallState:
        """The next state if ``event`` for ``call_id`` went ``direction``; changes nothing.

        Raises:
            LocalProtocolError: sending it is not allowed (state, id space or in-flight limit).
            RemoteProtocolError: receiving it is not allowed.
        """
        return self.step(call_id, direction, event)[1]

    def apply(self, call_id: int, direction: Direction, event: str) -> bool:
        """Make the transition :meth:`check` allows.

        Returns:
            Whether a received event is to be delivered (False for the :data:`IGNORED` ones).

        Raises:
            LocalProtocolError, RemoteProtocolError: as :meth:`check`.
        """
        state, nxt = self.step(call_id, direction, event)
        return self.commit(call_id, direction, event, state, nxt)

    def step(self, call_id: int, direction: Direction,
             event: str) -> tuple[CallState, CallState]:
        """:meth:`check` in two halves with :meth:`commit` (one table lookup per event): the
        call's state now and the next one. Changes nothing.

        Raises:
            LocalProtocolError, RemoteProtocolError: as :meth:`check`.
        """
        stored = self._states.get(call_id)
        state = stored if stored is not None else D if call_id <= self._horizon else N
        nxt = TRANSITIONS.get((self.role, state, direction, event))
        if nxt is None or (event == "Request" and not (
                0 <= call_id <= MAX_ID and len(self._states) < self.max_in_flight)):
            nxt = self._refuse_or_check(call_id, state, direction, event)
        return state, nxt

    def request(self, call_id: int, direction: Direction) -> None:
        """:meth:`apply` of a Request, the client's send or the server's receipt (the hot
        path: no table lookup when it is allowed).

        Raises:
            LocalProtocolError, RemoteProtocolError: as :meth:`check`; nothing changes then.
        """
        states = self._states
        if (direction is self._request_direction and self._horizon < call_id <= MAX_ID
                and len(states) < self.max_in_flight):
            states[call_id] = self._request_state
            self._horizon = call_id
            return
        state, nxt = self.step(call_id, direction, "Request")
        self.commit(call_id, direction, "Request", state, nxt)

    def answer(self, call_id: int, direction: Direction, event: str) -> None:
        """:meth:`apply` of a Response or an Error (``event``), the server's send or the
        client's receipt (the hot path: no table lookup when it is allowed).

        Raises:
            LocalProtocolError, RemoteProtocolError: as :meth:`check`; nothing changes then.
        """
        states = self._states
        if direction is self._answer_direction and call_id in states:
            del states[call_id]  # every stored state of this role takes an answer to DONE
            return
        state, nxt = self.step(call_id, direction, event)
        self.commit(call_id, direction, event, state, nxt)

    def _refuse_or_check(self, call_id: int, state: CallState, direction: Direction,
                         event: str) -> CallState:
        """The slow half of :meth:`step`: the typed error, or a Request's extra checks."""
        error = LocalProtocolError if direction is Direction.SEND else RemoteProtocolError
        try:
            nxt = next_state(self.role, state, direction, event)
        except (LocalProtocolError, RemoteProtocolError) as exc:
            hint = " (request ids must increase)" if event == "Request" and state is not N else ""
            raise error(f"call {call_id}: {exc}{hint}") from None
        if event == "Request":
            if not 0 <= call_id <= MAX_ID:
                raise error(f"call id {call_id} is outside 0..{MAX_ID}")
            if len(self._states) >= self.max_in_flight:
                raise error(f"call {call_id} would exceed {self.max_in_flight} calls in flight")
        return nxt

    def commit(self, call_id: int, direction: Direction, event: str, state: CallState,
               nxt: CallState) -> bool:
        """Make the transition that :meth:`step` returned (nothing may have changed the call
        in between). Returns what :meth:`apply` returns."""
        if nxt in _STORED:
            self._states[call_id] = nxt
        elif state in _STORED:
            del self._states[call_id]
        if event == "Request":
            self._horizon = call_id
        elif event == "Cancel" and (self.role, state, direction, event) in IGNORED:  # only Cancels
            if state is CallState.DONE:
                self.cancels_after_answer += 1
            else:
                self.unknown_cancels += 1
            return False
        return True
