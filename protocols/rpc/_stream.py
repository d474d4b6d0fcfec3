"""The RPC protocol's stream calls: their state machine and flow control. Everything that
affects a stream's life lives in this module (as :mod:`aiordma.protocols.rpc._state` holds
the life of every call). Sans-I/O.

A *stream call* is a call whose Request carries ``F_STREAM``. Besides the call's own frames
(its Request, perhaps a Cancel, and its answer), items travel both ways until the answer:

* client -> server: Data frames, then an End (the client sends no more), unless it cancels;
* server -> client: Data frames; the server's answer (a Response or an Error) ends this
  direction and the whole call, as it ends every call.

**Flow control**, per stream and per direction, counted in items: a side may send a Data only
while it holds a credit, and its peer grants credits with Credit frames (``count`` items at a
time). So the items a receiver holds for its application never exceed what it granted (its
*window*), whatever the sender does: a Data beyond it is a protocol error. The client grants
its first credits with a Credit right behind its Request (in the same message); the server
grants them when the call's handler starts reading the client's items. A side's credit and
window are each at most :data:`MAX_CREDIT`.

States of one stream on one side (:class:`StreamState`)::

    client  NONE --send Request(F_STREAM)--> OPEN --send End--> ENDED
            OPEN, ENDED --send Cancel--> CANCELLED
            OPEN, ENDED, CANCELLED --recv Response/Error--> DONE

    server  NONE --recv Request(F_STREAM)--> OPEN --recv End--> ENDED
            OPEN, ENDED --recv Cancel--> CANCELLED
            OPEN, ENDED, CANCELLED --send Response/Error--> DONE

and which items and credits each state lets through is :data:`TRANSITIONS`:
``(role, state, direction, event) -> next state``. Whether a Request, Cancel, Response or
Error may go at all is the call table's rule (:mod:`aiordma.protocols.rpc._state`); this table
says what they do to a stream. A Data, Credit or End missing from it is a protocol error:
:class:`LocalProtocolError` when this side tried to send it, :class:`RemoteProtocolError` when
the peer sent it; so is one for a call that is not a stream (UNARY) or does not exist (NONE).
A refused event changes nothing.

Crossings. The transport keeps order, but two sides' frames cross: a server's items may cross
the client's Cancel (the client then drops them: :data:`IGNORED`, still counted against its
window); a server's Credit may cross the client's End or Cancel (dropped too); the client's
items, End or Credit may cross the server's answer (the server has forgotten the call: DONE,
dropped). Nothing else crosses: a server never sends after its answer, and a client sends
nothing after its Cancel, so anything else is refused. Dropped frames are counted
(:attr:`Streams.dropped`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from .._table import Direction, Role, lookup
from ..errors import LocalProtocolError, RemoteProtocolError
from ._state import Calls, CallState

__all__ = [
    "IGNORED",
    "MAX_CREDIT",
    "STREAM_EVENTS",
    "TRANSITIONS",
    "Flow",
    "StreamState",
    "Streams",
]

MAX_CREDIT = (1 << 32) - 1
"""The most credits a side may hold, or grant at once (a Credit's count is a 32-bit field)."""

STREAM_EVENTS = ("Data", "Credit", "End")
"""The events only stream calls carry."""


class StreamState(Enum):
    """The state of one call id's stream on one side (see the module docstring)."""

    __hash__ = object.__hash__  # identity, as _table.Role's

    NONE = auto()  # no call with this id yet
    UNARY = auto()  # a call in flight that is not a stream
    OPEN = auto()  # a stream call: items may flow both ways
    ENDED = auto()  # the client's items have ended (End sent or received)
    CANCELLED = auto()  # the client cancelled (Cancel sent or received)
    DONE = auto()  # answered (and forgotten), stream or not


C, S = Role.CLIENT, Role.SERVER
TX, RX = Direction.SEND, Direction.RECV
N, O, E = StreamState.NONE, StreamState.OPEN, StreamState.ENDED
X, D = StreamState.CANCELLED, StreamState.DONE

# (role, state, direction, event name) -> next state
TRANSITIONS: dict[tuple[Role, StreamState, Direction, str], StreamState] = {
    # the call's own frames, as far as they concern its stream
    (C, N, TX, "Request"): O,
    (C, O, TX, "Cancel"): X,
    (C, E, TX, "Cancel"): X,
    (C, O, RX, "Response"): D,
    (C, E, RX, "Response"): D,
    (C, X, RX, "Response"): D,
    (C, O, RX, "Error"): D,
    (C, E, RX, "Error"): D,
    (C, X, RX, "Error"): D,
    (S, N, RX, "Request"): O,
    (S, O, RX, "Cancel"): X,
    (S, E, RX, "Cancel"): X,
    (S, O, TX, "Response"): D,
    (S, E, TX, "Response"): D,
    (S, X, TX, "Response"): D,
    (S, O, TX, "Error"): D,
    (S, E, TX, "Error"): D,
    (S, X, TX, "Error"): D,
    # the client's items and their credits
    (C, O, TX, "Data"): O,
    (C, O, TX, "End"): E,
    (S, O, RX, "Data"): O,
    (S, O, RX, "End"): E,
    (S, O, TX, "Credit"): O,  # (none once the client's items have ended)
    (C, O, RX, "Credit"): O,
    (C, E, RX, "Credit"): E,  # crossed the End: dropped
    (C, X, RX, "Credit"): X,  # crossed the Cancel: dropped
    (S, D, RX, "Data"): D,  # crossed the answer: dropped
    (S, D, RX, "End"): D,  # crossed the answer: dropped
    # the server's items and their credits
    (S, O, TX, "Data"): O,
    (S, E, TX, "Data"): E,
    (C, O, RX, "Data"): O,
    (C, E, RX, "Data"): E,
    (C, X, RX, "Data"): X,  # crossed the Cancel: dropped
    (C, O, TX, "Credit"): O,
    (C, E, TX, "Credit"): E,
    (S, O, RX, "Credit"): O,
    (S, E, RX, "Credit"): E,
    (S, D, RX, "Credit"): D,  # crossed the answer: dropped
}

IGNORED: frozenset[tuple[Role, StreamState, Direction, str]] = frozenset({
    (C, E, RX, "Credit"),
    (C, X, RX, "Credit"),
    (C, X, RX, "Data"),
    (S, D, RX, "Data"),
    (S, D, RX, "End"),
    (S, D, RX, "Credit"),
})
"""Legal received events that are dropped, not delivered to the application."""

_STORED = frozenset({O, E, X})  # the states kept in the table; the others are derived


@dataclass(slots=True)
class Flow:
    """One stream's state and counts on one side."""

    state: StreamState
    credit: int = 0  # Data this side may still send (granted by the peer, not yet spent)
    window: int = 0  # Data the peer may still send (granted by this side, not yet received)
    sent: int = 0  # Data sent
    received: int = 0  # Data received (dropped ones included)


class Streams:
    """The stream calls of one side: their states and credits.

    Args:
        role: which side this is.
        calls: the same side's call table (a stream is also a call there).
    """

    def __init__(self, role: Role, calls: Calls) -> None:
        self.role = role
        self._calls = calls
        self._flows: dict[int, Flow] = {}
        self.dropped = 0  # received events that crossed an answer, an End or a Cancel

    def __bool__(self) -> bool:
        """Some stream call is not answered yet."""
        return bool(self._flows)

    @property
    def open(self) -> frozenset[int]:
        """The ids of stream calls not answered yet."""
        return frozenset(self._flows)

    def flow(self, call_id: int) -> Flow | None:
        """The stream's counts, or None: not a stream call in flight."""
        return self._flows.get(call_id)

    def state(self, call_id: int) -> StreamState:
        """The state of ``call_id``'s stream on this side."""
        flow = self._flows.get(call_id)
        if flow is not None:
            return flow.state
        call = self._calls.state(call_id)
        if call is CallState.NONE:
            return N
        return D if call is CallState.DONE else StreamState.UNARY

    def step(self, call_id: int, direction: Direction, event: str,
             count: int = 1) -> tuple[StreamState, StreamState]:
        """The stream's state now and after ``event`` (``count``: a Credit's); changes nothing.
        A Request is stepped before the call table records it (its state is NONE then).

        Raises:
            LocalProtocolError: sending it is not allowed (state, credit, count).
            RemoteProtocolError: receiving it is not allowed.
        """
        state = self.state(call_id)
        error = LocalProtocolError if direction is TX else RemoteProtocolError
        try:
            nxt = lookup(TRANSITIONS, self.role, state, direction, event)
        except (LocalProtocolError, RemoteProtocolError) as exc:
            what = {N: "no such call", StreamState.UNARY: "not a stream call"}.get(state)
            raise error(f"call {call_id}: {exc}" + (f" ({what})" if what else "")) from None
        flow = self._flows.get(call_id)
        if flow is None:
            return state, nxt
        if event == "Data":
            if direction is TX and flow.credit < 1:
                raise error(f"call {call_id}: no credit to send Data (all {flow.sent} items "
                            f"granted so far were sent)")
            if direction is RX and flow.window < 1:
                raise error(f"call {call_id}: Data beyond the window (item {flow.received + 1} "
                            f"of a window that allows {flow.received})")
        elif event == "Credit":
            held = flow.window if direction is TX else flow.credit
            if type(count) is not int or not 1 <= count <= MAX_CREDIT - held:
                raise error(f"call {call_id}: a Credit of {count!r:.40} (1..{MAX_CREDIT - held} "
                            f"may be granted now)")
        return state, nxt

    def commit(self, call_id: int, direction: Direction, event: str, state: StreamState,
               nxt: StreamState, count: int = 1) -> bool:
        """Make the transition :meth:`step` returned (nothing may have changed the stream in
        between).

        Returns:
            Whether a received event is to be delivered (False for the :data:`IGNORED` ones).
        """
        flows = self._flows
        flow = flows.get(call_id)
        if flow is None:
            if nxt in _STORED:  # opened by its Request
                flows[call_id] = Flow(nxt)
        elif nxt in _STORED:
            flow.state = nxt
            if event == "Data":
                if direction is TX:
                    flow.credit -= 1
                    flow.sent += 1
                else:
                    flow.window -= 1
                    flow.received += 1
            elif event == "Credit":
                if direction is TX:
                    flow.window += count
                else:
                    flow.credit += count
        else:  # answered
            del flows[call_id]
        if (self.role, state, direction, event) in IGNORED:
            self.dropped += 1
            return False
        return True

    def apply(self, call_id: int, direction: Direction, event: str, count: int = 1) -> bool:
        """:meth:`step`, then :meth:`commit`; returns what :meth:`commit` returns.

        Raises:
            LocalProtocolError, RemoteProtocolError: as :meth:`step`; nothing changes then.
        """
        state, nxt = self.step(call_id, direction, event, count)
        return self.commit(call_id, direction, event, state, nxt, count)

    def answered(self, call_id: int) -> None:
        """The call's answer went or came (the call table allowed it): forget its stream, if
        it was one."""
        if self._flows:
            self._flows.pop(call_id, None)
