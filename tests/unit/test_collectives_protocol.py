"""aiordma.protocols.collectives without a device: messages round-trip and garbage is refused with a
typed error; chunks and pieces partition exactly; the ring schedules, simulated with numpy,
compute an allreduce and an allgather; recursive doubling, the binomial tree and the
dissemination barrier, simulated for every world size 1-16, reduce (to bit-identical results on
every rank), reach every rank and synchronise everyone; the rendezvous roster refuses bad
joins."""

from __future__ import annotations

import functools
import itertools

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
SMALL = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                     | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4),
                     max_leaves=8)
TAG = {"group": U64, "channel": U32, "call": U64, "op": st.integers(0, len(proto.KINDS) - 1)}
EVENTS = st.one_of(
    st.builds(proto.Hello, version=U32, token=U64, rank=U32, world=U32),
    st.builds(proto.Slots, descriptor=st.tuples(U64, U32, U64, st.integers(0, 7)), count=U32,
              size=U32),
    st.builds(proto.Credit, count=st.integers(1, 2**32)),
    st.builds(proto.Piece, **TAG, step=U32, slot=U32, offset=U64, nbytes=U64, signature=U32),
    st.builds(proto.Value, **TAG, step=U32, origin=U32, value=SMALL),
    st.builds(proto.Inline, **TAG, step=U32, offset=U64, signature=U32,
              data=st.binary(max_size=64)),
    st.builds(proto.Fault, reason=st.text(max_size=100)),
)


@given(EVENTS)
def test_every_event_round_trips(ev: proto.Event) -> None:
    assert proto.decode(proto.encode(ev)) == ev


@given(tag=st.builds(proto.Tag, **TAG), step=U32, offset=U64, signature=U32,
       data=st.binary(max_size=64))
def test_an_inline_piece_encoded_without_its_event_is_the_same_message(
        tag: proto.Tag, step: int, offset: int, signature: int, data: bytes) -> None:
    ev = proto.Inline(group=tag.group, channel=tag.channel, call=tag.call, op=tag.op, step=step,
                      offset=offset, signature=signature, data=data)
    assert proto.encode_inline(tag, step, offset, signature, data) == proto.encode(ev)


def test_an_inline_piece_encoded_without_its_event_refuses_as_encode_does() -> None:
    tag = proto.Tag(0, 0, 1, 1)
    with pytest.raises(LocalProtocolError, match="exceeds"):
        proto.encode_inline(tag, 0, 0, 0, b"x" * (1 << 20))
    with pytest.raises(LocalProtocolError, match="cannot encode Inline"):
        proto.encode_inline(tag, 0, 0, 0, object())  # type: ignore[arg-type]


@given(st.binary(max_size=64))
def test_garbage_is_a_remote_protocol_error_or_an_event(data: bytes) -> None:
    try:
        ev = proto.decode(data)
    except RemoteProtocolError:
        return
    assert isinstance(ev, proto.Event)


@pytest.mark.parametrize("obj", [
    [], [0], [99, 1], [True, 1], [3], [3, 0], [3, -1], [3, 1, 2], [4, 1, 2, 3, 4, 5, "x"],
    [2, [1, 2, 3], 1, 1], [2, [1, 2, 3, -4], 1, 1], [1, 1, 1, 1, 1.5], {"kind": 3},
    [6, 1, 0, 0, 1, "text, not bytes"], [6, 1, 0, 0, 1], [6, 1, 0, -1, 1, b""],
    [6, 0, 0, 1, 4, 0, 0, 0, "text, not bytes"], [6, 0, 0, 1, 99, 0, 0, 0, b""],
    [5, 0, 0, 1, 4, 0, 0], [4, 0, 0, 1, 4, 0, 0, 0, 8, -1], [7], [7, 3], [7, "x" * 2001],
])
def test_malformed_messages_are_refused(obj: object) -> None:
    with pytest.raises(RemoteProtocolError):
        proto.decode(msgpack.packb(obj))


