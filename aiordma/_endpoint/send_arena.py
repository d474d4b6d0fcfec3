"""A send arena: the send slots of a shared receive pool's connections, registered in chunks.

A connection on a shared receive pool (:mod:`.receive_pool`; a listener's or a client's) has
no receive slots of its own; without an arena it would still register ``send_slots x
slot_size`` bytes (512 KiB by default) of send slots in a memory region of its own. With one,
it takes a place in a *chunk* of the pool's :class:`SendArena` for its whole life: one memory
region of
``ARENA_MEMBERS x reserve + shared`` slots serving up to :data:`ARENA_MEMBERS` connections,
each with ``reserve`` slots of its own (``Config.send_reserve``) and the chunk's ``shared``
slots to borrow (``Config.send_slots`` of them, so that one busy connection can still have its
whole cap in flight). The rules of a chunk are sans-I/O
(:class:`aiordma.protocols.send_arena.SendChunk`); the endpoint's protocol writes its frames at
chunk offsets, and its action runner bakes the chunk's address and key.

Lifetimes: a chunk is registered when a connection finds every chunk full, and closed when its
last connection leaves (:meth:`SendSeat.leave`, after the connection's queue pair is destroyed,
so the device reads none of its slots any more). The arena belongs to its pool
(:func:`join_send_arena`); every connection holds the pool until it leaves.
"""

from __future__ import annotations

from aiordma._device.device import Device
from aiordma._memory.region import MemoryRegion
from aiordma.protocols.send_arena import SendChunk

__all__ = ["ARENA_MEMBERS", "SendArena", "SendSeat", "join_send_arena"]

ARENA_MEMBERS = 32
"""Connections one chunk serves at most (one memory region for each this many)."""


class _Chunk:
    __slots__ = ("region", "rules")

    def __init__(self, rules: SendChunk, region: MemoryRegion) -> None:
        self.rules, self.region = rules, region


class SendSeat:
    """A connection's place in a chunk: its member number, the chunk's rules and region.

    Attributes:
        chunk: the chunk's rules (give them to the protocol with ``member``).
        member: the connection's member number in the chunk.
        region: the chunk's registered slots (the connection's send region).
    """

    __slots__ = ("_arena", "_chunk", "chunk", "member", "region")

    def __init__(self, arena: SendArena, chunk: _Chunk, member: int) -> None:
        self._arena, self._chunk = arena, chunk
        self.chunk, self.region, self.member = chunk.rules, chunk.region, member

    def leave(self) -> None:
        """The connection's queue pair is destroyed and its borrowed slots are back
        (``MessageProtocol.release_sends``, if it had a protocol): its place is free, and the
        chunk's region is closed if it was the last (idempotent)."""
        if self.member >= 0:
            self._arena._leave(self._chunk, self.member)
            self.member = -1


class SendArena:
    """The chunks of send slots of one pool's connections (see the module documentation).

    Args:
        device: the opened device.
        slot_size: bytes per slot.
        reserve: slots of each connection's own.
        shared: slots of each chunk that its connections borrow.
        members: connections per chunk.
    """

    def __init__(self, device: Device, *, slot_size: int, reserve: int, shared: int,
                 members: int = ARENA_MEMBERS) -> None:
        self.device, self.slot_size = device, slot_size
        self.reserve, self.shared, self.members = reserve, shared, members
        self._chunks: list[_Chunk] = []

    @property
    def chunks(self) -> int:
        """Chunks (memory regions) registered now."""
        return len(self._chunks)

    def join(self) -> SendSeat:
        """A place for a new connection: in the first chunk with room, else in a new one.

        Raises:
            DeviceError: the registration of a new chunk failed.
        """
        chunk = next((c for c in self._chunks if not c.rules.full), None)
        if chunk is None:
            rules = SendChunk(members=self.members, reserve=self.reserve, shared=self.shared)
            region = MemoryRegion(self.device, bytearray(rules.slots * self.slot_size))
            chunk = _Chunk(rules, region)
            self._chunks.append(chunk)
        return SendSeat(self, chunk, chunk.rules.join())

    def _leave(self, chunk: _Chunk, member: int) -> None:
        chunk.rules.leave(member)
        if chunk.rules.occupied == 0:
            self._chunks.remove(chunk)
            chunk.region.close()

    def close(self) -> None:
        """Deregister every chunk (their connections are gone: the pool closes)."""
        for chunk in self._chunks:
            chunk.region.close()
        self._chunks.clear()

    def __repr__(self) -> str:
        used = sum(c.rules.occupied for c in self._chunks)
        return (f"<SendArena {used} connections in {len(self._chunks)} chunks of "
                f"{self.members} x {self.reserve} + {self.shared} slots of {self.slot_size} B>")


def join_send_arena(arenas: dict[tuple[int, int], SendArena], device: Device, *,
                    slot_size: int, reserve: int, shared: int) -> SendSeat:
    """A seat in the arena of ``arenas`` (a pool's) for this reserve and shared size (created
    on first use).

    Raises:
        DeviceError: the registration of a new chunk failed.
    """
    arena = arenas.get((reserve, shared))
    if arena is None:
        arena = arenas[(reserve, shared)] = SendArena(device, slot_size=slot_size,
                                                      reserve=reserve, shared=shared)
    return arena.join()
