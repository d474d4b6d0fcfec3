"""Step programs (aiordma.protocols.collectives' _programs), without a device: every rank's
allreduce program, run against the others in any interleaving and several calls in a row by
the sans-I/O reference (``simulate``), gives every rank numpy's result, bit-identical across
ranks, never overwrites a landing that was not consumed, and never deadlocks."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import LocalProtocolError


def _programs(world: int) -> list[proto.Program]:
    return [proto.allreduce_program(r, world) for r in range(world)]


@given(world=st.integers(1, 24), calls=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_every_rank_ends_with_the_same_sum_in_any_interleaving(world: int, calls: int,
                                                                seed: int) -> None:
    rnd = random.Random(seed)
    inputs = [np.float32(rnd.uniform(-1e3, 1e3)) for _ in range(world)]
    results = proto.simulate(_programs(world), inputs, lambda a, b: np.float32(a + b), calls,
                             choose=rnd.choice)
    expected = float(np.sum(np.array(inputs, np.float64)))
    for c in range(calls):
        got = {results[r][c].tobytes() for r in range(world)}
        assert len(got) == 1, f"ranks differ in call {c}"
        assert float(results[0][c]) == pytest.approx(expected, rel=1e-4, abs=1e-2)


@given(world=st.integers(2, 16), seed=st.integers(0, 2**32 - 1))
def test_every_rank_computes_the_same_expression(world: int, seed: int) -> None:
    """The operand order is the same on every rank (what makes float results bit-identical):
    with a non-commutative op (string concatenation) every rank's result is one string, in
    which every rank's input appears once."""
    rnd = random.Random(seed)
    results = proto.simulate(_programs(world), [f"<{r}>" for r in range(world)],
                             lambda a, b: f"({a}{b})", 2, choose=rnd.choice)
    for c in range(2):
        got = {results[r][c] for r in range(world)}
        assert len(got) == 1
        text = got.pop()
        assert sorted(int(x) for x in text.replace("(", "").replace(")", "").replace(
            "<", " ").replace(">", " ").split()) == list(range(world))


def test_a_landing_written_twice_before_it_is_consumed_is_caught() -> None:
    """The simulator's own check: a program that writes the same landing twice in one call
    (data the receiver has not consumed) fails it, so the tests above can fail."""
    bad = proto.Program(((proto.PUT, 1, 0, 0), (proto.PUT, 1, 0, 0)), 1, 1, (proto.BUF, 0))
    idle = proto.Program(((proto.WAIT, 0, 0),), 1, 1, (proto.BUF, 0))
    with pytest.raises(AssertionError, match="overwrote"):
        proto.simulate([bad, idle], [1, 2], lambda a, b: a + b)


def test_a_rank_waiting_for_a_write_that_never_comes_is_a_deadlock() -> None:
    lonely = proto.Program(((proto.WAIT, 1, 0),), 1, 1, (proto.BUF, 0))
    idle = proto.Program((), 1, 1, (proto.BUF, 0))
    with pytest.raises(AssertionError, match="deadlock"):
        proto.simulate([lonely, idle], [1, 2], lambda a, b: a + b)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 12])
def test_a_program_exchanges_with_log2_partners_and_one_fold(world: int) -> None:
    rounds = world.bit_length() - 1
    for r, prog in enumerate(_programs(world)):
        assert len(prog.peers) <= rounds + 1
        assert prog.landings == rounds + 2
        assert prog.buffers <= rounds + 2
        assert r not in prog.peers
        for p in prog.peers:  # the relation is mutual: both sides connect a queue pair
            assert r in proto.allreduce_program(p, world).peers


@given(landing=st.integers(0, 255), parity=st.integers(0, 1), sig=st.integers(0, 2**32 - 1))
def test_an_immediate_value_round_trips(landing: int, parity: int, sig: int) -> None:
    imm = proto.step_imm(landing, parity, sig)
    assert 0 <= imm < 2**32
    assert proto.read_imm(imm) == (landing, parity, sig & 0xFFFF)


@pytest.mark.parametrize("landing, parity", [(256, 0), (-1, 0), (0, 2)])
def test_an_immediate_value_out_of_range_is_refused(landing: int, parity: int) -> None:
    with pytest.raises(LocalProtocolError):
        proto.step_imm(landing, parity, 0)
