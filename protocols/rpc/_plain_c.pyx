# cython: language_level=3, boundscheck=False, wraparound=False
"""The RPC protocol's common frames, compiled: :class:`RpcConnection` with its hot paths in C.

The connection of :mod:`aiordma.protocols.rpc` (the reference) with three methods replaced by
compiled code that does the same for the frames nearly every call is made of, and hands
everything else to the Python methods it replaces:

- :meth:`receive_message`: the frame headers read in C; a Request of a bound method or a
  Response whose values are plain scalars (``_take_plain``'s case), with or without metadata,
  taken without the Python helpers in between (its event built as ``_events``' makers build
  it, each slot set at its member descriptor's offset); any other frame goes to ``_parse_frame`` and
  ``_complete`` as in Python, and a message that is not ``bytes``/``bytearray`` or that
  completes announced buffers goes to the Python method whole;
- :meth:`send_request`, :meth:`send_response`: a frame of plain values packed into one
  ``bytes`` with its header written in C; anything else (and every error's wording) is the
  Python method's.

Beside it, :class:`Outbox`: the batches of :class:`aiordma.protocols.rpc.Outbox` (a sender's
frames of one loop tick), made in C (:func:`aiordma._verbs.compiled.rpc_outbox`).

Same events, same state, same bytes, same errors (type and message) as the Python class:
``tests/unit/test_protocol_rpc_compiled.py`` drives both with hypothesis. Built by
``scripts/build_fastpath.py`` (no rdma-core needed); :func:`aiordma._verbs.compiled.rpc_connection`
hands out this class or the Python one (``AIORDMA_FASTPATH=0``: always the Python one).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy

from dataclasses import fields

import msgpack

from aiordma.protocols.errors import RemoteProtocolError
from aiordma.protocols.rpc import RpcConnection as _Reference
from aiordma.protocols.rpc import _codec as codec
from aiordma.protocols.rpc import _meta as meta
from aiordma.protocols.rpc import join as _join
from aiordma.protocols.rpc._events import Request, Response
from aiordma.protocols.rpc._frame import (
    F_DEADLINE,
    F_KWARGS,
    F_META,
    HEADER_SIZE,
    VERSION,
    peer_version,
)
from aiordma.protocols.rpc._state import MAX_ID, Direction

__all__ = ["Outbox", "RpcConnection"]

cdef int _HEADER = HEADER_SIZE
cdef int _VERSION = VERSION
cdef uint64_t _MAX_ID = MAX_ID
cdef int _F_DEADLINE = F_DEADLINE
cdef int _F_KWARGS = F_KWARGS
cdef int _F_META = F_META
cdef int _REQUEST_PLAIN = F_DEADLINE | F_KWARGS | F_META
cdef object _RECV = Direction.RECV
cdef object _SEND = Direction.SEND
cdef object _unpack = codec.unpack
cdef object _unpackb = msgpack.unpackb
cdef object _ext_hook = codec._ext_hook
cdef object _problem = meta.problem
cdef object _check_meta = meta.check
cdef object _INT_MIN = codec._INT_MIN
cdef object _UINT_MAX = codec._UINT_MAX
cdef Py_ssize_t _COPY_BELOW = 4096  # a body up to this is copied for msgpack, not viewed

cdef object _reference_receive = _Reference._receive
cdef object _reference_send_request = _Reference.send_request
cdef object _reference_send_response = _Reference.send_response


cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    ctypedef struct _Type "PyTypeObject":
        void* tp_alloc
    PyObject* _generic_alloc "PyType_GenericAlloc"(_Type*, Py_ssize_t)
    object _alloc "PyType_GenericAlloc"(_Type*, Py_ssize_t)


cdef Py_ssize_t[7] _REQUEST_AT  # where each field of a Request sits in the object
cdef Py_ssize_t[3] _RESPONSE_AT


cdef void _offsets(object cls, tuple names, Py_ssize_t* at) except *:
    """Where the slots ``names`` of the frozen event class ``cls`` keep their values (its
    slots' member descriptors: what ``_events._maker``'s setters write through)."""
    if (<_Type*>cls).tp_alloc != <void*>_generic_alloc:
        raise ImportError(f"{cls.__name__} is allocated another way than object's")
    if {f.name for f in fields(cls)} != set(names):
        raise ImportError(f"{cls.__name__} has other fields than {names}")
    for i, name in enumerate(names):
        descr = getattr(cls, name, None)
        if type(descr).__name__ != "member_descriptor":
            raise ImportError(f"{cls.__name__}.{name} is not a slot")
        at[i] = (<PyMemberDescrObject*>descr).d_member.offset


_offsets(Request, ("id", "method", "args", "kwargs", "deadline_ms", "stream", "metadata"),
         _REQUEST_AT)
_offsets(Response, ("id", "result", "metadata"), _RESPONSE_AT)


cdef inline object _new(object cls):
    """A new, empty ``cls`` object (every slot unset), as ``object.__new__(cls)`` makes it
    (``_offsets`` checked that the class is allocated the generic way)."""
    return _alloc(<_Type*>cls, 0)


cdef inline void _set(object obj, Py_ssize_t at, object value) noexcept:
    """An unset slot of a new object set to ``value`` (the slot's descriptor's ``__set__``)."""
    Py_INCREF(value)
    (<PyObject**>((<char*><PyObject*>obj) + at))[0] = <PyObject*>value


cdef object new_request(object call_id, object method, object args, object kwargs,
                        object deadline_ms, object stream, object metadata):
    """``_events.new_request``."""
    ev = _new(Request)
    _set(ev, _REQUEST_AT[0], call_id)
    _set(ev, _REQUEST_AT[1], method)
    _set(ev, _REQUEST_AT[2], args)
    _set(ev, _REQUEST_AT[3], kwargs)
    _set(ev, _REQUEST_AT[4], deadline_ms)
    _set(ev, _REQUEST_AT[5], stream)
    _set(ev, _REQUEST_AT[6], metadata)
    return ev


cdef object new_response(object call_id, object result, object metadata):
    """``_events.new_response``."""
    ev = _new(Response)
    _set(ev, _RESPONSE_AT[0], call_id)
    _set(ev, _RESPONSE_AT[1], result)
    _set(ev, _RESPONSE_AT[2], metadata)
    return ev


cdef inline uint64_t _le(const uint8_t* p, int n) noexcept nogil:
    """``n`` bytes at ``p`` as a little-endian unsigned integer."""
    cdef uint64_t v = 0
    cdef int i = n - 1
    while i >= 0:
        v = (v << 8) | p[i]
        i -= 1
    return v


cdef inline void _put(uint8_t* p, uint64_t v, int n) noexcept nogil:
    cdef int i
    for i in range(n):
        p[i] = <uint8_t>(v & 0xFF)
        v >>= 8


cdef inline bint _leaf(object v):
    """``type(v) in LEAVES`` (exact types)."""
    t = type(v)
    return t is str or t is bytes or t is int or t is float or t is bool or v is None


cdef bint _plain(object values, object threshold) except -1:
    """:func:`aiordma.protocols.rpc._codec.plain`."""
    for v in values:
        t = type(v)
        if t is str or v is None or t is bool or t is float:
            continue
        if t is int:
            if _INT_MIN <= v <= _UINT_MAX:
                continue
            return False
        if t is bytes and len(v) < threshold:
            continue
        return False
    return True


cdef bytes _frame(int kind, int flags, uint64_t index, bytes data, uint64_t call_id,
                  uint64_t deadline):
    """``HEADER.pack(VERSION, kind, flags, 0, index, len(data), call_id, deadline) + data``."""
    cdef Py_ssize_t size = len(data)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, _HEADER + size)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(out)
    p[0] = <uint8_t>_VERSION
    p[1] = <uint8_t>kind
    _put(p + 2, <uint64_t>flags, 2)
    _put(p + 4, 0, 4)
    _put(p + 8, index, 4)
    _put(p + 12, <uint64_t>size, 4)
    _put(p + 16, call_id, 8)
    _put(p + 24, deadline, 8)
    memcpy(p + _HEADER, PyBytes_AS_STRING(data), size)
    return out


cdef object _values(object conn, object body):
    """``codec.unpack(body, conn.max_message, conn.max_depth)`` of a body that is ``bytes``
    (a copy: below :data:`_COPY_BELOW`) or a view: msgpack's own call, and anything it
    refuses unpacked again by ``codec.unpack``, which words the error."""
    try:
        return _unpackb(body, ext_hook=_ext_hook)
    except Exception:  # noqa: BLE001  # (the reference raises the error, worded)
        return _unpack(memoryview(body), conn.max_message, conn.max_depth)


cdef object _packed(object conn, object body):
    """``body`` packed by the connection's packer if it packs and its frame fits
    ``max_message``; else None (the Python method then words why)."""
    try:
        data = conn._pack(body)
    except Exception:  # noqa: BLE001  # worded by the Python method
        return None
    if type(data) is bytes and len(<bytes>data) + _HEADER <= conn.max_message:
        return data
    return None


cdef void _answer(object conn, object call_id, object direction) except *:
    """A Response's step in the call table (``Calls.answer``'s hot path inline), and the end
    of the call's stream, if it had one."""
    calls = conn._calls
    states = calls._states
    if direction is calls._answer_direction and call_id in states:
        del states[call_id]
    else:
        calls.answer(call_id, direction, "Response")
    flows = conn._stream_flows
    if flows:
        flows.pop(call_id, None)


