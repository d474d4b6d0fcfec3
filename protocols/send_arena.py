"""Send slots shared by the connections of a receive pool, sans-I/O: one chunk of an arena.

A listener's connections on a shared receive pool (:mod:`aiordma.protocols.receive_pool`) need
no receive slots of their own; their send slots come from a *send arena* of the pool's, so
that an idle connection pins almost nothing. The arena registers its slots in *chunks*, one
memory region each; a :class:`SendChunk` is the bookkeeping of one, with room for
``members`` connections:

Layout
    ``members x reserve`` slots first, ``reserve`` per member (member ``i`` owns slots
    ``i * reserve`` to ``(i + 1) * reserve - 1``), then ``shared`` slots that any member may
    borrow: :attr:`SendChunk.shared_start` onwards. A connection joins a chunk with room
    (:meth:`SendChunk.join`) for its whole life; its frames are written at chunk offsets, so
    one address and key serve every connection of the chunk.

Reserve
    A member's ``reserve`` slots are its own: it never waits on another connection. When they
    are all in flight, it waits for its own completions (a signaled post always comes, see
    :class:`~aiordma.protocols.messages.MessageProtocol`).

Borrow
    A member whose own slots are all in flight takes a slot of :attr:`SendChunk.shared` (while
    its posts in flight are fewer than its cap, the ``send_slots`` of its ``Config``) and puts
    it back at its own completion. A borrow is opportunistic: nobody waits for a shared slot,
    so a completion wakes no other connection. A member never holds a borrowed slot past its
    own completions: a post that leaves borrowed slots behind the last signaled one is made
    signaled before the driver takes it.

Leave
    A member leaves once its queue pair is destroyed (nothing of it is in flight any more):
    :meth:`~aiordma.protocols.messages.MessageProtocol.release_sends` puts its borrowed slots
    back, then :meth:`SendChunk.leave` frees its place for a new connection.

The protocols of one chunk hold the same :attr:`SendChunk.shared` list, so a borrow and a
return cost a list ``pop``/``append`` on the posting path. ``tests/unit/test_send_arena.py``
proves the rules with hypothesis on many protocols of one chunk.
"""

from __future__ import annotations

from .errors import LocalProtocolError

__all__ = ["SendChunk"]


class SendChunk:
    """One chunk of a send arena: ``members x reserve + shared`` slots (see the module
    documentation).

    Args:
        members: connections the chunk serves at most.
        reserve: slots of each member's own (at least 2).
        shared: slots any member may borrow.

    Raises:
        LocalProtocolError: a size out of range.

    Attributes:
        shared: the shared slots free now (the members' protocols pop and append it).
        shared_start: the first shared slot; a slot below it is a member's own.
        slots: slots in the chunk (its region holds ``slots x slot_size`` bytes).
    """

    def __init__(self, *, members: int, reserve: int, shared: int) -> None:
        if members < 1 or reserve < 2 or shared < 0:
            raise LocalProtocolError(f"a send chunk needs members >= 1, reserve >= 2 and "
                                     f"shared >= 0, not {members}, {reserve} and {shared}")
        self.members, self.reserve = members, reserve
        self.shared_start = members * reserve
        self.slots = self.shared_start + shared
        self.shared = list(range(self.shared_start, self.slots))
        self._vacant = list(range(members - 1, -1, -1))  # (pop() gives the lowest first)

    @property
    def occupied(self) -> int:
        """Members now."""
        return self.members - len(self._vacant)

    @property
    def full(self) -> bool:
        """No room for another member."""
        return not self._vacant

    def join(self) -> int:
        """A connection joins: returns its member number (its reserve: :meth:`reserve_of`).

        Raises:
            LocalProtocolError: the chunk is full.
        """
        if not self._vacant:
            raise LocalProtocolError(f"the send chunk's {self.members} places are taken")
        return self._vacant.pop()

    def reserve_of(self, member: int) -> list[int]:
        """The slots of ``member``'s own."""
        if not 0 <= member < self.members:
            raise LocalProtocolError(f"no member {member} in a chunk of {self.members}")
        return list(range(member * self.reserve, (member + 1) * self.reserve))

    def leave(self, member: int) -> None:
        """``member`` left (its queue pair is destroyed and its borrowed slots are back):
        its place is free.

        Raises:
            LocalProtocolError: ``member`` is not in the chunk.
        """
        if not 0 <= member < self.members or member in self._vacant:
            raise LocalProtocolError(f"member {member} is not in the chunk")
        self._vacant.append(member)

    def __repr__(self) -> str:
        return (f"<SendChunk {self.occupied}/{self.members} members x {self.reserve} + "
                f"{len(self.shared)}/{self.slots - self.shared_start} shared free>")
