"""protocols/kv.py without a device: the table a one-sided reader sees, and that a reader never
accepts a torn slot.

* a stateful model: TableWriter against a dict; every key's window, read as bytes, gives the
  model's value or a verdict that sends the reader to the server for a stated reason;
* torn reads: windows assembled from the bytes before and after a rewrite, in any mixture
  (a DMA copy has no order), and every intermediate state of the rewrite, never yield a value
  other than the old or the new one.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from aiordma.protocols.errors import RemoteProtocolError
from aiordma.protocols.kv import (
    BIG,
    HEADER_SIZE,
    MISSING,
    TORN,
    UNKNOWN,
    Layout,
    TableWriter,
    lookup,
)

SMALL = Layout(slots=16, slot_size=64, window=3)  # inline: 40 bytes of key + value
KEY_SET = [b"", b"a", b"b", b"key", b"k" * 20, b"x" * 41] + [bytes([i]) * 3 for i in range(30)]
KEYS = st.sampled_from(KEY_SET)
VALUES = st.binary(max_size=60)


def window_of(layout: Layout, table: bytearray, key: bytes) -> bytes:
    home = layout.home(key)
    return bytes(table[home * layout.slot_size:(home + layout.window) * layout.slot_size])


def test_an_empty_table_says_missing() -> None:
    table = bytearray(SMALL.table_bytes)
    assert lookup(SMALL, window_of(SMALL, table, b"k"), b"k") is MISSING


def test_put_get_delete() -> None:
    table = bytearray(SMALL.table_bytes)
    w = TableWriter(SMALL, table)
    assert w.put(b"k", b"v1")
    assert lookup(SMALL, window_of(SMALL, table, b"k"), b"k") == b"v1"
    assert w.put(b"k", b"v2")
    assert lookup(SMALL, window_of(SMALL, table, b"k"), b"k") == b"v2"
    assert w.delete(b"k") and not w.delete(b"k")
    # A tombstone is not an EMPTY slot: the reader cannot conclude "absent" from it.
    assert lookup(SMALL, window_of(SMALL, table, b"k"), b"k") in (MISSING, UNKNOWN)


def test_large_values_and_keys_go_to_the_server() -> None:
    table = bytearray(SMALL.table_bytes)
    w = TableWriter(SMALL, table)
    assert w.put(b"k", b"v" * (SMALL.inline_max - 1))  # exactly fits
    assert lookup(SMALL, window_of(SMALL, table, b"k"), b"k") == b"v" * (SMALL.inline_max - 1)
    assert w.put(b"k", b"v" * SMALL.inline_max)  # one byte too many: BIG
    assert lookup(SMALL, window_of(SMALL, table, b"k"), b"k") is BIG
    huge = b"h" * (SMALL.inline_max + 1)
    assert not w.put(huge, b"")  # the key itself does not fit: not in the table


def test_a_full_window_overflows_and_readers_ask() -> None:
    layout = Layout(slots=4, slot_size=64, window=4)  # one window: every key shares it
    table = bytearray(layout.table_bytes)
    w = TableWriter(layout, table)
    keys = [bytes([i]) for i in range(5)]
    placed = [w.put(k, k * 2) for k in keys]
    assert placed == [True, True, True, True, False] and len(w) == 4
    assert lookup(layout, bytes(table), keys[4]) is UNKNOWN
    assert w.delete(keys[0])
    assert lookup(layout, bytes(table), keys[4]) is UNKNOWN  # tombstones are not EMPTY
    assert w.put(keys[4], b"now")  # the freed slot is reused
    assert lookup(layout, bytes(table), keys[4]) == b"now"


@given(key=st.binary(max_size=50), slots=st.integers(1, 10_000), window=st.integers(1, 16))
def test_windows_stay_inside_the_table(key: bytes, slots: int, window: int) -> None:
    layout = Layout(slots=max(slots, window), slot_size=64, window=window)
    home = layout.home(key)
    assert 0 <= home and home + layout.window <= layout.slots


@pytest.mark.parametrize("wire", [
    None, [], {"format": 2, "slots": 4, "slot_size": 64, "window": 1},
    {"format": 1, "slots": 4, "slot_size": 60, "window": 1},
    {"format": 1, "slots": 4, "slot_size": 64, "window": 5},
    {"format": 1, "slots": 4, "slot_size": 64},
    {"format": 1, "slots": "x", "slot_size": 64, "window": 1},
])
def test_bad_layouts_from_a_peer_are_protocol_errors(wire: object) -> None:
    with pytest.raises(RemoteProtocolError):
        Layout.from_wire(wire)


def test_layout_round_trip() -> None:
    assert Layout.from_wire(SMALL.to_wire()) == SMALL


class TableModel(RuleBasedStateMachine):
    """TableWriter against a dict: what each key's window says agrees with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.table = bytearray(SMALL.table_bytes)
        self.writer = TableWriter(SMALL, self.table)
        self.model: dict[bytes, bytes] = {}
        self.overflowed: set[bytes] = set()

    @rule(key=KEYS, value=VALUES)
    def put(self, key: bytes, value: bytes) -> None:
        self.model[key] = value
        if self.writer.put(key, value):
            self.overflowed.discard(key)
        else:
            self.overflowed.add(key)

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        self.writer.delete(key)
        self.model.pop(key, None)
        self.overflowed.discard(key)

    @invariant()
    def every_window_agrees(self) -> None:
        for key in KEY_SET:
            got = lookup(SMALL, window_of(SMALL, self.table, key), key)
            assert got is not TORN  # nothing is being rewritten
            if isinstance(got, bytes):
                assert self.model.get(key) == got
            elif got is MISSING:
                assert key not in self.model
            elif got is BIG:
                assert len(key) + len(self.model[key]) > SMALL.inline_max
            else:  # UNKNOWN: the key overflowed, or is absent behind a full window
                assert got is UNKNOWN
                assert key in self.overflowed or key not in self.model