def test_oversized_messages_are_refused_both_ways() -> None:
    tag = {"group": 0, "channel": 0, "call": 1, "op": 1}
    with pytest.raises(LocalProtocolError):
        proto.encode(proto.Value(**tag, step=0, origin=0, value="x" * (1 << 20)))
    with pytest.raises(RemoteProtocolError):
        proto.decode(b"\x00" * ((1 << 20) + 1))
    with pytest.raises(LocalProtocolError):
        proto.encode(proto.Value(**tag, step=0, origin=0, value=object()))
    with pytest.raises(LocalProtocolError):
        proto.encode(proto.Fault(reason="x" * 2001))


def test_signatures_tell_collectives_apart() -> None:
    sigs = {proto.signature("allreduce", op, dt, n) for op in ("sum", "max") for dt in
            ("<i4", "<f4") for n in (10, 11)}
    assert len(sigs) == 8
    assert proto.signature("a", 1) == proto.signature("a", 1)


@given(count=st.integers(0, 10_000), parts=st.integers(1, 64))
def test_chunks_partition_the_range_evenly(count: int, parts: int) -> None:
    chunks = proto.chunk_bounds(count, parts)
    assert len(chunks) == parts and chunks[0][0] == 0 and chunks[-1][1] == count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    sizes = [b - a for a, b in chunks]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1


@given(start=st.integers(0, 1000), length=st.integers(0, 5000), step=st.integers(1, 700))
def test_pieces_cover_a_range_in_order(start: int, length: int, step: int) -> None:
    pieces = list(proto.piece_bounds(start, start + length, step))
    assert sum(b - a for a, b in pieces) == length
    assert all(0 < b - a <= step for a, b in pieces)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    if pieces:
        assert pieces[0][0] == start and pieces[-1][1] == start + length


def test_bad_partition_arguments() -> None:
    with pytest.raises(ValueError):
        proto.chunk_bounds(-1, 2)
    with pytest.raises(ValueError):
        proto.chunk_bounds(3, 0)
    with pytest.raises(ValueError):
        list(proto.piece_bounds(0, 3, 0))


def simulate_allreduce(inputs: list[np.ndarray], ufunc: np.ufunc) -> list[np.ndarray]:
    """The ring of ``allreduce_schedule`` played step by step: at each step every rank sends
    its chunk, then every rank combines what its left neighbour sent."""
    world = len(inputs)
    work = [a.copy() for a in inputs]
    chunks = proto.chunk_bounds(inputs[0].size, world)
    schedules = [proto.allreduce_schedule(r, world) for r in range(world)]
    for t in range(2 * (world - 1)):
        sent = [work[r][slice(*chunks[schedules[r][t][0]])].copy() for r in range(world)]
        for r in range(world):
            _, recv, reduce = schedules[r][t]
            left = (r - 1) % world
            assert schedules[left][t][0] == recv  # the left neighbour sends what r expects
            sl = slice(*chunks[recv])
            work[r][sl] = ufunc(work[r][sl], sent[left]) if reduce else sent[left]
    return work


@given(world=st.integers(1, 7), size=st.integers(0, 40),
       op=st.sampled_from([np.add, np.maximum, np.minimum, np.multiply]),
       seed=st.integers(0, 2**32 - 1))
def test_the_allreduce_schedule_reduces(world: int, size: int, op: np.ufunc, seed: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-3, 4, size).astype(np.int64) for _ in range(world)]
    want = functools.reduce(op, inputs)
    for got in simulate_allreduce(inputs, op):
        np.testing.assert_array_equal(got, want)


def simulate_ring(inputs: list[np.ndarray], ufunc: np.ufunc,
                  schedule: object) -> list[np.ndarray]:
    """A ring schedule of ``(send, recv, reduce)`` steps played for every rank at once."""
    world = len(inputs)
    work = [a.copy() for a in inputs]
    chunks = proto.chunk_bounds(inputs[0].size, world)
    plans = [schedule(r, world) for r in range(world)]  # type: ignore[operator]
    for t in range(len(plans[0])):
        sent = [work[r][slice(*chunks[plans[r][t][0]])].copy() for r in range(world)]
        for r in range(world):
            _, recv, reduce = plans[r][t]
            left = (r - 1) % world
            assert plans[left][t][0] == recv  # the left neighbour sends what r expects
            if t:  # a rank forwards what it received at the step before
                assert plans[r][t][0] == plans[r][t - 1][1]
            sl = slice(*chunks[recv])
            work[r][sl] = ufunc(work[r][sl], sent[left]) if reduce else sent[left]
    return work


