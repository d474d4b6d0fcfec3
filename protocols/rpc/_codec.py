"""The RPC protocol's value codec: everything about *values* (arguments, results) lives here.

:mod:`aiordma.protocols.rpc` owns frames, events and the connection; this module turns the values inside
a frame into msgpack-ready objects and back, moving big buffers out of band, and enforces the
limits on what may be received (sizes, nesting depth, map keys, extension types). Sans-I/O and
without numpy: numpy is imported only when an array arrives.

Values
------
Arguments, keyword-argument values and results are msgpack values: nil, booleans, integers in
-2**63..2**64-1, floats, strings, binaries, arrays (lists and tuples; they arrive as lists, and
``args`` as a tuple) and maps with string keys, nested at most ``max_depth`` deep (a scalar has
depth 0, ``[1]`` depth 1). Two msgpack extension types carry buffers; every other extension type
(msgpack's timestamp -1 included) is refused:

=====  ===============  =================================================================
code   name             data
=====  ===============  =================================================================
1      ``BUFFER``       the buffer's index, 4 bytes little-endian
2      ``NDARRAY``      msgpack ``[typestr, shape, index]`` (out of band) or
                        ``[typestr, shape, bytes]`` (inline, for small arrays)
=====  ===============  =================================================================

* ``bytes``, ``bytearray`` and ``memoryview`` values of at least ``oob_threshold`` bytes are not
  packed into the frame: an ``ext 1`` stands in their place and their bytes travel as buffer
  message number ``index``. The message list returned by the sender holds the original object
  (a ``bytes`` as is, a ``bytearray`` through a ``memoryview``, a ``memoryview`` itself): nothing
  is copied. Smaller ones are packed inline as msgpack binaries. On receipt, an out-of-band
  value is a ``memoryview`` of the received buffer message (no copy either: keep that message
  alive and unchanged while the value is used); an inline one is ``bytes``.
* Objects that expose numpy's array protocol (``__array_interface__`` and the buffer protocol,
  C-contiguous, a plain numeric ``typestr`` such as ``"<f8"``: kinds b, i, u, f, c; numpy
  scalars included, which arrive as 0-d arrays) are sent as ``ext 2`` with their type string
  and shape: their bytes out of band when at least ``oob_threshold`` bytes (the index form), else
  inline in the ext (the bytes form; one small copy). A non-contiguous array (a strided slice, a
  transpose) is refused rather than silently copied: pass ``numpy.ascontiguousarray(a)``. On
  receipt they are rebuilt with ``numpy.frombuffer(data, typestr).reshape(shape)``: a view of
  the received message for out-of-band data (no copy; writable exactly when that message is), a
  read-only array over the frame's bytes for inline data. numpy is imported only when an
  ``ext 2`` arrives; without numpy that is a :class:`RemoteProtocolError`.

Every announced buffer must be referenced exactly once by the frame; that rule, and the frame
around the values, are :mod:`aiordma.protocols.rpc`'s.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "EXT_BUFFER",
    "EXT_CODES",
    "EXT_NDARRAY",
    "LEAVES",
    "MAX_DEPTH_LIMIT",
    "ArrayRef",
    "BufferRef",
    "ValueEncoder",
    "as_bytes_view",
    "check_array_size",
    "pack",
    "packer",
    "plain",
    "rebuild",
    "scan",
    "scan_items",
    "short",
    "unpack",
]

MAX_DEPTH_LIMIT = 512  # well below msgpack's 1024 levels and Python's recursion limit
MAX_NDIM = 32
MAX_SIZE = (1 << 63) - 1  # an array dimension (as ids: fits a signed 64-bit integer)

EXT_BUFFER = 1
EXT_NDARRAY = 2
EXT_CODES: dict[int, str] = {EXT_BUFFER: "BUFFER", EXT_NDARRAY: "NDARRAY"}
"""The msgpack extension types of this protocol; any other code is refused."""

_INDEX = struct.Struct("<I")
_TYPESTR = re.compile(r"[<>|=][biufc][1-9][0-9]?\Z")
_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1


def short(v: Any) -> str:
    """A bounded description of a value for error messages (never a deep repr)."""
    if isinstance(v, (int, float, type(None))):
        return repr(v)[:40]
    if isinstance(v, str):
        return repr(v[:40])
    return type(v).__name__


# -- sending ----------------------------------------------------------------------------------


class ValueEncoder:
    """Turns one frame's values into msgpack-ready values, moving big buffers out of band.

    Args:
        threshold: binaries and arrays of at least this many bytes go out of band.
        max_depth: the deepest nesting of containers allowed (at most :data:`MAX_DEPTH_LIMIT`).
        max_message: the largest out-of-band buffer allowed, in bytes.

    Attributes:
        buffers: the out-of-band buffers collected so far, in index order.
    """

    def __init__(self, threshold: int, max_depth: int, max_message: int) -> None:
        self.threshold = threshold
        self.max_depth = max_depth
        self.max_message = max_message
        self.buffers: list[bytes | memoryview] = []

    def _oob(self, buf: bytes | memoryview, nbytes: int) -> int:
        if nbytes > self.max_message:
            raise LocalProtocolError(f"a buffer of {nbytes} B exceeds {self.max_message} B")
        self.buffers.append(buf)
        return len(self.buffers) - 1

    def value(self, v: Any, level: int = 0) -> Any:
        """``v`` as a msgpack-ready value; ``level`` is the nesting depth of ``v`` itself.

        Raises:
            LocalProtocolError: ``v`` (or something inside it) cannot be sent.
        """
        # Recursion is bounded: max_depth <= MAX_DEPTH_LIMIT, checked before descending.
        t = type(v)
        if v is None or t is bool or t is float or t is str:
            return v
        if t is bytes and len(v) < self.threshold:  # the common small binary: as is
            return v
        if isinstance(v, (float, str)):  # subclasses (str enums, ...) as their base type
            return float(v) if isinstance(v, float) else str(v)
        if isinstance(v, int) and not isinstance(v, bool):
            if not _INT_MIN <= v <= _UINT_MAX:
                raise LocalProtocolError(f"integer {short(v)} does not fit 64 bits")
            return int(v)
        if hasattr(v, "__array_interface__"):  # first: an array may also be bytes-like
            return self._ndarray(v)
        if isinstance(v, (bytes, bytearray, memoryview)):
            return self._bytes(v)
        if isinstance(v, msgpack.ExtType) or not isinstance(v, (list, tuple, dict)):
            raise LocalProtocolError(f"cannot send a value of type {type(v).__name__}")
        if level >= self.max_depth:
            raise LocalProtocolError(f"values nest deeper than {self.max_depth} levels")
        if isinstance(v, dict):
            out = {}
            for k, item in v.items():
                if not isinstance(k, str):
                    raise LocalProtocolError(f"map key of type {type(k).__name__}: keys are str")
                out[k] = self.value(item, level + 1)
            return out
        return [self.value(item, level + 1) for item in v]

    def _bytes(self, v: bytes | bytearray | memoryview) -> Any:
        if isinstance(v, memoryview):
            if not v.contiguous:
                raise LocalProtocolError("a memoryview sent must be contiguous")
            if v.c_contiguous is False:
                raise LocalProtocolError("a memoryview sent must be C-contiguous")
            n = v.nbytes
        else:
            n = len(v)
        if n < self.threshold:
            return v if isinstance(v, bytes) else v.tobytes() if isinstance(
                v, memoryview) else bytes(v)
        buf = v if isinstance(v, (bytes, memoryview)) else memoryview(v)
        return msgpack.ExtType(EXT_BUFFER, _INDEX.pack(self._oob(buf, n)))

    def _ndarray(self, v: Any) -> msgpack.ExtType:
        try:
            iface = v.__array_interface__
            typestr, shape = iface["typestr"], tuple(iface["shape"])
            mv = memoryview(v)
        except Exception as exc:
            raise LocalProtocolError(f"{type(v).__name__} exposes no usable array buffer: "
                                     f"{exc}") from exc
        if not isinstance(typestr, str) or not _TYPESTR.match(typestr):
            raise LocalProtocolError(f"array type {short(typestr)} is not a plain numeric type")
        if len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
            raise LocalProtocolError(f"array shape {shape[:4]!r} is not valid")
        if not mv.c_contiguous:
            raise LocalProtocolError("an array sent must be C-contiguous "
                                     "(numpy.ascontiguousarray makes a copy that is)")
        n = int(typestr[2:])
        for d in shape:
            n *= d
        if n != mv.nbytes:
            raise LocalProtocolError(f"array of {mv.nbytes} B does not match its shape and type")
        if n < self.threshold:
            ref: Any = mv.tobytes()  # small: one copy, inline
        else:
            try:
                flat = mv.cast("B")  # still no copy
            except TypeError:  # a format cast() does not know (e.g. complex): send as is
                flat = mv
            ref = self._oob(flat, n)
        data = msgpack.packb([typestr, list(shape), ref], use_bin_type=True)
        return msgpack.ExtType(EXT_NDARRAY, data)


def plain(values: Any, threshold: int) -> bool:
    """Whether every one of ``values`` is a leaf that :meth:`ValueEncoder.value` would send as
    it is (None, bool, an int in range, float, str, bytes below ``threshold``; exact types, not
    subclasses): then a frame of them needs no encoder (the common case, checked flat)."""
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


def packer() -> Any:
    """A msgpack packer for :func:`pack` (one per connection: packers are not thread-safe;
    reusing one saves building it per frame)."""
    return msgpack.Packer(use_bin_type=True)


def pack(obj: Any, what: str, with_packer: Any = None) -> bytes:
    """``obj`` (msgpack-ready, from :class:`ValueEncoder`) as msgpack bytes, with
    ``with_packer`` (from :func:`packer`) if given.

    Raises:
        LocalProtocolError: msgpack refused it (e.g. a lone surrogate in a string).
    """
    try:
        if with_packer is not None:
            return with_packer.pack(obj)  # type: ignore[no-any-return]
        return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
    except Exception as exc:
        raise LocalProtocolError(f"{what} cannot be packed: {exc}") from exc


# -- receiving --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BufferRef:
    """Stands in for an out-of-band binary until its buffer arrives."""

    index: int


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """Stands in for an array: its bytes inline (``data``) or out of band (``index``)."""

    typestr: str
    shape: tuple[int, ...]
    index: int | None
    data: bytes | None


def _numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise RemoteProtocolError("the peer sent an array, and numpy is not installed") from exc
    return numpy


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_BUFFER:
        if len(data) != _INDEX.size:
            raise RemoteProtocolError(f"ext {EXT_BUFFER} carries {len(data)} B, not 4")
        return BufferRef(_INDEX.unpack(data)[0])
    if code == EXT_NDARRAY:
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True,
                                  max_str_len=8, max_bin_len=len(data), max_array_len=MAX_NDIM,
                                  max_map_len=0, max_ext_len=0)
        except Exception as exc:
            raise RemoteProtocolError(f"malformed ext {EXT_NDARRAY}: {exc}") from exc
        if not (type(obj) is list and len(obj) == 3):
            raise RemoteProtocolError(f"ext {EXT_NDARRAY} is not [typestr, shape, data]")
        typestr, shape, ref = obj
        if not (type(typestr) is str and _TYPESTR.match(typestr)):
            raise RemoteProtocolError(f"array type {short(typestr)} is not a plain numeric type")
        if not (type(shape) is list and len(shape) <= MAX_NDIM
                and all(type(d) is int and 0 <= d <= MAX_SIZE for d in shape)):
            raise RemoteProtocolError("array shape is not a list of sizes")
        _numpy()  # imported lazily, here, the first time an array arrives
        if type(ref) is int:
            return ArrayRef(typestr, tuple(shape), ref, None)
        if type(ref) is bytes:
            check_array_size(typestr, shape, len(ref))
            return ArrayRef(typestr, tuple(shape), None, ref)
        raise RemoteProtocolError(f"ext {EXT_NDARRAY} data is neither an index nor bytes")
    raise RemoteProtocolError(f"unknown msgpack ext type {code}")


def unpack(mv: memoryview, max_message: int, max_depth: int) -> Any:
    """Exactly one msgpack value from ``mv``, with every declared size bounded by
    ``max_message`` before anything is allocated; placeholders for the ext types.

    Raises:
        RemoteProtocolError: malformed, trailing bytes, too deep for msgpack, an unknown
            extension type, or a bad ext 1/ext 2 payload.
    """
    if mv.nbytes > max_message:
        raise RemoteProtocolError(f"an RPC frame's body of {mv.nbytes} B exceeds {max_message} B")
    try:
        # msgpack (>= 1.0; raw=False, strict_map_key=True, use_list=True are its defaults)
        # bounds every declared size by the data's own length, which is at most max_message:
        # stricter than passing max_message as five limits, and a call with six keywords
        # costs about as much as unpacking a small body.
        return msgpack.unpackb(mv, ext_hook=_ext_hook)
    except RemoteProtocolError:
        raise
    except msgpack.ExtraData as exc:
        raise RemoteProtocolError("trailing bytes after an RPC frame") from exc
    except msgpack.StackError as exc:
        raise RemoteProtocolError(f"RPC frame nests deeper than {max_depth}") from exc
    except Exception as exc:  # msgpack raises several types for malformed input
        raise RemoteProtocolError(f"malformed RPC frame: {exc}") from exc


Ref = tuple[Any, Any, BufferRef | ArrayRef]
"""Where a placeholder sits: ``(container, key, placeholder)``."""


_LEAVES = frozenset({type(None), bool, int, float, str, bytes})
LEAVES = _LEAVES
"""The types of received values that need no walk (msgpack's plain scalars)."""


def scan_items(container: Any, keys: Any, refs: list[Ref], max_depth: int) -> None:
    """:func:`scan` of ``container[key]`` for each of ``keys``: plain leaves (the common case)
    are passed over without building the walk's stack."""
    roots = [(container, k) for k in keys if type(container[k]) not in _LEAVES]
    if roots:
        scan(roots, refs, max_depth)


def scan(roots: list[tuple[Any, Any]], refs: list[Ref], max_depth: int) -> None:
    """Check every value under ``container[key]`` for each root (level 0): containers nest
    at most ``max_depth``, map keys are strings, leaves are plain msgpack values or
    placeholders (appended to ``refs``). Iterative; visits each object once.

    Raises:
        RemoteProtocolError: a rule is broken.
    """
    stack: list[tuple[Any, Any, int]] = [(c, k, 0) for c, k in roots]
    while stack:
        container, key, level = stack.pop()
        v = container[key]
        t = type(v)
        if t is list or t is dict:
            if level >= max_depth:
                raise RemoteProtocolError(f"values nest deeper than {max_depth} levels")
            if t is list:
                stack.extend((v, i, level + 1) for i in range(len(v)))
            else:
                for k in v:
                    if type(k) is not str:
                        raise RemoteProtocolError("map keys must be strings")
                stack.extend((v, k, level + 1) for k in v)
        elif t is BufferRef or t is ArrayRef:
            refs.append((container, key, v))
        elif not (v is None or t is bool or t is int or t is float or t is str
                  or t is bytes):
            # e.g. msgpack's Timestamp (ext -1), which the unpacker decodes itself
            raise RemoteProtocolError(f"unknown msgpack value of type {t.__name__}")


def rebuild(refs: list[Ref], buffers: list[memoryview]) -> None:
    """Put the values in place of the placeholders, now that every buffer has arrived.

    Raises:
        RemoteProtocolError: an array does not fit its buffer, or numpy cannot rebuild it.
    """
    for container, key, ref in refs:
        if isinstance(ref, BufferRef):
            container[key] = buffers[ref.index]
            continue
        data: Any = ref.data if ref.index is None else buffers[ref.index]
        check_array_size(ref.typestr, ref.shape, len(data))
        numpy = _numpy()
        try:
            container[key] = numpy.frombuffer(data, dtype=ref.typestr).reshape(ref.shape)
        except Exception as exc:
            raise RemoteProtocolError(f"array cannot be rebuilt: {exc}") from exc


def check_array_size(typestr: str, shape: list[int] | tuple[int, ...], nbytes: int) -> None:
    """Raises RemoteProtocolError unless ``nbytes`` is exactly what the array needs."""
    n = 0 if 0 in shape else int(typestr[2:])
    for d in shape:
        n *= d
        if n > nbytes:  # stop early: a huge product is wrong anyway
            break
    if n != nbytes:
        raise RemoteProtocolError(f"array of shape/type {typestr} needs other than {nbytes} B")


def as_bytes_view(msg: bytes | bytearray | memoryview) -> memoryview:
    """``msg`` as a flat memoryview of bytes (no copy).

    Raises:
        LocalProtocolError: ``msg`` is not a contiguous buffer.
    """
    t = type(msg)
    if t is bytearray or t is bytes:  # (flat bytes already: what channels deliver)
        return memoryview(msg)
    mv = msg if isinstance(msg, memoryview) else memoryview(msg)
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except TypeError as exc:
            raise LocalProtocolError(f"a received message must be a contiguous buffer: "
                                     f"{exc}") from exc
    return mv
