"""The collectives' written pieces (aiordma.protocols.collectives, "Written pieces"): the
immediate value and the note behind a piece's data, decoded where the receiver finds them.
No device."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError

U64 = st.integers(0, 2**64 - 1)


def write(slots: np.ndarray, size: int, piece: proto.Piece, data: bytes) -> tuple[int, int]:
    """What the sender's gathered WRITE does: the data, then the note, from the slot's start;
    returns the immediate value and the byte count the receiver's completion carries."""
    note = proto.encode(piece)
    at = piece.slot * (size + proto.NOTE_BYTES)
    slots[at:at + len(data) + len(note)] = np.frombuffer(data + note, np.uint8)
    return proto.note_imm(piece.slot, len(note)), len(data) + len(note)


@given(group=U64, channel=U64, call=U64, op=st.integers(0, len(proto.KINDS) - 1), step=U64,
       offset=U64, signature=U64, slot=st.integers(0, 7), size=st.integers(1, 300),
       data=st.data())
def test_any_piece_round_trips_through_its_slot(group: int, channel: int, call: int, op: int,
                                                step: int, offset: int, signature: int,
                                                slot: int, size: int,
                                                data: st.DataObject) -> None:
    """The largest fields still leave the note within its room; the receiver decodes the
    piece the sender wrote, and the slot's other bytes (and the other slots) are untouched."""
    count = 8
    nbytes = data.draw(st.integers(1, size))
    piece = proto.Piece(group=group, channel=channel, call=call, op=op, step=step, slot=slot,
                        offset=offset, nbytes=nbytes, signature=signature)
    assert len(proto.encode(piece)) <= proto.NOTE_BYTES
    slots = np.full(count * (size + proto.NOTE_BYTES), 0xA5, np.uint8)
    payload = bytes(data.draw(st.binary(min_size=nbytes, max_size=nbytes)))
    value, n = write(slots, size, piece, payload)
    assert value & 0xFFFF == slot
    assert proto.written_piece(value, n, slots, count, size) == piece
    at = slot * (size + proto.NOTE_BYTES)
    assert bytes(slots[at:at + nbytes]) == payload
    assert (slots[at + n:] == 0xA5).all() and (slots[:at] == 0xA5).all()


def piece(slot: int = 1, nbytes: int = 10) -> proto.Piece:
    return proto.Piece(group=0, channel=0, call=3, op=1, step=0, slot=slot, offset=0,
                       nbytes=nbytes, signature=7)


@pytest.mark.parametrize(("change", "match"), [
    (lambda v, n: (v | 5, n), "not a piece"),  # slot 5 of 4
    (lambda v, n: (v & 0xFFFF, n), "not a piece"),  # no note
    (lambda v, n: ((v & 0xFFFF) | (proto.NOTE_BYTES + 1) << 16, n), "not a piece"),
    (lambda v, n: (v, (v >> 16)), "not a piece"),  # no data
    (lambda v, n: (v, 64 + (v >> 16) + 1), "not a piece"),  # past the slot
    (lambda v, n: (v, n - 1), "msgpack|fields|note"),  # the note cut short
    (lambda v, n: (v & ~0xFFFF, n), "note of a piece|collectives message|msgpack"),  # slot 0
])
def test_what_is_not_a_written_piece_is_a_remote_error(change, match) -> None:
    size, count = 64, 4
    slots = np.zeros(count * (size + proto.NOTE_BYTES), np.uint8)
    value, n = write(slots, size, piece(), bytes(10))
    value, n = change(value, n)
    with pytest.raises(RemoteProtocolError, match=match):
        proto.written_piece(value, n, slots, count, size)


def test_a_note_that_is_not_a_piece_is_a_remote_error() -> None:
    size, count = 64, 2
    slots = np.zeros(count * (size + proto.NOTE_BYTES), np.uint8)
    note = proto.encode(proto.Credit(count=1))
    slots[10:10 + len(note)] = np.frombuffer(note, np.uint8)
    with pytest.raises(RemoteProtocolError, match="note of a piece"):
        proto.written_piece(proto.note_imm(0, len(note)), 10 + len(note), slots, count, size)


@pytest.mark.parametrize(("slot", "note"), [(-1, 10), (1 << 16, 10), (0, 0),
                                            (0, proto.NOTE_BYTES + 1)])
def test_an_unencodable_immediate_is_a_local_error(slot: int, note: int) -> None:
    with pytest.raises(LocalProtocolError):
        proto.note_imm(slot, note)