@given(world=st.integers(1, 7), blocks=st.integers(0, 6),
       op=st.sampled_from([np.add, np.maximum, np.minimum, np.multiply, np.bitwise_xor]),
       seed=st.integers(0, 2**32 - 1))
def test_the_reduce_scatter_schedule_leaves_each_rank_its_own_chunk(
        world: int, blocks: int, op: np.ufunc, seed: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-3, 4, blocks * world).astype(np.int64) for _ in range(world)]
    want = functools.reduce(op, inputs)
    chunks = proto.chunk_bounds(blocks * world, world)
    got = simulate_ring(inputs, op, proto.reduce_scatter_schedule)
    for r in range(world):
        np.testing.assert_array_equal(got[r][slice(*chunks[r])], want[slice(*chunks[r])])
    assert len(proto.reduce_scatter_schedule(0, world)) == world - 1


@given(world=st.integers(1, 7), size=st.integers(0, 40), seed=st.integers(0, 2**32 - 1))
def test_the_ring_player_agrees_with_the_allreduce_simulation(world: int, size: int,
                                                              seed: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-3, 4, size).astype(np.int64) for _ in range(world)]
    got = simulate_ring(inputs, np.add, proto.allreduce_schedule)
    for g, h in zip(got, simulate_allreduce(inputs, np.add), strict=True):
        np.testing.assert_array_equal(g, h)


@given(world=st.integers(1, 16))
def test_pairwise_steps_are_permutations(world: int) -> None:
    plans = [proto.pairwise(r, world) for r in range(world)]
    for i in range(world - 1):
        sends = [plans[r][i][0] for r in range(world)]
        assert sorted(sends) == list(range(world))  # each rank receives once per step
        for r in range(world):
            to, frm = plans[r][i]
            assert to != r and plans[to][i][1] == r and plans[frm][i][0] == r
    for r in range(world):  # every other rank once each way
        assert sorted(t for t, _ in plans[r]) == sorted(set(range(world)) - {r})


@given(world=st.integers(1, 16), root=st.integers(0, 15), seed=st.integers(0, 2**32 - 1))
def test_the_binomial_tree_run_backwards_reduces_to_the_root(world: int, root: int,
                                                             seed: int) -> None:
    """Reduce as _rounds.reduce plays it: a rank combines its children's results, the
    smallest subtree first, then hands its own to its parent."""
    root %= world
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-3, 4, 5).astype(np.int64) for _ in range(world)]
    trees = [proto.binomial_tree(r, world, root) for r in range(world)]

    def result(r: int) -> np.ndarray:
        acc = inputs[r].copy()
        for child in reversed(trees[r][1]):
            assert trees[child][0] == r
            acc = acc + result(child)
        return acc

    np.testing.assert_array_equal(result(root), functools.reduce(np.add, inputs))


@given(world=st.integers(1, 7))
def test_the_allgather_schedule_delivers_every_block_once(world: int) -> None:
    have = [{r} for r in range(world)]
    for t in range(world - 1):
        sent = [proto.allgather_schedule(r, world)[t][0] for r in range(world)]
        for r in range(world):
            assert sent[r] in have[r]  # a rank only forwards what it has
        for r in range(world):
            recv = proto.allgather_schedule(r, world)[t][1]
            assert recv == sent[(r - 1) % world] and recv not in have[r]
            have[r].add(recv)
    assert all(h == set(range(world)) for h in have)


WORLDS = st.integers(1, 16)


def simulate_recursive_doubling(leaves: list[object], combine) -> list[object]:  # type: ignore[no-untyped-def]
    """Every rank's plan played round by round, checking that partners agree on each other."""
    world = len(leaves)
    plans = [proto.recursive_doubling(r, world) for r in range(world)]
    val = list(leaves)
    for r, p in enumerate(plans):  # fold: the odd rank combines its even neighbour's data
        if p.fold_to is not None:
            assert plans[p.fold_to].fold_from == r and not p.rounds
    for r, p in enumerate(plans):
        if p.fold_from is not None:
            val[r] = combine(leaves[p.fold_from], leaves[r])
    active = [r for r, p in enumerate(plans) if p.fold_to is None]
    rounds = {len(plans[r].rounds) for r in active}
    assert len(rounds) == 1  # everyone in the rounds runs the same number
    for k in range(rounds.pop()):
        before = list(val)
        for r in active:
            partner, lower = plans[r].rounds[k]
            assert plans[partner].rounds[k] == (r, not lower)  # both see the same pair
            val[r] = (combine(before[partner], before[r]) if lower
                      else combine(before[r], before[partner]))
    for r, p in enumerate(plans):
        if p.fold_to is not None:
            val[r] = val[p.fold_to]
    return val


