"""The collectives' wire messages, schedules and rendezvous roster (sans-I/O).

:mod:`aiordma.services.collectives` runs a group of ``world`` ranks connected as a full mesh of
*directed links*: for every ordered pair of ranks ``(a, b)`` there is one connection on which
``a`` sends data to ``b`` and ``b`` answers only with credits. ``a`` writes a piece of data
either inline in an :class:`Inline` message (small pieces), or by RDMA WRITE into ``b``'s
receive *slots* followed by a :class:`Piece` message on the same queue pair (RC keeps the
WRITE before the SEND, so the data is in place when the message arrives); ``b`` answers a
Piece with a :class:`Credit` once it has consumed the slot. Everything here is pure: messages
in and out are ``bytes``, and the schedules are plain integer arithmetic, so they are tested
with hypothesis without a device.

Messages
--------
Each message is one msgpack array, ``[kind, field...]``:

==========  ====  ==========================================================================
event       kind  fields
==========  ====  ==========================================================================
Hello       1     ``version``, ``token`` (the group's), ``rank``, ``world`` (who connects)
Slots       2     ``descriptor`` (``RemoteBuffer.to_wire()``), ``count``, ``size`` (bytes)
Credit      3     ``count``: slots freed, in the order they were filled
Piece       4     ``call``, ``step``, ``slot``, ``offset``, ``nbytes``, ``signature``
Value       5     ``call``, ``step``, ``origin`` (rank whose value it is), ``value``
Inline      6     ``call``, ``step``, ``offset``, ``signature``, ``data`` (the bytes themselves)
==========  ====  ==========================================================================

``call`` numbers a group's collectives (every rank counts the same way), ``step`` the steps
within one, ``offset`` is a byte offset in the collective's logical buffer, and
``signature`` is a CRC of what the writer thinks the collective is (kind, op, dtype, size):
a receiver that expected something else raises :class:`MismatchError` instead of reducing
garbage.

Schedules
---------
Ring (bandwidth-optimal, for large arrays): :func:`allreduce_schedule` (reduce-scatter then
allgather) and :func:`allgather_schedule`. Latency-optimal, for small arrays:
:func:`recursive_doubling` (allreduce in ``log2`` rounds, any world size),
:func:`binomial_tree` (broadcast in ``ceil(log2 world)`` rounds) and
:func:`dissemination_schedule` (barrier). :func:`choose` picks one by size and world.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError

__all__ = [
    "PROTOCOL_VERSION", "Credit", "Event", "Hello", "Inline", "MismatchError", "Piece",
    "RecursiveDoubling", "RendezvousRefused", "Roster", "Slots", "Thresholds", "Value",
    "allgather_schedule", "allreduce_schedule", "binomial_tree", "choose", "chunk_bounds",
    "decode", "dissemination_schedule", "encode", "piece_bounds", "recursive_doubling",
    "signature", "validate_members",
]

PROTOCOL_VERSION = 2
_MAX_MESSAGE = 1 << 20  # collectives' control messages are small; values must stay small too


class MismatchError(ProtocolError):
    """Ranks disagree about the collective being run (kind, op, dtype, size, root or order)."""


class RendezvousRefused(ProtocolError):
    """A join was refused: a rank joined twice, is out of range, or disagrees on the world
    size. The whole rendezvous fails, so every rank hears of it at once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base class of the collectives' messages."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Event):
    """First message on a ring connection, from the connecting (left) rank."""

    version: int
    token: int
    rank: int
    world: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Slots(Event):
    """The receive slots a rank exposes to its left neighbour (sent once, at formation)."""

    descriptor: tuple[int, int, int, int]
    count: int
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit(Event):
    """``count`` slots are free again (the reader consumes slots in the order they filled)."""

    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece(Event):
    """``nbytes`` bytes for ``offset`` of the collective's buffer are in slot ``slot``."""

    call: int
    step: int
    slot: int
    offset: int
    nbytes: int
    signature: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Value(Event):
    """A small msgpack value travelling round the ring (barrier tokens, shapes and dtypes)."""

    call: int
    step: int
    origin: int
    value: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Inline(Event):
    """A piece small enough to travel in the message itself: ``data`` for ``offset``."""

    call: int
    step: int
    offset: int
    signature: int
    data: bytes


_KINDS: dict[type[Event], int] = {Hello: 1, Slots: 2, Credit: 3, Piece: 4, Value: 5, Inline: 6}
_CLASSES = {k: c for c, k in _KINDS.items()}
_FIELDS: dict[type[Event], tuple[str, ...]] = {
    Hello: ("version", "token", "rank", "world"),
    Slots: ("descriptor", "count", "size"),
    Credit: ("count",),
    Piece: ("call", "step", "slot", "offset", "nbytes", "signature"),
    Value: ("call", "step", "origin", "value"),
    Inline: ("call", "step", "offset", "signature", "data"),
}