cdef object _take_plain(object conn, int kind, int flags, uint64_t nbufs, uint64_t index,
                        uint64_t call_id, uint64_t deadline, object body):
    """``Receiving._take_plain``: True if taken; False: the frame goes the general way."""
    cdef Py_ssize_t n_in
    cdef object cid  # (a Python int once: the call table's keys)
    if nbufs:
        return False
    if kind == 1:
        methods_in = conn._methods_in
        n_in = len(methods_in)
        if flags & ~_REQUEST_PLAIN or index >= <uint64_t>n_in or call_id > _MAX_ID:
            return False
        if flags & _F_DEADLINE:
            if deadline > _MAX_ID:
                return False
            deadline_ms = deadline
        elif deadline:
            return False
        else:
            deadline_ms = None
        values = _values(conn, body)
        md = None
        if flags & _F_META:
            if type(values) is not list or len(values) != 2:
                return False
            md, values = values
            if type(md) is not dict or not md or _problem(md) is not None:
                return False
        if flags & _F_KWARGS:
            if type(values) is not list or len(values) != 2:
                return False
            args, kwargs = values
            if type(kwargs) is not dict:
                return False
            for k, v in (<dict>kwargs).items():
                if type(k) is not str or not _leaf(v):
                    return False
        else:
            args, kwargs = values, {}
        if type(args) is not list:
            return False
        for v in <list>args:
            if not _leaf(v):
                return False
        calls = conn._calls
        cid = call_id
        states = calls._states
        if (_RECV is calls._request_direction and calls._horizon < cid
                and len(states) < calls.max_in_flight):
            states[cid] = calls._request_state
            calls._horizon = cid
        else:
            calls.request(cid, _RECV)
        conn._events.append(new_request(cid, methods_in[index], tuple(args), kwargs,
                                        deadline_ms, False, md))
        return True
    if kind == 2:
        if flags & ~_F_META or index or deadline or call_id > _MAX_ID:
            return False
        result = _values(conn, body)
        md = None
        if flags:  # F_META
            if type(result) is not list or len(result) != 2:
                return False
            md, result = result
            if type(md) is not dict or not md or _problem(md) is not None:
                return False
        if not _leaf(result):
            return False
        cid = call_id
        _answer(conn, cid, _RECV)
        conn._events.append(new_response(cid, result, md))
        return True
    return False