@given(world=WORLDS)
def test_recursive_doubling_computes_one_expression_over_every_rank(world: int) -> None:
    got = simulate_recursive_doubling(list(range(world)), lambda a, b: (a, b))
    assert all(g == got[0] for g in got)  # the same expression, so bit-identical results

    def leaves(e: object) -> list[object]:
        return leaves(e[0]) + leaves(e[1]) if isinstance(e, tuple) else [e]

    assert sorted(leaves(got[0])) == list(range(world))  # every rank's data exactly once
    rounds = max(len(proto.recursive_doubling(r, world).rounds) for r in range(world))
    assert rounds == world.bit_length() - 1  # log2 of the largest power of two in world


@given(world=WORLDS, size=st.integers(0, 40),
       op=st.sampled_from([np.add, np.maximum, np.minimum, np.multiply]),
       seed=st.integers(0, 2**32 - 1))
def test_recursive_doubling_reduces_floats_to_identical_bits(world: int, size: int,
                                                             op: np.ufunc, seed: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(size) for _ in range(world)]
    got = simulate_recursive_doubling(inputs, op)
    for g in got:
        assert g.tobytes() == got[0].tobytes()
    np.testing.assert_allclose(got[0], functools.reduce(op, inputs), rtol=1e-12, atol=1e-12)


@given(world=WORLDS, root=st.integers(0, 15))
def test_the_binomial_tree_reaches_every_rank_once_in_log_rounds(world: int, root: int) -> None:
    root %= world
    trees = [proto.binomial_tree(r, world, root) for r in range(world)]
    assert trees[root][0] is None
    for r, (parent, _) in enumerate(trees):
        if r != root:
            assert parent is not None and trees[parent][1].count(r) == 1
    # play it: a rank that has the data sends to its children one per round, in order
    arrival = {root: 0}
    frontier = [root]
    while frontier:
        nxt = []
        for r in frontier:
            for i, child in enumerate(trees[r][1]):
                assert child not in arrival
                arrival[child] = arrival[r] + 1 + i
                nxt.append(child)
        frontier = nxt
    assert sorted(arrival) == list(range(world))
    assert max(arrival.values()) == (world - 1).bit_length()  # ceil(log2 world) rounds


@given(world=WORLDS)
def test_the_dissemination_barrier_hears_from_everyone(world: int) -> None:
    plans = [proto.dissemination_schedule(r, world) for r in range(world)]
    heard = [{r} for r in range(world)]
    for k in range(len(plans[0])):
        before = [set(h) for h in heard]
        for r in range(world):
            to, frm = plans[r][k]
            assert plans[frm][k][0] == r and plans[to][k][1] == r
            heard[r] |= before[frm]
    assert all(h == set(range(world)) for h in heard)
    assert len(plans[0]) == (world - 1).bit_length()


def test_the_choice_of_algorithm_follows_size_and_world() -> None:
    t = proto.Thresholds(allreduce=100, broadcast=200, allgather=300)
    assert proto.choose("allreduce", 100, 4, t) == "recursive_doubling"
    assert proto.choose("allreduce", 101, 4, t) == "ring"
    assert proto.choose("allreduce", 10 << 20, 2, t) == "ring"  # measured: no slower at 2
    assert proto.choose("broadcast", 10 << 20, 2, t) == "binomial"  # the same, for 2 ranks
    assert proto.choose("broadcast", 201, 4, t) == "chain"
    assert proto.choose("broadcast", 200, 4, t) == "binomial"
    assert proto.choose("allgather", 301, 3, t) == "ring"
    assert proto.choose("allgather", 300, 3, t) == "direct"
    t = proto.Thresholds(reduce_scatter=100, reduce=200)
    assert proto.choose("reduce_scatter", 100, 4, t) == "direct"
    assert proto.choose("reduce_scatter", 101, 4, t) == "ring"
    assert proto.choose("reduce_scatter", 10 << 20, 2, t) == "direct"  # the same at 2
    assert proto.choose("reduce", 200, 4, t) == "binomial"
    assert proto.choose("reduce", 201, 4, t) == "ring"
    assert proto.choose("reduce", 10 << 20, 2, t) == "binomial"
    assert proto.choose("alltoall", 10 << 20, 4, t) == "direct"
    with pytest.raises(LocalProtocolError):
        proto.choose("gather", 1, 2)


