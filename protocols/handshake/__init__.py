"""The control channel: connection set-up, then close, over a byte stream (TCP).

Sans-I/O, as h11 is: feed received bytes with :meth:`ControlConnection.receive_data`, take
events from :meth:`ControlConnection.next_event` (or :data:`NEED_DATA`), and turn events to
send into bytes with :meth:`ControlConnection.send`. The state machine lives in
:mod:`aiordma.protocols.handshake._state`.

Wire format: each message is a 4-byte big-endian length, then a msgpack map with a type code
``"t"`` and the fields of the event. Limits are explicit: :data:`MAX_FRAME` bytes per message,
msgpack string/bin/array/map sizes bounded, ``strict_map_key``, no ext types. Any violation is
a :class:`RemoteProtocolError`.

Set-up (three messages): the client sends :class:`Hello` (protocol version, its queue pair's
number, initial PSN, GID, LID, MTU, its receive window and the largest message it accepts); the server answers
:class:`Accept` (the same for its side) or :class:`Reject`; the client, once its queue pair is
ready to receive and send, confirms with :class:`Ready`, after which either side may use RDMA.
Close: each side sends one :class:`Close` carrying how many RDMA messages it sent, so the peer
knows when it has seen them all. End of stream is reported as :class:`ConnectionClosed`.

Shared secret (optional, mutual, HMAC-SHA256 challenge-response): a client that holds a secret
puts a fresh 32-byte random nonce into its Hello; the server answers :class:`Challenge` with
its own nonce; the client sends :class:`Proof`, an HMAC over both nonces and the Hello's
queue-pair parameters; only if it matches does the server create anything for the client, and
its Accept then carries its own HMAC over both nonces and both sides' parameters, which the
client checks before connecting its queue pair. The parameters are inside the MACs, so a man
in the middle cannot splice another queue pair in; fresh nonces on both sides defeat replay;
the labels differ per role, so a proof cannot be reflected. Comparisons use
:func:`hmac.compare_digest`. A side with a secret meeting a side without one fails cleanly:
a Hello with a nonce at a server without a secret, or without one at a server with a secret,
is an :class:`~aiordma.protocols.errors.AuthenticationError` on the server, which then sends
``Reject(category=RejectCategory.AUTHENTICATION)`` with a reason that says which side lacks it.
:class:`ControlConnection` fills in nonces and proofs itself; callers never handle them.
This protects connection set-up only: nothing is encrypted, and the data path (RDMA) carries
no authentication of its own.

The TCP transport (protocol version 4): a client that moves its messages over the TCP
connection itself sends :class:`TcpHello` (its receive buffer, slots, ``eager_max`` and largest
message: :mod:`aiordma.protocols.tcp`'s parameters) instead of Hello; the server answers
:class:`TcpAccept` (its own) or Reject; the client, once it reads the stream as
:mod:`aiordma.protocols.tcp` frames, sends Ready, and from then on the byte stream carries those
frames (the server sends none before the Ready, so nothing of them is read as a control
message). The shared secret works as above, with labels of its own. A listener that does not
take a transport refuses it with ``Reject(category=RejectCategory.TRANSPORT)`` (an RDMA Hello
at a listener without a device, a TcpHello at one that takes RDMA only).

Versions: Hello and Accept carry :data:`RDMA_VERSION` (3), unchanged since version 3, so that
a peer of version 3 still connects over RDMA, both ways; TcpHello and TcpAccept carry
:data:`PROTOCOL_VERSION` (4), and a version-3 listener drops a TcpHello as an unknown message.

The shared receive pool (:mod:`aiordma.protocols.receive_pool`): a client that follows a
receive pool's grants (Want, Grant, Reclaim, Return) says so with ``Hello.receive_pool=1``;
a server whose receives for this connection come from its pool answers
``Accept.receive_pool=1`` and ``pool_grant``, the data credits it grants at once (its
``data_slots`` is then the most the client may hold, the pool's share). A client whose own
receives come from a pool (its event loop's) says ``Hello.receive_pool=2`` (it follows a
pool's grants too) and ``pool_grant``, the credits its pool grants the server at once; the
server then follows that pool's grants (:func:`receives_from_pool`). The fields are *left
off the wire when 0*, so a Hello or Accept without the pool is version 3's byte for byte,
and the MACs cover them only when set. Hence:

* a client of before the pool sends no ``receive_pool``: the server gets 0 and gives it
  per-connection slots (:func:`server_uses_pool` says no), which that client knows;
* a server of before the pool never sends ``receive_pool``, so a new client that did not ask
  for the pool connects to it as ever; one that asks (an opt-in ``Config`` choice) is refused
  by it, since a version-3 server refuses unknown fields (its Reject names ``receive_pool``):
  such a client connects with the pool off;
* a listener of before clients' pools (``receive_pool`` 0 or 1 only) refuses a Hello with
  ``receive_pool=2`` (a value out of range): a client connects to it with the pool off;
* an Accept with ``receive_pool=1`` after a Hello without it, an Accept with
  ``receive_pool=2``, or a ``pool_grant`` beyond ``data_slots`` or without the pool (in a
  Hello: without ``receive_pool=2``) is a :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass, fields, replace
from enum import IntEnum
from typing import Any, ClassVar

import msgpack

from .._sentinels import NEED_DATA, _Sentinel
from ..errors import AuthenticationError, LocalProtocolError, RemoteProtocolError
from ._state import Direction, Role, State, next_state

__all__ = [
    "MAX_FRAME",
    "NEED_DATA",
    "NONCE_SIZE",
    "PROTOCOL_VERSION",
    "RDMA_VERSION",
    "Accept",
    "Challenge",
    "Close",
    "ConnectionClosed",
    "ControlConnection",
    "Event",
    "Hello",
    "Proof",
    "Ready",
    "Reject",
    "RejectCategory",
    "Role",
    "State",
    "TcpAccept",
    "TcpHello",
    "receives_from_pool",
    "server_uses_pool",
]

PROTOCOL_VERSION = 4  # 2: shared-secret challenge-response, Reject categories; 3: max_message,
# and the message protocol's DONE frames spend control credits (aiordma.protocols.messages);
# 4: the TCP transport (TcpHello, TcpAccept, RejectCategory.TRANSPORT)
RDMA_VERSION = 3
"""The version Hello and Accept carry: the RDMA set-up is version 3's, byte for byte."""
MAX_FRAME = 16 * 1024
NONCE_SIZE = 32  # bytes of each side's random nonce; also the HMAC-SHA256 size
MIN_SECRET = 16  # bytes; shorter secrets are refused as a caller error
_LEN = struct.Struct(">I")
# One packer for every message (msgpack.packb makes one per call); it takes no Python
# callbacks, so a pack() runs whole under the GIL.
_pack = msgpack.Packer(use_bin_type=True).pack
_CLIENT_LABEL = b"aiordma/handshake/2 client proof"
_SERVER_LABEL = b"aiordma/handshake/2 server proof"
_TCP_CLIENT_LABEL = b"aiordma/handshake/4 tcp client proof"
_TCP_SERVER_LABEL = b"aiordma/handshake/4 tcp server proof"


