"""The collectives' wire messages, matching, schedules and rendezvous roster (sans-I/O).

:mod:`aiordma.services.collectives` runs a group of ``world`` ranks connected as a full mesh of
*directed links*: for every ordered pair of ranks ``(a, b)`` there is one connection on which
``a`` sends data to ``b`` and ``b`` answers only with credits. ``a`` writes a piece of data
either inline in an :class:`Inline` message (small pieces), or by RDMA WRITE into ``b``'s
receive *slots*, announced by its :class:`Piece` (see "Written pieces" below); ``b`` answers
Pieces with a :class:`Credit` once it has consumed their slots. Everything here is pure:
messages in and out are ``bytes``, and the schedules are plain integer arithmetic, so they
are tested with hypothesis without a device.

Messages
--------
Each message is one msgpack array, ``[kind, field...]``:

==========  ====  ==========================================================================
event       kind  fields
==========  ====  ==========================================================================
Hello       1     ``version``, ``token`` (the group's), ``rank``, ``world`` (who connects)
Slots       2     ``descriptor`` (``RemoteBuffer.to_wire()``), ``count``, ``size`` (bytes)
Credit      3     ``count``: slots freed, in the order they were filled
Piece       4     *tag*, ``step``, ``slot``, ``offset``, ``nbytes``, ``signature``
Value       5     *tag*, ``step``, ``origin`` (rank whose value it is), ``value``
Inline      6     *tag*, ``step``, ``offset``, ``signature``, ``data`` (the bytes themselves)
Fault       7     ``reason``: why the sender's group broke (it aborts right after)
==========  ====  ==========================================================================

A window's signal (``Group.window``'s ``put(..., signal=k)``) is a ``Value`` on
:data:`SIGNAL_CHANNEL` whose ``step`` is the counter ``k`` and ``origin`` the writer's rank, sent
right behind the WRITE it signals (so it arrives once the data is in place).

A *tag* is four fields: ``group`` (0: the whole group; a subgroup's number otherwise, see
:func:`group_id`), ``channel`` (0: the group's collectives; ``1 + tag`` for point-to-point
messages of that tag; :data:`SIGNAL_CHANNEL` for a window's signals), ``call`` (the
collective's number in its group, see "ordering" below; a point-to-point message's number on
its channel; for a signal, the number of the collective that made its window) and ``op`` (the
operation's kind, :data:`KINDS`). ``step`` numbers the steps within one operation, ``offset`` is a byte offset
in its logical buffer, and ``signature`` is a CRC of what the writer thinks the collective is
(kind, op, dtype, size): a receiver that expected something else raises
:class:`MismatchError` instead of reducing garbage.

Written pieces
--------------
Each of ``b``'s slots is followed by :data:`NOTE_BYTES` bytes of room (the slot stride is
``size + NOTE_BYTES``). ``a`` writes a piece as one RDMA WRITE with immediate data that
gathers the piece's bytes and its encoded :class:`Piece` (the *note*) behind them, at the
slot's start; the immediate value is :func:`note_imm` (the slot and the note's length), and
``b``, told by the completion that the data is in place, reads the note where the WRITE
ended (:func:`written_piece`). A note longer than :data:`NOTE_BYTES` (never, for the fields'
ranges) would go as before: a plain WRITE and the ``Piece`` as a message behind it on the
same queue pair (RC keeps the WRITE before the SEND).

Ordering
--------
See :mod:`aiordma.protocols.collectives._matching`: a group's collectives are numbered in the order
each rank starts them, may run at the same time, and a rank that starts them in another
order than its peers gets a :class:`MismatchError` naming both operations
(:class:`CallOrder`). Slots given back out of order are handled by :class:`SlotLedger`.

Schedules
---------
See :mod:`aiordma.protocols.collectives._schedules`: rings (:func:`allreduce_schedule`,
:func:`reduce_scatter_schedule`, :func:`allgather_schedule`), few-rounds algorithms
(:func:`recursive_doubling`, :func:`binomial_tree`, :func:`dissemination_schedule`), direct
exchanges (:func:`pairwise`) and :func:`choose`.

Step programs
-------------
See :mod:`aiordma.protocols.collectives._programs`: a schedule as plain steps (``PUT``,
``WAIT``, ``REDUCE``) that an executor runs without Python per step
(:func:`allreduce_program`, :func:`barrier_program`, :func:`allgather_program`,
:func:`broadcast_program`, :func:`alltoall_program`, :func:`reduce_scatter_program`), the
immediate values of their WRITEs (:func:`step_imm`), an allgather block's description behind
its bytes (:func:`block_tail`, :func:`split_block`), and :func:`simulate`, the reference of
their semantics.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from ..errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ._matching import (
    KINDS,
    CallOrder,
    MismatchError,
    SlotLedger,
    SlotWriter,
    group_id,
    kind_code,
    split_members,
)
from ._programs import (
    BUF,
    FWD,
    LAND,
    PUT,
    REDUCE,
    SIGNAL,
    TAIL_MAX,
    WAIT,
    Program,
    allgather_program,
    allreduce_program,
    alltoall_program,
    barrier_program,
    block_tail,
    broadcast_program,
    imm_program,
    landing_place,
    read_imm,
    reduce_scatter_program,
    simulate,
    split_block,
    step_clash,
    step_imm,
    step_mismatch,
)
from ._schedules import (
    RecursiveDoubling,
    Thresholds,
    allgather_schedule,
    allreduce_schedule,
    binomial_tree,
    choose,
    chunk_bounds,
    dissemination_schedule,
    pairwise,
    piece_bounds,
    recursive_doubling,
    reduce_scatter_schedule,
)

__all__ = [
    "KINDS", "LINK_CHOICES", "NOTE_BYTES", "PROTOCOL_VERSION", "REDUCE_OPS", "SIGNAL_CHANNEL", "CallOrder",
    "Credit", "Event", "Fault", "Hello", "Inline", "MismatchError", "Piece", "RecursiveDoubling",
    "RendezvousRefused", "Roster", "SlotLedger", "SlotWriter", "Slots", "Tag", "Thresholds",
    "BUF", "FWD", "LAND", "PUT", "REDUCE", "SIGNAL", "TAIL_MAX", "WAIT", "Program",
    "allgather_program", "allreduce_program", "alltoall_program", "barrier_program",
    "block_tail", "broadcast_program", "imm_program", "landing_place", "read_imm",
    "reduce_scatter_program",
    "simulate", "split_block", "step_clash", "step_imm", "step_mismatch",
    "Value", "allgather_schedule", "allreduce_schedule", "binomial_tree", "choose", "chunk_bounds",
    "decode", "dissemination_schedule", "encode", "encode_inline", "group_id", "kind_code",
    "note_imm",
    "op_refusal",
    "pairwise", "piece_bounds", "recursive_doubling", "reduce_scatter_schedule", "signature",
    "split_members", "validate_members", "written_piece",
]

PROTOCOL_VERSION = 11  # 11: a step WRITE names its program; 10: allreduces written from 256 KiB
NOTE_BYTES = 128
"""Room behind each receive slot for the note of a piece written there (see "Written
pieces"): a :class:`Piece` encodes in at most 91 bytes."""
#: The channel of windows' signals: above every point-to-point channel (``1 + tag``, tags
#: up to ``2**31 - 1``).
SIGNAL_CHANNEL = 1 << 32
_MAX_MESSAGE = 1 << 20  # collectives' control messages are small; values must stay small too
_MAX_REASON = 2000  # characters of a Fault's reason

#: The reduction ops and the dtype kinds (numpy's ``dtype.kind`` letters: ``b`` bool, ``i``
#: signed, ``u`` unsigned, ``f`` floating, ``c`` complex) each one reduces.
REDUCE_OPS: dict[str, str] = {
    "sum": "biufc", "prod": "biufc", "max": "biufc", "min": "biufc", "avg": "fc",
    "band": "biu", "bor": "biu", "bxor": "biu",
}


def op_refusal(op: Any, dtype_kind: str, dtype_name: str = "") -> str | None:
    """Why ``op`` cannot reduce values of numpy dtype kind ``dtype_kind`` (None: it can)."""
    if not isinstance(op, str) or op not in REDUCE_OPS:
        return f"op {op!r:.80} is not one of {sorted(REDUCE_OPS)}"
    if dtype_kind not in REDUCE_OPS[op]:
        what = {"fc": "floating or complex", "biu": "integer or bool"}.get(REDUCE_OPS[op],
                                                                        "numeric")
        return f"op {op!r} reduces {what} values, not dtype {dtype_name or dtype_kind}"
    return None


class RendezvousRefused(ProtocolError):
    """A join was refused: a rank joined twice, is out of range, or disagrees on the world
    size. The whole rendezvous fails, so every rank hears of it at once."""


class Tag(NamedTuple):
    """What a data message belongs to (see the module's "Messages"): ``key`` files it on the
    receiving side, ``op`` is checked against the receiver's own operation. (A named tuple,
    not an event: one is made per operation, on the hot path.)"""

    group: int
    channel: int
    call: int
    op: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.group, self.channel, self.call)


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base class of the collectives' messages."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Event):
    """First message on a link, from the connecting rank."""

    version: int
    token: int
    rank: int
    world: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Slots(Event):
    """The receive slots a rank exposes to the rank that writes to it (sent once, at
    formation)."""

    descriptor: tuple[int, int, int, int]
    count: int
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit(Event):
    """``count`` slots are free again (the oldest ones; see :class:`SlotLedger`)."""

    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece(Event):
    """``nbytes`` bytes for ``offset`` of an operation's buffer are in slot ``slot``."""

    group: int
    channel: int
    call: int
    op: int
    step: int
    slot: int
    offset: int
    nbytes: int
    signature: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.group, self.channel, self.call)


