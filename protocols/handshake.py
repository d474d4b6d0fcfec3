"""The control channel: connection set-up, then close, over a byte stream (TCP).

Sans-I/O, as h11 is: feed received bytes with :meth:`ControlConnection.receive_data`, take
events from :meth:`ControlConnection.next_event` (or :data:`NEED_DATA`), and turn events to
send into bytes with :meth:`ControlConnection.send`. The state machine lives in
:mod:`protocols._handshake_state`.

Wire format: each message is a 4-byte big-endian length, then a msgpack map with a type code
``"t"`` and the fields of the event. Limits are explicit: :data:`MAX_FRAME` bytes per message,
msgpack string/bin/array/map sizes bounded, ``strict_map_key``, no ext types. Any violation is
a :class:`RemoteProtocolError`.

Set-up (three messages): the client sends :class:`Hello` (protocol version, its queue pair's
number, initial PSN, GID, LID, MTU, and its receive window); the server answers
:class:`Accept` (the same for its side) or :class:`Reject`; the client, once its queue pair is
ready to receive and send, confirms with :class:`Ready`, after which either side may use RDMA.
Close: each side sends one :class:`Close` carrying how many RDMA messages it sent, so the peer
knows when it has seen them all. End of stream is reported as :class:`ConnectionClosed`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

from ._handshake_state import Direction, Role, State, next_state
from ._sentinels import NEED_DATA, _Sentinel
from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAX_FRAME",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "Accept",
    "Close",
    "ConnectionClosed",
    "ControlConnection",
    "Event",
    "Hello",
    "Ready",
    "Reject",
    "Role",
    "State",
]

PROTOCOL_VERSION = 1
MAX_FRAME = 16 * 1024
_LEN = struct.Struct(">I")


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base class of control-channel events."""

    code: ClassVar[int] = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class _QPParams(Event):
    """What each side tells the other about its queue pair and receive window."""

    version: int = PROTOCOL_VERSION
    qp_num: int  # 24 bits
    psn: int  # 24 bits, random
    gid: bytes  # 16 bytes
    lid: int  # 16 bits (0 on RoCE)
    mtu: int  # ibv_mtu enum, 1..5
    data_slots: int  # receive slots for data messages (the peer's initial data credits)
    ctrl_slots: int  # receive slots for credit messages (the peer's initial control credits)
    slot_size: int  # bytes per receive slot, header included
    max_rd_atomic: int  # RDMA READs/atomics this side accepts in flight


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(_QPParams):
    """Client -> server: connection request."""

    code: ClassVar[int] = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Accept(_QPParams):
    """Server -> client: request accepted; the server's queue pair is ready."""

    code: ClassVar[int] = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Reject(Event):
    """Either way during set-up: request refused, with a reason for humans."""

    code: ClassVar[int] = 3
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Event):
    """Client -> server: the client's queue pair is connected; RDMA traffic may start."""

    code: ClassVar[int] = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Close(Event):
    """Either way when open: this side sends nothing more; it sent ``sent`` RDMA messages."""

    code: ClassVar[int] = 5
    sent: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionClosed(Event):
    """The byte stream ended. ``graceful`` is true when the peer's Close came first."""

    code: ClassVar[int] = -1
    graceful: bool