class RejectCategory(IntEnum):
    """Why a set-up was refused, for the program (``Reject.reason`` is for humans)."""

    OTHER = 0
    AUTHENTICATION = 1  # the shared-secret check failed, or only one side uses a secret
    LIMIT = 2  # a connection limit of the listener was reached
    RESOURCES = 3  # no RDMA resources for the connection
    TRANSPORT = 4  # the listener does not take this transport (the reason says which it takes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base class of control-channel events."""

    code: ClassVar[int] = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class _QPParams(Event):
    """What each side tells the other about its queue pair and receive window."""

    version: int = RDMA_VERSION
    qp_num: int  # 24 bits
    psn: int  # 24 bits, random
    gid: bytes  # 16 bytes
    lid: int  # 16 bits (0 on RoCE)
    mtu: int  # ibv_mtu enum, 1..5
    data_slots: int  # receive slots for data messages (the peer's initial data credits)
    ctrl_slots: int  # receive slots for credit messages (the peer's initial control credits)
    slot_size: int  # bytes per receive slot, header included
    max_rd_atomic: int  # RDMA READs/atomics this side accepts in flight
    max_message: int = 1 << 30  # the largest message this side accepts (a sender checks it)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(_QPParams):
    """Client -> server: connection request.

    ``nonce`` is empty, or 32 random bytes when the client holds a shared secret (asking to
    authenticate); :class:`ControlConnection` fills it in.
    """

    code: ClassVar[int] = 1
    nonce: bytes = b""
    # 1: this client follows a receive pool's grants; 2: that too, and its own receives come
    # from a pool, whose grants the server follows (both left off when 0)
    receive_pool: int = 0
    pool_grant: int = 0  # (receive_pool 2) data credits its pool grants at once