@dataclass(frozen=True, slots=True, kw_only=True)
class Value(Event):
    """A small msgpack value (barrier tokens, shapes and dtypes, small arrays' bytes)."""

    group: int
    channel: int
    call: int
    op: int
    step: int
    origin: int
    value: Any

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.group, self.channel, self.call)


@dataclass(frozen=True, slots=True, kw_only=True)
class Inline(Event):
    """A piece small enough to travel in the message itself: ``data`` for ``offset``."""

    group: int
    channel: int
    call: int
    op: int
    step: int
    offset: int
    signature: int
    data: bytes

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.group, self.channel, self.call)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault(Event):
    """The sender's group broke because ranks disagree (``reason`` says how); the sender
    aborts right after, so that every rank raises the same typed error, not only the one
    that noticed."""

    reason: str


_KINDS: dict[type[Event], int] = {Hello: 1, Slots: 2, Credit: 3, Piece: 4, Value: 5, Inline: 6,
                                  Fault: 7}
_CLASSES = {k: c for c, k in _KINDS.items()}
_TAG = ("group", "channel", "call", "op")
_FIELDS: dict[type[Event], tuple[str, ...]] = {
    Hello: ("version", "token", "rank", "world"),
    Slots: ("descriptor", "count", "size"),
    Credit: ("count",),
    Piece: (*_TAG, "step", "slot", "offset", "nbytes", "signature"),
    Value: (*_TAG, "step", "origin", "value"),
    Inline: (*_TAG, "step", "offset", "signature", "data"),
    Fault: ("reason",),
}


