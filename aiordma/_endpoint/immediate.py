"""An endpoint's RDMA WRITEs with immediate data: ``post_write(src, dst, imm=k)`` and
``recv_event()`` (see :class:`~aiordma._endpoint.endpoint.Endpoint`).

A WRITE with immediate data takes one of the peer's receive slots, as a message does: the
message protocol reserves a data credit for it (:meth:`MessageProtocol.send_imm
<aiordma.protocols.messages.MessageProtocol.send_imm>`), in its place among the messages
queued, and nothing queued behind it is posted before it; the peer's protocol files the
value among its messages, in order (the peer must accept immediates:
``Config(immediates=True)``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

from aiordma._args import check_int
from aiordma._endpoint.qp import _check_remote, opcode
from aiordma._errors import ClosedResourceError, LocalProtocolError
from aiordma._memory.region import LocalSlice, RemoteBuffer
from aiordma.protocols import messages as msgs
from aiordma.protocols.errors import LocalProtocolError as _ProtoLocalError

if TYPE_CHECKING:
    from aiordma._endpoint.endpoint import Endpoint

__all__ = ["imm_ahead", "post_write_imm", "recv_event", "retrieve", "single"]

_L = msgs.Lifecycle


def retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception as retrieved (asyncio logs unretrieved ones)."""
    if not fut.cancelled():
        fut.exception()


def single(src: Any, dst: RemoteBuffer) -> LocalSlice:
    """``src`` of a WRITE without ``imm``: one slice, checked against ``dst``."""
    if type(src) is tuple:
        raise LocalProtocolError("post_write(): two slices are gathered only with imm=")
    _check_remote(src, dst, "write")
    return src  # type: ignore[no-any-return]


def _gather(ep: Endpoint, src: Any, dst: RemoteBuffer) -> tuple[LocalSlice, Any]:
    """``src`` checked against ``dst``: a slice, or two gathered into ``dst`` in order; the
    first, and how to post the work request (None: alone)."""
    if type(src) is not tuple:
        _check_remote(src, dst, "write")
        return src, None
    if len(src) != 2 or not (isinstance(src[0], LocalSlice) and isinstance(src[1], LocalSlice)):
        raise LocalProtocolError("post_write(): src is a slice, or a tuple of two slices")
    head, tail = src
    if not isinstance(dst, RemoteBuffer) or head.length + tail.length != dst.length:
        raise LocalProtocolError(f"write: local ranges of {head.length} + {tail.length} B, "
                                 f"remote range {getattr(dst, 'length', dst)!r:.40} B")
    _check_remote(head, dst[0:head.length], "write")
    if tail.region.device is not ep.device:
        raise LocalProtocolError("the local buffer is registered on another device")
    if tail.region.closed:
        raise ClosedResourceError("the local buffer's memory region is deregistered")
    return head, functools.partial(ep._qp.post_gather, tail=tail)


async def post_write_imm(ep: Endpoint, src: Any, dst: RemoteBuffer,
                         imm: object) -> asyncio.Future[None]:
    """``ep.post_write(src, dst, imm=imm)``."""
    word = check_int(imm, name="imm", low=0, high=0xFFFF_FFFF)
    head, post = _gather(ep, src, dst)
    proto = ep._proto
    if proto.state is not _L.OPEN:
        raise ep._send_error()
    try:
        ticket = proto.send_imm()
    except _ProtoLocalError as exc:
        raise LocalProtocolError(str(exc)) from None
    if ticket:  # behind queued messages, or no credit yet: wait for the reservation
        fut: asyncio.Future[None] = ep._loop.create_future()
        ep._posted[ticket] = fut  # (SendPosted resolves it; SendDropped fails it)
        ep._run()
        try:
            await fut
        except asyncio.CancelledError:
            if ep._posted.pop(ticket, None) is not None:
                proto.withdraw(ticket)
            else:
                _abandon(ep)
            raise
    try:
        done = await ep._onesided.start("rdma write with imm", opcode("RDMA_WRITE_WITH_IMM"),
                                        head, dst, imm_data=word, post=post)
    except BaseException:
        _abandon(ep)
        raise
    if proto.state not in (_L.BROKEN, _L.RELEASED):
        proto.imm_posted()
        ep._run()
    done.add_done_callback(retrieve)
    return done


def _abandon(ep: Endpoint) -> None:
    """The reserved WRITE will not be posted: its credit goes back, the queue moves on."""
    proto = ep._proto
    if proto.state not in (_L.BROKEN, _L.RELEASED):
        proto.imm_abandoned()
        ep._run()


async def recv_event(ep: Endpoint) -> bytearray | msgs.Immediate | None:
    """``ep.recv_event()``: the next message, or immediate, or None at the end."""
    proto = ep._proto
    while True:
        inbox = proto.inbox
        if inbox and type(inbox[0]) is msgs.Immediate and proto.state is not _L.RELEASED:
            out = proto.pop()
            ep._after_pop()
            return out
        if ((inbox and proto.head is not msgs.READING) or proto.at_eof
                or proto.state is _L.RELEASED):
            return await ep.recv()  # (a message there, the end, or the error: no wait)
        await ep._wait_inbound()


def imm_ahead(what: str) -> LocalProtocolError:
    """``recv()`` or ``recv_into()`` found an immediate at the head of the inbox."""
    return LocalProtocolError(f"{what}: the next item is a WRITE with immediate data (it "
                              f"stays queued): read it with recv_event()")
