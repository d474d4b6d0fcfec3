"""Matching the collectives' messages, and the receive slots of a link (sans-I/O).

Re-exported by :mod:`aiordma.protocols.collectives`.

The ordering rule
-----------------
A group numbers its collectives in the order in which each rank *starts* them: the first
collective a rank starts on a group is call 0 there, the next call 1, and so on (a group's
formation is call 0 of the world group). Every message of a collective carries its group,
its call number and its kind (allreduce, broadcast, ...), so collectives of one group may run
at the same time, their messages interleaved on the same links: a receiver files each message
under its call. Ranks must therefore start a group's collectives in the same order (as MPI
requires of blocking collectives; arguments must match too). :class:`CallOrder` checks it on
one rank: a message for a call this rank started as another kind, or for a call it has
finished, or a call started as another kind than a message already received for it, is a
:class:`MismatchError` naming both operations.

Point-to-point messages (``send``/``recv``) are outside that order: they travel on a
*channel* of their own per tag, numbered per pair of ranks and tag in the order the sender
starts its sends and the receiver its receives (MPI's non-overtaking rule).

Slots
-----
A link's receive slots are filled round-robin (piece ``i`` in slot ``i % count``): the writer
takes a credit per piece (:class:`SlotWriter`), the reader gives slots back in fill order
(:class:`SlotLedger`), in batches. Several collectives sharing a link consume their pieces in
any order; a slot consumed early is only given back once the slots filled before it are, so
the writer's round-robin never reaches a slot still in use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from ..errors import LocalProtocolError, ProtocolError, RemoteProtocolError

__all__ = [
    "KINDS", "CallOrder", "MismatchError", "SlotLedger", "SlotWriter", "group_id", "kind_code",
    "split_members",
]

#: The kinds of operation a message can belong to, by wire code (its index).
KINDS: tuple[str, ...] = (
    "formation", "barrier", "broadcast", "allgather", "allreduce", "reduce_scatter",
    "alltoall", "alltoallv", "gather", "scatter", "reduce", "split", "send", "window",
)
_CODES = {name: i for i, name in enumerate(KINDS)}


class MismatchError(ProtocolError):
    """Ranks disagree about the collective being run (kind, op, dtype, size, root or order)."""


def kind_code(name: str) -> int:
    """The wire code of an operation kind (see :data:`KINDS`)."""
    try:
        return _CODES[name]
    except KeyError:
        raise LocalProtocolError(f"no operation kind {name!r}") from None


def _kind_name(code: int) -> str:
    return KINDS[code] if 0 <= code < len(KINDS) else f"kind {code}"


class CallOrder:
    """The collectives one rank has started on one group, and what a message from another
    rank for a call means (see the module's "ordering rule").

    Args:
        name: how errors name the group (e.g. ``"the group"``).
        history: how many finished calls are remembered by kind, for error messages.
    """

    def __init__(self, name: str = "the group", history: int = 256) -> None:
        self.name = name
        self.started = 0  # calls 0 .. started - 1 have started here
        self._history = history
        self._kinds: dict[int, int] = {}  # running and recently finished calls: their kind
        self._running: set[int] = set()
        self._early: dict[int, tuple[int, int]] = {}  # call -> (kind, rank) heard before start

    def start(self, kind: int) -> int:
        """Number the next collective this rank starts (of wire kind ``kind``).

        Raises:
            MismatchError: another rank's message for this call, already received, said
                another kind.
        """
        call = self.started
        self.started += 1
        self._kinds[call] = kind
        self._running.add(call)
        self._kinds.pop(call - self._history, None)
        heard = self._early.pop(call, None)
        if heard is not None and heard[0] != kind:
            raise self.mismatch(call, heard[0], heard[1])
        return call

    def finish(self, call: int) -> None:
        """Call ``call`` ended here (it stays known by kind for a while, for messages)."""
        self._running.discard(call)

    @property
    def running(self) -> frozenset[int]:
        return frozenset(self._running)

    def check(self, call: int, kind: int, rank: int) -> None:
        """A message of kind ``kind`` for call ``call`` arrived from ``rank``: fine if this rank
        runs that call as that kind, or has not started it yet (it is filed until then).

        Raises:
            MismatchError: this rank started the call as another kind, or has finished it (a
                rank that runs the same collective sends nothing after the other has finished).
        """
        if call >= self.started:
            first = self._early.setdefault(call, (kind, rank))
            if first[0] != kind:  # two other ranks disagree already
                raise MismatchError(
                    f"collective #{call} of {self.name}: rank {first[1]} started "
                    f"{_kind_name(first[0])} and rank {rank} {_kind_name(kind)}; every rank "
                    f"must start a group's collectives in the same order")
            return
        mine = self._kinds.get(call)
        if call in self._running and mine == kind:
            return
        if call not in self._running:
            what = (f"which this rank ran as {_kind_name(mine)} and has finished"
                    if mine is not None else "which this rank finished long ago")
            raise MismatchError(
                f"rank {rank} sent a {_kind_name(kind)} message for collective #{call} of "
                f"{self.name}, {what}: every rank must start a group's collectives in the "
                f"same order, with the same arguments")
        raise self.mismatch(call, kind, rank)

    def mismatch(self, call: int, theirs: int, rank: int) -> MismatchError:
        """The error for rank ``rank`` running call ``call`` as ``theirs``."""
        mine = self._kinds.get(call)
        return MismatchError(
            f"collective #{call} of {self.name}: rank {rank} started {_kind_name(theirs)}, this "
            f"rank {_kind_name(mine) if mine is not None else 'nothing yet'}; every rank must "
            f"start a group's collectives in the same order")


class SlotWriter:
    """The writing side of a link's ``count`` receive slots: a credit per free slot."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise LocalProtocolError("a link needs at least one slot")
        self.count = count
        self.credits = count
        self.written = 0

    def take(self) -> int | None:
        """The slot for the next piece, or None when every slot is in use (wait for a
        :meth:`credit`)."""
        if self.credits == 0:
            return None
        self.credits -= 1
        slot = self.written % self.count
        self.written += 1
        return slot

    def credit(self, n: int) -> None:
        """The reader gave ``n`` slots back (the oldest ones).

        Raises:
            RemoteProtocolError: more slots than are in use.
        """
        if n < 1 or self.credits + n > self.count:
            raise RemoteProtocolError(f"a credit of {n} with {self.credits} of {self.count} "
                                      f"slots free")
        self.credits += n


class SlotLedger:
    """The reading side of a link's ``count`` receive slots: which pieces are in use, and how
    many slots to give back.

    Pieces are numbered in the order they fill slots (piece ``i`` is in slot ``i % count``).
    :meth:`release` may come in any order; :meth:`due` gives back only the oldest slots whose
    pieces are all released, in batches of ``batch`` (default half the slots), or at once
    when the writer has none left.
    """

    def __init__(self, count: int, batch: int | None = None) -> None:
        if count < 1:
            raise LocalProtocolError("a link needs at least one slot")
        self.count = count
        self.batch = batch if batch is not None else max(1, count // 2)
        if not 1 <= self.batch <= count:
            raise LocalProtocolError(f"a batch of {self.batch} for {count} slots")
        self.filled = 0  # pieces that arrived
        self.credited = 0  # pieces whose slots went back
        self._released: set[int] = set()  # released pieces at or after ``credited``
        self._prefix = 0  # every piece before this one is released

    def fill(self, slot: int) -> int:
        """A piece arrived in ``slot``; its number.

        Raises:
            RemoteProtocolError: not the slot the writer must use next, or the writer had no
                credit for it.
        """
        if self.filled - self.credited >= self.count:
            raise RemoteProtocolError(f"a piece arrived in slot {slot} while every slot was "
                                      f"in use")
        want = self.filled % self.count
        if slot != want:
            raise RemoteProtocolError(f"a piece arrived in slot {slot}; the next slot to fill "
                                      f"is {want}")
        self.filled += 1
        return self.filled - 1

    def release(self, piece: int) -> None:
        """Piece ``piece`` is consumed (its slot may be reused once given back).

        Raises:
            LocalProtocolError: not a piece in use.
        """
        if not (self._prefix <= piece < self.filled) or piece in self._released:
            raise LocalProtocolError(f"piece {piece} is not in use")
        self._released.add(piece)
        while self._prefix in self._released:
            self._released.discard(self._prefix)
            self._prefix += 1

    @property
    def stalled(self) -> bool:
        """Every slot is in use: the writer cannot send another piece until some come back."""
        return self.filled - self.credited >= self.count

    def in_use(self, piece: int) -> bool:
        return self._prefix <= piece < self.filled and piece not in self._released

    def due(self) -> int:
        """How many slots to give back now (0: none yet); counted as given back."""
        ready = self._prefix - self.credited
        if ready >= self.batch or (ready and self.stalled):
            self.credited += ready
            return ready
        return 0


def split_members(entries: Sequence[Any], rank: int) -> list[int] | None:
    """MPI's ``Comm_split``: the parent ranks of ``rank``'s new group, in their new rank
    order, from every rank's ``(color, key)`` (``entries[r]`` is rank ``r``'s); None when
    ``rank``'s color is None (it joins no group). Ranks of one color are ordered by key, ties
    by their rank in the parent group.

    Raises:
        RemoteProtocolError: an entry is not ``[color, key]`` with color None or an int >= 0
            and key an int.
    """
    def valid(e: Any) -> bool:
        if not (isinstance(e, (list, tuple)) and len(e) == 2):
            return False
        color, key = e
        return ((color is None or (type(color) is int and color >= 0)) and type(key) is int)

    if not all(valid(e) for e in entries):
        raise RemoteProtocolError(f"bad split entries: {list(entries)!r:.200}")
    color = entries[rank][0]
    if color is None:
        return None
    same = [(entries[r][1], r) for r in range(len(entries)) if entries[r][0] == color]
    return [r for _, r in sorted(same)]


def group_id(*parts: object) -> int:
    """A group's number on the wire, derived from how it was made (the parent's number and
    the call or member list that made it), so that every member computes the same one
    without a message; never 0 (the whole group's)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1
