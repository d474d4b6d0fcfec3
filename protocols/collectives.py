"""The collectives' wire messages, ring schedules and rendezvous roster (sans-I/O).

:mod:`aiordma.services.collectives` runs a group of ``world`` ranks connected in a ring: every rank
has one endpoint to its *right* neighbour ``(rank + 1) % world`` (it connected it) and one
from its *left* neighbour ``(rank - 1) % world`` (it accepted it). Data only ever flows
rightwards: a rank RDMA-WRITEs into its right neighbour's receive *slots* and then tells it
with a :class:`Piece` message on the same queue pair (RC keeps the WRITE before the SEND); the
neighbour answers with a :class:`Credit` once it has consumed the slot. Everything here is
pure: messages in and out are ``bytes``, and the schedules are plain integer arithmetic, so
they are tested with hypothesis without a device.

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
==========  ====  ==========================================================================

``call`` numbers a group's collectives (every rank counts the same way), ``step`` the ring
steps within one, ``offset`` is a byte offset in the collective's logical buffer, and
``signature`` is a CRC of what the writer thinks the collective is (kind, op, dtype, size):
a receiver that expected something else raises :class:`MismatchError` instead of reducing
garbage.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError

__all__ = [
    "PROTOCOL_VERSION", "Credit", "Event", "Hello", "MismatchError", "Piece", "RendezvousRefused",
    "Roster", "Slots", "Value", "allgather_schedule", "allreduce_schedule", "chunk_bounds",
    "decode", "encode", "piece_bounds", "signature", "validate_members",
]

PROTOCOL_VERSION = 1
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


_KINDS: dict[type[Event], int] = {Hello: 1, Slots: 2, Credit: 3, Piece: 4, Value: 5}
_CLASSES = {k: c for c, k in _KINDS.items()}
_FIELDS: dict[type[Event], tuple[str, ...]] = {
    Hello: ("version", "token", "rank", "world"),
    Slots: ("descriptor", "count", "size"),
    Credit: ("count",),
    Piece: ("call", "step", "slot", "offset", "nbytes", "signature"),
    Value: ("call", "step", "origin", "value"),
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
