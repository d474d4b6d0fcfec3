"""Memory registration: :class:`MemoryRegion` over any buffer, slices, and remote descriptors.

A :class:`MemoryRegion` registers the memory of any object that exports the buffer protocol
(``bytearray``, ``mmap``, numpy arrays, a writable ``memoryview``; read-only ``bytes`` for
send/write sources) without copying. It holds a buffer export for its lifetime, so a
``bytearray`` cannot be resized (and moved) under the device.

Access flags are the minimum the caller asks for: local read always, local write when the
buffer is writable (receive and RDMA READ targets), remote read/write/atomic only through
:meth:`MemoryRegion.expose`, which is the one way to obtain a :class:`RemoteBuffer` (an rkey).
An rkey grants exactly the access its ``expose()`` call asked for: each combination of remote
access gets its own registration (the region's own, if it was registered with exactly that
combination), so exposing a region read-only after exposing it writable hands out a key that
cannot write. For a sub-range, for access only one connection can use, and for revocation, see
``Endpoint.expose`` (:mod:`aiordma._memory.window`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Self

from aiordma._args import check_bool, check_type
from aiordma._device.device import Device
from aiordma._errors import ClosedResourceError, LocalProtocolError
from aiordma._resources import Share
from aiordma._verbs.mr import access_flags, register

__all__ = ["LocalSlice", "MemoryRegion", "RemoteBuffer", "buffer_address", "remote_access"]


def _byte_view(obj: Any) -> memoryview:
    mv = memoryview(obj)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]


_PyObject_GetBuffer = ctypes.pythonapi.PyObject_GetBuffer
_PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_PyObject_GetBuffer.restype = ctypes.c_int
_PyBuffer_Release = ctypes.pythonapi.PyBuffer_Release
_PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_PyBuffer_Release.restype = None
_PyBUF_SIMPLE = 0  # contiguous bytes, no shape; exporters of non-contiguous memory refuse it


class _BufferExport:
    """A held buffer export (``PyObject_GetBuffer``): address and length stay valid until
    release."""

    __slots__ = ("_held", "_view", "address", "length", "readonly")

    def __init__(self, obj: Any) -> None:
        self._view = _PyBuffer()
        try:
            _PyObject_GetBuffer(obj, ctypes.byref(self._view), _PyBUF_SIMPLE)
        except (BufferError, TypeError) as exc:
            raise LocalProtocolError(f"cannot register {type(obj).__name__}: it must export a "
                                     f"contiguous buffer ({exc})") from exc
        self._held = True
        self.address: int = self._view.buf or 0
        self.length: int = self._view.len
        self.readonly: bool = bool(self._view.readonly)

    def release(self) -> None:
        if self._held:
            self._held = False
            _PyBuffer_Release(ctypes.byref(self._view))


def buffer_address(obj: Any) -> tuple[int, int, bool]:
    """``(address, length, readonly)`` of a buffer-protocol object (the export is released)."""
    exp = _BufferExport(obj)
    try:
        return exp.address, exp.length, exp.readonly
    finally:
        exp.release()


@dataclass(frozen=True, slots=True)
class LocalSlice:
    """A byte range of a :class:`MemoryRegion`: what a work request's SGE points at.

    Made by slicing a region (``region[a:b]``, ``region.whole()``); one built directly is
    checked the same way.

    Raises:
        LocalProtocolError: ``region`` is not a :class:`MemoryRegion`, or the range is not
            inside it (``offset`` and ``length`` are integers, ``0 <= offset`` and
            ``offset + length <= len(region)``).
    """

    region: MemoryRegion
    offset: int
    length: int

    def __post_init__(self) -> None:
        region, offset, length = self.region, self.offset, self.length
        if (type(region) is MemoryRegion and type(offset) is int and type(length) is int
                and 0 <= offset and 0 <= length and offset + length <= region.length):
            return  # (the common case, checked without a generator; the rest below)
        if not isinstance(region, MemoryRegion):
            raise LocalProtocolError(f"a LocalSlice is of a MemoryRegion, not "
                                     f"{type(region).__name__}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)):
            raise LocalProtocolError(f"a LocalSlice's offset and length are integers, not "
                                     f"{offset!r:.40} and {length!r:.40}")
        if offset < 0 or length < 0 or offset + length > region.length:
            raise LocalProtocolError(f"[{offset}:{offset + length}] is outside the region's "
                                     f"0..{region.length}")

    @property
    def address(self) -> int:
        return self.region.address + self.offset

    @property
    def lkey(self) -> int:
        return self.region.lkey

    def __len__(self) -> int:
        return self.length

    def memoryview(self) -> memoryview:
        return self.region.view[self.offset:self.offset + self.length]


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteBuffer:
    """A peer-accessible byte range: address, rkey, length and the access it was exposed with.

    Produced only by :meth:`MemoryRegion.expose`; send it to the peer as ``to_wire()`` (a
    msgpack-friendly tuple) and rebuild it there with ``from_wire()``. Slicing is bounds-checked
    locally, so a bad range fails before anything is posted.
    """

    address: int
    rkey: int
    length: int
    readable: bool = False
    writable: bool = False
    atomic: bool = False

    def __post_init__(self) -> None:
        a, r, n = self.address, self.rkey, self.length
        if (type(a) is int and type(r) is int and type(n) is int and 0 <= a < 1 << 64
                and 0 <= r < 1 << 32 and 0 <= n < 1 << 64 and type(self.readable) is bool
                and type(self.writable) is bool and type(self.atomic) is bool):
            return  # (the common case, checked without a loop of calls; the rest below)
        for name, limit in (("address", 1 << 64), ("rkey", 1 << 32), ("length", 1 << 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
                raise LocalProtocolError(f"RemoteBuffer {name} must be an integer in "
                                         f"0..{limit - 1}, not {v!r:.80}")
        for name in ("readable", "writable", "atomic"):
            check_bool(getattr(self, name), name=f"RemoteBuffer {name}")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> RemoteBuffer:
        if type(key) is slice and key.step is None:  # (the common case: int bounds, inside)
            start, stop = key.start, key.stop
            if (type(start) is int and type(stop) is int and 0 <= start <= self.length
                    and 0 <= stop <= self.length):
                return RemoteBuffer(address=self.address + start, rkey=self.rkey,
                                    length=max(0, stop - start), readable=self.readable,
                                    writable=self.writable, atomic=self.atomic)
        if (not isinstance(key, slice) or key.step not in (None, 1)
                or not all(b is None or (isinstance(b, int) and not isinstance(b, bool))
                           for b in (key.start, key.stop))):
            raise LocalProtocolError("a RemoteBuffer is sliced with [start:stop] only")
        start, stop, _ = key.indices(self.length)
        if key.start is not None and not (0 <= key.start <= self.length):
            raise LocalProtocolError(f"slice start {key.start} is outside 0..{self.length}")
        if key.stop is not None and not (0 <= key.stop <= self.length):
            raise LocalProtocolError(f"slice stop {key.stop} is outside 0..{self.length}")
        return RemoteBuffer(address=self.address + start, rkey=self.rkey,
                            length=max(0, stop - start), readable=self.readable,
                            writable=self.writable, atomic=self.atomic)

    def to_wire(self) -> tuple[int, int, int, int]:
        flags = (self.readable << 0) | (self.writable << 1) | (self.atomic << 2)
        return (self.address, self.rkey, self.length, flags)

    @classmethod
    def from_wire(cls, wire: Any) -> RemoteBuffer:
        ok = False
        if isinstance(wire, (list, tuple)):  # not bytes or str, whose items would unpack too
            try:
                address, rkey, length, flags = wire
                ok = isinstance(flags, int) and 0 <= flags < 8
            except ValueError:
                pass
        if not ok:
            raise LocalProtocolError(f"not a RemoteBuffer descriptor: {wire!r:.200}")
        try:
            return cls(address=address, rkey=rkey, length=length, readable=bool(flags & 1),
                       writable=bool(flags & 2), atomic=bool(flags & 4))
        except LocalProtocolError as exc:
            raise LocalProtocolError(f"not a RemoteBuffer descriptor: {exc}") from None


def remote_access(read: bool, write: bool, atomic: bool) -> int:
    """The ``IBV_ACCESS_REMOTE_*`` flags granting exactly ``read``/``write``/``atomic``."""
    return access_flags(remote_read=read, remote_write=write, atomic=atomic)


class MemoryRegion:
    """A registered buffer (``ibv_reg_mr``), sliceable into :class:`LocalSlice` ranges.

    Args:
        device: the device (protection domain) to register with.
        buffer: any contiguous buffer-protocol object; writable unless the region is only
            ever a send or RDMA WRITE source.
        remote_read, remote_write, atomic: remote access to grant. Leave them off unless the
            region will be exposed with :meth:`expose`.

    Raises:
        LocalProtocolError: ``device`` is not a :class:`Device`, a flag is not a bool, the
            object is not a contiguous buffer, or a remote write/atomic access was asked for
            on read-only memory.
        ClosedResourceError: the device is closed.
        DeviceError: the device refused the registration.
    """

    def __init__(self, device: Device, buffer: Any, *, remote_read: bool = False,
                 remote_write: bool = False, atomic: bool = False) -> None:
        check_type(device, Device, name="device", what="an aiordma Device")
        for name, flag in (("remote_read", remote_read), ("remote_write", remote_write),
                           ("atomic", atomic)):
            check_bool(flag, name=name)
        self._export = _BufferExport(buffer)
        if device.closed:
            self._export.release()
            raise ClosedResourceError(f"device {device.name} is closed")
        readonly = self._export.readonly
        self.device = device
        self.obj = buffer
        self.view = _byte_view(buffer) if self._export.length else memoryview(b"")
        self.address: int = self._export.address
        self.length: int = self._export.length
        self.readonly = readonly
        self._closed = False
        # (remote_read, remote_write, atomic) -> a registration granting exactly that, for
        # expose(); and what must close before the region (exposures with memory windows)
        self._exposed: dict[tuple[bool, bool, bool], Any] = {}
        self._dependents: list[Any] = []
        # ibv_reg_mr refuses a zero-length range; a 1-byte dummy keeps empty buffers usable.
        self._pad = bytearray(1) if self.length == 0 else None
        try:
            self._mr = self.register_range(remote_read, remote_write, atomic)
        except BaseException:
            self._export.release()
            raise
        self._share = Share(self, "mrs")  # the region's own registration; expose() adds
        self.remote_read, self.remote_write, self.atomic = remote_read, remote_write, atomic
        device._adopt(self)

    def register_range(self, remote_read: bool, remote_write: bool, atomic: bool, *,
                       mw_bind: bool = False, offset: int = 0, length: int | None = None) -> Any:
        """A new pyverbs MR over ``[offset, offset + length)`` of the buffer with exactly the
        remote access given (``mw_bind``: memory windows may be bound to it), owned by the
        caller (exposures use it; close it before this region, see :meth:`add_dependent`).

        Raises:
            LocalProtocolError: remote write/atomic asked for on read-only memory.
            DeviceError: the device refused the registration.
        """
        if self.readonly and (remote_write or atomic):
            raise LocalProtocolError("read-only memory cannot be exposed for remote write/atomic")
        access = access_flags(local_write=not self.readonly, remote_read=remote_read,
                              remote_write=remote_write, atomic=atomic, mw_bind=mw_bind)
        addr = self.address if self._pad is None else buffer_address(self._pad)[0]
        size = max(self.length if length is None else length, 1)
        return register(self.device.pd, addr + offset, size, access, device_name=self.device.name)

    @property
    def lkey(self) -> int:
        if self._closed:  # pyverbs would dereference the freed MR (a crash, not an error)
            raise ClosedResourceError("the memory region is deregistered")
        return int(self._mr.lkey)

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> LocalSlice:
        if type(key) is slice and key.step is None:  # (the common case: int bounds, inside)
            start, stop = key.start, key.stop
            if (type(start) is int and type(stop) is int and 0 <= start <= self.length
                    and 0 <= stop <= self.length):
                return LocalSlice(self, start, max(0, stop - start))
        if (not isinstance(key, slice) or key.step not in (None, 1)
                or not all(b is None or (isinstance(b, int) and not isinstance(b, bool))
                           for b in (key.start, key.stop))):
            raise LocalProtocolError("a MemoryRegion is sliced with [start:stop] only")
        for bound in (key.start, key.stop):
            if bound is not None and not (0 <= bound <= self.length):
                raise LocalProtocolError(f"slice bound {bound} is outside 0..{self.length}")
        start, stop, _ = key.indices(self.length)
        return LocalSlice(self, start, max(0, stop - start))

    def whole(self) -> LocalSlice:
        return LocalSlice(self, 0, self.length)

    def expose(self, *, read: bool = False, write: bool = False,
               atomic: bool = False) -> RemoteBuffer:
        """A descriptor the peer can use for one-sided access to the whole region.

        Its rkey grants exactly ``read``/``write``/``atomic``: the region's own registration
        if it was made with exactly that access, else a registration of the same memory with
        exactly that access (made once per combination, kept until the region closes; the
        region's ``lkey`` never changes). Memory is reachable by a peer only through a
        descriptor returned here or by ``Endpoint.expose``. Such an rkey works on every queue
        pair of the device's protection domain and lasts until the region closes; for a
        sub-range, one connection only, or revocation, use ``Endpoint.expose``.

        Raises:
            LocalProtocolError: a flag is not a bool, no access asked for, or remote
                write/atomic on read-only memory.
            ClosedResourceError: the region is deregistered.
            DeviceError: the device refused the registration.
        """
        for name, flag in (("read", read), ("write", write), ("atomic", atomic)):
            check_bool(flag, name=name)
        self._check_open()
        if not (read or write or atomic):
            raise LocalProtocolError("expose() needs at least one of read, write, atomic")
        want = (read, write, atomic)
        if want == (self.remote_read, self.remote_write, self.atomic):
            mr = self._mr
        else:
            mr = self._exposed.get(want)
            if mr is None:
                mr = self._exposed[want] = self.register_range(*want)
                self._share.add()
        return RemoteBuffer(address=self.address, rkey=int(mr.rkey), length=self.length,
                            readable=read, writable=write, atomic=atomic)

    def add_dependent(self, dependent: Any) -> None:
        """``dependent.close()`` is called first when this region closes (an exposure whose
        window is bound to a range of it: such a registration cannot be deregistered)."""
        self._dependents.append(dependent)

    def remove_dependent(self, dependent: Any) -> None:
        """The dependent closed by itself."""
        if dependent in self._dependents:
            self._dependents.remove(dependent)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the memory region is deregistered")

    def close(self) -> None:
        """Deregister (idempotent): exposures with memory windows first (a registration with
        a window bound to it cannot be deregistered), then the extra registrations of
        :meth:`expose`, then the region's own. The buffer export is released afterwards, and
        the region lets go of the buffer (``obj`` becomes None): memory made for the region
        alone is freed though the region is still referenced."""
        if self._closed:
            return
        self._closed = True
        dependents, self._dependents = self._dependents, []
        for d in dependents:
            d.close()
        for mr in self._exposed.values():
            try:
                mr.close()
            finally:
                self._share.give_back()
        self._exposed.clear()
        try:
            self._mr.close()
        finally:
            self._share.give_back()
        self.view.release()
        self._export.release()
        self.obj = None  # (a buffer made for the region goes with it, though the region stays)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<MemoryRegion {self.length} B at {self.address:#x}{state}>"


class RegistrationCache:
    """Reuses registrations of local buffers across operations (LRU, bounded).

    For buffers an endpoint only reads from or writes into locally (``recv_into`` targets):
    registering costs a system call and page pinning, so a buffer used again is not registered
    again. Entries hold their buffer (the address cannot be reused while cached; a cached
    ``bytearray`` cannot be resized), and are never exposed to a peer. ``close()`` deregisters
    everything.
    """

    def __init__(self, device: Device, *, max_bytes: int = 64 << 20, max_entries: int = 64) -> None:
        self.device = device
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: dict[tuple[int, int], MemoryRegion] = {}
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, buffer: Any) -> MemoryRegion:
        """A registration of ``buffer`` (writable, contiguous), cached or new."""
        address, length, _ = buffer_address(buffer)
        key = (address, length)
        mr = self._entries.pop(key, None)
        if mr is not None and mr.obj is buffer and not mr.closed:
            self._entries[key] = mr  # most recently used last
            self.hits += 1
            return mr
        if mr is not None:
            self._drop(mr)
        self.misses += 1
        mr = MemoryRegion(self.device, buffer)
        self._entries[key] = mr
        self.bytes += mr.length
        while self._entries and (len(self._entries) > self.max_entries
                                 or self.bytes > self.max_bytes):
            oldest = next(iter(self._entries))
            if self._entries[oldest] is mr:
                break
            self._drop(self._entries.pop(oldest))
        return mr

    def _drop(self, mr: MemoryRegion) -> None:
        self.bytes -= mr.length
        mr.close()

    def close(self) -> None:
        for mr in self._entries.values():
            self._drop(mr)
        self._entries.clear()
