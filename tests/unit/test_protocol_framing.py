"""Frames in receive slots (aiordma.protocols.framing): round trips and strict parsing. No device."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError
from aiordma.protocols.framing import (
    HEADER_SIZE,
    CreditFrame,
    DataFrame,
    DoneFrame,
    Frame,
    Kind,
    PoolFrame,
    RtsFrame,
    pack_credit,
    pack_data_header,
    pack_done,
    pack_pool,
    pack_rts,
    parse,
)

HEADER = struct.Struct("<BBHHHI")  # the documented layout, restated independently
U16 = st.integers(0, 0xFFFF)
U32 = st.integers(0, (1 << 32) - 1)
U64 = st.integers(0, (1 << 64) - 1)
OFFSETS = st.integers(0, 64)
SLACK = st.integers(0, 64)  # unused bytes after the frame in the slot
FILL = st.sampled_from([0x00, 0xA5, 0xFF])  # what the rest of the slot holds


def slot(offset: int, size: int, slack: int, fill: int) -> bytearray:
    return bytearray([fill]) * (offset + size + slack)


def test_header_size_and_kinds() -> None:
    assert HEADER_SIZE == HEADER.size == 12
    assert {k.name: int(k) for k in Kind} == {"DATA": 1, "RTS": 2, "DONE": 3, "CREDIT": 4,
                                               "WANT": 5, "RECLAIM": 6, "RETURN": 7}


# -- round trips ------------------------------------------------------------------------------


@given(payload=st.binary(max_size=300), credits=U16, ctrl=U16, offset=OFFSETS, slack=SLACK,
       fill=FILL, view=st.booleans())
def test_data_round_trip(payload: bytes, credits: int, ctrl: int, offset: int, slack: int,
                         fill: int, view: bool) -> None:
    buf = slot(offset, HEADER_SIZE + len(payload), slack, fill)
    target = memoryview(buf) if view else buf
    n = pack_data_header(target, offset, len(payload), credits, ctrl)
    assert n == HEADER_SIZE + len(payload)
    buf[offset + HEADER_SIZE:offset + n] = payload
    frame = parse(bytes(buf) if view else buf, offset, n)
    assert frame == DataFrame(credits=credits, ctrl_credits=ctrl, offset=offset + HEADER_SIZE,
                              length=len(payload))
    assert bytes(buf[frame.offset:frame.offset + frame.length]) == payload
    assert HEADER.unpack_from(buf, offset) == (1, 0, credits, ctrl, 0, len(payload))
    # nothing outside the frame was written
    assert set(buf[:offset]) <= {fill} and set(buf[offset + n:]) <= {fill}


@given(size=U64, address=U64, rkey=U32, token=U32, credits=U16, ctrl=U16, offset=OFFSETS,
       slack=SLACK, fill=FILL)
def test_rts_round_trip(size: int, address: int, rkey: int, token: int, credits: int, ctrl: int,
                        offset: int, slack: int, fill: int) -> None:
    buf = slot(offset, HEADER_SIZE + 24, slack, fill)
    n = pack_rts(buf, offset, size=size, address=address, rkey=rkey, token=token,
                 credits=credits, ctrl=ctrl)
    assert n == HEADER_SIZE + 24
    assert parse(buf, offset, n) == RtsFrame(credits=credits, ctrl_credits=ctrl, size=size,
                                             address=address, rkey=rkey, token=token)
    assert set(buf[:offset]) <= {fill} and set(buf[offset + n:]) <= {fill}


@given(token=U32, credits=U16, ctrl=U16, offset=OFFSETS, slack=SLACK, fill=FILL)
def test_done_round_trip(token: int, credits: int, ctrl: int, offset: int, slack: int,
                         fill: int) -> None:
    buf = slot(offset, HEADER_SIZE + 4, slack, fill)
    n = pack_done(memoryview(buf), offset, token=token, credits=credits, ctrl=ctrl)
    assert n == HEADER_SIZE + 4
    assert parse(memoryview(buf), offset, n) == DoneFrame(credits=credits, ctrl_credits=ctrl,
                                                         token=token)
    assert set(buf[:offset]) <= {fill} and set(buf[offset + n:]) <= {fill}


@given(credits=U16, ctrl=U16, offset=OFFSETS, slack=SLACK, fill=FILL)
def test_credit_round_trip(credits: int, ctrl: int, offset: int, slack: int, fill: int) -> None:
    buf = slot(offset, HEADER_SIZE, slack, fill)
    n = pack_credit(buf, offset, credits=credits, ctrl=ctrl)
    assert n == HEADER_SIZE
    frame = parse(bytes(buf), offset, n)
    assert frame == CreditFrame(credits=credits, ctrl_credits=ctrl)
    assert type(frame) is CreditFrame
    assert set(buf[:offset]) <= {fill} and set(buf[offset + n:]) <= {fill}


def test_extreme_credit_values() -> None:
    buf = bytearray(64)
    for credits, ctrl in ((0, 0), (0xFFFF, 0), (0, 0xFFFF), (0xFFFF, 0xFFFF)):
        n = pack_credit(buf, 0, credits=credits, ctrl=ctrl)
        assert parse(buf, 0, n) == CreditFrame(credits=credits, ctrl_credits=ctrl)


# -- packing refuses credits that do not fit ---------------------------------------------------

BAD_CREDITS = [(0x10000, 0), (0, 0x10000), (-1, 0), (0, -1), (1 << 40, 1 << 40)]


@pytest.mark.parametrize(("credits", "ctrl"), BAD_CREDITS)
@pytest.mark.parametrize("kind", ["data", "rts", "done", "credit"])
def test_pack_refuses_credits_beyond_16_bits(kind: str, credits: int, ctrl: int) -> None:
    buf = bytearray(b"\xee" * 64)
    with pytest.raises(LocalProtocolError):
        if kind == "data":
            pack_data_header(buf, 0, 4, credits, ctrl)
        elif kind == "rts":
            pack_rts(buf, 0, size=1, address=2, rkey=3, token=4, credits=credits, ctrl=ctrl)
        elif kind == "done":
            pack_done(buf, 0, token=4, credits=credits, ctrl=ctrl)
        else:
            pack_credit(buf, 0, credits=credits, ctrl=ctrl)
    assert buf == b"\xee" * 64  # nothing was written


@given(credits=st.integers(0x10000, 1 << 70) | st.integers(-(1 << 70), -1), ctrl=U16,
       swap=st.booleans())
def test_pack_refuses_any_out_of_range_credit(credits: int, ctrl: int, swap: bool) -> None:
    if swap:
        credits, ctrl = ctrl, credits
    with pytest.raises(LocalProtocolError):
        pack_credit(bytearray(16), 0, credits=credits, ctrl=ctrl)


# -- parsing refuses malformed frames ----------------------------------------------------------


BODY_SIZES = {Kind.RTS: 24, Kind.DONE: 4, Kind.CREDIT: 0, Kind.WANT: 4, Kind.RECLAIM: 0,
              Kind.RETURN: 4}


def header(kind: int = Kind.CREDIT, flags: int = 0, credits: int = 1, ctrl: int = 2,
           reserved: int = 0, length: int = 0) -> bytes:
    return HEADER.pack(kind, flags, credits, ctrl, reserved, length)


def test_valid_reference_frames_parse() -> None:
    # positive controls for the refusals below, built with the independent struct
    assert parse(header(), 0, 12) == CreditFrame(credits=1, ctrl_credits=2)
    assert parse(header(Kind.DATA, length=3) + b"abc", 0, 15) == DataFrame(
        credits=1, ctrl_credits=2, offset=12, length=3)
    assert parse(header(Kind.DONE, length=4) + b"\x07\0\0\0", 0, 16) == DoneFrame(
        credits=1, ctrl_credits=2, token=7)
    body = struct.pack("<QQII", 10, 20, 30, 40)
    assert parse(header(Kind.RTS, length=24) + body, 0, 36) == RtsFrame(
        credits=1, ctrl_credits=2, size=10, address=20, rkey=30, token=40)


@pytest.mark.parametrize("nbytes", range(HEADER_SIZE))
def test_shorter_than_a_header(nbytes: int) -> None:
    buf = header()[:nbytes]
    with pytest.raises(RemoteProtocolError):
        parse(buf, 0, nbytes)
    with pytest.raises(RemoteProtocolError):  # even when the buffer behind it is larger
        parse(header(), 0, nbytes)


@pytest.mark.parametrize("kind", [0, 8, 9, 0x7F, 0x80, 0xFF])
@pytest.mark.parametrize("length", [0, 4, 24])
def test_unknown_kind(kind: int, length: int) -> None:
    with pytest.raises(RemoteProtocolError):
        parse(header(kind, length=length) + bytes(length), 0, HEADER_SIZE + length)


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize(("flags", "reserved"), [(1, 0), (0x80, 0), (0, 1), (0, 0x8000),
                                                 (0xFF, 0xFFFF)])
def test_non_zero_flags_or_reserved(kind: Kind, flags: int, reserved: int) -> None:
    length = {Kind.DATA: 5, **BODY_SIZES}[kind]
    buf = header(kind, flags=flags, reserved=reserved, length=length) + bytes(length)
    with pytest.raises(RemoteProtocolError):
        parse(buf, 0, len(buf))


@given(kind=st.sampled_from(list(Kind)), declared=st.integers(0, 100), carried=st.integers(0, 100))
def test_declared_length_must_match_nbytes(kind: Kind, declared: int, carried: int) -> None:
    buf = header(kind, length=declared) + bytes(max(declared, carried))
    right_size = kind == Kind.DATA or declared == BODY_SIZES[kind]
    if declared == carried and right_size:
        assert isinstance(parse(buf, 0, HEADER_SIZE + carried), Frame)
    else:
        with pytest.raises(RemoteProtocolError):
            parse(buf, 0, HEADER_SIZE + carried)


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("delta", [-4, -1, 1, 8])
def test_nbytes_off_from_the_declared_length(kind: Kind, delta: int) -> None:
    length = {Kind.DATA: 10, **BODY_SIZES}[kind]
    buf = header(kind, length=length) + bytes(length + 8)
    assert isinstance(parse(buf, 0, HEADER_SIZE + length), Frame)  # the exact size is fine
    if HEADER_SIZE + length + delta >= 0:
        with pytest.raises(RemoteProtocolError):
            parse(buf, 0, HEADER_SIZE + length + delta)


@pytest.mark.parametrize(("kind", "length"), [
    (Kind.RTS, 0), (Kind.RTS, 4), (Kind.RTS, 23), (Kind.RTS, 25), (Kind.RTS, 48),
    (Kind.DONE, 0), (Kind.DONE, 3), (Kind.DONE, 5), (Kind.DONE, 24),
    (Kind.CREDIT, 1), (Kind.CREDIT, 4), (Kind.CREDIT, 24),
])
def test_bodies_of_the_wrong_size(kind: Kind, length: int) -> None:
    buf = header(kind, length=length) + bytes(length)  # consistent length, wrong for the kind
    with pytest.raises(RemoteProtocolError):
        parse(buf, 0, len(buf))


@given(data=st.binary(max_size=80), prefix=st.binary(max_size=16), cut=st.integers(0, 80))
def test_arbitrary_bytes_are_a_frame_or_a_remote_error(data: bytes, prefix: bytes,
                                                       cut: int) -> None:
    nbytes = min(cut, len(data))
    try:
        frame = parse(prefix + data, len(prefix), nbytes)
    except RemoteProtocolError:
        return
    assert type(frame) in (DataFrame, RtsFrame, DoneFrame, CreditFrame)
    assert 0 <= frame.credits <= 0xFFFF and 0 <= frame.ctrl_credits <= 0xFFFF
    kind, flags, credits, ctrl, reserved, length = HEADER.unpack_from(data)
    assert flags == reserved == 0 and length == nbytes - HEADER_SIZE
    assert (frame.credits, frame.ctrl_credits) == (credits, ctrl)
    if isinstance(frame, DataFrame):
        assert kind == Kind.DATA
        assert frame.offset == len(prefix) + HEADER_SIZE and frame.length == length


@given(kind=st.sampled_from(list(Kind)), flags=st.integers(0, 255), credits=U16, ctrl=U16,
       reserved=U16, length=st.integers(0, 40), extra=st.integers(-3, 3))
def test_near_valid_headers_are_a_frame_or_a_remote_error(kind: Kind, flags: int, credits: int,
                                                          ctrl: int, reserved: int, length: int,
                                                          extra: int) -> None:
    buf = header(kind, flags, credits, ctrl, reserved, length) + bytes(length + 3)
    nbytes = max(0, HEADER_SIZE + length + extra)
    try:
        frame = parse(buf, 0, nbytes)
    except RemoteProtocolError:
        assert flags or reserved or extra or (kind != Kind.DATA and length != BODY_SIZES[kind])
        return
    assert flags == reserved == extra == 0
    assert (frame.credits, frame.ctrl_credits) == (credits, ctrl)


# -- the receive pool's frames (WANT, RECLAIM, RETURN) ---------------------------------------


@given(kind=st.sampled_from([Kind.WANT, Kind.RETURN]), count=U32, credits=U16, ctrl=U16,
       offset=st.integers(0, 64))
def test_pool_frames_round_trip(kind: Kind, count: int, credits: int, ctrl: int,
                                offset: int) -> None:
    buf = bytearray(offset + HEADER_SIZE + 4)
    n = pack_pool(buf, offset, kind=kind, count=count, credits=credits, ctrl=ctrl)
    assert n == HEADER_SIZE + 4
    assert HEADER.unpack_from(buf, offset) == (kind, 0, credits, ctrl, 0, 4)
    assert parse(buf, offset, n) == PoolFrame(credits=credits, ctrl_credits=ctrl, kind=kind,
                                              count=count)


def test_reclaim_frame_has_no_body() -> None:
    buf = bytearray(HEADER_SIZE)
    assert pack_pool(buf, 0, kind=Kind.RECLAIM, count=0, credits=3, ctrl=1) == HEADER_SIZE
    assert parse(buf, 0, HEADER_SIZE) == PoolFrame(credits=3, ctrl_credits=1,
                                                   kind=Kind.RECLAIM, count=0)
    with pytest.raises(LocalProtocolError):
        pack_pool(buf, 0, kind=Kind.RECLAIM, count=1, credits=0, ctrl=0)
    with pytest.raises(RemoteProtocolError):  # a body on a RECLAIM
        parse(header(Kind.RECLAIM, length=4) + bytes(4), 0, HEADER_SIZE + 4)


@pytest.mark.parametrize("kind", [Kind.DATA, Kind.DONE, Kind.CREDIT, 9])
def test_pack_pool_refuses_other_kinds(kind: int) -> None:
    with pytest.raises(LocalProtocolError):
        pack_pool(bytearray(32), 0, kind=kind, count=1, credits=0, ctrl=0)


@pytest.mark.parametrize("kind", [Kind.WANT, Kind.RETURN])
@pytest.mark.parametrize("length", [0, 3, 5, 8])
def test_pool_frames_of_the_wrong_size(kind: Kind, length: int) -> None:
    with pytest.raises(RemoteProtocolError):
        parse(header(kind, length=length) + bytes(length), 0, HEADER_SIZE + length)