@dataclass(frozen=True, slots=True, kw_only=True)
class Accept(_QPParams):
    """Server -> client: request accepted; the server's queue pair is ready.

    ``mac`` is empty, or, after a challenge, the server's proof (HMAC-SHA256 over both nonces
    and both sides' parameters); :class:`ControlConnection` fills it in and checks it.
    """

    code: ClassVar[int] = 2
    mac: bytes = b""
    receive_pool: int = 0  # 1: the server's receives come from its pool (left off when 0)
    pool_grant: int = 0  # data credits granted at once from the pool (left off when 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reject(Event):
    """Either way during set-up: request refused, with a reason for humans and a
    :class:`RejectCategory` for programs."""

    code: ClassVar[int] = 3
    reason: str
    category: int = RejectCategory.OTHER


@dataclass(frozen=True, slots=True, kw_only=True)
class _TcpParams(Event):
    """What each side of a TCP-transport connection tells the other about its receiving
    (:class:`aiordma.protocols.tcp.StreamMessages`' parameters)."""

    version: int = PROTOCOL_VERSION
    recv_buffer: int  # bytes of unread messages this side holds
    slots: int  # messages it holds past them
    eager_max: int  # its sends up to this size do not wait for the peer to read them
    max_message: int  # the largest message it accepts


@dataclass(frozen=True, slots=True, kw_only=True)
class TcpHello(_TcpParams):
    """Client -> server: a connection whose messages travel over this TCP connection.

    ``nonce`` as :class:`Hello`'s.
    """

    code: ClassVar[int] = 8
    nonce: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class TcpAccept(_TcpParams):
    """Server -> client: TCP request accepted. ``mac`` as :class:`Accept`'s."""

    code: ClassVar[int] = 9
    mac: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Event):
    """Client -> server: the client's queue pair is connected; RDMA traffic may start. (Over
    TCP: the client reads the stream as message frames now; they may start.)"""

    code: ClassVar[int] = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Close(Event):
    """Either way when open: this side sends nothing more; it sent ``sent`` RDMA messages."""

    code: ClassVar[int] = 5
    sent: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Challenge(Event):
    """Server -> client, when both hold a shared secret: the server's fresh nonce.

    Send ``Challenge()``: :class:`ControlConnection` fills in the nonce.
    """

    code: ClassVar[int] = 6
    nonce: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Proof(Event):
    """Client -> server: HMAC-SHA256(secret, label, both nonces, the Hello's parameters).

    Send ``Proof()``: :class:`ControlConnection` computes the MAC.
    """

    code: ClassVar[int] = 7
    mac: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionClosed(Event):
    """The byte stream ended. ``graceful`` is true when the peer's Close came first."""

    code: ClassVar[int] = -1
    graceful: bool


_BY_CODE: dict[int, type[Event]] = {c.code: c for c in (Hello, Accept, Reject, Ready, Close,
                                                         Challenge, Proof, TcpHello, TcpAccept)}