cdef object _receive(object conn, object msg, const uint8_t* p, Py_ssize_t n):
    """``Receiving._receive`` of a ``bytes`` or ``bytearray`` message at ``p`` (``n`` B), with
    nothing pending."""
    cdef Py_ssize_t at = 0, start, size
    cdef int count = 0, kind, flags
    cdef uint64_t nbufs, index, call_id, deadline
    mv = None  # a view of msg, made for the first frame that goes the general way
    while True:
        if n - at < _HEADER or p[at] != _VERSION:
            first = PyBytes_FromStringAndSize(<const char*>p + at, min(3, n - at))
            if not first or p[at] != _VERSION:
                raise RemoteProtocolError(f"peer speaks RPC protocol version "
                                          f"{peer_version(first)}, this side {_VERSION}")
            raise RemoteProtocolError(f"an RPC frame header is {_HEADER} B: "
                                      f"{n - at} B left in the message")
        kind = p[at + 1]
        flags = <int>_le(p + at + 2, 2)
        nbufs = _le(p + at + 4, 4)
        index = _le(p + at + 8, 4)
        size = <Py_ssize_t>_le(p + at + 12, 4)
        call_id = _le(p + at + 16, 8)
        deadline = _le(p + at + 24, 8)
        start = at + _HEADER
        at = start + size
        if at > n:
            raise RemoteProtocolError(f"an RPC frame's body of {size} B is longer than the "
                                      f"{n - start} B left in the message")
        if size <= _COPY_BELOW and not nbufs:
            body = PyBytes_FromStringAndSize(<const char*>p + start, size)
        else:
            if mv is None:
                mv = memoryview(msg)
            body = mv[start:at]
        if not _take_plain(conn, kind, flags, nbufs, index, call_id, deadline, body):
            if mv is None:
                mv = memoryview(msg)
            body = mv[start:at]
            pending = conn._parse_frame(kind, flags, nbufs, index, call_id, deadline, body)
            if pending.nbufs:
                if at != n:
                    raise RemoteProtocolError(f"frame {count} of a batch announces buffers: "
                                              f"only the last may")
                conn._pending = pending
                return
            conn._complete(pending)
        if at == n:
            return
        count += 1


