"""Encoding the RPC protocol's frames: an event and its values into a frame (header and
msgpack body, :mod:`aiordma.protocols.rpc._frame`) and its out-of-band buffers. Sans-I/O; the
general path, which checks everything and words every error (:class:`RpcConnection`'s hot
paths send the same bytes for the common calls and fall back to it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import LocalProtocolError
from . import _codec as codec
from . import _meta as meta
from ._events import (
    MAX_NAME,
    Cancel,
    Credit,
    Data,
    End,
    Error,
    Request,
    Response,
    RpcEvent,
    bad,
    ok_id,
    ok_name,
)
from ._frame import F_DEADLINE, F_KWARGS, F_META, F_NAMED, F_STREAM, F_WALK, HEADER, VERSION
from ._stream import MAX_CREDIT

__all__ = ["Limits", "encode_event", "encode_request", "encode_value"]


@dataclass(slots=True)
class Limits:
    """What encoding needs of a connection (:func:`aiordma.protocols.rpc.encode` makes one of
    its own)."""

    oob_threshold: int
    max_depth: int
    max_message: int
    max_buffers: int
    packer: Any


def _values(lim: Limits, args: Any, kwargs: dict[str, Any] | None, result: Any = None
            ) -> tuple[Any, Any, Any, list[bytes | memoryview]]:
    """``args``, ``kwargs`` and ``result`` as msgpack-ready values (out-of-band buffers
    replaced by placeholders), and the buffers. The general path: values that nest or are not
    plain scalars.

    Raises:
        LocalProtocolError: a value cannot be sent, or there are more buffers than allowed.
    """
    enc = codec.ValueEncoder(lim.oob_threshold, lim.max_depth, lim.max_message)
    value = enc.value
    a = None if args is None else [value(x, 0) for x in args]
    kw = None if kwargs is None else {k: value(x, 0) for k, x in kwargs.items()}
    r = value(result, 0)
    if len(enc.buffers) > lim.max_buffers:
        raise LocalProtocolError(f"{len(enc.buffers)} out-of-band buffers exceed "
                                 f"{lim.max_buffers}")
    return a, kw, r, enc.buffers


_NO_BODY = frozenset({4, 6, 7})  # Cancel, Credit, End


def _finish(lim: Limits, kind: int, flags: int, call_id: int, body: Any, what: str,
            bufs: list[bytes | memoryview] | None, method: int = 0, deadline: int = 0,
            metadata: Any = None) -> list[bytes | memoryview]:
    if metadata is not None:
        md = meta.check(metadata)
        if md:  # (an empty mapping travels as none: no flag)
            body = [md, body]
            flags |= F_META
    data = codec.pack(body, what, lim.packer) if kind not in _NO_BODY else b""
    frame = HEADER.pack(VERSION, kind, flags, 0 if bufs is None else len(bufs), method,
                        len(data), call_id, deadline) + data
    if len(frame) > lim.max_message:
        raise LocalProtocolError(f"{what} frame of {len(frame)} B exceeds {lim.max_message} B")
    return [frame] if not bufs else [frame, *bufs]


def encode_request(lim: Limits, call_id: int, method: Any, index: int, args: Any,
                   kwargs: Any, deadline: Any, stream: Any = False,
                   metadata: Any = None) -> list[bytes | memoryview]:
    """A Request's messages; ``index`` is the method's index, or ``-i - 1`` to bind the name
    ``method`` to index ``i`` with this request."""
    if not ok_id(call_id):
        raise bad(Request, "id", call_id, LocalProtocolError)
    if not (type(args) is tuple or type(args) is list):
        raise bad(Request, "args", args, LocalProtocolError)
    if type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
        raise bad(Request, "kwargs", kwargs, LocalProtocolError)
    if type(stream) is not bool:
        raise bad(Request, "stream", stream, LocalProtocolError)
    flags = F_STREAM if stream else 0
    dl = 0
    if deadline is not None:
        if not ok_id(deadline):
            raise bad(Request, "deadline_ms", deadline, LocalProtocolError)
        flags |= F_DEADLINE
        dl = deadline
    threshold = lim.oob_threshold
    bufs = None
    if not (codec.plain(args, threshold) and (not kwargs or codec.plain(kwargs.values(),
                                                                         threshold))):
        args, kwargs, _, bufs = _values(lim, args, kwargs)
        flags |= F_WALK
    if index < 0:  # bind: the name travels, with its index
        if not ok_name(method):
            raise bad(Request, "method", method, LocalProtocolError)
        flags |= F_NAMED
        body: Any = [method, args, kwargs]
        index = -index - 1
    elif kwargs:
        flags |= F_KWARGS
        body = [args, kwargs]
    else:
        body = args
    return _finish(lim, 1, flags, call_id, body, "Request", bufs, index, dl, metadata)


def encode_value(lim: Limits, cls: type[RpcEvent], call_id: int,
                 value: Any, metadata: Any = None) -> list[bytes | memoryview]:
    """A Response's or a Data's messages: the frame with ``value``, then its buffers
    (``metadata``: a Response's)."""
    if not ok_id(call_id):
        raise bad(cls, "id", call_id, LocalProtocolError)
    if codec.plain((value,), lim.oob_threshold):
        return _finish(lim, cls.kind, 0, call_id, value, cls.__name__, None, metadata=metadata)
    _, _, value, bufs = _values(lim, None, None, value)
    return _finish(lim, cls.kind, F_WALK, call_id, value, cls.__name__, bufs, metadata=metadata)


def encode_event(lim: Limits, event: RpcEvent, index: int) -> list[bytes | memoryview]:
    """Any event's messages (``index``: a Request's method index, negative to bind)."""
    cls = type(event)
    ev: Any = event
    if cls is Request:
        return encode_request(lim, ev.id, ev.method, index, ev.args, ev.kwargs, ev.deadline_ms,
                              ev.stream, ev.metadata)
    if cls is Response:
        return encode_value(lim, Response, ev.id, ev.result, ev.metadata)
    if cls is Data:
        return encode_value(lim, Data, ev.id, ev.value)
    if not ok_id(ev.id):
        raise bad(cls, "id", ev.id, LocalProtocolError)
    if cls is Error:
        if not (isinstance(ev.type, str) and len(ev.type) <= MAX_NAME):
            raise bad(Error, "type", ev.type, LocalProtocolError)
        if not isinstance(ev.message, str):
            raise bad(Error, "message", ev.message, LocalProtocolError)
        return _finish(lim, 3, 0, ev.id, [ev.type, ev.message], "Error", None,
                       metadata=ev.metadata)
    if cls is Cancel or cls is End:
        return _finish(lim, cls.kind, 0, ev.id, None, cls.__name__, None)
    if cls is Credit:
        if not (type(ev.count) is int and 1 <= ev.count <= MAX_CREDIT):
            raise bad(Credit, "count", ev.count, LocalProtocolError)
        return _finish(lim, 6, 0, ev.id, None, "Credit", None, ev.count)
    raise LocalProtocolError(f"{cls.__name__} is not sent on the wire")