# the version each set-up message carries (see the module documentation)
_VERSION: dict[type[Event], int] = {Hello: RDMA_VERSION, Accept: RDMA_VERSION,
                                    TcpHello: PROTOCOL_VERSION, TcpAccept: PROTOCOL_VERSION}
_U24, _U16, _U32, _U64 = (1 << 24) - 1, (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1
# field -> (type, low, high); bytes fields: (bytes, exact length, exact length)
_FIELD_RULES: dict[str, tuple[type, int, int]] = {
    "version": (int, 0, _U16), "qp_num": (int, 0, _U24), "psn": (int, 0, _U24),
    "gid": (bytes, 16, 16), "lid": (int, 0, _U16), "mtu": (int, 1, 5),
    "data_slots": (int, 1, _U16), "ctrl_slots": (int, 1, _U16),
    "slot_size": (int, 64, 1 << 20), "max_rd_atomic": (int, 0, 255),
    "max_message": (int, 0, 1 << 62),
    "recv_buffer": (int, 0, 1 << 62), "slots": (int, 1, _U16), "eager_max": (int, 0, 1 << 62),
    "reason": (str, 0, 1024), "sent": (int, 0, _U64), "category": (int, 0, 255),
    "nonce": (bytes, 0, NONCE_SIZE), "mac": (bytes, 0, NONCE_SIZE),
    "receive_pool": (int, 0, 2), "pool_grant": (int, 0, _U16),
}
# bytes fields whose length is exactly one of these (instead of a range)
_LENGTHS: dict[tuple[str, str], tuple[int, ...]] = {
    ("Hello", "nonce"): (0, NONCE_SIZE), ("Accept", "mac"): (0, NONCE_SIZE),
    ("TcpHello", "nonce"): (0, NONCE_SIZE), ("TcpAccept", "mac"): (0, NONCE_SIZE),
    ("Challenge", "nonce"): (NONCE_SIZE,), ("Proof", "mac"): (NONCE_SIZE,),
}
# fields added in protocol version 2 that a sender may leave out (their default applies)
_OPTIONAL: dict[tuple[str, str], Any] = {
    ("Hello", "nonce"): b"", ("Accept", "mac"): b"", ("Reject", "category"): 0,
    ("Hello", "receive_pool"): 0, ("Accept", "receive_pool"): 0, ("Accept", "pool_grant"): 0,
    ("Hello", "pool_grant"): 0,
}
# fields of the receive pool, left off the wire when 0 (a peer of before the pool refuses
# unknown fields, and its MACs do not cover them)
_POOL_FIELDS = ("receive_pool", "pool_grant")


_NAMES: dict[type, tuple[str, ...]] = {}


def _names(cls: type[Event]) -> tuple[str, ...]:
    """The field names of ``cls``, in order (``dataclasses.fields`` once per class, not per
    message: a set-up's handshake, both sides, 48 -> 40 us of CPU on the host)."""
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
    return names


_MISSING = object()
_Rule = tuple[str, type, int, int, "tuple[int, ...] | None", Any]
_RULES: dict[type, tuple[_Rule, ...]] = {}


def _rules(cls: type[Event]) -> tuple[_Rule, ...]:
    """Each field of ``cls`` with its rule, exact lengths and default if optional (looked up
    once per class, not per field of each message)."""
    rules = _RULES.get(cls)
    if rules is None:
        n = cls.__name__
        rules = _RULES[cls] = tuple(
            (name, *_FIELD_RULES[name], _LENGTHS.get((n, name)), _OPTIONAL.get((n, name),
                                                                               _MISSING))
            for name in _names(cls))
    return rules


def _check_fields(cls: type[Event], values: dict[str, Any], error: type[Exception]) -> None:
    for name, kind, low, high, lengths, default in _rules(cls):
        v = values.get(name, _MISSING)
        if v is _MISSING:
            if default is not _MISSING:
                values[name] = default
                continue
            raise error(f"{cls.__name__} lacks field {name!r}")
        if kind is int:  # IntEnum members are ints; bool is not
            ok = isinstance(v, int) and not isinstance(v, bool) and low <= v <= high
        elif kind is bytes:
            ok = isinstance(v, bytes) and (len(v) in lengths if lengths else
                                           low <= len(v) <= high)
        else:  # at most ``high`` characters, all encodable (no lone surrogates)
            ok = isinstance(v, str) and len(v) <= high
            if ok:
                try:
                    v.encode()
                except UnicodeEncodeError:
                    ok = False
        if not ok:
            raise error(f"{cls.__name__}.{name}: {v!r} is not a valid value")


def encode(event: Event) -> bytes:
    """One event as a length-prefixed msgpack frame (validated)."""
    cls = type(event)
    if cls not in _BY_CODE.values():
        raise LocalProtocolError(f"{cls.__name__} is not sent on the wire")
    values = {name: getattr(event, name) for name in _names(cls)}
    _check_fields(cls, values, LocalProtocolError)
    wire: dict[str, Any] = {"t": cls.code}
    for k, v in values.items():
        if k in _POOL_FIELDS and v == 0:
            continue
        wire[k] = int(v) if isinstance(v, IntEnum) else v
    body = _pack(wire)
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
    extra = set(obj).difference(_names(cls))
    if extra:
        raise RemoteProtocolError(f"{cls.__name__} has unknown fields {sorted(map(str, extra))}")
    _check_fields(cls, obj, RemoteProtocolError)
    return cls(**obj)


_PARAM_FIELDS = _names(_QPParams)
_TCP_FIELDS = _names(_TcpParams)
_Params = _QPParams | _TcpParams


def _params_bytes(params: _Params) -> bytes:
    """The set-up parameters (the queue pair's, or the TCP transport's) in a fixed order, as
    the MACs cover them."""
    names = _TCP_FIELDS if isinstance(params, _TcpParams) else _PARAM_FIELDS
    values = [getattr(params, n) for n in names]
    pool = [getattr(params, n, 0) for n in _POOL_FIELDS]
    if any(pool):  # (when 0, the bytes of before the pool)
        values += pool
    return _pack(values)


def server_uses_pool(hello: Hello, *, pool: bool) -> bool:
    """Whether a server whose ``Config`` chooses a receive pool (``pool``) takes this
    client's receives from it: only if the client's Hello says it follows a pool's grants
    (a client of before the pool gets per-connection slots)."""
    return pool and hello.receive_pool >= 1


def receives_from_pool(params: _QPParams) -> bool:
    """Whether the peer that sent ``params`` (a Hello or an Accept) receives from a pool, so
    that this side follows that pool's grants: an Accept's ``receive_pool=1``, a Hello's
    ``receive_pool=2``."""
    if isinstance(params, Hello):
        return params.receive_pool == 2
    return isinstance(params, Accept) and params.receive_pool == 1


def _check_hello_pool(hello: Hello) -> None:
    if hello.pool_grant and hello.receive_pool != 2:
        raise RemoteProtocolError("the Hello grants pool credits without a receive pool")
    if hello.pool_grant > hello.data_slots:
        raise RemoteProtocolError(f"the Hello grants {hello.pool_grant} pool credits, more "
                                  f"than its share of {hello.data_slots}")


def _check_pool(hello: Hello | None, accept: Accept) -> None:
    if accept.receive_pool > 1:
        raise RemoteProtocolError(f"an Accept's receive_pool is 0 or 1, not "
                                  f"{accept.receive_pool}")
    if accept.receive_pool and (hello is None or not hello.receive_pool):
        raise RemoteProtocolError("the Accept uses a receive pool the Hello did not offer")
    if accept.pool_grant and not accept.receive_pool:
        raise RemoteProtocolError("the Accept grants pool credits without a receive pool")
    if accept.pool_grant > accept.data_slots:
        raise RemoteProtocolError(f"the Accept grants {accept.pool_grant} pool credits, more "
                                  f"than its share of {accept.data_slots}")


def _labels(hello: Hello | TcpHello) -> tuple[bytes, bytes]:
    """The client's and the server's MAC labels for a set-up that began with ``hello``."""
    if isinstance(hello, TcpHello):
        return _TCP_CLIENT_LABEL, _TCP_SERVER_LABEL
    return _CLIENT_LABEL, _SERVER_LABEL


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``label`` and length-prefixed ``parts`` (unambiguous concatenation)."""
    h = hmac.new(secret, label, hashlib.sha256)
    for part in parts:
        h.update(_LEN.pack(len(part)))
        h.update(part)
    return h.digest()


class ControlConnection:
    """One side of the control channel.

    Args:
        role: :attr:`Role.CLIENT` (sends Hello) or :attr:`Role.SERVER`.
        max_frame: the largest message body accepted, in bytes.
        secret: a shared secret (at least :data:`MIN_SECRET` bytes), or ``None``. With one,
            the connection starts in ``AUTH_START``: it puts its nonce into the Hello
            (client), challenges (server), computes and checks the proofs, and refuses to
            send anything but Reject after a failed check.
        nonce: this side's nonce (32 bytes); default: :func:`secrets.token_bytes`. For tests.

    Raises:
        LocalProtocolError: the secret or the nonce is not acceptable.

    Attributes:
        authenticated: true once the peer proved that it holds the secret.
        peer_params: the peer's Hello or Accept (TcpHello or TcpAccept), once received (and,
            with a secret, checked).
    """

    def __init__(self, role: Role, *, max_frame: int = MAX_FRAME, secret: bytes | None = None,
                 nonce: bytes | None = None) -> None:
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET):
            raise LocalProtocolError(f"a shared secret is bytes of at least {MIN_SECRET} bytes")
        if nonce is not None and (not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE):
            raise LocalProtocolError(f"a nonce is {NONCE_SIZE} bytes")
        self.role = role
        self.state = State.AUTH_START if secret is not None else State.START
        self.max_frame = max_frame
        self._buf = bytearray()
        self._eof = False
        self._closed_reported = False
        self.peer_params: _Params | None = None
        self._secret = secret
        self._nonce = b"" if secret is None else (nonce or secrets.token_bytes(NONCE_SIZE))
        self._peer_nonce = b""
        self._hello: Hello | TcpHello | None = None  # the client's, as sent or received
        self._auth_failed = False
        self.authenticated = False

    @property
    def uses_secret(self) -> bool:
        """Whether this side holds a shared secret (and so requires the peer to prove it)."""
        return self._secret is not None

    def send(self, event: Event) -> bytes:
        """Bytes for ``event``; advances the state machine.

        With a shared secret, leave ``Hello.nonce``, ``Challenge.nonce``, ``Proof.mac`` and
        ``Accept.mac`` (and TcpHello's and TcpAccept's) empty: they are filled in here.

        Raises:
            LocalProtocolError: the event is not allowed now, or its fields are invalid (for
                instance an authentication field set by the caller, or anything but Reject
                after the peer failed authentication).
        """
        nxt = next_state(self.role, self.state, Direction.SEND, type(event).__name__)
        if self._auth_failed and not isinstance(event, Reject):
            raise LocalProtocolError("the peer failed authentication: only Reject may follow")
        event = self._complete(event)
        data = encode(event)
        self.state = nxt
        if isinstance(event, (Hello, TcpHello)):
            self._hello = event
        return data

    def _complete(self, event: Event) -> Event:
        """``event`` with this side's nonce or proof filled in (secret mode)."""
        if isinstance(event, (Hello, TcpHello, Challenge)):
            if event.nonce:
                raise LocalProtocolError("the nonce is this connection's to choose")
            return replace(event, nonce=self._nonce) if self._nonce else event
        if isinstance(event, Proof):
            if event.mac:
                raise LocalProtocolError("the proof is this connection's to compute")
            assert self._secret is not None and self._hello is not None  # CHALLENGED
            return replace(event, mac=_mac(self._secret, _labels(self._hello)[0], self._nonce,
                                           self._peer_nonce, _params_bytes(self._hello)))
        if isinstance(event, (Accept, TcpAccept)):
            if event.mac:
                raise LocalProtocolError("the proof is this connection's to compute")
            if self.state in (State.PROOF_RECEIVED, State.TCP_PROOF_RECEIVED):
                if not self.authenticated:  # unreachable: a wrong proof raised and was noted
                    raise LocalProtocolError("the client did not prove the secret")
                assert self._secret is not None and self._hello is not None
                return replace(event, mac=_mac(
                    self._secret, _labels(self._hello)[1], self._peer_nonce, self._nonce,
                    _params_bytes(self._hello), _params_bytes(event)))
        return event

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

    @property
    def trailing_data(self) -> tuple[bytes, bool]:
        """What was fed and not yet taken as events, and whether the stream ended (as h11's):
        after a TCP set-up, the first of :mod:`aiordma.protocols.tcp`'s frames."""
        return bytes(self._buf), self._eof

    def next_event(self) -> Event | _Sentinel:
        """The next event, or :data:`NEED_DATA`.

        Raises:
            RemoteProtocolError: malformed bytes, a limit exceeded, a message not allowed in
                the current state, or the stream ending inside a message.
            AuthenticationError: the peer's proof does not match, or only one side uses a
                shared secret. The event was consumed and the state advanced: this side may
                now only send Reject (category AUTHENTICATION).
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
                want = _VERSION.get(type(event))
                if want is not None and event.version != want:  # type: ignore[attr-defined]
                    raise RemoteProtocolError(
                        f"peer speaks protocol version {event.version} in its "  # type: ignore[attr-defined]
                        f"{type(event).__name__}; this side {want}")
                self._authenticate(event)
                if isinstance(event, Accept):
                    _check_pool(self._hello if isinstance(self._hello, Hello) else None, event)
                elif isinstance(event, Hello):
                    _check_hello_pool(event)
                if isinstance(event, (_QPParams, _TcpParams)):
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

    def _fail_auth(self, message: str) -> AuthenticationError:
        self._auth_failed = True
        return AuthenticationError(message)

    def _authenticate(self, event: Event) -> None:
        """The secret checks of a received event (the table already allowed it)."""
        secret = self._secret
        if isinstance(event, (Hello, TcpHello)):
            self._hello = event
            self._peer_nonce = event.nonce
            if secret is not None and not event.nonce:
                raise self._fail_auth("this listener requires a shared secret; the client "
                                      "offered none (pass secret= to connect())")
            if secret is None and event.nonce:
                raise self._fail_auth("the client wants to authenticate with a shared secret; "
                                      "this listener has none (pass secret= to listen())")
        elif isinstance(event, Challenge):
            self._peer_nonce = event.nonce
        elif isinstance(event, Proof):
            assert secret is not None and self._hello is not None  # CHALLENGE_SENT
            want = _mac(secret, _labels(self._hello)[0], self._peer_nonce, self._nonce,
                        _params_bytes(self._hello))
            if not hmac.compare_digest(event.mac, want):
                raise self._fail_auth("the client's proof does not match: it does not hold "
                                      "this listener's shared secret")
            self.authenticated = True
        elif isinstance(event, (Accept, TcpAccept)):
            if secret is None:
                if event.mac:
                    raise RemoteProtocolError(f"{type(event).__name__} carries a proof that "
                                              f"was not asked for")
                return
            assert self._hello is not None  # PROOF_SENT
            want = _mac(secret, _labels(self._hello)[1], self._nonce, self._peer_nonce,
                        _params_bytes(self._hello), _params_bytes(event))
            if not hmac.compare_digest(event.mac, want):
                raise self._fail_auth("the listener's proof does not match: it does not hold "
                                      "this client's shared secret (or the answer was altered)")
            self.authenticated = True