class RpcConnection(_Reference):
    """:class:`aiordma.protocols.rpc.RpcConnection`, its common frames compiled."""

    def receive_message(self, msg):
        cdef Py_buffer view
        if self._failed is not None:
            raise RemoteProtocolError(f"the connection failed earlier: {self._failed}")
        try:
            t = type(msg)
            if (t is not bytes and t is not bytearray) or self._pending is not None:
                _reference_receive(self, msg)
            else:
                PyObject_GetBuffer(msg, &view, PyBUF_SIMPLE)  # (a bytearray cannot resize now)
                try:
                    if view.len > self.max_message:
                        _reference_receive(self, msg)  # (raises: the Python wording)
                    else:
                        _receive(self, msg, <const uint8_t*>view.buf, view.len)
                finally:
                    PyBuffer_Release(&view)
        except RemoteProtocolError as exc:
            self._failed = exc
            self._pending = None
            raise

    def send_request(self, method, args=(), kwargs=None, deadline_ms=None, stream=False,
                     metadata=None):
        calls = self._calls
        index = self._methods_out.get(method) if type(method) is str else None
        if (index is not None and not kwargs and type(args) is tuple and stream is False
                and (deadline_ms is None or (type(deadline_ms) is int
                                             and 0 <= deadline_ms <= MAX_ID))
                and _plain(args, self.oob_threshold)):
            call_id = calls._horizon + 1
            flags = 0 if deadline_ms is None else _F_DEADLINE
            body = args
            if metadata is not None:
                md = _check_meta(metadata)
                if md:
                    body, flags = [md, args], flags | _F_META
            data = _packed(self, body)
            if data is not None:
                frame = _frame(1, flags, index, data, call_id, deadline_ms or 0)
                calls.request(call_id, _SEND)
                return call_id, [frame]
        return _reference_send_request(self, method, args, kwargs, deadline_ms, stream,
                                       metadata)

    def send_response(self, call_id, result, metadata=None):
        if type(call_id) is int and 0 <= call_id <= MAX_ID and _plain(
                (result,), self.oob_threshold):
            flags = 0
            body = result
            if metadata is not None:
                md = _check_meta(metadata)
                if md:
                    body, flags = [md, result], _F_META
            data = _packed(self, body)
            if data is not None:
                _answer(self, call_id, _SEND)
                return [_frame(2, flags, 0, data, call_id, 0)]
        return _reference_send_response(self, call_id, result, metadata)


cdef class Outbox:
    """:class:`aiordma.protocols.rpc.Outbox` compiled: the same batches of the same frames,
    in the same order (``add``, ``take``, truth, ``limit``); a frame and every batch as the
    Python class makes them (:func:`~aiordma.protocols.rpc.join`'s bytes)."""

    cdef list _frames  # the open batch
    cdef Py_ssize_t _size  # its size in bytes
    cdef list _ready  # closed messages, in order
    cdef readonly Py_ssize_t limit

    def __init__(self, Py_ssize_t limit):
        if limit < 1:
            raise ValueError("a batch limit is at least 1 byte")
        self.limit = limit
        self._frames = []
        self._size = 0
        self._ready = []

    def __bool__(self):
        return len(self._frames) > 0 or len(self._ready) > 0

    def add(self, msgs):
        cdef object frame = msgs[0]
        cdef Py_ssize_t n = len(frame)
        if len(self._frames) > 0 and self._size + n > self.limit:
            self._close()
        self._frames.append(frame)
        self._size += n
        if len(msgs) > 1:  # its buffers follow: the batch ends with it
            self._close()
            self._ready.extend(msgs[1:])

    def take(self):
        if len(self._frames) > 0:
            self._close()
        out = self._ready
        self._ready = []
        return out

    cdef void _close(self) except *:
        self._ready.append(_join(self._frames))  # (once per batch: the reference's bytes)
        self._frames = []
        self._size = 0
