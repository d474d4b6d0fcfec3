"""Inputs for the collectives' device tests, built identically in the workers and the test.

A case is a JSON-able dict; ``make_input(case, rank)`` builds that rank's array from the case's
seed and the rank, so the test computes the expected results with numpy from the same inputs
without receiving them. Values for reductions are small integers (also for float and complex
dtypes), so sums and products are exact in every order and comparisons can be exact.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

REDUCE_DTYPES = ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64",
                 "complex64", ">i4"]
ANY_DTYPES = REDUCE_DTYPES + ["S3", "U2", "M8[ns]", "[('a', '<i4'), ('b', '<f8', (2,))]"]
UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def dtype_of(name: str) -> np.dtype[Any]:
    if name.startswith("["):
        import ast

        return np.dtype(ast.literal_eval(name))
    return np.dtype(name)


def _layout(base: np.ndarray, layout: str) -> np.ndarray:
    """``base`` as a C-contiguous, Fortran-ordered or strided (non-contiguous) array."""
    if layout == "f":
        return np.asfortranarray(base)
    if layout == "strided" and base.ndim:
        wide = np.zeros(base.shape[:-1] + (2 * base.shape[-1],), base.dtype)
        wide[..., ::2] = base
        view = wide[..., ::2]
        assert view.shape == base.shape
        return view
    return np.ascontiguousarray(base) if base.ndim else base.copy()


def make_input(case: dict[str, Any], rank: int) -> np.ndarray:
    """Rank ``rank``'s input array for ``case``."""
    shape = tuple(case["shapes"][rank] if "shapes" in case else case["shape"])
    dtype = dtype_of(case["dtypes"][rank] if "dtypes" in case else case["dtype"])
    rng = np.random.default_rng([case["seed"], rank])
    count = int(np.prod(shape, dtype=np.int64))
    if case.get("values") == "random":  # real-valued floats: sums compare with a tolerance
        base = rng.standard_normal(count).astype(dtype)
    elif case["kind"] == "allreduce":
        if dtype.kind == "b":
            base = rng.integers(0, 2, count).astype(dtype)
        elif dtype.kind == "u":
            base = rng.integers(0, 4, count).astype(dtype)
        elif dtype.kind == "c":
            base = (rng.integers(-3, 4, count) + 1j * rng.integers(-3, 4, count)).astype(dtype)
        else:
            base = rng.integers(-3, 4, count).astype(dtype)
    else:  # broadcast, allgather: any bytes (compared as bytes)
        base = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)
    return _layout(base.reshape(shape), case.get("layout", "c"))


def expected_allreduce(case: dict[str, Any], world: int) -> np.ndarray:
    inputs = [make_input(case, r) for r in range(world)]
    return functools.reduce(UFUNCS[case["op"]], inputs)
