"""The pool's policies, sans-I/O (aiordma.protocols.rpc_pool): the least-outstanding pick, the
pick by key (rendezvous hashing: stable, minimal movement when a replica leaves or joins,
spread), the backoff schedule, the retry budget and a replica's life table. Hypothesis, no
clock, no device."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from aiordma.protocols.errors import LocalProtocolError
from aiordma.protocols.rpc_pool import (
    EVENTS,
    TRANSITIONS,
    Backoff,
    ReplicaLife,
    ReplicaState,
    RetryBudget,
    affinity_key,
    least_outstanding,
    rendezvous,
    rendezvous_order,
    rendezvous_weight,
)

LOADS = st.lists(st.one_of(st.none(), st.integers(0, 64)), max_size=12)


# -- the pick ---------------------------------------------------------------------------------

@given(loads=LOADS, start=st.integers(0, 100))
def test_the_pick_is_a_least_loaded_candidate(loads: list[int | None], start: int) -> None:
    i = least_outstanding(loads, start)
    candidates = [x for x in loads if x is not None]
    if not candidates:
        assert i is None
        return
    assert i is not None and loads[i] == min(candidates)


@given(loads=LOADS, start=st.integers(0, 100))
def test_ties_go_to_the_first_candidate_from_start(loads: list[int | None], start: int) -> None:
    i = least_outstanding(loads, start)
    if i is None:
        return
    n = len(loads)
    before = [(start + k) % n for k in range((i - start) % n)]  # visited before i
    assert all(loads[j] is None or loads[j] > loads[i] for j in before)  # type: ignore[operator]


@given(n=st.integers(1, 12), rounds=st.integers(1, 5),
       unusable=st.sets(st.integers(0, 11), max_size=11))
def test_equal_loads_are_served_round_robin(n: int, rounds: int, unusable: set[int]) -> None:
    """Calls one at a time (every load 0), the start advanced past each pick as the pool does:
    each usable replica gets the same number of calls, in turn."""
    loads: list[int | None] = [None if i in unusable else 0 for i in range(n)]
    usable = [i for i in range(n) if loads[i] is not None]
    nxt, picks = 0, []
    for _ in range(rounds * len(usable)):
        i = least_outstanding(loads, nxt)
        assert i is not None
        picks.append(i)
        nxt = i + 1
    assert picks == usable * rounds


# -- the pick by key --------------------------------------------------------------------------

NAMES = st.lists(st.one_of(
    st.builds(lambda a, b, p: f"10.{a}.{b}.1:{p}", st.integers(0, 255), st.integers(0, 255),
              st.integers(1, 65535)),
    st.text(min_size=1, max_size=30)), min_size=1, max_size=12, unique=True)
KEYS = st.lists(st.binary(max_size=24), min_size=1, max_size=40)


@given(names=NAMES, keys=KEYS, data=st.data())
def test_a_key_goes_to_the_same_replica_whatever_the_order(names: list[str], keys: list[bytes],
                                                          data: st.DataObject) -> None:
    shuffled = data.draw(st.permutations(names))
    for key in keys:
        a, b = rendezvous(key, names), rendezvous(key, shuffled)
        assert a is not None and b is not None
        assert names[a] == shuffled[b]
        assert rendezvous(key, names) == a  # (a function of its inputs: no state)


@given(names=NAMES, keys=KEYS, data=st.data())
def test_when_a_replica_leaves_only_its_keys_move(names: list[str], keys: list[bytes],
                                                  data: st.DataObject) -> None:
    """Removing one replica (here: making it no candidate, as a replica that is not UP is)
    moves exactly the keys it had, each to its second choice; every other key stays."""
    gone = data.draw(st.sampled_from(names))
    left: list[str | None] = [None if n == gone else n for n in names]
    for key in keys:
        before = names[rendezvous(key, names)]  # type: ignore[index]
        after = rendezvous(key, left)
        if len(names) == 1:
            assert after is None
            continue
        assert after is not None
        order = [names[i] for i in rendezvous_order(key, names)]
        if before == gone:
            assert names[after] == order[1]
        else:
            assert names[after] == before


@given(names=NAMES, keys=KEYS, new=st.text(min_size=1, max_size=30))
def test_when_a_replica_joins_keys_move_only_to_it(names: list[str], keys: list[bytes],
                                                   new: str) -> None:
    if new in names:
        return
    joined = [*names, new]
    for key in keys:
        before = names[rendezvous(key, names)]  # type: ignore[index]
        after = joined[rendezvous(key, joined)]  # type: ignore[index]
        assert after in (before, new)


@given(n=st.integers(2, 8), salt=st.binary(max_size=8))
def test_keys_spread_evenly_over_the_replicas(n: int, salt: bytes) -> None:
    """4,000 keys over n replicas: each gets its share within 40% (the binomial's standard
    deviation is under 3% of a share here: a failure means a skewed hash, not bad luck)."""
    names = [f"10.0.{i}.1:7000" for i in range(n)]
    counts = [0] * n
    keys = 4000
    for k in range(keys):
        counts[rendezvous(salt + f"user-{k}".encode(), names)] += 1  # type: ignore[index]
    share = keys / n
    assert all(0.6 * share <= c <= 1.4 * share for c in counts), counts


@given(names=NAMES, key=st.binary(max_size=24), data=st.data())
def test_the_pick_among_candidates_is_the_first_of_the_keys_order(
        names: list[str], key: bytes, data: st.DataObject) -> None:
    out = data.draw(st.sets(st.sampled_from(names)))
    candidates: list[str | None] = [None if n in out else n for n in names]
    first = next((i for i in rendezvous_order(key, names) if names[i] not in out), None)
    assert rendezvous(key, candidates) == first
    assert sorted(rendezvous_order(key, names)) == list(range(len(names)))
    w = rendezvous_weight(key, names[0])
    assert 0 <= w < 2 ** 64 and w == rendezvous_weight(key, names[0])


def test_affinity_keys_are_str_bytes_or_int() -> None:
    assert affinity_key("user-1") == b"user-1" == affinity_key(b"user-1")
    assert affinity_key(bytearray(b"ab")) == b"ab" == affinity_key(memoryview(b"ab"))
    assert affinity_key(42) == affinity_key("42") == b"42"
    assert affinity_key("é") == "é".encode()
    for bad in (None, 1.5, True, ("a",), "\ud800"):
        with pytest.raises(LocalProtocolError):
            affinity_key(bad)
    assert rendezvous(b"k", []) is None and rendezvous(b"k", [None, None]) is None


# -- the backoff ------------------------------------------------------------------------------

BACKOFFS = st.builds(
    lambda base, factor, extra: Backoff(base=base, factor=factor, cap=base * extra),
    base=st.floats(1e-3, 10.0), factor=st.floats(1.0, 4.0), extra=st.floats(1.0, 1000.0))


@given(b=BACKOFFS, attempt=st.integers(0, 10_000), rand=st.floats(0.0, 1.0, exclude_max=True))
@example(b=Backoff(), attempt=10**6, rand=0.999)  # no overflow for a replica down for long
def test_a_delay_is_jittered_within_its_capped_envelope(b: Backoff, attempt: int,
                                                         rand: float) -> None:
    env = b.envelope(attempt)
    assert b.base <= env <= b.cap or math.isclose(env, b.cap)
    assert env / 2 <= b.delay(attempt, rand) <= env
    if attempt:
        assert b.envelope(attempt - 1) <= env  # never shrinks as failures go on


@given(b=BACKOFFS)
def test_the_envelope_grows_by_the_factor_until_the_cap(b: Backoff) -> None:
    assert b.envelope(0) == b.base
    for k in range(1, 40):
        want = min(b.cap, b.base * b.factor ** k)
        assert math.isclose(b.envelope(k), want, rel_tol=1e-9)


def test_the_default_schedule() -> None:
    """0.1 s doubling to 5 s: reconnects after about 0.05-0.1, 0.1-0.2, ..., then 2.5-5 s."""
    b = Backoff()
    assert [b.envelope(k) for k in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert b.delay(0, 0.0) == 0.05 and b.delay(7, 0.999999) <= 5.0


@pytest.mark.parametrize("kw", [{"base": 0}, {"base": -1.0}, {"cap": math.inf},
                                {"factor": 0.5}, {"base": 2.0, "cap": 1.0},
                                {"base": True}, {"factor": math.nan}, {"cap": "5"}])
def test_bad_backoffs_are_refused_typed(kw: dict[str, Any]) -> None:
    with pytest.raises(LocalProtocolError):
        Backoff(**kw)


# -- the retry budget -------------------------------------------------------------------------

@given(ratio=st.floats(0.0, 1.0), burst=st.floats(0.0, 100.0),
       steps=st.lists(st.booleans(), max_size=400))
def test_retries_stay_within_the_budget(ratio: float, burst: float, steps: list[bool]) -> None:
    """Any sequence of calls (True) and retry requests (False): retries granted never exceed
    burst + ratio * calls, the bucket stays within [0, burst], and every request is either
    granted or counted as refused."""
    b = RetryBudget(ratio, burst)
    asked = 0
    for is_call in steps:
        if is_call:
            b.on_call()
        else:
            asked += 1
            b.try_retry()
        assert b.retries <= burst + ratio * b.calls + 1e-9
        assert -1e-9 <= b.tokens <= burst + 1e-9
    assert b.retries + b.refused == asked


@given(calls=st.integers(0, 2000))
def test_a_failing_replica_gets_at_most_a_fifth_of_calls_retried(calls: int) -> None:
    """The default budget (20 %, burst 20) when every call fails and asks for a retry."""
    b = RetryBudget()
    for _ in range(calls):
        b.on_call()
        b.try_retry()
    assert b.retries <= 20 + 0.2 * calls
    if calls >= 200:
        assert b.retries >= 0.2 * calls - 1  # and it does not starve: the share is granted


@pytest.mark.parametrize(("ratio", "burst"), [(-0.1, 1), (1.5, 1), (math.nan, 1), (0.2, -1),
                                              (0.2, math.inf), (True, 1), ("0.2", 1)])
def test_bad_budgets_are_refused_typed(ratio: Any, burst: Any) -> None:
    with pytest.raises(LocalProtocolError):
        RetryBudget(ratio, burst)


# -- a replica's life -------------------------------------------------------------------------

def test_every_state_and_event_is_either_in_the_table_or_refused() -> None:
    for state in ReplicaState:
        for event in EVENTS:
            life = ReplicaLife()
            life.state = state
            if (state, event) in TRANSITIONS:
                assert life.handle(event) is TRANSITIONS[(state, event)]
            else:
                with pytest.raises(LocalProtocolError):
                    life.handle(event)
                assert life.state is state  # a refused event changes nothing


def test_a_replica_that_breaks_and_comes_back() -> None:
    life = ReplicaLife()
    for event in ("connect_failed", "backoff_done", "connected", "broken", "backoff_done",
                  "connect_failed", "backoff_done", "connected", "health_failed"):
        life.handle(event)
    assert life.state is ReplicaState.EJECTED
    assert (life.ejections, life.reconnects, life.connect_failures) == (2, 1, 2)
    assert life.attempt == 0  # ejected from UP: the next backoff starts from the base


class ReplicaLifeMachine(RuleBasedStateMachine):
    """Random events against a model: counters as the model counts them, CLOSED for good,
    the backoff exponent the failures since the replica was last UP."""

    def __init__(self) -> None:
        super().__init__()
        self.life = ReplicaLife()
        self.state = ReplicaState.CONNECTING
        self.ejections = self.reconnects = self.failures = self.attempt = 0
        self.was_up = False

    @rule(event=st.sampled_from(EVENTS))
    def handle(self, event: str) -> None:
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            with pytest.raises(LocalProtocolError):
                self.life.handle(event)
            return
        assert self.life.handle(event) is nxt
        if nxt is not self.state:
            if nxt is ReplicaState.UP:
                self.reconnects += self.was_up
                self.was_up, self.attempt = True, 0
            elif nxt is ReplicaState.EJECTED and self.state is ReplicaState.UP:
                self.ejections += 1
            elif nxt is ReplicaState.EJECTED:
                self.failures += 1
                self.attempt += 1
        self.state = nxt

    @invariant()
    def agrees(self) -> None:
        life = self.life
        assert life.state is self.state
        assert (life.ejections, life.reconnects, life.connect_failures, life.attempt) == (
            self.ejections, self.reconnects, self.failures, self.attempt)
        assert life.reconnects <= life.ejections + life.connect_failures

    @invariant()
    def closed_is_for_good(self) -> None:
        if self.state is ReplicaState.CLOSED:
            for event in EVENTS:
                if event != "close":
                    with pytest.raises(LocalProtocolError):
                        self.life.handle(event)


TestReplicaLife = ReplicaLifeMachine.TestCase
