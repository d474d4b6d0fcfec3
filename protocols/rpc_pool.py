"""The policies of a client over replicas (``aiordma.rpc.connect_pool``), sans-I/O: which
replica takes a call (the least loaded, or by a key: :func:`rendezvous`), a replica's life (a
table), how long to wait before reconnecting, and how many calls may be sent again. No clock, no randomness, no I/O: the pool passes the time and
the random numbers in, so every rule here is tested with hypothesis on any machine
(``tests/unit/test_protocol_rpc_pool.py``).

A replica's states (:class:`ReplicaState`) and the events that move it (:data:`TRANSITIONS`)::

    CONNECTING --connected--> UP --broken / health_failed--> EJECTED
    CONNECTING --connect_failed--> EJECTED --backoff_done--> CONNECTING
    any state --close--> CLOSED

*connected* means the connection is made and the server answered the built-in health method
(so a replica takes calls only once it proved it serves, and the pool knows its idempotent
methods). An event missing from the table for a state is a :class:`LocalProtocolError` and
changes nothing, except the repeats that the pool's tasks may report concurrently (a call and
the health check both seeing one broken connection), which :data:`TRANSITIONS` lists as
staying put. Counters: an *ejection* is UP -> EJECTED; a *reconnect* is CONNECTING -> UP of a
replica that was UP before.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

from .errors import LocalProtocolError

__all__ = [
    "EVENTS",
    "TRANSITIONS",
    "Backoff",
    "ReplicaLife",
    "ReplicaState",
    "RetryBudget",
    "affinity_key",
    "least_outstanding",
    "rendezvous",
    "rendezvous_order",
    "rendezvous_weight",
]


class ReplicaState(Enum):
    """Where one replica is in its life (see the module's table)."""

    __hash__ = object.__hash__  # (identity, as protocols/_table.py's enums)

    CONNECTING = auto()  # a connection and its first health check under way
    UP = auto()  # takes calls
    EJECTED = auto()  # broken, failed its health check, or could not connect: waits to retry
    CLOSED = auto()  # the pool closed, or the resolver no longer names it


EVENTS = ("connected", "connect_failed", "broken", "health_failed", "backoff_done", "close")

_S = ReplicaState
TRANSITIONS: dict[tuple[ReplicaState, str], ReplicaState] = {
    (_S.CONNECTING, "connected"): _S.UP,
    (_S.CONNECTING, "connect_failed"): _S.EJECTED,
    (_S.UP, "broken"): _S.EJECTED,
    (_S.UP, "health_failed"): _S.EJECTED,
    # repeats: a call and the health check may both report one broken connection
    (_S.EJECTED, "broken"): _S.EJECTED,
    (_S.EJECTED, "health_failed"): _S.EJECTED,
    (_S.EJECTED, "backoff_done"): _S.CONNECTING,
    **{(s, "close"): _S.CLOSED for s in ReplicaState},
}
"""``(state, event) -> next state``; a pair missing is refused."""


class ReplicaLife:
    """One replica's state and counters, driven by :meth:`handle`.

    Attributes:
        state: the current :class:`ReplicaState`.
        ejections: times it left UP for EJECTED.
        reconnects: times it came back UP after having been UP before.
        connect_failures: attempts to connect (or pass the first health check) that failed.
        attempt: failed attempts since it was last UP: the exponent of its next backoff.
    """

    __slots__ = ("attempt", "connect_failures", "ejections", "reconnects", "state", "was_up")

    def __init__(self) -> None:
        self.state = ReplicaState.CONNECTING
        self.ejections = 0
        self.reconnects = 0
        self.connect_failures = 0
        self.attempt = 0
        self.was_up = False

    def handle(self, event: str) -> ReplicaState:
        """Apply ``event``; the new state.

        Raises:
            LocalProtocolError: ``event`` is not allowed in this state (nothing changes).
        """
        before = self.state
        try:
            after = TRANSITIONS[(before, event)]
        except KeyError:
            raise LocalProtocolError(f"a replica cannot take {event!r} in state "
                                     f"{before.name}") from None
        if before is after:
            return after
        if after is ReplicaState.UP:
            if self.was_up:
                self.reconnects += 1
            self.was_up = True
            self.attempt = 0
        elif after is ReplicaState.EJECTED:
            if before is ReplicaState.UP:
                self.ejections += 1
            else:
                self.connect_failures += 1
                self.attempt += 1
        self.state = after
        return after


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """Exponential backoff with jitter, capped: the wait before the ``attempt``-th reconnect
    (0 for the first after being UP) is drawn from ``[d/2, d]`` with
    ``d = min(cap, base * factor ** attempt)`` ("equal jitter": never less than half the
    envelope, so a dead replica is not hammered, and spread, so replicas that failed together
    do not come back in step).

    Raises:
        LocalProtocolError: ``base`` or ``cap`` is not a positive finite number, ``cap`` is
            below ``base``, or ``factor`` is below 1.
    """

    base: float = 0.1
    factor: float = 2.0
    cap: float = 5.0

    def __post_init__(self) -> None:
        for name in ("base", "factor", "cap"):
            v = getattr(self, name)
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                    or v <= 0):
                raise LocalProtocolError(f"backoff {name} must be a positive finite number, "
                                         f"not {v!r:.80}")
        if self.factor < 1 or self.cap < self.base:
            raise LocalProtocolError(f"backoff needs factor >= 1 and cap >= base, not factor "
                                     f"{self.factor!r} and cap {self.cap!r} < base "
                                     f"{self.base!r}")

    def envelope(self, attempt: int) -> float:
        """``min(cap, base * factor ** attempt)``, without overflowing for a large attempt."""
        if attempt < 0:
            raise LocalProtocolError(f"attempt must be >= 0, not {attempt}")
        if self.factor == 1:
            return self.base
        # beyond this many doublings the cap holds anyway (and factor ** attempt would overflow)
        if attempt > math.log(self.cap / self.base, self.factor) + 1:
            return self.cap
        return min(self.cap, self.base * self.factor ** attempt)

    def delay(self, attempt: int, rand: float) -> float:
        """The wait before reconnect ``attempt``; ``rand`` is a uniform draw in [0, 1)."""
        d = self.envelope(attempt)
        return d / 2 + d / 2 * min(max(rand, 0.0), 1.0)


