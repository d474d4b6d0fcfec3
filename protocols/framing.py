"""Frames carried by RDMA SENDs in an endpoint's receive slots.

Every SEND is one frame: a 12-byte header, then a body. The header returns flow-control
credits (see :mod:`aiordma.protocols.messages._credits`) on every frame, so credits ride along
with traffic.
DATA and RTS are *data* frames (messages: they spend data credits); DONE and CREDIT are
*control* frames (they spend control credits, and the receiver frees their slot on arrival).

======  ==========  =====================================================================
kind    body        meaning
======  ==========  =====================================================================
DATA    payload     a whole message (eager path)
RTS     24 bytes    rendezvous request: a message of ``size`` bytes is readable at
                    ``address``/``rkey``; ``token`` names it (the receiver RDMA-READs it)
DONE    4 bytes     rendezvous done: the message ``token`` was read; the sender may reuse it
CREDIT  empty       credits only (sent when there is no traffic to piggyback them on)
WANT    4 bytes     receive pool: the sender needs ``frames`` more data credits
RECLAIM empty       receive pool: the receiver asks for the credits the sender cannot use now
RETURN  4 bytes     receive pool: ``credits`` unused data credits given back
======  ==========  =====================================================================

WANT, RECLAIM and RETURN carry :mod:`aiordma.protocols.receive_pool`'s ``Want``, ``Reclaim``
and ``Return`` on a connection whose receiver takes its receives from a shared pool (the
handshake negotiates it); they are control frames. On such a connection the data credits
in the receiver's headers are the pool's grants.

Header: ``kind`` u8, ``flags`` u8 (zero), ``credits`` u16 (data credits returned),
``ctrl_credits`` u16 (control credits returned), ``reserved`` u16, ``length`` u32 (body bytes).
Little-endian. :func:`parse` validates everything and raises :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "HEADER_SIZE",
    "CreditFrame",
    "DataFrame",
    "DoneFrame",
    "Frame",
    "Kind",
    "PoolFrame",
    "RtsFrame",
    "pack_credit",
    "pack_data_header",
    "pack_done",
    "pack_pool",
    "pack_rts",
    "parse",
    "unpack_header",
]

HEADER = struct.Struct("<BBHHHI")
HEADER_SIZE = HEADER.size  # 12
RTS_BODY = struct.Struct("<QQII")  # size, address, rkey, token
DONE_BODY = struct.Struct("<I")  # token
POOL_BODY = struct.Struct("<I")  # WANT: frames; RETURN: credits


class Kind(IntEnum):
    DATA = 1
    RTS = 2
    DONE = 3
    CREDIT = 4
    WANT = 5
    RECLAIM = 6
    RETURN = 7


@dataclass(frozen=True, slots=True, kw_only=True)
class Frame:
    """Base of parsed frames: the credits every header returns."""

    credits: int
    ctrl_credits: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DataFrame(Frame):
    """An eager message: its payload is ``slot[offset:offset + length]``."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RtsFrame(Frame):
    """A rendezvous request for a message of ``size`` bytes exposed at ``address``/``rkey``."""

    size: int
    address: int
    rkey: int
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DoneFrame(Frame):
    """The peer finished reading rendezvous message ``token``."""

    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CreditFrame(Frame):
    """Credits only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolFrame(Frame):
    """A receive pool's frame: ``kind`` WANT (``count``: frames wanted), RECLAIM (``count``
    0) or RETURN (``count``: credits given back)."""

    kind: Kind
    count: int


_U16 = 0xFFFF


def _check_credits(credits: int, ctrl: int) -> None:
    if not (0 <= credits <= _U16 and 0 <= ctrl <= _U16):
        raise LocalProtocolError(f"credits {credits}/{ctrl} do not fit in 16 bits")


def pack_data_header(buf: bytearray | memoryview, offset: int, length: int, credits: int,
                     ctrl: int) -> int:
    """Write a DATA header at ``buf[offset:]`` for a body of ``length``; return the frame size."""
    _check_credits(credits, ctrl)
    HEADER.pack_into(buf, offset, Kind.DATA, 0, credits, ctrl, 0, length)
    return HEADER_SIZE + length


def pack_rts(buf: bytearray | memoryview, offset: int, *, size: int, address: int, rkey: int,
             token: int, credits: int, ctrl: int) -> int:
    _check_credits(credits, ctrl)
    HEADER.pack_into(buf, offset, Kind.RTS, 0, credits, ctrl, 0, RTS_BODY.size)
    RTS_BODY.pack_into(buf, offset + HEADER_SIZE, size, address, rkey, token)
    return HEADER_SIZE + RTS_BODY.size


def pack_done(buf: bytearray | memoryview, offset: int, *, token: int, credits: int,
              ctrl: int) -> int:
    _check_credits(credits, ctrl)
    HEADER.pack_into(buf, offset, Kind.DONE, 0, credits, ctrl, 0, DONE_BODY.size)
    DONE_BODY.pack_into(buf, offset + HEADER_SIZE, token)
    return HEADER_SIZE + DONE_BODY.size


def pack_credit(buf: bytearray | memoryview, offset: int, *, credits: int, ctrl: int) -> int:
    _check_credits(credits, ctrl)
    HEADER.pack_into(buf, offset, Kind.CREDIT, 0, credits, ctrl, 0, 0)
    return HEADER_SIZE


def pack_pool(buf: bytearray | memoryview, offset: int, *, kind: int, count: int,
              credits: int, ctrl: int) -> int:
    """A WANT or RETURN frame carrying ``count``, or a RECLAIM (``count`` 0, no body)."""
    _check_credits(credits, ctrl)
    if kind == Kind.RECLAIM:
        if count:
            raise LocalProtocolError("a RECLAIM frame carries no count")
        HEADER.pack_into(buf, offset, kind, 0, credits, ctrl, 0, 0)
        return HEADER_SIZE
    if kind not in (Kind.WANT, Kind.RETURN) or not 0 <= count <= 0xFFFF_FFFF:
        raise LocalProtocolError(f"not a pool frame: kind {kind}, count {count}")
    HEADER.pack_into(buf, offset, kind, 0, credits, ctrl, 0, POOL_BODY.size)
    POOL_BODY.pack_into(buf, offset + HEADER_SIZE, count)
    return HEADER_SIZE + POOL_BODY.size


_unpack_header = HEADER.unpack_from


def unpack_header(buf: bytes | bytearray | memoryview, offset: int,
                  nbytes: int) -> tuple[int, int, int, int]:
    """The validated header of the ``nbytes`` frame at ``buf[offset:]``: ``(kind, credits,
    ctrl_credits, body length)``. The kind is not checked here (:func:`parse` does); this is
    the allocation-free part, for hot paths that unpack bodies themselves.

    Raises:
        RemoteProtocolError: too short, non-zero flags/reserved bits, or a declared length that
            disagrees with the received size.
    """
    if nbytes < HEADER_SIZE:
        raise RemoteProtocolError(f"frame of {nbytes} B is shorter than its header")
    kind, flags, credits, ctrl, reserved, length = _unpack_header(buf, offset)
    if flags or reserved:
        raise RemoteProtocolError("frame header has unknown flag or reserved bits set")
    if length != nbytes - HEADER_SIZE:
        raise RemoteProtocolError(f"frame declares {length} B of body, carries "
                                  f"{nbytes - HEADER_SIZE} B")
    return kind, credits, ctrl, length


def parse(buf: bytes | bytearray | memoryview, offset: int, nbytes: int) -> Frame:
    """Parse the frame of ``nbytes`` received at ``buf[offset:]``.

    Raises:
        RemoteProtocolError: too short, unknown kind, non-zero flags/reserved bits, or a
            declared length that disagrees with the received size.
    """
    kind, credits, ctrl, length = unpack_header(buf, offset, nbytes)
    body = offset + HEADER_SIZE
    if kind == Kind.DATA:
        return DataFrame(credits=credits, ctrl_credits=ctrl, offset=body, length=length)
    if kind == Kind.RTS:
        if length != RTS_BODY.size:
            raise RemoteProtocolError("RTS frame of the wrong size")
        size, address, rkey, token = RTS_BODY.unpack_from(buf, body)
        return RtsFrame(credits=credits, ctrl_credits=ctrl, size=size, address=address,
                        rkey=rkey, token=token)
    if kind == Kind.DONE:
        if length != DONE_BODY.size:
            raise RemoteProtocolError("DONE frame of the wrong size")
        (token,) = DONE_BODY.unpack_from(buf, body)
        return DoneFrame(credits=credits, ctrl_credits=ctrl, token=token)
    if kind == Kind.CREDIT:
        if length:
            raise RemoteProtocolError("CREDIT frame with a body")
        return CreditFrame(credits=credits, ctrl_credits=ctrl)
    if kind == Kind.RECLAIM:
        if length:
            raise RemoteProtocolError("RECLAIM frame with a body")
        return PoolFrame(credits=credits, ctrl_credits=ctrl, kind=Kind.RECLAIM, count=0)
    if kind == Kind.WANT or kind == Kind.RETURN:
        if length != POOL_BODY.size:
            raise RemoteProtocolError(f"{Kind(kind).name} frame of the wrong size")
        (count,) = POOL_BODY.unpack_from(buf, body)
        return PoolFrame(credits=credits, ctrl_credits=ctrl, kind=Kind(kind), count=count)
    raise RemoteProtocolError(f"unknown frame kind {kind}")