TestTableModel = TableModel.TestCase
TestTableModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@given(old=VALUES, new=VALUES, data=st.data())
@settings(max_examples=300, deadline=None)
def test_a_torn_window_never_yields_a_third_value(old: bytes, new: bytes,
                                                  data: st.DataObject) -> None:
    layout = SMALL
    key = b"key"
    table = bytearray(layout.table_bytes)
    writer = TableWriter(layout, table)
    writer.put(key, old)
    before = bytes(table)
    writer.put(key, new)
    after = bytes(table)
    home = layout.home(key)
    lo, hi = home * layout.slot_size, (home + layout.window) * layout.slot_size
    # A mixture: each 8-byte word from before or after (a DMA copy in any order, any timing).
    words = (hi - lo) // 8
    picks = data.draw(st.lists(st.booleans(), min_size=words, max_size=words))
    mixed = bytearray(before[lo:hi])
    for i, take_new in enumerate(picks):
        if take_new:
            mixed[8 * i:8 * i + 8] = after[lo + 8 * i:lo + 8 * i + 8]
    # And the version odd in the middle of the rewrite, whatever else was copied.
    if data.draw(st.booleans()):
        slot = writer.slot_of(key)
        assert slot is not None
        off = (slot - home) * layout.slot_size
        mixed[off] |= 1
    got = lookup(layout, bytes(mixed), key)
    if isinstance(got, bytes):
        assert got in (old, new)
    elif got is BIG:
        assert len(key) + max(len(old), len(new)) > layout.inline_max
    else:
        assert got is TORN


@given(data=st.binary(min_size=SMALL.window_bytes, max_size=SMALL.window_bytes),
       key=st.binary(max_size=10))
@settings(max_examples=300)
def test_garbage_is_never_a_value(data: bytes, key: bytes) -> None:
    # Random bytes pass the checksum with probability 2**-64 per slot: never in practice.
    assert not isinstance(lookup(SMALL, data, key), bytes)


def test_header_size_matches_the_documented_layout() -> None:
    assert HEADER_SIZE == 24