def encode(event: Event) -> bytes:
    """The message for ``event``.

    Raises:
        LocalProtocolError: a field is not representable (e.g. a value msgpack cannot pack, or
            a message over 1 MiB).
    """
    cls = type(event)
    try:
        data: bytes = msgpack.packb([_KINDS[cls], *(getattr(event, f) for f in _FIELDS[cls])])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode {event!r}: {exc}") from exc
    if len(data) > _MAX_MESSAGE:
        raise LocalProtocolError(f"{cls.__name__} message of {len(data)} B exceeds "
                                 f"{_MAX_MESSAGE} B")
    return data


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 64)


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
    fields = dict(zip(names, obj[1:], strict=True))
    for name, v in fields.items():
        if name == "value":
            continue
        if name == "data":
            if not isinstance(v, bytes):
                raise RemoteProtocolError(f"Inline.data is not bytes: {v!r:.100}")
            continue
        if name == "descriptor":
            if not (isinstance(v, list) and len(v) == 4 and all(_is_uint(x) for x in v)):
                raise RemoteProtocolError(f"Slots.descriptor is not 4 unsigned ints: {v!r:.100}")
            fields[name] = tuple(v)
        elif not _is_uint(v):
            raise RemoteProtocolError(f"{cls.__name__}.{name} is not an unsigned int: {v!r:.100}")
    if cls is Credit and fields["count"] == 0:
        raise RemoteProtocolError("Credit of 0 slots")
    return cls(**fields)


def signature(*parts: object) -> int:
    """A 32-bit CRC of what a collective is (kind, op, dtype, element count...)."""
    return zlib.crc32("|".join(map(str, parts)).encode())


# -- partitioning and schedules ----------------------------------------------------------------