_GETTERS = {c: operator.attrgetter(*f) if len(f) > 1 else (lambda e, n=f[0]: (getattr(e, n),))
            for c, f in _FIELDS.items()}
_pack = msgpack.Packer().pack  # (msgpack.packb makes a Packer per call; pack resets on error)


def encode(event: Event) -> bytes:
    """The message for ``event``.

    Raises:
        LocalProtocolError: a field is not representable (e.g. a value msgpack cannot pack, or
            a message over 1 MiB).
    """
    cls = type(event)
    if cls is Fault and len(event.reason) > _MAX_REASON:  # type: ignore[attr-defined]
        raise LocalProtocolError(f"a Fault's reason is limited to {_MAX_REASON} characters")
    try:
        data: bytes = _pack([_KINDS[cls], *_GETTERS[cls](event)])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode {event!r}: {exc}") from exc
    if len(data) > _MAX_MESSAGE:
        raise LocalProtocolError(f"{cls.__name__} message of {len(data)} B exceeds "
                                 f"{_MAX_MESSAGE} B")
    return data


def encode_inline(tag: Tag, step: int, offset: int, signature: int, data: bytes) -> bytes:
    """``encode(Inline(...))`` for a piece of ``tag``'s operation, without making the event
    (an operation's hot path): the same bytes, and the same errors.

    Raises:
        LocalProtocolError: as :func:`encode`.
    """
    try:
        out: bytes = _pack([6, *tag, step, offset, signature, data])  # (6: _KINDS[Inline])
    except (TypeError, ValueError, OverflowError) as exc:
        event = Inline(group=tag[0], channel=tag[1], call=tag[2], op=tag[3], step=step,
                       offset=offset, signature=signature, data=data)
        raise LocalProtocolError(f"cannot encode {event!r}: {exc}") from exc
    if len(out) > _MAX_MESSAGE:
        raise LocalProtocolError(f"Inline message of {len(out)} B exceeds {_MAX_MESSAGE} B")
    return out


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 64)


# Per class: how many leading fields are unsigned ints; what the others are (checked apart).
_LEADING_UINTS = {Hello: 4, Slots: 0, Credit: 1, Piece: 9, Value: 6, Inline: 7, Fault: 0}
_set = object.__setattr__


