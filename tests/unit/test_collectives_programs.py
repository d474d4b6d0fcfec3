"""Step programs (aiordma.protocols.collectives' _programs), without a device: every rank's
allreduce program, run against the others in any interleaving and several calls in a row by
the sans-I/O reference (``simulate``), gives every rank numpy's result, bit-identical across
ranks, never overwrites a landing that was not consumed, and never deadlocks; so do the
barrier and allgather programs, alone and mixed with allreduces call after call over one
landing space; and an allgather block's description round-trips."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError


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
        got = {results[r][c][0].tobytes() for r in range(world)}
        assert len(got) == 1, f"ranks differ in call {c}"
        assert float(results[0][c][0]) == pytest.approx(expected, rel=1e-4, abs=1e-2)


@given(world=st.integers(2, 16), seed=st.integers(0, 2**32 - 1))
def test_every_rank_computes_the_same_expression(world: int, seed: int) -> None:
    """The operand order is the same on every rank (what makes float results bit-identical):
    with a non-commutative op (string concatenation) every rank's result is one string, in
    which every rank's input appears once."""
    rnd = random.Random(seed)
    results = proto.simulate(_programs(world), [f"<{r}>" for r in range(world)],
                             lambda a, b: f"({a}{b})", 2, choose=rnd.choice)
    for c in range(2):
        got = {results[r][c][0] for r in range(world)}
        assert len(got) == 1
        text = got.pop()
        assert sorted(int(x) for x in text.replace("(", "").replace(")", "").replace(
            "<", " ").replace(">", " ").split()) == list(range(world))


def test_a_landing_written_twice_before_it_is_consumed_is_caught() -> None:
    """The simulator's own check: a program that writes the same landing twice in one call
    (data the receiver has not consumed) fails it, so the tests above can fail."""
    bad = proto.Program(((proto.PUT, 1, 0, 0), (proto.PUT, 1, 0, 0)), 1, 1, ((proto.BUF, 0),))
    idle = proto.Program(((proto.WAIT, 0, 0),), 1, 1, ((proto.BUF, 0),))
    with pytest.raises(AssertionError, match="overwrote"):
        proto.simulate([bad, idle], [1, 2], lambda a, b: a + b)


def test_a_rank_waiting_for_a_write_that_never_comes_is_a_deadlock() -> None:
    lonely = proto.Program(((proto.WAIT, 1, 0),), 1, 1, ((proto.BUF, 0),))
    idle = proto.Program((), 1, 1, ((proto.BUF, 0),))
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


@given(landing=st.integers(0, 255), parity=st.integers(0, 1), sig=st.integers(0, 2**32 - 1),
       program=st.integers(0, 300))
def test_an_immediate_value_round_trips(landing: int, parity: int, sig: int,
                                        program: int) -> None:
    imm = proto.step_imm(landing, parity, sig, program)
    assert 0 <= imm < 2**32
    assert proto.read_imm(imm) == (landing, parity, sig & 0xFFFF)
    assert proto.imm_program(imm) == min(program, 127)
    assert proto.read_imm(proto.step_imm(landing, parity, sig)) == proto.read_imm(imm)


def test_every_program_is_named_by_its_kind_and_a_mismatch_names_both() -> None:
    """A step WRITE carries its program's number, so an executor that gets one from another
    program names both kinds (the executors word it with ``step_mismatch``), as do two
    WRITEs of different programs into one landing in one call (``step_clash``)."""
    names = {proto.allreduce_program(0, 3).name, proto.barrier_program(0, 3).name,
             proto.allgather_program(0, 3).name, proto.alltoall_program(0, 3).name,
             proto.reduce_scatter_program(0, 3).name, proto.broadcast_program(0, 3, 1).name,
             proto.allreduce_program(0, 2).name, proto.broadcast_program(1, 2, 0).name}
    assert names == {"allreduce", "barrier", "allgather", "alltoall", "reduce_scatter",
                     "broadcast"}
    text = proto.step_mismatch(2, 1, "allgather", 0x1234, "barrier", 0xBEEF)
    assert "rank 2" in text and "allgather" in text and "barrier" in text
    assert "0x1234" in text and "0xbeef" in text
    text = proto.step_clash(0, (2, "allreduce", 0x1234), (0, "barrier", 0xBEEF))
    assert "rank 2" in text and "rank 0" in text and "allreduce" in text and "barrier" in text
    assert "0x1234" in text and "0xbeef" in text and "landing 0" in text


