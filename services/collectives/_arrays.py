"""What the collectives take as arrays, and the reduction ops.

Arrays
    An input may be a numpy array, any object with ``__dlpack__`` on the CPU (a torch CPU
    tensor, a JAX or CuPy-on-host array: seen through ``numpy.from_dlpack``, without a
    copy), any object with the buffer protocol (``bytes``, ``bytearray``, ``array.array``,
    ``memoryview``: its format gives the dtype), or anything ``numpy.asarray`` takes (lists,
    scalars). An array that is filled in place (``out=``, an allreduce's argument, a
    broadcast's or a recv's destination) must be one of the first three kinds and writable,
    so that the caller's own object changes: a torch tensor passed to ``allreduce`` holds the
    result afterwards. Any layout works (non-contiguous arrays are copied in and out).

Ops
    :data:`REDUCE_OPS` maps each op's name to the numpy ufunc that combines two partial
    results; ``avg`` sums, then divides by the group's size (floating and complex dtypes
    only); ``band``, ``bor`` and ``bxor`` take integer and bool dtypes; the rules are
    :data:`aiordma.protocols.collectives.REDUCE_OPS`'s.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiordma.protocols import collectives as proto

from ._errors import CollectiveArgumentError

__all__ = ["REDUCE_OPS", "ReduceOp", "as_input", "as_output", "mapped", "reduce_op"]

#: The reduction ops and the numpy ufuncs that combine two partial results (``avg`` divides
#: the sum by the group's size at the end).
REDUCE_OPS: dict[str, np.ufunc] = {
    "sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum, "avg": np.add,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}


@dataclass(frozen=True, slots=True)
class ReduceOp:  # (one per op, made once)
    """An op as the algorithms use it: its name (in signatures: ranks must agree on it) and
    its ufunc."""

    name: str
    ufunc: np.ufunc

    def finish(self, result: np.ndarray, world: int) -> None:
        """What the op does once every rank's value is combined (``avg``: divide)."""
        if self.name == "avg":
            np.divide(result, world, out=result)


_OPS = {name: ReduceOp(name, ufunc) for name, ufunc in REDUCE_OPS.items()}


def reduce_op(op: Any, dtype: np.dtype[Any], what: str) -> ReduceOp:
    """The op ``op`` for values of ``dtype``.

    Raises:
        CollectiveArgumentError: an unknown op, or one that cannot reduce ``dtype``.
    """
    kind = "V" if dtype.fields is not None else dtype.kind
    found = _OPS.get(op) if isinstance(op, str) else None
    if found is None or kind not in proto.REDUCE_OPS[op]:
        raise CollectiveArgumentError(f"{what}: {proto.op_refusal(op, kind, str(dtype))}")
    return found


def _shared(obj: Any, what: str) -> np.ndarray | None:
    """A numpy view of ``obj``'s own memory (DLPack or the buffer protocol), or None when it
    offers neither."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__") and not isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            return np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise CollectiveArgumentError(f"{what}: numpy cannot take this "
                                          f"{type(obj).__name__} through DLPack (it must be "
                                          f"on the CPU, of a dtype numpy has, and not need "
                                          f"gradients): {exc}") from None
    try:
        view = memoryview(obj)
    except TypeError:
        return None
    try:
        return np.asarray(view)
    except (TypeError, ValueError) as exc:
        raise CollectiveArgumentError(f"{what}: numpy cannot read this buffer (format "
                                      f"{view.format!r}): {exc}") from None


def _no_objects(arr: np.ndarray, what: str) -> np.ndarray:
    if arr.dtype.hasobject:
        raise CollectiveArgumentError(f"{what} cannot send Python objects (dtype {arr.dtype})")
    return arr


def as_input(obj: Any, what: str) -> np.ndarray:
    """``obj`` as an array to read (see the module; no copy where it can be avoided).

    Raises:
        CollectiveArgumentError: not something numpy can read, or an object dtype.
    """
    if type(obj) is np.ndarray and not obj.dtype.hasobject:  # (the common case, no calls)
        return obj
    arr = _shared(obj, what)
    if arr is None:
        try:
            arr = np.asarray(obj)
        except (TypeError, ValueError) as exc:
            raise CollectiveArgumentError(f"{what} takes an array, not "
                                          f"{type(obj).__name__}: {exc}") from None
    return _no_objects(arr, what)


def as_output(obj: Any, what: str) -> np.ndarray:
    """A writable numpy view of ``obj``'s memory, to fill in place.

    Raises:
        CollectiveArgumentError: not a numpy array, a DLPack tensor or a buffer; read-only;
            or an object dtype.
    """
    if type(obj) is np.ndarray and obj.flags.writeable and not obj.dtype.hasobject:
        return obj  # (the common case, no calls)
    arr = _shared(obj, what)
    if arr is None:
        raise CollectiveArgumentError(f"{what} fills an array in place (a numpy array, a "
                                      f"DLPack tensor or a writable buffer), not "
                                      f"{type(obj).__name__}")
    if not arr.flags.writeable:
        raise CollectiveArgumentError(f"{what} needs a writable array")
    return _no_objects(arr, what)


def check_like(arr: np.ndarray, shape: tuple[int, ...], dtype: np.dtype[Any],
               what: str) -> None:
    """Raise :class:`CollectiveArgumentError` unless ``arr`` has ``shape`` and ``dtype``."""
    if arr.shape != shape or arr.dtype != dtype:
        raise CollectiveArgumentError(f"{what} must be {dtype} of shape {shape}, not "
                                      f"{arr.dtype} of shape {arr.shape}")


def mapped(nbytes: int) -> np.ndarray:
    """A zeroed ``uint8`` array of ``nbytes`` on an anonymous mapping of its own (page
    aligned), for the group's registered buffers: its pages go back to the system when the
    last reference to it goes. An array from ``malloc`` would not always: after a large block
    is freed, glibc raises its mmap threshold (up to 32 MiB), so the next buffers of that size
    come from the heap, whose freed middle stays in the process (measured: a second group in
    a process peaked 63 MiB per rank above the first, 4 ranks, 16 MiB allgathers)."""
    if nbytes <= 0:
        return np.zeros(0, np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
