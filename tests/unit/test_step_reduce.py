"""The compiled step runner's typed reduction loops against numpy's ufuncs, without a device:
every (dtype, op) they cover gives numpy's result bit for bit, special values included
(integers wrapping, NaN on either side, infinities, signed zeros), except which NaN a sum or
product of two NaNs is (numpy's own differs by position: its vector loop and its tail give
+NaN and -NaN for the same operands); what they do not cover is refused. (The runner calls them on the device: tests/rxe/test_collectives_engine.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aiordma._verbs.pysteps import DTYPE_CODES, OP_CODES

UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
CASES = [(kind, size, op) for (kind, size) in DTYPE_CODES for op in OP_CODES
         if kind != "f" or op not in ("band", "bor", "bxor")]


def _reduce_into() -> object:
    from aiordma._verbs.compiled import describe, fastpath

    mod = fastpath()
    if mod is None:
        pytest.skip(f"the compiled fast path is not here: {describe()}")
    return mod.reduce_into  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind, size, op", CASES, ids=[f"{k}{s}-{o}" for k, s, o in CASES])
@given(data=st.data())
def test_a_typed_loop_is_numpys_ufunc_bit_for_bit(kind: str, size: int, op: str,
                                                  data: st.DataObject) -> None:
    reduce_into = _reduce_into()
    dtype = np.dtype(f"{kind}{size}")
    n = data.draw(st.integers(0, 40))
    a = data.draw(hnp.arrays(dtype, n))
    b = data.draw(hnp.arrays(dtype, n))
    want = np.empty_like(a)
    with np.errstate(all="ignore"):
        UFUNCS[op](a, b, out=want)
    got = np.empty_like(a)
    reduce_into(OP_CODES[op], DTYPE_CODES[(kind, size)], a, b, got)
    if kind == "f" and op in ("sum", "prod"):
        both = np.isnan(a) & np.isnan(b)
        assert np.isnan(got[both]).all()
        got[both] = want[both] = np.nan
    assert got.tobytes() == want.tobytes(), (a, b, got, want)


def test_special_floats_keep_numpys_order() -> None:
    reduce_into = _reduce_into()
    a = np.array([np.nan, 1.0, -0.0, 0.0, np.inf, -np.inf, np.nan], np.float64)
    b = np.array([1.0, np.nan, 0.0, -0.0, -np.inf, np.inf, np.nan], np.float64)
    for op in ("min", "max", "sum", "prod"):
        got = np.empty_like(a)
        reduce_into(OP_CODES[op], DTYPE_CODES[("f", 8)], a, b, got)
        with np.errstate(all="ignore"):
            want = UFUNCS[op](a, b)
        assert got.tobytes() == want.tobytes(), (op, got, want)


def test_a_bitwise_op_on_floats_and_an_unknown_code_are_refused() -> None:
    reduce_into = _reduce_into()
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="no loop"):
        reduce_into(OP_CODES["band"], DTYPE_CODES[("f", 4)], a, a, np.empty_like(a))
    with pytest.raises(ValueError, match="no loop"):
        reduce_into(0, 99, a, a, np.empty_like(a))
    with pytest.raises(ValueError, match="differ in length"):
        reduce_into(0, 0, a, a[:2], np.empty_like(a))