@pytest.mark.parametrize("landing, parity, program", [(256, 0, 0), (-1, 0, 0), (0, 2, 0),
                                                      (0, 0, -1)])
def test_an_immediate_value_out_of_range_is_refused(landing: int, parity: int,
                                                    program: int) -> None:
    with pytest.raises(LocalProtocolError):
        proto.step_imm(landing, parity, 0, program)


_KINDS = {"allreduce": proto.allreduce_program, "barrier": proto.barrier_program,
          "allgather": proto.allgather_program, "alltoall": proto.alltoall_program,
          "reduce_scatter": proto.reduce_scatter_program,
          **{f"broadcast{k}": (lambda k: lambda r, w: proto.broadcast_program(r, w, k % w))(k)
             for k in range(3)}}


@given(world=st.integers(1, 16), kinds=st.lists(st.sampled_from(sorted(_KINDS)), min_size=1,
                                                max_size=6),
       seed=st.integers(0, 2**32 - 1))
def test_programs_mixed_call_after_call_give_each_its_result(world: int, kinds: list[str],
                                                             seed: int) -> None:
    """Allreduces, barriers, allgathers, broadcasts (from roots 0-2), alltoalls and
    reduce-scatters in any order over one landing space (as one executor runs them), in any
    interleaving: each call gives every rank its result (the sum; every rank's input in rank
    order; the root's input; block ``r`` of every rank's input; the sum of those; nothing),
    no landing is overwritten before it is consumed, and no rank ends a call before every
    rank has started it (what makes a barrier a barrier, and what lets the next call reuse
    the landings)."""
    rnd = random.Random(seed)
    plan = [[_KINDS[k](r, world) for r in range(world)] for k in kinds]
    log: list[tuple[str, int, int]] = []
    # Rank r's input: world numbers, its blocks (a program of no blocks takes the tuple)
    inputs = [tuple(1000 * r + i for i in range(world)) for r in range(world)]

    def add(a: object, b: object) -> object:
        if isinstance(a, tuple) and isinstance(b, tuple):
            return tuple(x + y for x, y in zip(a, b, strict=True))
        return a + b  # type: ignore[operator]

    results = proto.simulate(plan, inputs, add, choose=rnd.choice, log=log)
    for c, kind in enumerate(kinds):
        for r in range(world):
            got = results[r][c]
            if kind == "allreduce":
                assert got == (tuple(sum(x[i] for x in inputs) for i in range(world)),)
            elif kind == "allgather":
                assert got == tuple(inputs)
            elif kind.startswith("broadcast"):
                assert got == (inputs[int(kind[-1]) % world],), (kind, r)
            elif kind == "alltoall":
                assert got == tuple(inputs[q][r] for q in range(world))
            elif kind == "reduce_scatter":
                assert got == (sum(inputs[q][r] for q in range(world)),)
            else:
                assert got == ()
        started = [i for i, e in enumerate(log) if e[0] == "start" and e[2] == c]
        ended = [i for i, e in enumerate(log) if e[0] == "end" and e[2] == c]
        assert len(started) == len(ended) == world
        assert max(started) < min(ended), f"a rank ended call {c} ({kind}) before all began"


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 13])
def test_a_barrier_takes_ceil_log2_rounds_and_an_allgather_one(world: int) -> None:
    rounds = (world - 1).bit_length()
    for r in range(world):
        barrier = proto.barrier_program(r, world)
        assert sum(s[0] == proto.PUT for s in barrier.steps) == rounds
        assert barrier.sized and barrier.results == ()
        gather = proto.allgather_program(r, world)
        assert not gather.sized
        assert gather.peers == tuple(p for p in range(world) if p != r)
        assert [s[0] for s in gather.steps] == [proto.PUT] * (world - 1) + [proto.WAIT] * (
            world - 1)