class RetryBudget:
    """A token bucket that bounds retries to a share of calls: every call deposits ``ratio``
    tokens, every retry takes one, and the bucket holds at most ``burst`` (it starts full). So
    over any run, retries <= ``burst + ratio * calls``: a dead replica makes at most its calls
    in flight be sent again, never a storm that multiplies the load on the survivors.

    Attributes:
        tokens: what is in the bucket now.
        calls: calls deposited.
        retries: retries granted.
        refused: retries refused for want of a token.

    Raises:
        LocalProtocolError: ``ratio`` is not in [0, 1] or ``burst`` not a non-negative number.
    """

    __slots__ = ("burst", "calls", "ratio", "refused", "retries", "tokens")

    def __init__(self, ratio: float = 0.2, burst: float = 20.0) -> None:
        for name, v, high in (("retry_ratio", ratio, 1.0), ("retry_burst", burst, 1e9)):
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                    or not 0 <= v <= high):
                raise LocalProtocolError(f"{name} must be a number in 0..{high:g}, not "
                                         f"{v!r:.80}")
        self.ratio = float(ratio)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.calls = self.retries = self.refused = 0

    def on_call(self) -> None:
        """A call was made (not a retry): deposit ``ratio``."""
        self.calls += 1
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def try_retry(self) -> bool:
        """Take a token for one retry; False (and counted) when the bucket has less than one."""
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.retries += 1
            return True
        self.refused += 1
        return False


def least_outstanding(loads: Sequence[int | None], start: int) -> int | None:
    """The index of the least loaded candidate: ``loads[i]`` is replica i's calls outstanding,
    or None where it cannot take a call (not UP, full, or already tried by this call). Ties go
    to the first such candidate at or after ``start`` (cyclically): a pool that advances
    ``start`` with every pick spreads calls round-robin among equally loaded replicas (one call
    at a time included). None: no candidate."""
    n = len(loads)
    best, best_load = None, 0
    for k in range(n):
        i = (start + k) % n
        load = loads[i]
        if load is not None and (best is None or load < best_load):
            best, best_load = i, load
    return best


# -- affinity: rendezvous (highest-random-weight) hashing ----------------------------------------

def affinity_key(key: object) -> bytes:
    """A call's ``key`` as the bytes that are hashed: a ``str`` in UTF-8, ``bytes`` (or a
    ``bytearray`` or ``memoryview``) as they are, an ``int`` as its decimal digits (so ``42``
    and ``"42"`` are the same key).

    Raises:
        LocalProtocolError: any other type (a ``bool`` included), or a ``str`` that is not
            valid Unicode (a lone surrogate).
    """
    if isinstance(key, str):
        try:
            return key.encode()
        except UnicodeEncodeError:
            raise LocalProtocolError(f"an affinity key cannot be encoded: {key!r:.80}") from None
    if isinstance(key, bytes):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key).encode()
    raise LocalProtocolError(f"an affinity key is a str, bytes or int, not {key!r:.80}")


def rendezvous_weight(key: bytes, replica: str) -> int:
    """The weight of ``replica`` (its name, ``"host:port"``) for ``key``: 64 bits of BLAKE2b
    over both (the name's length first, so no two (name, key) pairs hash the same bytes)."""
    name = replica.encode()
    h = hashlib.blake2b(len(name).to_bytes(4, "big"), digest_size=8)
    h.update(name)
    h.update(key)
    return int.from_bytes(h.digest(), "big")


def rendezvous(key: bytes, replicas: Sequence[str | None]) -> int | None:
    """The index of the replica that takes calls with ``key``: of the candidates (``None``
    where a replica cannot take it: not UP, or already tried by this call), the one of highest
    :func:`rendezvous_weight` (equal weights, which 64 bits make all but impossible, go to the
    smaller name). None: no candidate.

    Rendezvous (highest-random-weight) hashing: every key ranks every replica by a weight
    that depends on the two alone. So a key goes to the same replica whatever the order or
    the other members of the set, as long as that replica is a candidate; when a replica
    leaves, only its keys move (each to its own next choice, spread over the others), and
    when one joins, it takes only keys it outranks for (about ``1/n`` of them)."""
    best: int | None = None
    best_rank: tuple[int, str] = (0, "")
    for i, name in enumerate(replicas):
        if name is None:
            continue
        rank = (rendezvous_weight(key, name), name)
        if best is None or rank[0] > best_rank[0] or (rank[0] == best_rank[0]
                                                      and name < best_rank[1]):
            best, best_rank = i, rank
    return best


def rendezvous_order(key: bytes, replicas: Sequence[str]) -> list[int]:
    """Every index of ``replicas``, in ``key``'s order of preference: the first is what
    :func:`rendezvous` picks, the next what it picks once the first is no candidate, etc."""
    return sorted(range(len(replicas)),
                  key=lambda i: (-rendezvous_weight(key, replicas[i]), replicas[i]))
