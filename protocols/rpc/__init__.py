"""The RPC wire protocol that :mod:`aiordma.rpc` runs over an aiordma Endpoint.

Sans-I/O, as :mod:`aiordma.protocols.handshake` is: turn events into messages with
:meth:`RpcConnection.send` (or the ``send_*`` shorthands), feed each received message to
:meth:`RpcConnection.receive_message`, and take events from :meth:`RpcConnection.next_event`
(or :data:`NEED_DATA`). The per-call state machine lives in :mod:`aiordma.protocols.rpc._state`,
the stream calls' in :mod:`aiordma.protocols.rpc._stream`.

Transport
---------
An Endpoint is message-oriented: each send is one message, boundaries and order are kept. A
message carries one RPC *frame*, or a *batch* of frames back to back (see
:mod:`aiordma.protocols.rpc._batch`, whose :class:`Outbox` builds them). A frame that announces
out-of-band buffers is followed by that many raw *buffer* messages (in index order); in a
batch, only the last frame may announce any.

Frames
------
A frame (:mod:`aiordma.protocols.rpc._frame`) is a fixed 32-byte binary header (version, kind,
flags, ``nbufs``, method index, body length, id, deadline), then a msgpack *body*:

=========  ====  ======================================================================
event      kind  body
=========  ====  ======================================================================
Request    1     ``args`` (array); ``[args, kwargs]`` with ``F_KWARGS``; ``[method, args,
                 kwargs]`` with ``F_NAMED``. ``method`` is a str of 1..256 characters,
                 ``kwargs`` a map with string keys. With ``F_DEADLINE`` the header's
                 deadline is the caller's timeout in ms (0..2**63-1); without it, none.
Response   2     ``result`` (any value)
Error      3     ``[type, message]``: ``type`` (str, at most 256 characters: the remote
                 exception's type name), ``message`` (str)
Cancel     4     (no body)
Data       5     ``value`` (any value): a stream call's next item, either way
Credit     6     (no body; the header's method field is the count, 1..2**32-1): the sender
                 takes that many more items of the call from its peer
End        7     (no body): the client sends no more items on the call
=========  ====  ======================================================================

Data, Credit and End belong to *stream calls* (a Request with ``F_STREAM``): their rules, flow
control in items included, are :mod:`aiordma.protocols.rpc._stream`'s.

**Metadata.** A Request, a Response or an Error flagged ``F_META`` carries the call's (or the
answer's) key/value pairs: its body is ``[metadata, body]``, a msgpack map of 1..64 entries
and the body above. Keys are 1..128 characters of ``0-9 a-z _ . -``, values ``str`` or
``bytes`` of at most 4096 characters or bytes, keys and values at most 16 KiB together;
everything about them is :mod:`aiordma.protocols.rpc._meta`'s. Without the flag there is no
map (an empty one is refused: no metadata is sent as no flag), and the frame is byte for byte
what version 4 sent.

``version`` is :data:`PROTOCOL_VERSION` (5; version 4 had the same frames without
``F_META``, version 3 also without the stream kinds, version 2 was msgpack arrays with the
method name in every request, version 1 had no batches) and is checked first, so a frame of another version
is refused with a message naming both versions whatever its other fields are. ``id`` is the
call's id, an int in 0..2**63-1 chosen by the client, greater than every id it used before.
``nbufs`` is the number of out-of-band buffer messages that follow the frame (0..``max_buffers``).
Fields a kind does not use are 0, and a kind carries only its own flags.

**Method names travel once per connection.** The first request of a method name carries it
(``F_NAMED``) and binds it to the next free index (0, 1, 2, ... in order of first use, at most
:data:`MAX_METHODS`); later requests carry only the index. No exchange at connect is needed:
the table grows as the client calls, whatever the server serves (an unknown name is bound too,
and answered with an error per call one level up).

**Values are walked only when flagged.** Without ``F_WALK`` every value (each argument, each
keyword value, the result) is a plain scalar (nil, bool, int, float, str, bin) and the
receiver only checks that; a sender sets ``F_WALK`` when a value nests or carries an
extension type (out-of-band buffers, arrays), and the receiver then walks it.

``deadline`` is the caller's *relative* timeout in milliseconds, as the caller set it; the
server starts its own clock when the request arrives (so no clock need be shared; the transit
time is not deducted, which is conservative for the caller: the server may work a little past
the caller's deadline, never give up before it).

Values
------
The values inside a frame (arguments, results), the two msgpack extension types that carry
out-of-band buffers and numpy arrays, and their limits are :mod:`aiordma.protocols.rpc._codec`'s.
Every announced buffer must be referenced exactly once by the frame (no index at or above
``nbufs``, no index twice, none left over).

Limits and errors
-----------------
On receipt, anything malformed is a :class:`RemoteProtocolError` (the connection must then be
closed; the connection object keeps refusing afterwards): a message or buffer larger than
``max_message`` bytes, a header cut short or a body longer than the message, a body that is not
exactly one msgpack value, a batch frame before the last that announces buffers, containers
nested deeper than ``max_depth`` (msgpack's own unpacker stops at 1024 levels; deeper bombs are
refused without recursion), a container or extension value without ``F_WALK``, map keys other
than strings, unknown extension types, a wrong version, an unknown kind, flags or fields the
kind does not use, a method index not bound (or a name bound out of order, or past
:data:`MAX_METHODS`), a body of the wrong shape or a field of the wrong type or range,
``nbufs`` above ``max_buffers``, a bad buffer index, and any event the state machine does not
allow (see :mod:`aiordma.protocols.rpc._state`). Sizes declared inside msgpack (strings,
binaries, arrays, maps) are bounded by ``max_message`` before anything is allocated. Sending
anything that the receiver would refuse is a :class:`LocalProtocolError` instead, and changes
nothing.

The receiver cannot tell a frame from a buffer: while buffers are expected, the next message *is*
the next buffer, whatever it contains (the transport keeps order, so with a well-behaved sender it
always is). Conversely a buffer that arrives when none is expected is parsed as a frame and is then
normally refused as malformed.

Only the client sends requests, cancels and Ends; only the server answers. Both send items and
credits on a stream call. For calls both ways, run
two connections (one of each role) and tell their frames apart one level up.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .._sentinels import (
    NEED_DATA,
    _Sentinel,  # noqa: F401
)
from ..errors import LocalProtocolError, RemoteProtocolError
from . import _codec as codec
from . import _meta as meta
from ._batch import Outbox, join
from ._codec import EXT_BUFFER, EXT_CODES, EXT_NDARRAY, MAX_DEPTH_LIMIT
from ._encode import Limits, encode_event
from ._events import (
    BY_KIND,
    MAX_NAME,
    STREAM_KINDS,
    Cancel,
    Credit,
    Data,
    End,
    Error,
    Request,
    Response,
    RpcEvent,
    bad,
    new_data,
    new_request,
    new_response,
    ok_id,
)
from ._frame import (  # noqa: F401
    F_DEADLINE,
    F_KWARGS,
    F_META,
    F_NAMED,
    F_STREAM,
    F_WALK,
    HEADER,
    HEADER_SIZE,
    KIND_FLAGS,
    MAX_METHODS,
    VERSION,
    peer_version,
)
from ._receive import Receiving, _Pending
from ._state import (
    MAX_ID,  # noqa: F401
    Calls,
    CallState,
    Direction,
    Role,
)
from ._stream import MAX_CREDIT, Streams, StreamState

__all__ = [
    "DEFAULT_MAX_BUFFERS",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_MESSAGE",
    "DEFAULT_OOB_THRESHOLD",
    "EXT_BUFFER",
    "EXT_CODES",
    "EXT_NDARRAY",
    "MAX_CREDIT",
    "MAX_DEPTH_LIMIT",
    "MAX_METHODS",
    "MAX_NAME",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "CallState",
    "Cancel",
    "Credit",
    "Data",
    "End",
    "Error",
    "Outbox",
    "Request",
    "Response",
    "Role",
    "RpcConnection",
    "RpcEvent",
    "StreamState",
    "encode",
    "join",
]

PROTOCOL_VERSION = VERSION
DEFAULT_MAX_MESSAGE = 16 << 20
DEFAULT_MAX_DEPTH = 32
DEFAULT_MAX_BUFFERS = 64
DEFAULT_MAX_IN_FLIGHT = 1024
DEFAULT_OOB_THRESHOLD = 64 << 10


# -- sending ------------------------------------------------------------------------------------


def encode(event: RpcEvent, *, oob_threshold: int = DEFAULT_OOB_THRESHOLD,
           max_depth: int = DEFAULT_MAX_DEPTH, max_message: int = DEFAULT_MAX_MESSAGE,
           max_buffers: int = DEFAULT_MAX_BUFFERS, method_index: int = 0, bind: bool = True
           ) -> list[bytes | memoryview]:
    """The messages that carry ``event``: its frame, then its out-of-band buffers (validated).

    This checks the event alone; :meth:`RpcConnection.send` also checks the state machine and
    keeps the method table. A Request encoded here carries ``method_index``: with ``bind``,
    with its method's name too, binding the name to that index (as the first call of a name
    on a connection does, where the index is the next free one); without, the index alone (a
    later call).

    Args:
        event: the event to send.
        oob_threshold: binaries and arrays of at least this many bytes go out of band.
        max_depth: the deepest nesting of containers allowed in a value.
        max_message: the largest frame or buffer allowed, in bytes.
        max_buffers: the most out-of-band buffers allowed after one frame.
        method_index: a Request's method index.
        bind: whether a Request names its method (binding it to ``method_index``).

    Returns:
        The frame (``bytes``), then each buffer (the original object, not a copy).

    Raises:
        LocalProtocolError: the event or one of its values cannot be sent, or a limit is exceeded.
    """
    lim = Limits(oob_threshold, max_depth, max_message, max_buffers, codec.packer())
    return encode_event(lim, event, -method_index - 1 if bind else method_index)


_pack_header = HEADER.pack


class RpcConnection(Receiving):
    """One side of an RPC conversation over a message transport.

    Args:
        role: :attr:`Role.CLIENT` (sends requests and cancels) or :attr:`Role.SERVER`.
        max_message: the largest message or buffer, in bytes, sent or accepted.
        max_depth: the deepest nesting of containers in a value, sent or accepted
            (1..:data:`MAX_DEPTH_LIMIT`).
        max_buffers: the most out-of-band buffers after one frame, sent or accepted.
        max_in_flight: a server's limit on calls received and not yet answered.
        oob_threshold: binaries and arrays of at least this many bytes are sent out of band.
        peer_max_in_flight: a client's view of the server's ``max_in_flight`` (the client refuses
            to exceed it); defaults to ``max_in_flight``.

    Raises:
        ValueError: a limit is out of range.
    """

    def __init__(self, role: Role, *, max_message: int = DEFAULT_MAX_MESSAGE,
                 max_depth: int = DEFAULT_MAX_DEPTH, max_buffers: int = DEFAULT_MAX_BUFFERS,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 oob_threshold: int = DEFAULT_OOB_THRESHOLD,
                 peer_max_in_flight: int | None = None) -> None:
        if not 1 <= max_depth <= MAX_DEPTH_LIMIT:
            raise LocalProtocolError(f"max_depth must be 1..{MAX_DEPTH_LIMIT}")
        if max_message < 64 or max_buffers < 0 or max_buffers > 0xFFFFFFFF or oob_threshold < 1:
            raise LocalProtocolError("max_message >= 64, 0 <= max_buffers < 2**32, oob_threshold >= 1")
        if max_in_flight < 1 or (peer_max_in_flight is not None and peer_max_in_flight < 1):
            raise LocalProtocolError("in-flight limits must be at least 1")
        self.role = role
        self.max_message = max_message
        self.max_depth = max_depth
        self.max_buffers = max_buffers
        self.max_in_flight = max_in_flight
        self.oob_threshold = oob_threshold
        limit = max_in_flight
        if role is Role.CLIENT and peer_max_in_flight is not None:
            limit = peer_max_in_flight
        self._calls = Calls(role, limit)
        self._streams = Streams(role, self._calls)
        self._stream_flows = self._streams._flows  # (the hot paths check it is empty)
        self._pending: _Pending | None = None
        self._events: deque[RpcEvent] = deque()
        self._failed: RemoteProtocolError | None = None
        self._lim = Limits(oob_threshold, max_depth, max_message, max_buffers, codec.packer())
        self._pack = self._lim.packer.pack
        self._methods_out: dict[str, int] = {}  # client: the names bound so far, by name
        self._methods_in: list[str] = []  # server: the names bound so far, by index

    # -- state ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> frozenset[int]:
        """Ids of calls not answered yet: sent and unanswered (client), received and unanswered
        (server)."""
        return self._calls.in_flight

    @property
    def next_id(self) -> int:
        """The id :meth:`send_request` will give the next call."""
        return self._calls.next_id

    @property
    def cancels_after_answer(self) -> int:
        """Cancels received for calls already answered (they crossed the answer; ignored)."""
        return self._calls.cancels_after_answer

    @property
    def unknown_cancels(self) -> int:
        """Cancels received for ids never seen (a peer's bug; harmless, ignored)."""
        return self._calls.unknown_cancels

    @property
    def expecting_buffers(self) -> int:
        """How many out-of-band buffers the last frame announced that have not arrived yet."""
        p = self._pending
        return 0 if p is None else p.nbufs - len(p.buffers)

    @property
    def methods(self) -> tuple[str, ...]:
        """The method names bound on this connection, in index order: by the requests this side
        sent (a client) or received (a server)."""
        if self.role is Role.CLIENT:
            return tuple(self._methods_out)
        return tuple(self._methods_in)

    def call_state(self, call_id: int) -> CallState:
        """The state of call ``call_id`` on this side (see :mod:`aiordma.protocols.rpc._state`)."""
        return self._calls.state(call_id)

    @property
    def streams(self) -> frozenset[int]:
        """Ids of stream calls not answered yet (see :mod:`aiordma.protocols.rpc._stream`)."""
        return self._streams.open

    @property
    def streams_dropped(self) -> int:
        """Stream frames received that crossed an answer, an End or a Cancel (dropped)."""
        return self._streams.dropped

    def stream_state(self, call_id: int) -> StreamState:
        """The state of call ``call_id``'s stream on this side."""
        return self._streams.state(call_id)

    def stream_credit(self, call_id: int) -> int:
        """How many Data this side may send on stream call ``call_id`` now (0 for a call that
        is not an open stream)."""
        flow = self._stream_flows.get(call_id)
        return 0 if flow is None else flow.credit

    def stream_window(self, call_id: int) -> int:
        """How many Data the peer may still send on stream call ``call_id`` (granted by this
        side and not received yet; 0 for a call that is not an open stream)."""
        flow = self._stream_flows.get(call_id)
        return 0 if flow is None else flow.window

    # -- sending -------------------------------------------------------------------------

    def _index(self, method: Any) -> int:
        """The method's index, or (not bound yet) ``-next - 1``: bind it with this request."""
        index = self._methods_out.get(method) if type(method) is str else None
        if index is not None:
            return index
        if len(self._methods_out) >= MAX_METHODS:
            raise LocalProtocolError(f"more than {MAX_METHODS} method names on one connection")
        return -len(self._methods_out) - 1

    def send(self, event: RpcEvent) -> list[bytes | memoryview]:
        """The messages that carry ``event``, to be sent in order; advances the state machine.

        Args:
            event: a :class:`Request` (client; its id above every id used so far),
                :class:`Cancel` (client), :class:`Response` or :class:`Error` (server).

        Returns:
            The frame, then its out-of-band buffers (the original objects, not copies).

        Raises:
            LocalProtocolError: the event is not allowed now (state, in-flight limit), or cannot
                be sent (a value or limit). Nothing changes then.
        """
        cls = type(event)
        name = cls.__name__
        if cls not in BY_KIND.values():
            raise LocalProtocolError(f"{name} is not sent on the wire")
        if type(event.id) is not int:
            raise bad(cls, "id", event.id, LocalProtocolError)
        call_id = event.id
        if cls in STREAM_KINDS:
            count = event.count if cls is Credit else 1  # type: ignore[attr-defined]
            sstate, snxt = self._streams.step(call_id, Direction.SEND, name, count)
            messages = encode_event(self._lim, event, 0)
            self._streams.commit(call_id, Direction.SEND, name, sstate, snxt, count)
            return messages
        state, nxt = self._calls.step(call_id, Direction.SEND, name)
        stream = self._stream_step(event, Direction.SEND, name)
        index = self._index(event.method) if cls is Request else 0  # type: ignore[attr-defined]
        messages = encode_event(self._lim, event, index)
        self._calls.commit(call_id, Direction.SEND, name, state, nxt)
        self._stream_commit(call_id, Direction.SEND, name, stream)
        if index < 0:
            self._methods_out[event.method] = -index - 1  # type: ignore[attr-defined]
        return messages

    def _stream_step(self, event: RpcEvent, direction: Direction,
                     name: str) -> tuple[StreamState, StreamState] | None:
        """What a call's own event (checked by the call table) does to its stream: a stream
        Request opens one, a Cancel moves it; None: nothing (not a stream, or an answer, which
        :meth:`_stream_commit` forgets the stream for)."""
        if (type(event) is Request and event.stream is True) or (  # type: ignore[attr-defined]
                type(event) is Cancel and event.id in self._stream_flows):
            return self._streams.step(event.id, direction, name)
        return None

    def _stream_commit(self, call_id: int, direction: Direction, name: str,
                       step: tuple[StreamState, StreamState] | None) -> None:
        if step is not None:
            self._streams.commit(call_id, direction, name, *step)
        elif self._stream_flows and (name == "Response" or name == "Error"):
            self._stream_flows.pop(call_id, None)  # (an answer: an open stream -> DONE)

    def send_request(self, method: str, args: tuple[Any, ...] = (),
                     kwargs: dict[str, Any] | None = None, deadline_ms: int | None = None,
                     stream: bool = False, metadata: dict[str, str | bytes] | None = None
                     ) -> tuple[int, list[bytes | memoryview]]:
        """Start a call (client): allocates its id.

        Args:
            method: the method's name, 1..256 characters.
            args: positional arguments.
            kwargs: keyword arguments (string keys).
            deadline_ms: the caller's timeout, in milliseconds from now, or None.
            stream: a stream call (see :mod:`aiordma.protocols.rpc._stream`): grant the
                server's first credits with :meth:`send_credit`.
            metadata: the call's key/value pairs (:mod:`aiordma.protocols.rpc._meta`), or
                None (an empty mapping is sent as none).

        Returns:
            The call's id, and the messages to send in order.

        Raises:
            LocalProtocolError: this is a server, the server's in-flight limit would be exceeded,
                the ids are exhausted, more than :data:`MAX_METHODS` names were used, or an
                argument or the metadata cannot be sent.
        """
        calls = self._calls
        call_id = calls.next_id
        index = self._methods_out.get(method) if type(method) is str else None
        if (index is not None and not kwargs and type(args) is tuple and stream is False
                and (deadline_ms is None or ok_id(deadline_ms))
                and codec.plain(args, self.oob_threshold)):
            # the common call: a bound name, plain positional arguments (same bytes as the
            # general path below, which words every error)
            flags = 0 if deadline_ms is None else F_DEADLINE
            body: Any = args
            if metadata is not None:
                md = meta.check(metadata)  # (LocalProtocolError: nothing changed)
                if md:
                    body, flags = [md, args], flags | F_META
            try:
                data = self._pack(body)
            except Exception:  # noqa: BLE001  # e.g. a lone surrogate: worded below
                data = None
            if data is not None:
                frame = _pack_header(VERSION, 1, flags, 0, index, len(data), call_id,
                                     deadline_ms or 0) + data
                if len(frame) <= self.max_message:
                    calls.request(call_id, Direction.SEND)
                    return call_id, [frame]
        event = new_request(call_id, method, tuple(args), {} if kwargs is None else kwargs,
                             deadline_ms, stream, metadata)
        return call_id, self.send(event)

    def send_response(self, call_id: int, result: Any,
                      metadata: dict[str, str | bytes] | None = None
                      ) -> list[bytes | memoryview]:
        """Answer call ``call_id`` (server) with ``result`` (and the answer's ``metadata``).

        Returns:
            The messages to send in order.

        Raises:
            LocalProtocolError: this is a client, the call is not running here, or the result
                or the metadata cannot be sent.
        """
        if type(call_id) is int and codec.plain((result,), self.oob_threshold):
            # the common answer (same bytes as the general path below, which words errors)
            flags = 0
            body: Any = result
            if metadata is not None:
                md = meta.check(metadata)  # (LocalProtocolError: nothing changed)
                if md:
                    body, flags = [md, result], F_META
            try:
                data = self._pack(body)
            except Exception:  # noqa: BLE001  # e.g. a lone surrogate: worded below
                data = None
            if data is not None and len(data) + HEADER_SIZE <= self.max_message:
                self._calls.answer(call_id, Direction.SEND, "Response")
                if self._stream_flows:
                    self._stream_flows.pop(call_id, None)
                return [_pack_header(VERSION, 2, flags, 0, 0, len(data), call_id, 0) + data]
        return self.send(new_response(call_id, result, metadata))

    def send_error(self, call_id: int, type: str, message: str,
                   metadata: dict[str, str | bytes] | None = None) -> list[bytes | memoryview]:
        """Answer call ``call_id`` (server) with an exception's type name and message (and the
        answer's ``metadata``).

        Returns:
            The messages to send in order.

        Raises:
            LocalProtocolError: this is a client, the call is not running here, the type name
                is longer than 256 characters, or the metadata cannot be sent.
        """
        return self.send(Error(id=call_id, type=type, message=message, metadata=metadata))

    def send_cancel(self, call_id: int) -> list[bytes | memoryview]:
        """Tell the server (client) that call ``call_id``'s answer is no longer wanted.

        The call stays in flight until its answer (which the server always sends) arrives.

        Returns:
            The messages to send in order.

        Raises:
            LocalProtocolError: this is a server, or the call is not waiting (unknown, answered,
                or already cancelled).
        """
        return self.send(Cancel(id=call_id))

    def send_data(self, call_id: int, value: Any) -> list[bytes | memoryview]:
        """Send the next item of stream call ``call_id`` (either side); spends a credit.

        Returns:
            The messages to send in order (the frame, then its out-of-band buffers).

        Raises:
            LocalProtocolError: the call is not an open stream this side may send on (a client
                after its End or Cancel; a server after a Cancel), no credit is left, or the
                value cannot be sent. Nothing changes then.
        """
        return self.send(new_data(call_id, value))

    def send_credit(self, call_id: int, count: int) -> list[bytes | memoryview]:
        """Let the peer send ``count`` more items on stream call ``call_id``.

        Raises:
            LocalProtocolError: the peer sends no more items on this call (a server after the
                client's End; anything cancelled or answered), or ``count`` is not in 1..the
                room left below :data:`MAX_CREDIT`.
        """
        return self.send(Credit(id=call_id, count=count))

    def send_end(self, call_id: int) -> list[bytes | memoryview]:
        """Tell the server (client) that stream call ``call_id`` has no more items.

        Raises:
            LocalProtocolError: this is a server, or the call is not an open stream.
        """
        return self.send(End(id=call_id))