def test_a_program_that_ends_before_the_others_begin_is_caught() -> None:
    """The log's check can fail: a rank that only writes ends before its partner begins."""
    writer = proto.Program(((proto.PUT, 1, 0, 0),), 1, 1, ())
    reader = proto.Program(((proto.WAIT, 0, 0),), 1, 1, ())
    log: list[tuple[str, int, int]] = []
    proto.simulate([writer, reader], [0, 0], lambda a, b: a, log=log)
    assert log[:2] == [("start", 0, 0), ("end", 0, 0)]


@given(description=st.recursive(st.none() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8),
                                lambda inner: st.lists(inner, max_size=4), max_leaves=20),
       data=st.binary(max_size=64))
def test_an_allgather_block_description_round_trips(description: object, data: bytes) -> None:
    tail = proto.block_tail(["<f4", description])
    if len(tail) == 2 and tail == proto.block_tail(None):
        assert proto.split_block(data[:0] + tail) is None
        return
    assert proto.split_block(data + tail) == (len(data), ["<f4", description])


def test_an_oversize_mark_and_a_long_description_are_marks() -> None:
    assert proto.split_block(proto.block_tail(None)) is None
    assert proto.block_tail(["<f4", list(range(1000))]) == proto.block_tail(None)


@pytest.mark.parametrize("block", [b"", b"\x01", b"abc\x09\x00", b"\x01\x00\x00",
                                   b"\xc1\x01\x00"])
def test_a_malformed_allgather_block_is_a_remote_protocol_error(block: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        proto.split_block(block)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 8, 11])
def test_a_broadcast_uses_the_allreduces_partners_and_writes_the_block_once_per_rank(
        world: int) -> None:
    """A broadcast needs no queue pair the allreduce has not, and the block travels once to
    each rank (the other writes are empty), from any root."""
    for root in range(world):
        blocks = 0
        for r in range(world):
            prog = proto.broadcast_program(r, world, root)
            assert set(prog.peers) <= set(proto.allreduce_program(r, world).peers)
            blocks += sum(s[0] in (proto.PUT, proto.FWD) for s in prog.steps)
        assert blocks == world - 1, (root, blocks)


@given(world=st.integers(1, 16), seed=st.integers(0, 2**32 - 1))
def test_a_reduce_scatter_reduces_in_the_links_order(world: int, seed: int) -> None:
    """Rank ``r``'s block is reduced as the links' direct reduce-scatter does it (its own
    first, then rank ``r - 1``'s, ``r - 2``'s, ...): with a non-commutative op, float results
    on the engine are the links' bit for bit."""
    rnd = random.Random(seed)
    inputs = [tuple(f"<{q}.{p}>" for p in range(world)) for q in range(world)]
    programs = [proto.reduce_scatter_program(r, world) for r in range(world)]
    results = proto.simulate(programs, inputs, lambda a, b: f"({a}{b})", 2, choose=rnd.choice)
    for r in range(world):
        expected = inputs[r][r]
        for _, frm in proto.pairwise(r, world):
            expected = f"({expected}{inputs[frm][r]})"
        assert results[r] == [(expected,), (expected,)]


@pytest.mark.parametrize("world", [2, 3, 5, 8, 16])
def test_an_alltoall_and_a_reduce_scatter_stage_a_block_per_rank(world: int) -> None:
    """Both take their input as one block per rank (``blocks``), write each other rank once,
    to the landing of the writer's rank (the allgather's landings: no new landing space)."""
    for r in range(world):
        gather = proto.allgather_program(r, world)
        for prog in (proto.alltoall_program(r, world), proto.reduce_scatter_program(r, world)):
            assert prog.blocks == world and prog.sized
            assert prog.peers == gather.peers
            assert prog.landings == gather.landings
            puts = [s for s in prog.steps if s[0] == proto.PUT]
            assert sorted(s[1] for s in puts) == list(prog.peers)
            assert all(s[2] == s[1] and s[3] == r for s in puts)
