"""The key-value table's memory layout: what a one-sided reader may find and how it tells a
consistent entry from a torn one (sans-I/O: bytes in, verdicts out).

The server keeps its table in one registered buffer of ``slots`` fixed-size slots and exposes
it read-only. A client hashes a key to its *home* slot, RDMA-READs the ``window`` slots from
there in one operation and looks the key up in the bytes it got (Pilaf, USENIX ATC 2013, reads
a hash table the same way; FaRM, NSDI 2014, also validates what it read instead of locking).

Slot layout (little-endian)::

    0   u64  version   even: stable; odd: the server is rewriting this slot (a seqlock)
    8   u8   state     EMPTY (never used), LIVE, TOMBSTONE (deleted), BIG (live, value not inline)
    9   u8   reserved
    10  u16  key length
    12  u32  value length (inline bytes; 0 for BIG)
    16  u64  checksum  BLAKE2b-64 over bytes 0..16, the key and the inline value
    24  key, then the value

The server rewrites a slot as: version += 1 (odd), the body, the checksum, version += 1 (even,
covered by the checksum). A READ that overlaps a rewrite sees an odd version, or a checksum
that does not match what it read: :data:`TORN`, and the client asks the server by RPC instead.
A checksum also catches what a seqlock alone would not (a READ that saw the old version and
half of the new body), since the DMA copy has no ordering the reader can rely on.

Placement: linear probing inside the key's window only. Windows never wrap (the home slot is
``hash % (slots - window + 1)``), so a window is one contiguous READ. A key that finds no free
slot in its window lives only in the server's dictionary (overflow). Slots never return to
EMPTY (deletes leave TOMBSTONEs), so a reader may conclude "absent" only at an EMPTY slot met
before the key; a window with neither the key nor an EMPTY slot means "ask the server".
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "BIG",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MISSING",
    "TORN",
    "UNKNOWN",
    "Layout",
    "Lookup",
    "SlotState",
    "TableWriter",
    "lookup",
]

FORMAT_VERSION = 1
HEADER_SIZE = 24
_HEAD = struct.Struct("<QBBHI")  # version, state, reserved, key length, value length
_U64 = struct.Struct("<Q")
MAX_KEY = 0xFFFF
MAX_SLOT_SIZE = 1 << 20
MAX_TABLE_BYTES = 4 << 30  # the server registers the whole table
MAX_WINDOW_BYTES = 1 << 20  # what one GET reads (a client keeps a buffer of it per reader)


class SlotState(enum.IntEnum):
    EMPTY = 0
    LIVE = 1
    TOMBSTONE = 2
    BIG = 3  # live, but the value is too large to be inline: read it by RPC


class Lookup(enum.Enum):
    """A lookup's verdicts other than a value."""

    MISSING = "missing"  # an EMPTY slot came before the key: it is not in the table
    TORN = "torn"  # a slot changed while it was read: ask the server
    BIG = "big"  # the key is there, its value is not inline: ask the server
    UNKNOWN = "unknown"  # neither the key nor an EMPTY slot in the window: ask the server


MISSING, TORN, BIG, UNKNOWN = Lookup.MISSING, Lookup.TORN, Lookup.BIG, Lookup.UNKNOWN