def chunk_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(count)`` into ``parts`` consecutive chunks whose sizes differ by at most
    one (the first ``count % parts`` are one longer); chunks may be empty when
    ``count < parts``."""
    if count < 0 or parts < 1:
        raise LocalProtocolError(f"chunk_bounds({count}, {parts})")
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append((start, stop))
        start = stop
    return out


def piece_bounds(start: int, stop: int, max_count: int) -> Iterator[tuple[int, int]]:
    """Split ``range(start, stop)`` into consecutive pieces of at most ``max_count`` items
    (none when it is empty): what fits one receive slot."""
    if max_count < 1:
        raise LocalProtocolError("max_count must be at least 1")
    for a in range(start, stop, max_count):
        yield a, min(a + max_count, stop)


def allreduce_schedule(rank: int, world: int) -> list[tuple[int, int, bool]]:
    """The ring allreduce of ``rank``: ``(send_chunk, recv_chunk, reduce)`` per step.

    ``world - 1`` reduce-scatter steps (``reduce=True``: the received chunk is combined into
    the local one), after which rank ``r`` holds the complete chunk ``(r + 1) % world``; then
    ``world - 1`` allgather steps (``reduce=False``: the received chunk replaces the local one).
    The chunk sent at step ``t > 0`` is the one received at step ``t - 1``, so each rank sends
    ``2 (world - 1) / world`` of the data, the bandwidth-optimal amount.
    """
    steps = []
    for t in range(world - 1):  # reduce-scatter
        steps.append(((rank - t) % world, (rank - t - 1) % world, True))
    for u in range(world - 1):  # allgather of the reduced chunks
        steps.append(((rank + 1 - u) % world, (rank - u) % world, False))
    return steps


def allgather_schedule(rank: int, world: int) -> list[tuple[int, int]]:
    """The ring allgather of ``rank``: ``(block_sent, block_received)`` per step; block ``b``
    is rank ``b``'s contribution. Step 0 sends the rank's own block, step ``t > 0`` forwards the
    block received at step ``t - 1``."""
    return [((rank - t) % world, (rank - t - 1) % world) for t in range(world - 1)]


def dissemination_schedule(rank: int, world: int) -> list[tuple[int, int]]:
    """The dissemination barrier of ``rank``: ``(send_to, receive_from)`` per round, rounds
    ``k = 0 .. ceil(log2 world) - 1`` with distance ``2**k``. After round ``k`` a rank has heard,
    directly or through others, from the ``2**(k + 1) - 1`` ranks before it; after the last,
    from everyone."""
    out, d = [], 1
    while d < world:
        out.append(((rank + d) % world, (rank - d) % world))
        d *= 2
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RecursiveDoubling:
    """One rank's part in a recursive-doubling allreduce of ``world`` ranks.

    With ``P`` the largest power of two not over ``world`` and ``extra = world - P``, the first
    ``2 * extra`` ranks pair up before the rounds: each even one (``fold_to`` set) sends its data
    to the odd one above it and waits for the result from it; each odd one (``fold_from`` set)
    combines that data with its own, lower rank's first. Then ``P`` ranks run ``log2 P``
    rounds: in each, partners exchange their partial results and both combine them, the
    partial of the lower block first, so every rank computes the same expression and ends
    with bit-identical results. Finally each odd folding rank sends the result to ``fold_from``.

    Attributes:
        fold_to: the rank to hand this rank's data to (and get the result from), or None.
        fold_from: the rank whose data is combined in before the rounds (and gets the result
            after them), or None.
        rounds: ``(partner, partner_is_lower)`` per round; empty for a rank with ``fold_to``.
    """

    fold_to: int | None
    fold_from: int | None
    rounds: tuple[tuple[int, bool], ...]


def recursive_doubling(rank: int, world: int) -> RecursiveDoubling:
    """The plan of ``rank`` in a recursive-doubling allreduce (see :class:`RecursiveDoubling`)."""
    if not (0 <= rank < world):
        raise LocalProtocolError(f"rank {rank} is not in a world of {world}")
    p = 1 << (world.bit_length() - 1)
    extra = world - p
    if rank < 2 * extra and rank % 2 == 0:
        return RecursiveDoubling(fold_to=rank + 1, fold_from=None, rounds=())
    fold_from = rank - 1 if rank < 2 * extra else None
    v = rank // 2 if rank < 2 * extra else rank - extra  # this rank's place among the P

    def real(u: int) -> int:
        return 2 * u + 1 if u < extra else u + extra

    rounds, mask = [], 1
    while mask < p:
        u = v ^ mask
        rounds.append((real(u), u < v))
        mask *= 2
    return RecursiveDoubling(fold_to=None, fold_from=fold_from, rounds=tuple(rounds))


def binomial_tree(rank: int, world: int, root: int) -> tuple[int | None, list[int]]:
    """``rank``'s place in the binomial broadcast tree rooted at ``root``: its parent (None for
    the root) and its children, the largest subtree first (sent to first, so the deepest
    branch starts earliest). Depth ``ceil(log2 world)``."""
    if not (0 <= rank < world and 0 <= root < world):
        raise LocalProtocolError(f"rank {rank} or root {root} is not in a world of {world}")
    v = (rank - root) % world
    low = v & -v if v else 1 << max(0, (world - 1).bit_length())
    parent = None if v == 0 else ((v - low) + root) % world
    children, m = [], low >> 1
    while m:
        if v + m < world:
            children.append((v + m + root) % world)
        m >>= 1
    return parent, children


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """Where the latency-optimal algorithms give way to the ring ones (bytes of the array,
    or of all ranks' blocks for allgather). Every rank must use the same values: they decide
    who sends what."""

    allreduce: int = 64 << 10
    broadcast: int = 64 << 10
    allgather: int = 64 << 10


def choose(kind: str, nbytes: int, world: int, limits: Thresholds = Thresholds()) -> str:
    """The algorithm for a collective: ``"recursive_doubling"`` or ``"ring"`` (allreduce),
    ``"binomial"`` or ``"chain"`` (broadcast), ``"direct"`` or ``"ring"`` (allgather).
    Small sizes take the few-rounds algorithm, large ones the bandwidth-optimal one."""
    if kind == "allreduce":
        return "recursive_doubling" if nbytes <= limits.allreduce else "ring"
    if kind == "broadcast":
        return "binomial" if nbytes <= limits.broadcast or world < 3 else "chain"
    if kind == "allgather":
        return "direct" if nbytes <= limits.allgather or world < 3 else "ring"
    raise LocalProtocolError(f"no algorithm for {kind!r}")


# -- rendezvous --------------------------------------------------------------------------------


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
        self.failure: str | None = None

    @property
    def complete(self) -> bool:
        """Every rank joined (and nothing failed)."""
        return self.failure is None and len(self.members) == self.world

    @property
    def done(self) -> bool:
        """Complete or failed: waiters can be answered."""
        return self.failure is not None or len(self.members) == self.world

    def add(self, rank: Any, world: Any, host: Any, port: Any) -> None:
        """Record that ``rank`` listens on ``host:port``.

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
        if problem is not None:
            self.failure = problem
            raise RendezvousRefused(problem)
        self.members[rank] = (host, port)

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
