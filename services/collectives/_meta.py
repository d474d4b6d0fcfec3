"""An array's description as it travels between ranks: ``[dtype descr, shape]``."""

from __future__ import annotations

from typing import Any

import numpy as np

from aiordma import RemoteProtocolError

__all__ = ["meta_dtype_shape", "meta_for", "meta_nbytes", "meta_of"]


def meta_of(arr: np.ndarray) -> list[Any]:
    """The msgpack value describing ``arr``'s dtype and shape."""
    return meta_for(arr.dtype, arr.shape)


def meta_for(dtype: np.dtype[Any], shape: tuple[int, ...]) -> list[Any]:
    """The msgpack value describing an array of ``dtype`` and ``shape``."""
    return [np.lib.format.dtype_to_descr(dtype), list(shape)]


def meta_dtype_shape(meta: Any) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """Inverse of :func:`meta_of`.

    Raises:
        RemoteProtocolError: not a valid description.
    """
    try:
        descr, shape = meta
        dtype = np.lib.format.descr_to_dtype(descr)
        shp = tuple(int(s) for s in shape)
        if any(s < 0 for s in shp) or dtype.hasobject:
            raise ValueError("negative extent or object dtype")
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"not an array description: {meta!r:.200}") from exc
    return dtype, shp


def meta_nbytes(meta: Any) -> int:
    """The byte size of the array a ``(descr, shape)`` meta value describes."""
    dtype, shape = meta_dtype_shape(meta)
    return int(dtype.itemsize * int(np.prod(shape, dtype=np.int64)))
