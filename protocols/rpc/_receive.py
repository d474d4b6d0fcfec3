"""The receiving half of :class:`aiordma.protocols.rpc.RpcConnection`: messages in, events
out (the frames and their rules are described in :mod:`aiordma.protocols.rpc`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._sentinels import NEED_DATA, _Sentinel
from ..errors import RemoteProtocolError
from . import _codec as codec
from . import _meta as meta
from ._events import (
    BY_KIND,
    MAX_NAME,
    STREAM_KINDS,
    Cancel,
    Credit,
    Data,
    End,
    Error,
    Request,
    Response,
    RpcEvent,
    bad,
    new_request,
    new_response,
)
from ._frame import (
    F_DEADLINE,
    F_KWARGS,
    F_META,
    F_NAMED,
    F_STREAM,
    F_WALK,
    HEADER,
    HEADER_SIZE,
    KIND_FLAGS,
    MAX_METHODS,
    VERSION,
    peer_version,
)
from ._state import MAX_ID, Direction

if TYPE_CHECKING:
    from ._state import Calls as _Calls
    from ._stream import Streams as _Streams

__all__ = ["Receiving"]


@dataclass(slots=True)
class _Pending:
    """A frame whose out-of-band buffers have not all arrived."""

    cls: type[RpcEvent]
    values: dict[str, Any]
    refs: list[codec.Ref]  # (container, key, placeholder)
    nbufs: int
    buffers: list[memoryview]
    step: tuple[Any, Any] | None  # the state machine's verdict, if still valid


_LEAVES = codec.LEAVES
_pack_header = HEADER.pack
_REQUEST_PLAIN = F_DEADLINE | F_KWARGS | F_META  # the flags of a request the fast path takes



class Receiving:
    """The receiving methods of :class:`~aiordma.protocols.rpc.RpcConnection` (a mixin: the
    connection's ``__init__`` makes the state they use)."""

    max_message: int
    max_depth: int
    max_buffers: int
    _calls: _Calls
    _streams: _Streams
    _stream_flows: dict[int, Any]
    _pending: _Pending | None
    _events: deque[RpcEvent]
    _failed: RemoteProtocolError | None
    _methods_in: list[str]

    def _stream_step(self, event: RpcEvent, direction: Direction, name: str) -> Any:
        raise NotImplementedError  # (RpcConnection's)

    def _stream_commit(self, call_id: int, direction: Direction, name: str,
                       stream: Any) -> None:
        raise NotImplementedError  # (RpcConnection's)


    def receive_message(self, msg: bytes | bytearray | memoryview) -> None:
        """Feed exactly one received message: a frame or a batch of frames, or the next buffer
        the last frame announced. The message is not copied when it becomes an out-of-band
        value.

        Raises:
            RemoteProtocolError: the message is malformed, exceeds a limit, or brings an event
                the state machine does not allow. The connection is unusable afterwards.
            LocalProtocolError: ``msg`` is not a contiguous buffer.
        """
        if self._failed is not None:
            raise RemoteProtocolError(f"the connection failed earlier: {self._failed}")
        try:
            self._receive(msg)
        except RemoteProtocolError as exc:
            self._failed = exc
            self._pending = None
            raise

    def next_event(self) -> RpcEvent | _Sentinel:
        """The next received event, or :data:`NEED_DATA` when a message must be fed first.

        Events come in the order their frames arrived; an event whose out-of-band buffers have
        not all arrived is not returned yet.
        """
        return self._events.popleft() if self._events else NEED_DATA

    def _receive(self, msg: bytes | bytearray | memoryview) -> None:
        mv = codec.as_bytes_view(msg)
        n = mv.nbytes
        if n > self.max_message:
            what = "buffer" if self._pending is not None else "message"
            raise RemoteProtocolError(f"{what} of {n} B exceeds {self.max_message} B")
        pending = self._pending
        if pending is not None:
            pending.buffers.append(mv)
            if len(pending.buffers) == pending.nbufs:
                self._pending = None
                self._complete(pending)
            return
        unpack_header = HEADER.unpack_from
        at = 0
        count = 0
        while True:
            if n - at < HEADER_SIZE or mv[at] != VERSION:
                first = bytes(mv[at:at + 3])
                if not first or first[0] != VERSION:
                    raise RemoteProtocolError(f"peer speaks RPC protocol version "
                                              f"{peer_version(first)}, this side {VERSION}")
                raise RemoteProtocolError(f"an RPC frame header is {HEADER_SIZE} B: "
                                          f"{n - at} B left in the message")
            _, kind, flags, nbufs, index, size, call_id, deadline = unpack_header(mv, at)
            start = at + HEADER_SIZE
            at = start + size
            if at > n:
                raise RemoteProtocolError(f"an RPC frame's body of {size} B is longer than the "
                                          f"{n - start} B left in the message")
            body = mv[start:at]
            if not self._take_plain(kind, flags, nbufs, index, call_id, deadline, body):
                p = self._parse_frame(kind, flags, nbufs, index, call_id, deadline, body)
                if p.nbufs:
                    if at != n:
                        raise RemoteProtocolError(f"frame {count} of a batch announces buffers: "
                                                  f"only the last may")
                    self._pending = p
                    return
                self._complete(p)
            if at == n:
                return
            count += 1

    def _take_plain(self, kind: int, flags: int, nbufs: int, index: int, call_id: int,
                    deadline: int, body: memoryview) -> bool:
        """Take a well-formed Request (of a bound method) or Response without buffers whose
        values are plain scalars (the common case, with or without metadata) at once; False: :meth:`_parse_frame`
        checks the frame in full (and words any error). Accepts exactly what the general
        path accepts."""
        if nbufs:
            return False
        if kind == 1:
            if flags & ~_REQUEST_PLAIN or index >= len(self._methods_in) or call_id > MAX_ID:
                return False
            if flags & F_DEADLINE:
                if deadline > MAX_ID:
                    return False
            elif deadline:
                return False
            else:
                deadline = None  # type: ignore[assignment]
            values = codec.unpack(body, self.max_message, self.max_depth)
            md = None
            if flags & F_META:
                if type(values) is not list or len(values) != 2:
                    return False
                md, values = values
                if type(md) is not dict or not md or meta.problem(md) is not None:
                    return False
            if flags & F_KWARGS:
                if type(values) is not list or len(values) != 2:
                    return False
                args, kwargs = values
                if type(kwargs) is not dict:
                    return False
                for k, v in kwargs.items():
                    if type(k) is not str or type(v) not in _LEAVES:
                        return False
            else:
                args, kwargs = values, {}
            if type(args) is not list:
                return False
            for v in args:
                if type(v) not in _LEAVES:
                    return False
            self._calls.request(call_id, Direction.RECV)
            self._events.append(new_request(call_id, self._methods_in[index], tuple(args),
                                             kwargs, deadline, False, md))
            return True
        if kind == 2:
            if flags & ~F_META or index or deadline or call_id > MAX_ID:
                return False
            result = codec.unpack(body, self.max_message, self.max_depth)
            md = None
            if flags:  # F_META
                if type(result) is not list or len(result) != 2:
                    return False
                md, result = result
                if type(md) is not dict or not md or meta.problem(md) is not None:
                    return False
            if type(result) not in _LEAVES:
                return False
            self._calls.answer(call_id, Direction.RECV, "Response")
            if self._stream_flows:
                self._stream_flows.pop(call_id, None)
            self._events.append(new_response(call_id, result, md))
            return True
        return False

    def _parse_frame(self, kind: int, flags: int, nbufs: int, index: int, call_id: int,
                     deadline: int, body: memoryview) -> _Pending:
        cls = BY_KIND.get(kind)
        if cls is None:
            raise RemoteProtocolError(f"unknown RPC frame kind {kind}")
        name = cls.__name__
        if flags & ~KIND_FLAGS[kind]:
            raise RemoteProtocolError(f"{name} frame with flags {flags:#x} (a {name} may carry "
                                      f"{KIND_FLAGS[kind]:#x})")
        if nbufs > self.max_buffers:
            raise RemoteProtocolError(f"{name} announces {nbufs} buffers (at most "
                                      f"{self.max_buffers})")
        if call_id > MAX_ID:
            raise bad(cls, "id", call_id, RemoteProtocolError)
        if cls is not Request and (deadline or (index and cls is not Credit)):
            raise RemoteProtocolError(f"{name} frame with a method index or a deadline")
        values: dict[str, Any] = {"id": call_id}
        # The state machine first (checked, not applied), so that a frame the call's state
        # does not allow is refused as such, and before its buffers are awaited.
        step: tuple[Any, Any]
        if cls in STREAM_KINDS:
            count = 1
            if cls is Credit:
                values["count"] = count = index
            step = self._streams.step(call_id, Direction.RECV, name, count)
        else:
            step = self._calls.step(call_id, Direction.RECV, name)
        refs: list[codec.Ref] = []
        walk = flags & F_WALK
        if cls is Cancel or cls is Credit or cls is End:
            if body.nbytes:
                raise RemoteProtocolError(f"a {name} has no body ({body.nbytes} B here)")
        else:
            value = codec.unpack(body, self.max_message, self.max_depth)
            if flags & F_META:  # (Request, Response, Error: the kinds' flags say so)
                if type(value) is not list or len(value) != 2:
                    raise RemoteProtocolError(f"a {name}'s body with F_META is [metadata, body]")
                values["metadata"] = meta.take(value[0])
                value = value[1]
            if cls is Request:
                self._request_values(flags, index, deadline, value, values)
                args, kw = values["args"], values["kwargs"]
                if walk:
                    codec.scan_items(args, range(len(args)), refs, self.max_depth)
                    codec.scan_items(kw, kw, refs, self.max_depth)
                else:
                    _leaves(args, "argument")
                    _leaves(kw.values(), "keyword argument")
            elif cls is Response or cls is Data:
                key = "result" if cls is Response else "value"
                values[key] = value
                if walk:
                    codec.scan_items(values, (key,), refs, self.max_depth)
                else:
                    _leaves((value,), key)
            else:  # Error
                if type(value) is not list or len(value) != 2:
                    raise RemoteProtocolError("an Error's body is [type, message]")
                type_, message = value
                if not (type(type_) is str and len(type_) <= MAX_NAME):
                    raise bad(Error, "type", type_, RemoteProtocolError)
                if type(message) is not str:
                    raise bad(Error, "message", message, RemoteProtocolError)
                values["type"], values["message"] = type_, message
        seen = set()
        for _, _, ref in refs:
            i = ref.index
            if i is None:
                continue
            if i >= nbufs or i in seen:
                raise RemoteProtocolError(f"buffer index {i} is not one of the {nbufs} "
                                          f"announced, or is used twice")
            seen.add(i)
        if len(seen) != nbufs:
            raise RemoteProtocolError(f"{name} announces {nbufs} buffers and uses {len(seen)}")
        if cls is Request and flags & F_NAMED:  # (every check passed: the name is bound)
            self._methods_in.append(values["method"])
        return _Pending(cls, values, refs, nbufs, [], step if nbufs == 0 else None)

    def _request_values(self, flags: int, index: int, deadline: int, value: Any,
                        values: dict[str, Any]) -> None:
        """A Request's fields from its header and body, checked, into ``values``."""
        bound = len(self._methods_in)
        if flags & F_NAMED:
            if flags & F_KWARGS:
                raise RemoteProtocolError("a Request is named or has F_KWARGS, not both")
            if type(value) is not list or len(value) != 3:
                raise RemoteProtocolError("a named Request's body is [method, args, kwargs]")
            method, args, kwargs = value
            if not (type(method) is str and 1 <= len(method) <= MAX_NAME):
                raise bad(Request, "method", method, RemoteProtocolError)
            if index != bound or bound >= MAX_METHODS:
                raise RemoteProtocolError(f"method {codec.short(method)} bound to index {index}: "
                                          f"the next is {bound} (at most {MAX_METHODS})")
        else:
            if index >= bound:
                raise RemoteProtocolError(f"method index {index} is not bound ({bound} are)")
            method = self._methods_in[index]
            if flags & F_KWARGS:
                if type(value) is not list or len(value) != 2:
                    raise RemoteProtocolError("a Request's body with F_KWARGS is [args, kwargs]")
                args, kwargs = value
            else:
                args, kwargs = value, {}
        if type(args) is not list:
            raise bad(Request, "args", args, RemoteProtocolError)
        if type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise bad(Request, "kwargs", kwargs, RemoteProtocolError)
        values["stream"] = bool(flags & F_STREAM)
        if flags & F_DEADLINE:
            if deadline > MAX_ID:
                raise bad(Request, "deadline_ms", deadline, RemoteProtocolError)
            values["deadline_ms"] = deadline
        elif deadline:
            raise RemoteProtocolError("a Request without F_DEADLINE has a deadline")
        else:
            values["deadline_ms"] = None
        values["method"], values["args"], values["kwargs"] = method, args, kwargs

    def _complete(self, pending: _Pending) -> None:
        if pending.refs:
            codec.rebuild(pending.refs, pending.buffers)
        values = pending.values
        cls = pending.cls
        if cls is Request:
            values["args"] = tuple(values["args"])
        event = cls(**values)
        name = cls.__name__
        # (a step taken before buffers were awaited may be stale: this side may have sent
        # something for the call meanwhile; take it again then)
        if cls in STREAM_KINDS:
            count = values.get("count", 1)
            state, nxt = pending.step or self._streams.step(event.id, Direction.RECV, name, count)
            if self._streams.commit(event.id, Direction.RECV, name, state, nxt, count):
                self._events.append(event)
            return
        state, nxt = pending.step or self._calls.step(event.id, Direction.RECV, name)
        stream = self._stream_step(event, Direction.RECV, name)
        if self._calls.commit(event.id, Direction.RECV, name, state, nxt):
            self._stream_commit(event.id, Direction.RECV, name, stream)
            self._events.append(event)


def _leaves(values: Any, what: str) -> None:
    """Raises RemoteProtocolError unless every one of ``values`` is a plain scalar (a frame
    without F_WALK)."""
    for v in values:
        if type(v) not in _LEAVES:
            raise RemoteProtocolError(f"a {what} of type {type(v).__name__} in a frame without "
                                      f"F_WALK (only plain scalars)")