def _checksum(head: bytes | memoryview, key: bytes | memoryview,
              value: bytes | bytearray | memoryview) -> int:
    h = hashlib.blake2b(head, digest_size=8)
    h.update(key)
    h.update(value)
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """The table's geometry, as the server announces it to clients.

    Raises:
        LocalProtocolError: a field is not an integer, ``slot_size`` is not a multiple of 8
            in 32..:data:`MAX_SLOT_SIZE`, ``window`` is not in 1..``slots``, or the table or a
            window is larger than :data:`MAX_TABLE_BYTES` / :data:`MAX_WINDOW_BYTES`.
    """

    slots: int
    slot_size: int
    window: int

    def __post_init__(self) -> None:
        for name in ("slots", "slot_size", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise LocalProtocolError(f"{name} must be an integer, not {v!r:.80}")
        if not HEADER_SIZE + 8 <= self.slot_size <= MAX_SLOT_SIZE or self.slot_size % 8:
            raise LocalProtocolError(f"slot_size must be a multiple of 8 in "
                                     f"{HEADER_SIZE + 8}..{MAX_SLOT_SIZE}, not {self.slot_size}")
        if not 1 <= self.window <= self.slots:
            raise LocalProtocolError(f"window must be between 1 and the number of slots, not "
                                     f"{self.window} (slots: {self.slots})")
        if self.table_bytes > MAX_TABLE_BYTES or self.window_bytes > MAX_WINDOW_BYTES:
            raise LocalProtocolError(f"a table is at most {MAX_TABLE_BYTES >> 30} GiB and a "
                                     f"window at most {MAX_WINDOW_BYTES >> 20} MiB (one READ "
                                     f"per GET), not {self.slots} x {self.slot_size} B with "
                                     f"windows of {self.window}")

    @property
    def table_bytes(self) -> int:
        return self.slots * self.slot_size

    @property
    def window_bytes(self) -> int:
        return self.window * self.slot_size

    @property
    def inline_max(self) -> int:
        """The most key + value bytes a slot holds inline."""
        return self.slot_size - HEADER_SIZE

    def home(self, key: bytes) -> int:
        """The first slot of ``key``'s window (the same on every machine: not ``hash()``)."""
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return h % (self.slots - self.window + 1)

    def to_wire(self) -> dict[str, int]:
        return {"format": FORMAT_VERSION, "slots": self.slots, "slot_size": self.slot_size,
                "window": self.window}

    @classmethod
    def from_wire(cls, wire: object) -> Layout:
        """Raises RemoteProtocolError: not a layout this version can read."""
        if not isinstance(wire, dict) or wire.get("format") != FORMAT_VERSION:
            raise RemoteProtocolError(f"unsupported table layout: {wire!r}")
        try:
            return cls(slots=int(wire["slots"]), slot_size=int(wire["slot_size"]),
                       window=int(wire["window"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"bad table layout: {wire!r}") from exc


def lookup(layout: Layout, window: bytes | bytearray | memoryview,
           key: bytes) -> bytes | Lookup:
    """Find ``key`` in the bytes of its window, as one READ returned them.

    Returns the value (a copy), or a :class:`Lookup` verdict. Never returns bytes that did not
    pass the checksum: a torn slot is :data:`TORN` even if it holds the key.
    """
    if len(key) > min(MAX_KEY, layout.inline_max):
        return UNKNOWN  # such a key is never placed in the table: only the server knows
    view = memoryview(window)
    size = layout.slot_size
    for i in range(len(view) // size):
        slot = view[i * size:(i + 1) * size]
        version, state, _, klen, vlen = _HEAD.unpack_from(slot)
        if version & 1:
            return TORN
        if state == SlotState.EMPTY and version == 0:
            return MISSING  # never written (an all-zero slot)
        if HEADER_SIZE + klen + vlen > size or state > SlotState.BIG:
            return TORN  # lengths from a half-written header
        (check,) = _U64.unpack_from(slot, 16)
        k = slot[HEADER_SIZE:HEADER_SIZE + klen]
        v = slot[HEADER_SIZE + klen:HEADER_SIZE + klen + vlen]
        if check != _checksum(slot[:16], k, v):
            return TORN
        if state in (SlotState.LIVE, SlotState.BIG) and k == key:
            return bytes(v) if state == SlotState.LIVE else BIG
    return UNKNOWN


class TableWriter:
    """The server's side: places, rewrites and deletes entries in ``buffer`` (the exposed
    table) with the seqlock protocol above. Not thread-safe: one writer (the event loop)."""

    def __init__(self, layout: Layout, buffer: bytearray | memoryview) -> None:
        if len(buffer) < layout.table_bytes:
            raise LocalProtocolError("the buffer is smaller than the table")
        self.layout = layout
        self._buf = memoryview(buffer)
        self._where: dict[bytes, int] = {}  # key -> slot, for keys that are in the table

    def __len__(self) -> int:
        """How many keys are in the table (the others overflowed: server only)."""
        return len(self._where)

    def slot_of(self, key: bytes) -> int | None:
        return self._where.get(key)

    def put(self, key: bytes, value: bytes | bytearray | memoryview) -> bool:
        """Store ``key``; False if its window is full (the caller keeps it elsewhere)."""
        if len(key) > min(MAX_KEY, self.layout.inline_max):
            return False  # the key itself does not fit a slot
        slot = self._where.get(key)
        if slot is None:
            slot = self._free_slot(key)
            if slot is None:
                return False
            self._where[key] = slot
        if len(key) + len(value) <= self.layout.inline_max:
            self._write(slot, SlotState.LIVE, key, value)
        else:
            self._write(slot, SlotState.BIG, key, b"")
        return True

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` from the table (a TOMBSTONE); False if it was not in it."""
        slot = self._where.pop(key, None)
        if slot is None:
            return False
        self._write(slot, SlotState.TOMBSTONE, b"", b"")
        return True

    def _free_slot(self, key: bytes) -> int | None:
        home = self.layout.home(key)
        size = self.layout.slot_size
        for slot in range(home, home + self.layout.window):
            if self._buf[slot * size + 8] in (SlotState.EMPTY, SlotState.TOMBSTONE):
                return slot
        return None

    def _write(self, slot: int, state: SlotState, key: bytes,
               value: bytes | bytearray | memoryview) -> None:
        off = slot * self.layout.slot_size
        buf = self._buf
        (version,) = _U64.unpack_from(buf, off)
        _U64.pack_into(buf, off, version + 1)  # odd: readers treat the slot as torn
        head = _HEAD.pack(version + 2, state, 0, len(key), len(value))
        buf[off + 8:off + 16] = head[8:]
        k0 = off + HEADER_SIZE
        buf[k0:k0 + len(key)] = key
        buf[k0 + len(key):k0 + len(key) + len(value)] = value
        _U64.pack_into(buf, off + 16, _checksum(head, key, value))
        _U64.pack_into(buf, off, version + 2)  # even again: stable