_BY_CODE: dict[int, type[Event]] = {c.code: c for c in (Hello, Accept, Reject, Ready, Close)}
_U24, _U16, _U32, _U64 = (1 << 24) - 1, (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1
# field -> (type, low, high); bytes fields: (bytes, exact length, exact length)
_FIELD_RULES: dict[str, tuple[type, int, int]] = {
    "version": (int, 0, _U16), "qp_num": (int, 0, _U24), "psn": (int, 0, _U24),
    "gid": (bytes, 16, 16), "lid": (int, 0, _U16), "mtu": (int, 1, 5),
    "data_slots": (int, 1, _U16), "ctrl_slots": (int, 1, _U16),
    "slot_size": (int, 64, 1 << 20), "max_rd_atomic": (int, 0, 255),
    "reason": (str, 0, 1024), "sent": (int, 0, _U64),
}


def _check_fields(cls: type[Event], values: dict[str, Any], error: type[Exception]) -> None:
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in values:
            raise error(f"{cls.__name__} lacks field {f.name!r}")
        kind, low, high = _FIELD_RULES[f.name]
        v = values[f.name]
        if kind is int:
            ok = type(v) is int and low <= v <= high
        elif kind is bytes:
            ok = isinstance(v, bytes) and low <= len(v) <= high
        else:  # at most ``high`` characters, all encodable (no lone surrogates)
            ok = isinstance(v, str) and len(v) <= high
            if ok:
                try:
                    v.encode()
                except UnicodeEncodeError:
                    ok = False
        if not ok:
            raise error(f"{cls.__name__}.{f.name}: {v!r} is not a valid value")


def encode(event: Event) -> bytes:
    """One event as a length-prefixed msgpack frame (validated)."""
    cls = type(event)
    if cls not in _BY_CODE.values():
        raise LocalProtocolError(f"{cls.__name__} is not sent on the wire")
    values = {f.name: getattr(event, f.name) for f in fields(event)}
    _check_fields(cls, values, LocalProtocolError)
    body = msgpack.packb({"t": cls.code, **values}, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _decode(body: bytes) -> Event:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                              max_str_len=4 * 1024, max_bin_len=64, max_array_len=16,
                              max_map_len=32, max_ext_len=0)
    except msgpack.ExtraData as exc:
        raise RemoteProtocolError("trailing bytes after a control message") from exc
    except Exception as exc:  # msgpack raises several types for malformed input
        raise RemoteProtocolError(f"malformed control message: {exc}") from exc
    if not isinstance(obj, dict) or type(obj.get("t")) is not int:
        raise RemoteProtocolError("a control message is a map with an integer type 't'")
    cls = _BY_CODE.get(obj.pop("t"))
    if cls is None:
        raise RemoteProtocolError("unknown control message type")
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    extra = set(obj) - names
    if extra:
        raise RemoteProtocolError(f"{cls.__name__} has unknown fields {sorted(map(str, extra))}")
    _check_fields(cls, obj, RemoteProtocolError)
    return cls(**obj)


class ControlConnection:
    """One side of the control channel.

    Args:
        role: :attr:`Role.CLIENT` (sends Hello) or :attr:`Role.SERVER`.
        max_frame: the largest message body accepted, in bytes.
    """

    def __init__(self, role: Role, *, max_frame: int = MAX_FRAME) -> None:
        self.role = role
        self.state = State.START
        self.max_frame = max_frame
        self._buf = bytearray()
        self._eof = False
        self._closed_reported = False
        self.peer_params: _QPParams | None = None

    def send(self, event: Event) -> bytes:
        """Bytes for ``event``; advances the state machine.

        Raises:
            LocalProtocolError: the event is not allowed now, or its fields are invalid.
        """
        data = encode(event)
        self.state = next_state(self.role, self.state, Direction.SEND, type(event).__name__)
        return data

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes from the stream; ``b""`` means end of stream."""
        if self._eof:
            if data:
                raise LocalProtocolError("data fed after end of stream")
            return
        if not data:
            self._eof = True
        else:
            self._buf += data

    def next_event(self) -> Event | _Sentinel:
        """The next event, or :data:`NEED_DATA`.

        Raises:
            RemoteProtocolError: malformed bytes, a limit exceeded, a message not allowed in
                the current state, or the stream ending inside a message.
        """
        buf = self._buf
        if len(buf) >= 4:
            (n,) = _LEN.unpack_from(buf)
            if n > self.max_frame:
                raise RemoteProtocolError(f"control message of {n} B exceeds {self.max_frame} B")
            if len(buf) >= 4 + n:
                body = bytes(buf[4:4 + n])
                del buf[:4 + n]
                event = _decode(body)
                self.state = next_state(self.role, self.state, Direction.RECV,
                                        type(event).__name__)
                if isinstance(event, (Hello, Accept)):
                    if event.version != PROTOCOL_VERSION:
                        raise RemoteProtocolError(f"peer speaks protocol version {event.version},"
                                                  f" this side {PROTOCOL_VERSION}")
                    self.peer_params = event
                return event
        if self._eof:
            if buf:
                raise RemoteProtocolError(f"stream ended inside a control message "
                                          f"({len(buf)} B left)")
            if not self._closed_reported:
                self._closed_reported = True
                graceful = self.state in (State.CLOSE_RECEIVED, State.CLOSED)
                return ConnectionClosed(graceful=graceful)
        return NEED_DATA
