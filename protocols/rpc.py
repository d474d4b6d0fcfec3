"""The RPC wire protocol that :mod:`aiordma.rpc` runs over an aiordma Endpoint.

Sans-I/O, as :mod:`aiordma.protocols.handshake` is: turn events into messages with
:meth:`RpcConnection.send` (or the ``send_*`` shorthands), feed each received message to
:meth:`RpcConnection.receive_message`, and take events from :meth:`RpcConnection.next_event`
(or :data:`NEED_DATA`). The per-call state machine lives in :mod:`aiordma.protocols._rpc_state`.

Transport
---------
An Endpoint is message-oriented: each send is one message, boundaries and order are kept. So
there is no byte-stream framing here: a message carries one RPC *frame*, or a *batch* of
frames (a msgpack array of one or more frames, in order; see
:mod:`aiordma.protocols._rpc_batch`, whose :class:`Outbox` builds them). A frame that announces
out-of-band buffers is followed by that many raw *buffer* messages (in index order); in a
batch, only the last frame may announce any.

Frames
------
A frame is one msgpack array::

    [version, kind, id, field..., nbufs]

=========  ====  ======================================================================
event      kind  fields (between ``id`` and ``nbufs``)
=========  ====  ======================================================================
Request    1     ``method`` (str, 1..256 characters), ``args`` (array), ``kwargs``
                 (map, string keys), ``deadline_ms`` (nil or int 0..2**63-1)
Response   2     ``result`` (any value)
Error      3     ``type`` (str, at most 256 characters: the remote exception's type name),
                 ``message`` (str)
Cancel     4     (none)
=========  ====  ======================================================================

``version`` is :data:`PROTOCOL_VERSION` (2: version 1 had no batches) and is checked first, so a frame of another version
is refused with a message naming both versions whatever its other fields are. ``id`` is the
call's id, an int in 0..2**63-1 chosen by the client, greater than every id it used before.
``nbufs`` is the number of out-of-band buffer messages that follow the frame (0..``max_buffers``).

``deadline_ms`` is the caller's *relative* timeout in milliseconds, as the caller set it; the
server starts its own clock when the request arrives (so no clock need be shared; the transit
time is not deducted, which is conservative for the caller: the server may work a little past
the caller's deadline, never give up before it).

Values
------
The values inside a frame (arguments, results), the two msgpack extension types that carry
out-of-band buffers and numpy arrays, and their limits are :mod:`aiordma.protocols._rpc_codec`'s.
Every announced buffer must be referenced exactly once by the frame (no index at or above
``nbufs``, no index twice, none left over).

Limits and errors
-----------------
On receipt, anything malformed is a :class:`RemoteProtocolError` (the connection must then be
closed; the connection object keeps refusing afterwards): a frame or buffer larger than
``max_message`` bytes, bytes that are not exactly one msgpack value, a batch frame before the
last that announces buffers, containers nested deeper than
``max_depth`` (msgpack's own unpacker stops at 1024 levels; deeper bombs are refused without
recursion), map keys other than strings, unknown extension types, a wrong version, an unknown kind,
a wrong number of fields or a field of the wrong type or range, ``nbufs`` above ``max_buffers``, a
bad buffer index, and any event the state machine does not allow (see
:mod:`aiordma.protocols._rpc_state`). Sizes declared inside msgpack (strings, binaries, arrays, maps) are
bounded by ``max_message`` before anything is allocated. Sending anything that the receiver would
refuse is a :class:`LocalProtocolError` instead, and changes nothing.

The receiver cannot tell a frame from a buffer: while buffers are expected, the next message *is*
the next buffer, whatever it contains (the transport keeps order, so with a well-behaved sender it
always is). Conversely a buffer that arrives when none is expected is parsed as a frame and is then
normally refused as malformed.

Only the client sends requests (and cancels); only the server answers. For calls both ways, run
two connections (one of each role) and tell their frames apart one level up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from . import _rpc_codec as codec
from ._rpc_batch import Outbox, join
from ._rpc_codec import EXT_BUFFER, EXT_CODES, EXT_NDARRAY, MAX_DEPTH_LIMIT
from ._rpc_state import MAX_ID, Calls, CallState, Direction, Role
from ._sentinels import NEED_DATA, _Sentinel
from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_BUFFERS",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_MESSAGE",
    "DEFAULT_OOB_THRESHOLD",
    "EXT_BUFFER",
    "EXT_CODES",
    "EXT_NDARRAY",
    "MAX_DEPTH_LIMIT",
    "MAX_NAME",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "CallState",
    "Cancel",
    "Error",
    "Outbox",
    "Request",
    "Response",
    "Role",
    "RpcConnection",
    "RpcEvent",
    "encode",
    "join",
]

PROTOCOL_VERSION = 2
DEFAULT_MAX_MESSAGE = 16 << 20
DEFAULT_MAX_DEPTH = 32
DEFAULT_MAX_BUFFERS = 64
DEFAULT_MAX_IN_FLIGHT = 1024
DEFAULT_OOB_THRESHOLD = 64 << 10
MAX_NAME = 256  # characters in a method name or an error's type name


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcEvent:
    """Base class of RPC events. Every event names its call by ``id``."""

    kind: ClassVar[int] = 0
    id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Request(RpcEvent):
    """Client -> server: call ``method(*args, **kwargs)``, giving up after ``deadline_ms``."""

    kind: ClassVar[int] = 1
    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    deadline_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Response(RpcEvent):
    """Server -> client: the call returned ``result``."""

    kind: ClassVar[int] = 2
    result: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(RpcEvent):
    """Server -> client: the call raised an exception of type name ``type`` with ``message``."""

    kind: ClassVar[int] = 3
    type: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel(RpcEvent):
    """Client -> server: the caller no longer wants the answer (the server still answers)."""

    kind: ClassVar[int] = 4


def _maker(cls: type[RpcEvent], *names: str) -> Any:
    """A constructor of ``cls`` from positional field values (``names``' order) for the hot
    paths: the same frozen event as ``cls(**fields)``, built without the frozen ``__init__``'s
    ``object.__setattr__`` per field (about 2.5x faster). Every field must be given."""
    new = object.__new__
    setters = tuple(getattr(cls, n).__set__ for n in names)  # the slots' own descriptors
    if {f.name for f in fields(cls)} != set(names):
        raise TypeError(f"{cls.__name__} has other fields than {names}")
    if len(setters) == 2:
        set_a, set_b = setters

        def make2(a: Any, b: Any) -> Any:
            obj = new(cls)
            set_a(obj, a)
            set_b(obj, b)
            return obj
        return make2
    set_a, set_b, set_c, set_d, set_e = setters

    def make5(a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
        obj = new(cls)
        set_a(obj, a)
        set_b(obj, b)
        set_c(obj, c)
        set_d(obj, d)
        set_e(obj, e)
        return obj
    return make5


_new_request = _maker(Request, "id", "method", "args", "kwargs", "deadline_ms")
_new_response = _maker(Response, "id", "result")

_BY_KIND: dict[int, type[RpcEvent]] = {c.kind: c for c in (Request, Response, Error, Cancel)}
_FIELDS: dict[type[RpcEvent], tuple[str, ...]] = {
    c: tuple(f.name for f in fields(c) if f.name != "id") for c in _BY_KIND.values()}


def _ok_id(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_ID


def _ok_name(v: Any) -> bool:
    return isinstance(v, str) and 1 <= len(v) <= MAX_NAME


_FIELD_OK: dict[str, Any] = {  # the header fields' types and ranges, one check per field name
    "id": _ok_id,
    "deadline_ms": lambda v: v is None or _ok_id(v),
    "method": _ok_name,
    "type": lambda v: isinstance(v, str) and len(v) <= MAX_NAME,
    "message": lambda v: isinstance(v, str),
    "args": lambda v: isinstance(v, (tuple, list)),
    "kwargs": lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    "result": lambda v: True,  # any value: checked by the codec
}
_CHECKS: dict[type[RpcEvent], tuple[tuple[str, Any], ...]] = {
    c: tuple((n, _FIELD_OK[n]) for n in ("id", *names)) for c, names in _FIELDS.items()}


def _check_fields(cls: type[RpcEvent], values: dict[str, Any], error: type[Exception]) -> None:
    """The header fields' types and ranges (values inside args/kwargs/result are checked
    elsewhere)."""
    for name, ok in _CHECKS[cls]:
        v = values[name]
        if not ok(v):
            raise error(f"{cls.__name__}.{name}: {codec.short(v)} is not a valid value")


def _encode_plain(event: RpcEvent, cls: type, threshold: int, packer: Any) -> bytes | None:
    """The frame of a Request or Response whose values are all plain leaves (the common case:
    no encoder, no walk, no out-of-band buffer), or None: then :func:`encode`'s general path
    checks and encodes it (and words any error). Same bytes as the general path."""
    if cls is Request:
        ev: Any = event
        args, kwargs, deadline, name = ev.args, ev.kwargs, ev.deadline_ms, ev.method
        if not (type(args) is tuple or type(args) is list) or type(kwargs) is not dict:
            return None
        if not (_ok_id(ev.id) and _ok_name(name) and (deadline is None or _ok_id(deadline))
                and codec.plain(args, threshold)):
            return None
        if kwargs and not (all(type(k) is str for k in kwargs)
                           and codec.plain(kwargs.values(), threshold)):
            return None
        return codec.pack([PROTOCOL_VERSION, 1, ev.id, name, args, kwargs, deadline, 0],
                          "Request", packer)
    if cls is Response:
        ev = event
        if not (_ok_id(ev.id) and codec.plain((ev.result,), threshold)):
            return None
        return codec.pack([PROTOCOL_VERSION, 2, ev.id, ev.result, 0], "Response", packer)
    return None


def encode(event: RpcEvent, *, oob_threshold: int = DEFAULT_OOB_THRESHOLD,
           max_depth: int = DEFAULT_MAX_DEPTH, max_message: int = DEFAULT_MAX_MESSAGE,
           max_buffers: int = DEFAULT_MAX_BUFFERS, packer: Any = None
           ) -> list[bytes | memoryview]:
    """The messages that carry ``event``: its frame, then its out-of-band buffers (validated).

    This checks the event alone; :meth:`RpcConnection.send` also checks the state machine.

    Args:
        event: the event to send.
        oob_threshold: binaries and arrays of at least this many bytes go out of band.
        max_depth: the deepest nesting of containers allowed in a value.
        max_message: the largest frame or buffer allowed, in bytes.
        max_buffers: the most out-of-band buffers allowed after one frame.
        packer: a :func:`aiordma.protocols._rpc_codec.packer` to reuse (a connection's own).

    Returns:
        The frame (``bytes``), then each buffer (the original object, not a copy).

    Raises:
        LocalProtocolError: the event or one of its values cannot be sent, or a limit is exceeded.
    """
    cls = type(event)
    data = _encode_plain(event, cls, oob_threshold, packer)
    if data is not None:
        if len(data) > max_message:
            raise LocalProtocolError(f"{cls.__name__} frame of {len(data)} B exceeds "
                                     f"{max_message} B")
        return [data]
    checks = _CHECKS.get(cls)
    if checks is None:
        raise LocalProtocolError(f"{cls.__name__} is not sent on the wire")
    values_out = codec.ValueEncoder(oob_threshold, max_depth, max_message)
    value = values_out.value
    frame: list[Any] = [PROTOCOL_VERSION, cls.kind]
    for name, ok in checks:  # id first, then the fields in wire order
        v = getattr(event, name)
        if not ok(v):
            raise LocalProtocolError(f"{cls.__name__}.{name}: {codec.short(v)} is not a valid "
                                     f"value")
        if name == "args":
            v = [value(a, 0) for a in v]
        elif name == "kwargs":
            v = {k: value(a, 0) for k, a in v.items()}
        elif name == "result":
            v = value(v, 0)
        frame.append(v)
    frame.append(len(values_out.buffers))
    if len(values_out.buffers) > max_buffers:
        raise LocalProtocolError(f"{len(values_out.buffers)} out-of-band buffers exceed "
                                 f"{max_buffers}")
    data = codec.pack(frame, cls.__name__, packer)
    if len(data) > max_message:
        raise LocalProtocolError(f"{cls.__name__} frame of {len(data)} B exceeds {max_message} B")
    return [data, *values_out.buffers]


# -- receiving --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    """A frame whose out-of-band buffers have not all arrived."""

    cls: type[RpcEvent]
    values: dict[str, Any]
    refs: list[codec.Ref]  # (container, key, placeholder)
    nbufs: int
    buffers: list[memoryview]
    step: tuple[CallState, CallState] | None  # the state machine's verdict, if still valid


class RpcConnection:
    """One side of an RPC conversation over a message transport.

    Args:
        role: :attr:`Role.CLIENT` (sends requests and cancels) or :attr:`Role.SERVER`.
        max_message: the largest frame or buffer, in bytes, sent or accepted.
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
        self._pending: _Pending | None = None
        self._events: deque[RpcEvent] = deque()
        self._failed: RemoteProtocolError | None = None
        self._packer = codec.packer()

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

    def call_state(self, call_id: int) -> CallState:
        """The state of call ``call_id`` on this side (see :mod:`aiordma.protocols._rpc_state`)."""
        return self._calls.state(call_id)

    # -- sending -------------------------------------------------------------------------

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
        name = type(event).__name__
        if type(event) not in _FIELDS:
            raise LocalProtocolError(f"{name} is not sent on the wire")
        if type(event.id) is not int:
            raise LocalProtocolError(f"{name}.id: {codec.short(event.id)} is not a valid value")
        state, nxt = self._calls.step(event.id, Direction.SEND, name)
        messages = encode(event, oob_threshold=self.oob_threshold, max_depth=self.max_depth,
                          max_message=self.max_message, max_buffers=self.max_buffers,
                          packer=self._packer)
        self._calls.commit(event.id, Direction.SEND, name, state, nxt)
        return messages

    def send_request(self, method: str, args: tuple[Any, ...] = (),
                     kwargs: dict[str, Any] | None = None,
                     deadline_ms: int | None = None) -> tuple[int, list[bytes | memoryview]]:
        """Start a call (client): allocates its id.

        Args:
            method: the method's name, 1..256 characters.
            args: positional arguments.
            kwargs: keyword arguments (string keys).
            deadline_ms: the caller's timeout, in milliseconds from now, or None.

        Returns:
            The call's id, and the messages to send in order.

        Raises:
            LocalProtocolError: this is a server, the server's in-flight limit would be exceeded,
                the ids are exhausted, or an argument cannot be sent.
        """
        call_id = self._calls.next_id
        event = _new_request(call_id, method, tuple(args), {} if kwargs is None else kwargs,
                             deadline_ms)
        return call_id, self.send(event)

    def send_response(self, call_id: int, result: Any) -> list[bytes | memoryview]:
        """Answer call ``call_id`` (server) with ``result``.

        Returns:
            The messages to send in order.

        Raises:
            LocalProtocolError: this is a client, the call is not running here, or the result
                cannot be sent.
        """
        return self.send(_new_response(call_id, result))

    def send_error(self, call_id: int, type: str, message: str) -> list[bytes | memoryview]:
        """Answer call ``call_id`` (server) with an exception's type name and message.

        Returns:
            The messages to send in order.

        Raises:
            LocalProtocolError: this is a client, the call is not running here, or the type name
                is empty or longer than 256 characters.
        """
        return self.send(Error(id=call_id, type=type, message=message))

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

    # -- receiving -----------------------------------------------------------------------

    def receive_message(self, msg: bytes | bytearray | memoryview) -> None:
        """Feed exactly one received message: a frame or a batch of frames, or the next buffer
        the last frame announced. The message is not copied when it becomes an out-of-band
        value.

        Raises:
            RemoteProtocolError: the message is malformed, exceeds a limit, or brings an event
                the state machine does not allow. The connection is unusable afterwards.
            LocalProtocolError: ``msg`` is not a contiguous buffer.
        """
        if self._failed is not None:
            raise RemoteProtocolError(f"the connection failed earlier: {self._failed}")
        try:
            self._receive(msg)
        except RemoteProtocolError as exc:
            self._failed = exc
            self._pending = None
            raise

    def next_event(self) -> RpcEvent | _Sentinel:
        """The next received event, or :data:`NEED_DATA` when a message must be fed first.

        Events come in the order their frames arrived; an event whose out-of-band buffers have
        not all arrived is not returned yet.
        """
        return self._events.popleft() if self._events else NEED_DATA

    def _receive(self, msg: bytes | bytearray | memoryview) -> None:
        mv = codec.as_bytes_view(msg)
        if mv.nbytes > self.max_message:
            what = "buffer" if self._pending is not None else "frame"
            raise RemoteProtocolError(f"{what} of {mv.nbytes} B exceeds {self.max_message} B")
        pending = self._pending
        if pending is not None:
            pending.buffers.append(mv)
            if len(pending.buffers) == pending.nbufs:
                self._pending = None
                self._complete(pending)
            return
        frame = codec.unpack(mv, self.max_message, self.max_depth)
        if type(frame) is list and frame and type(frame[0]) is list:  # a batch
            last = len(frame) - 1
            for i, f in enumerate(frame):
                if not self._take_frame(f) and i != last:
                    raise RemoteProtocolError(f"frame {i} of a batch of {last + 1} announces "
                                              f"buffers: only the last may")
        else:
            self._take_frame(frame)

    def _take_frame(self, frame: Any) -> bool:
        """Take one frame; False: it announced buffers, which the next messages bring."""
        if self._take_plain(frame):
            return True
        pending = self._parse_frame(frame)
        if pending.nbufs:
            self._pending = pending
            return False
        self._complete(pending)
        return True

    def _take_plain(self, frame: Any) -> bool:
        """Take a well-formed Request or Response frame without buffers whose values are
        plain leaves (the common case) at once; False: :meth:`_parse_frame` checks the frame
        in full (and words any error). Accepts exactly what the general path accepts."""
        if type(frame) is not list or frame[-1:] != [0] or type(frame[-1]) is not int:
            return False
        n = len(frame)
        if n == 8:  # [version, 1, id, method, args, kwargs, deadline, 0]
            version, kind, call_id, name, args, kwargs, deadline, _ = frame
            if not (kind == 1 and type(kind) is int and version == PROTOCOL_VERSION
                    and type(version) is int and _ok_id(call_id) and _ok_name(name)
                    and type(args) is list
                    and type(kwargs) is dict and (deadline is None or _ok_id(deadline))):
                return False
            leaves = codec.LEAVES
            for v in args:
                if type(v) not in leaves:
                    return False
            for k, v in kwargs.items():
                if type(k) is not str or type(v) not in leaves:
                    return False
            state, nxt = self._calls.step(call_id, Direction.RECV, "Request")
            event: RpcEvent = _new_request(call_id, name, tuple(args), kwargs, deadline)
            if self._calls.commit(call_id, Direction.RECV, "Request", state, nxt):
                self._events.append(event)
            return True
        if n == 5:  # [version, 2, id, result, 0]
            version, kind, call_id, result, _ = frame
            if not (kind == 2 and type(kind) is int and version == PROTOCOL_VERSION
                    and type(version) is int and _ok_id(call_id)
                    and type(result) in codec.LEAVES):
                return False
            state, nxt = self._calls.step(call_id, Direction.RECV, "Response")
            event = _new_response(call_id, result)
            if self._calls.commit(call_id, Direction.RECV, "Response", state, nxt):
                self._events.append(event)
            return True
        return False

    def _parse_frame(self, frame: Any) -> _Pending:
        if type(frame) is not list or len(frame) < 2:
            raise RemoteProtocolError("an RPC frame is an array [version, kind, id, ..., nbufs]")
        version, kind = frame[0], frame[1]
        if version != PROTOCOL_VERSION or type(version) is not int:
            raise RemoteProtocolError(f"peer speaks RPC protocol version {codec.short(version)}, "
                                      f"this side {PROTOCOL_VERSION}")
        cls = _BY_KIND.get(kind) if type(kind) is int else None
        if cls is None:
            raise RemoteProtocolError(f"unknown RPC frame kind {codec.short(kind)}")
        names = _FIELDS[cls]
        if len(frame) != len(names) + 4:
            raise RemoteProtocolError(f"{cls.__name__} frame has {len(frame)} items, "
                                      f"not {len(names) + 4}")
        nbufs = frame[-1]
        if type(nbufs) is not int or not 0 <= nbufs <= self.max_buffers:
            raise RemoteProtocolError(f"{cls.__name__} announces {codec.short(nbufs)} buffers "
                                      f"(at most {self.max_buffers})")
        values = dict(zip(names, frame[3:-1], strict=True))
        values["id"] = frame[2]
        _check_fields(cls, values, RemoteProtocolError)
        # Walk the values without recursion: nesting depth, map keys, leaf types, placeholders.
        refs: list[codec.Ref] = []
        if cls is Request:
            values["args"] = args = list(values["args"])
            codec.scan_items(args, range(len(args)), refs, self.max_depth)
            kw = values["kwargs"]
            codec.scan_items(kw, kw, refs, self.max_depth)
        elif cls is Response:
            codec.scan_items(values, ("result",), refs, self.max_depth)
        else:  # header fields only: a placeholder among them is already refused by type
            pass
        seen = set()
        for _, _, ref in refs:
            index = ref.index
            if index is None:
                continue
            if index >= nbufs or index in seen:
                raise RemoteProtocolError(f"buffer index {index} is not one of the {nbufs} "
                                          f"announced, or is used twice")
            seen.add(index)
        if len(seen) != nbufs:
            raise RemoteProtocolError(f"{cls.__name__} announces {nbufs} buffers and uses "
                                      f"{len(seen)}")
        # Check the state machine now too (without applying it), so a frame the call's state
        # does not allow is refused before its buffers are awaited.
        step = self._calls.step(values["id"], Direction.RECV, cls.__name__)
        return _Pending(cls, values, refs, nbufs, [], step if nbufs == 0 else None)

    def _complete(self, pending: _Pending) -> None:
        if pending.refs:
            codec.rebuild(pending.refs, pending.buffers)
        values = pending.values
        cls = pending.cls
        if cls is Request:
            values["args"] = tuple(values["args"])
        event = cls(**values)
        name = cls.__name__
        # (a step taken before buffers were awaited may be stale: this side may have sent
        # something for the call meanwhile; take it again then)
        state, nxt = pending.step or self._calls.step(event.id, Direction.RECV, name)
        if self._calls.commit(event.id, Direction.RECV, name, state, nxt):
            self._events.append(event)