def decode(data: bytes | bytearray | memoryview) -> Event:
    """The event in one received message.

    Raises:
        RemoteProtocolError: not a well-formed collectives message.
    """
    if len(data) > _MAX_MESSAGE:
        raise RemoteProtocolError(f"a {len(data)} B message exceeds {_MAX_MESSAGE} B")
    try:
        obj = msgpack.unpackb(data, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise RemoteProtocolError(f"not a msgpack message: {exc}") from exc
    if not isinstance(obj, list) or not obj or obj[0] not in _CLASSES or isinstance(obj[0], bool):
        raise RemoteProtocolError(f"not a collectives message: {obj!r:.100}")
    cls = _CLASSES[obj[0]]
    names = _FIELDS[cls]
    if len(obj) != len(names) + 1:
        raise RemoteProtocolError(f"{cls.__name__} has {len(obj) - 1} fields, not {len(names)}")
    n = _LEADING_UINTS[cls]
    for i in range(1, n + 1):  # (the hot path: a plain loop, no call per field)
        v = obj[i]
        if type(v) is not int or v < 0 or v >> 64:
            raise RemoteProtocolError(f"{cls.__name__}.{names[i - 1]} is not an unsigned int: "
                                      f"{v!r:.100}")
    if cls is Inline:
        if not isinstance(obj[8], bytes):
            raise RemoteProtocolError(f"Inline.data is not bytes: {obj[8]!r:.100}")
    elif cls is Fault:
        if not (isinstance(obj[1], str) and len(obj[1]) <= _MAX_REASON):
            raise RemoteProtocolError(f"Fault.reason is not a short str: {obj[1]!r:.100}")
    elif cls is Slots:
        d = obj[1]
        if not (isinstance(d, list) and len(d) == 4 and all(_is_uint(x) for x in d)):
            raise RemoteProtocolError(f"Slots.descriptor is not 4 unsigned ints: {d!r:.100}")
        if not (_is_uint(obj[2]) and _is_uint(obj[3])):
            raise RemoteProtocolError(f"Slots has a count or size that is not an unsigned int: "
                                      f"{obj!r:.100}")
        obj[1] = tuple(d)
    elif cls is Credit and obj[1] == 0:
        raise RemoteProtocolError("Credit of 0 slots")
    if n >= 4 and cls is not Hello and obj[4] >= len(KINDS):  # a tag's op
        raise RemoteProtocolError(f"{cls.__name__} of an unknown operation {obj[4]}")
    # What the class's (frozen) __init__ would do, without its keyword handling.
    ev = object.__new__(cls)
    for name, v in zip(names, obj[1:]):
        _set(ev, name, v)
    return ev


def signature(*parts: object) -> int:
    """A 32-bit CRC of what a collective is (kind, op, dtype, element count...)."""
    return zlib.crc32("|".join(map(str, parts)).encode())


# -- written pieces ----------------------------------------------------------------------------


def note_imm(slot: int, note: int) -> int:
    """The immediate value of a piece written into ``slot`` with a note of ``note`` bytes
    behind it: the slot in the low 16 bits, the note's length above.

    Raises:
        LocalProtocolError: ``slot`` past 16 bits, or ``note`` not 1..:data:`NOTE_BYTES`.
    """
    if not (0 <= slot < 1 << 16 and 0 < note <= NOTE_BYTES):
        raise LocalProtocolError(f"a written piece in slot {slot} with a {note} B note")
    return slot | note << 16


def written_piece(value: int, nbytes: int, slots: Any, count: int, size: int) -> Piece:
    """The :class:`Piece` of the WRITE with immediate ``value`` that wrote ``nbytes`` into
    ``slots`` (the receive slots' buffer, ``count`` of ``size`` bytes each, stride ``size +``
    :data:`NOTE_BYTES`): its note decoded from behind the data, checked against the
    immediate (same slot, the data's length).

    Raises:
        RemoteProtocolError: the immediate, the length or the note are not a written
            piece's.
    """
    slot, note = value & 0xFFFF, value >> 16
    if slot >= count or not 0 < note <= NOTE_BYTES or not note < nbytes <= size + note:
        raise RemoteProtocolError(f"a WRITE with immediate data {value:#x} of {nbytes} B is "
                                  f"not a piece in one of {count} slots of {size} B")
    end = slot * (size + NOTE_BYTES) + nbytes
    ev = decode(bytes(slots[end - note:end]))
    if not isinstance(ev, Piece) or ev.slot != slot or ev.nbytes != nbytes - note:
        raise RemoteProtocolError(f"the note of a piece written in slot {slot} ({nbytes - note}"
                                  f" B) is {ev!r:.200}")
    return ev


# -- rendezvous --------------------------------------------------------------------------------


LINK_CHOICES = ("rdma", "tcp", "either")
"""What a rank takes for its links, sent with its join: RDMA only, TCP only, or either (it
asked for ``"auto"`` and has a usable device). See :attr:`Roster.transport`."""


class Roster:
    """Who has joined a rendezvous of ``world`` ranks, and where each one listens.

    ``add()`` records a join or refuses it; a refusal fails the whole rendezvous (``failure``),
    so that the ranks already waiting learn of a misconfiguration at once instead of at their
    timeout.
    """

    def __init__(self, world: int) -> None:
        if not (isinstance(world, int) and world >= 1):
            raise LocalProtocolError(f"the world size must be an int >= 1, not {world!r}")
        self.world = world
        self.members: dict[int, tuple[str, int]] = {}
        self.links: dict[int, str] = {}  # rank -> the links it takes (see LINK_CHOICES)
        self.failure: str | None = None

    @property
    def complete(self) -> bool:
        """Every rank joined (and nothing failed)."""
        return self.failure is None and len(self.members) == self.world

    @property
    def done(self) -> bool:
        """Complete or failed: waiters can be answered."""
        return self.failure is not None or len(self.members) == self.world

    def add(self, rank: Any, world: Any, host: Any, port: Any, links: Any = "rdma") -> None:
        """Record that ``rank`` listens on ``host:port`` and takes ``links`` (one of
        :data:`LINK_CHOICES`; a rank of before the TCP links sends none: ``"rdma"``).

        Raises:
            RendezvousRefused: the join is invalid, or the rendezvous already failed.
        """
        if self.failure is not None:
            raise RendezvousRefused(self.failure)
        problem = None
        if not (_is_uint(rank) and _is_uint(world) and isinstance(host, str)
                and _is_uint(port) and 0 < port < 65536):
            problem = (f"malformed join (rank={rank!r}, world size={world!r}, host={host!r}, "
                       f"port={port!r})")
        elif world != self.world:
            problem = (f"rank {rank} was started with a world size of {world}; rank 0 with "
                       f"{self.world}")
        elif rank >= self.world:
            problem = f"rank {rank} is out of range for a world size of {self.world}"
        elif rank in self.members:
            h, p = self.members[rank]
            problem = f"rank {rank} joined twice (from {h}:{p} and {host}:{port})"
        elif len(self.members) == self.world:
            problem = "the group is already complete"
        elif links not in LINK_CHOICES or not isinstance(links, str):
            problem = f"rank {rank} asked for links {links!r:.40}, not one of {LINK_CHOICES}"
        else:
            clash = next((r for r, c in self.links.items() if {c, links} == {"rdma", "tcp"}),
                         None)
            if clash is not None:
                problem = (f"rank {clash} takes {self.links[clash]} links only and rank {rank} "
                           f"{links} only: a group's links are all RDMA or all TCP")
        if problem is not None:
            self.failure = problem
            raise RendezvousRefused(problem)
        self.members[rank] = (host, port)
        self.links[rank] = links

    @property
    def transport(self) -> str:
        """The whole group's links (once complete): ``"tcp"`` if any rank takes TCP only (it
        asked for TCP, or has no usable RDMA device), else ``"rdma"``."""
        if not self.complete:
            raise LocalProtocolError("the rendezvous is not complete")
        return "tcp" if "tcp" in self.links.values() else "rdma"

    def addresses(self) -> list[tuple[str, int]]:
        """Every rank's ``(host, port)``, in rank order (once complete)."""
        if not self.complete:
            raise LocalProtocolError("the rendezvous is not complete")
        return [self.members[r] for r in range(self.world)]


def validate_members(members: Sequence[Any], world: int) -> list[tuple[str, int]]:
    """Check the address list a joining rank received.

    Raises:
        RemoteProtocolError: not ``world`` pairs of ``(host, port)``.
    """
    ok = isinstance(members, (list, tuple)) and len(members) == world and all(
        isinstance(m, (list, tuple)) and len(m) == 2 and isinstance(m[0], str)
        and _is_uint(m[1]) and 0 < m[1] < 65536 for m in members)
    if not ok:
        raise RemoteProtocolError(f"bad member list for {world} ranks: {members!r:.200}")
    return [(str(h), int(p)) for h, p in members]