def test_large_collectives_over_rdma_links_are_written() -> None:
    """``"written"`` (every block straight into its place) is chosen only over one-sided links
    and from ``Thresholds.written`` bytes (1 MiB by default), for the four kinds it has; for
    allreduce from ``Thresholds.written_allreduce`` (256 KiB by default)."""
    t = proto.Thresholds(allreduce=100, allgather=100, reduce_scatter=100, written=1000,
                         written_allreduce=500)
    for kind in ("allreduce", "allgather", "alltoall", "reduce_scatter"):
        at = 500 if kind == "allreduce" else 1000
        default = (256 << 10) if kind == "allreduce" else (1 << 20)
        for world in (2, 3, 16):
            assert proto.choose(kind, at, world, t, one_sided=True) == "written"
            assert proto.choose(kind, at - 1, world, t, one_sided=True) != "written"
            assert proto.choose(kind, 10 << 20, world, t) != "written"  # TCP links
        assert proto.choose(kind, default, 4, one_sided=True) == "written"
        assert proto.choose(kind, default - 1, 4, one_sided=True) != "written"
    for kind in ("broadcast", "reduce"):
        assert proto.choose(kind, 10 << 20, 4, t, one_sided=True) in ("chain", "ring")
    with pytest.raises(LocalProtocolError):
        proto.recursive_doubling(3, 3)
    with pytest.raises(LocalProtocolError):
        proto.binomial_tree(0, 2, 2)


def test_the_roster_completes_in_rank_order() -> None:
    roster = proto.Roster(3)
    for r in (2, 0, 1):
        assert not roster.done
        roster.add(r, 3, f"10.0.0.{r}", 1000 + r)
    assert roster.complete and roster.done
    assert roster.addresses() == [("10.0.0.0", 1000), ("10.0.0.1", 1001), ("10.0.0.2", 1002)]


@pytest.mark.parametrize(("joins", "needle"), [
    ([(1, 3), (1, 3)], "joined twice"),
    ([(0, 3), (1, 4)], "world size of 4"),
    ([(5, 3)], "out of range"),
    ([("1", 3)], "malformed"),
    ([(True, 3)], "malformed"),
])
def test_the_roster_refuses_bad_joins_and_fails_for_everyone(joins: list[tuple[object, int]],
                                                             needle: str) -> None:
    roster = proto.Roster(3)
    with pytest.raises(proto.RendezvousRefused, match=needle):
        for rank, world in joins:
            roster.add(rank, world, "h", 1)
    assert roster.done and not roster.complete and needle in (roster.failure or "")
    with pytest.raises(proto.RendezvousRefused):  # later joins hear of it too
        roster.add(2, 3, "h", 1)
    with pytest.raises(LocalProtocolError):
        roster.addresses()


def test_a_complete_roster_refuses_more() -> None:
    roster = proto.Roster(1)
    roster.add(0, 1, "h", 1)
    with pytest.raises(proto.RendezvousRefused):
        roster.add(0, 1, "h", 2)
    with pytest.raises(LocalProtocolError):
        proto.Roster(0)


def test_member_lists_are_validated() -> None:
    assert proto.validate_members([["a", 1], ["b", 2]], 2) == [("a", 1), ("b", 2)]
    for bad in ([["a", 1]], [["a", 0], ["b", 2]], [["a", 1], ["b"]], None, [[1, 1], ["b", 2]]):
        with pytest.raises(RemoteProtocolError):
            proto.validate_members(bad, 2)  # type: ignore[arg-type]
