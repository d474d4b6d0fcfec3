"""The shared receive pool's credit rules (aiordma.protocols.receive_pool): unit tests, then one
receiver and several senders played against each other by a hypothesis state machine, with
every message in flight in order per connection. Safety: no frame a sender was allowed to send
ever finds no posted buffer, and credits are conserved exactly. Liveness: every connection that
has frames to send sends one within a bounded number of rounds, even with a slow receiver
(one buffer released per round) and idle connections holding credits. No device."""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError
from aiordma.protocols.receive_pool import (
    Grant,
    PoolCredits,
    ReceivePool,
    Reclaim,
    Return,
    Want,
)

# -- one pool ---------------------------------------------------------------------------------


def test_attach_reserves_control_buffers_and_grants_the_initial_credits() -> None:
    pool = ReceivePool(buffers=10, share_max=4, ctrl_reserve=3, initial=1)
    assert pool.attach("a") == 1
    assert (pool.reserved, pool.outstanding, pool.free) == (3, 1, 6)
    assert pool.attach("b") == 1
    assert pool.free == 2 and not pool.can_attach()
    with pytest.raises(LocalProtocolError, match="grow it first"):
        pool.attach("c")
    pool.grow(1)
    assert not pool.can_attach()  # it would leave no buffer for data
    pool.grow(1)
    assert pool.attach("c") == 1 and pool.free == 0
    with pytest.raises(LocalProtocolError, match="attached already"):
        pool.attach("a")
    assert "ReceivePool" in repr(pool)


def test_a_frame_without_a_credit_is_the_senders_fault() -> None:
    pool = ReceivePool(buffers=8, share_max=2, ctrl_reserve=3, initial=1)
    pool.attach("a")
    pool.on_frame("a")
    with pytest.raises(RemoteProtocolError, match="without a pool credit"):
        pool.on_frame("a")
    with pytest.raises(LocalProtocolError, match="not attached"):
        pool.on_frame("nobody")


def grants(pool: ReceivePool) -> list[Grant]:
    return [a for a in pool.take_actions() if isinstance(a, Grant)]


def test_wants_are_served_round_robin_within_the_share() -> None:
    pool = ReceivePool(buffers=3 * 3 + 4, share_max=3, ctrl_reserve=3, initial=0)
    for c in "abc":
        pool.attach(c)
    pool.on_want("a", Want(frames=5))
    assert pool.take_actions() == [Grant(conn="a", credits=3)]  # its share, 1 free left
    pool.on_want("b", Want(frames=1))
    pool.on_want("c", Want(frames=1))
    # c waits (nothing free) and a waits (at its share): a and b, which hold credits, are
    # asked to give back what they cannot use (once each)
    assert pool.take_actions() == [Grant(conn="b", credits=1), Reclaim(conn="a"),
                                   Reclaim(conn="b")]
    pool.on_return("a", Return(credits=0))  # a needs them all
    assert pool.take_actions() == []
    assert pool.waiting == 2
    pool.on_frame("a")
    pool.on_frame("a")
    pool.release("a")  # free buffers go to the waiters in turn: a has waited longest
    assert grants(pool) == [Grant(conn="a", credits=1)]
    pool.release("a")  # then c
    assert grants(pool) == [Grant(conn="c", credits=1)]


def test_idle_credits_are_reclaimed_for_a_waiter() -> None:
    pool = ReceivePool(buffers=2 * 3 + 3, share_max=4, ctrl_reserve=3, initial=2)
    assert pool.attach("idle") == 2
    assert pool.attach("busy") == 1  # all that was free
    pool.on_frame("busy")
    pool.on_want("busy", Want(frames=1))
    assert pool.take_actions() == [Reclaim(conn="idle")]
    sender = PoolCredits(initial=2)
    back = sender.on_reclaim(queued=0)
    assert back == Return(credits=2) and sender.credits == 0
    pool.on_return("idle", back)
    assert pool.take_actions() == [Grant(conn="busy", credits=1)]
    with pytest.raises(RemoteProtocolError, match="Return of 5"):
        pool.on_return("idle", Return(credits=5))


def test_a_busy_sender_answers_a_reclaim_with_nothing_and_is_not_asked_again() -> None:
    pool = ReceivePool(buffers=2 * 3 + 2, share_max=4, ctrl_reserve=3, initial=1)
    pool.attach("busy")
    pool.attach("late")
    pool.on_frame("late")
    pool.on_want("late", Want(frames=1))
    assert pool.take_actions() == [Reclaim(conn="busy")]
    pool.on_return("busy", PoolCredits(initial=1).on_reclaim(queued=1))  # Return(0)
    assert pool.take_actions() == []  # no ping-pong of Reclaim and Return(0)
    pool.on_frame("busy")  # its frame arrives ...
    assert pool.take_actions() == []
    pool.release("busy")  # ... and its buffer goes to the waiter
    assert pool.take_actions() == [Grant(conn="late", credits=1)]


def test_detach_gives_everything_back() -> None:
    pool = ReceivePool(buffers=2 * 3 + 3, share_max=4, ctrl_reserve=3, initial=2)
    pool.attach("a")
    pool.attach("b")
    pool.on_want("b", Want(frames=2))
    assert pool.take_actions() == [Reclaim(conn="a"), Reclaim(conn="b")]
    pool.on_frame("a")
    pool.detach("a")
    # a's unused credit and its control reservation; its frame's buffer stays held
    assert pool.take_actions() == [Grant(conn="b", credits=2)]
    assert (pool.outstanding, pool.held, pool.free) == (3, 1, 2)
    pool.release("a")  # after it went
    assert pool.take_actions() == [] and pool.held == 0 and pool.free == 3
    with pytest.raises(LocalProtocolError, match="holds no frame"):
        pool.release()


def test_sender_rules() -> None:
    s = PoolCredits(initial=1, keep=1)
    s.send()
    with pytest.raises(LocalProtocolError, match="no pool credit"):
        s.send()
    assert s.want(queued=3) == Want(frames=3)
    assert s.want(queued=3) is None  # asked already
    assert s.want(queued=4) == Want(frames=1)
    s.on_grant(Grant(conn=None, credits=2))
    assert (s.credits, s.asked) == (2, 2)
    assert s.idle() == Return(credits=1) and s.idle() is None  # keeps one
    with pytest.raises(RemoteProtocolError, match="no credits"):
        s.on_grant(Grant(conn=None, credits=0))


@pytest.mark.parametrize("kwargs", [{"buffers": 0, "share_max": 1},
                                    {"buffers": 4, "share_max": 0},
                                    {"buffers": 4, "share_max": 1, "ctrl_reserve": -1},
                                    {"buffers": 4, "share_max": 1, "initial": True}])
def test_bad_arguments_are_typed_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(LocalProtocolError):
        ReceivePool(**kwargs)


def test_a_want_of_nothing_is_refused() -> None:
    pool = ReceivePool(buffers=8, share_max=2)
    pool.attach("a")
    with pytest.raises(RemoteProtocolError, match="no credits"):
        pool.on_want("a", Want(frames=0))


# -- a receiver and its senders, with everything in flight ------------------------------------


class World:
    """One pool, its senders, the messages in flight (per connection, in order both ways)."""

    def __init__(self, buffers: int, share_max: int, reserve: int, initial: int,
                 keep: int) -> None:
        self.pool = ReceivePool(buffers=buffers, share_max=share_max, ctrl_reserve=reserve,
                                initial=initial)
        self.keep = keep
        self.senders: dict[int, PoolCredits] = {}
        self.queued: dict[int, int] = {}
        self.up: dict[int, deque[Any]] = {}  # sender -> receiver: "frame", Want, Return
        self.down: dict[int, deque[Any]] = {}  # receiver -> sender: Grant, Reclaim
        self.held: list[int] = []  # the SRQ's buffers holding a data frame (whose)
        self.srq_buffers = buffers  # receives posted in the simulated SRQ, ever
        self.sent = 0
        self.next_id = 0

    def attach(self) -> None:
        conn = self.next_id
        self.next_id += 1
        grant = self.pool.attach(conn)
        self.senders[conn] = PoolCredits(initial=grant, keep=self.keep)
        self.queued[conn] = 0
        self.up[conn], self.down[conn] = deque(), deque()
        self._route()

    def _route(self) -> None:
        for a in self.pool.take_actions():
            self.down[a.conn].append(a)

    def send(self, conn: int) -> None:
        self.senders[conn].send()
        self.queued[conn] -= 1
        self.up[conn].append("frame")
        self.sent += 1

    def ask(self, conn: int) -> None:
        w = self.senders[conn].want(self.queued[conn])
        if w is not None:
            self.up[conn].append(w)

    def idle(self, conn: int) -> None:
        r = self.senders[conn].idle()
        if r is not None:
            self.up[conn].append(r)

    def to_receiver(self, conn: int) -> None:
        item = self.up[conn].popleft()
        if item == "frame":
            # the simulated SRQ: a posted buffer must be there (or the NIC would RNR)
            assert self.srq_buffers - len(self.held) - self.pool.reserved > 0, \
                "a frame the sender was allowed to send found no posted receive"
            self.pool.on_frame(conn)
            self.held.append(conn)
        elif isinstance(item, Want):
            self.pool.on_want(conn, item)
        else:
            self.pool.on_return(conn, item)
        self._route()

    def to_sender(self, conn: int) -> None:
        item = self.down[conn].popleft()
        if isinstance(item, Grant):
            self.senders[conn].on_grant(item)
        else:
            self.up[conn].append(self.senders[conn].on_reclaim(self.queued[conn]))

    def release(self, i: int) -> None:
        conn = self.held.pop(i)
        self.pool.release(conn if conn in self.senders else None)
        self._route()

    def detach(self, conn: int) -> None:
        self.pool.detach(conn)
        for d in (self.senders, self.queued, self.up, self.down):
            del d[conn]
        self._route()

    def grow(self, n: int) -> None:
        self.srq_buffers += n
        self.pool.grow(n)
        self._route()

    def promised(self) -> int:
        """Frames that may still arrive: credits held, granted in flight, frames in flight."""
        return (sum(s.credits for s in self.senders.values())
                + sum(g.credits for q in self.down.values() for g in q if isinstance(g, Grant))
                + sum(1 for q in self.up.values() for x in q if x == "frame"))

    def returning(self) -> int:
        return sum(x.credits for q in self.up.values() for x in q if isinstance(x, Return))

    def round(self, *, releases: int) -> None:
        """One fair round: every message delivered, every sender acts, ``releases`` held
        buffers freed (the oldest first)."""
        for conn in list(self.senders):
            while self.down[conn]:
                self.to_sender(conn)
            while self.senders[conn].credits and self.queued[conn]:
                self.send(conn)
            if self.queued[conn]:
                self.ask(conn)
            else:
                self.idle(conn)
        for conn in list(self.senders):
            while self.up[conn]:
                self.to_receiver(conn)
        for _ in range(min(releases, len(self.held))):
            self.release(0)


class PoolMachine(RuleBasedStateMachine):
    world: World

    @initialize(buffers=st.integers(4, 40), share_max=st.integers(1, 8),
                reserve=st.integers(0, 3), initial=st.integers(0, 3), keep=st.integers(0, 2),
                conns=st.integers(1, 6))
    def start(self, buffers: int, share_max: int, reserve: int, initial: int, keep: int,
              conns: int) -> None:
        self.world = World(buffers, share_max, reserve, initial, keep)
        for _ in range(conns):
            if self.world.pool.can_attach():
                self.world.attach()

    def _conn(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.world.senders)))

    @precondition(lambda self: self.world.senders)
    @rule(data=st.data(), n=st.integers(1, 6))
    def enqueue(self, data: st.DataObject, n: int) -> None:
        self.world.queued[self._conn(data)] += n

    @precondition(lambda self: self.world.senders)
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        conn = self._conn(data)
        self.world.queued[conn] = max(0, self.world.queued[conn] - 1)

    @precondition(lambda self: self.world.senders)
    @rule(data=st.data())
    def sender_acts(self, data: st.DataObject) -> None:
        w, conn = self.world, self._conn(data)
        if w.senders[conn].credits and w.queued[conn]:
            w.send(conn)
        elif w.queued[conn]:
            w.ask(conn)
        else:
            w.idle(conn)

    @precondition(lambda self: any(self.world.up.values()))
    @rule(data=st.data())
    def deliver_up(self, data: st.DataObject) -> None:
        w = self.world
        w.to_receiver(data.draw(st.sampled_from(sorted(c for c in w.up if w.up[c]))))

    @precondition(lambda self: any(self.world.down.values()))
    @rule(data=st.data())
    def deliver_down(self, data: st.DataObject) -> None:
        w = self.world
        w.to_sender(data.draw(st.sampled_from(sorted(c for c in w.down if w.down[c]))))

    @precondition(lambda self: self.world.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.world.release(data.draw(st.integers(0, len(self.world.held) - 1)))

    @precondition(lambda self: self.world.pool.can_attach())
    @rule()
    def attach(self) -> None:
        self.world.attach()

    @rule(data=st.data())
    def detach(self, data: st.DataObject) -> None:
        w = self.world
        quiet = sorted(c for c in w.senders if not w.up[c] and not w.down[c])
        if quiet:  # its queue pair is destroyed: nothing of it is in flight
            w.detach(data.draw(st.sampled_from(quiet)))

    @rule(n=st.integers(1, 8))
    def grow(self, n: int) -> None:
        self.world.grow(n)

    @invariant()
    def safety_and_conservation(self) -> None:
        w = self.world
        pool = w.pool
        assert pool.held == len(w.held)
        # every frame that may still arrive has a posted buffer owed to no one else
        assert w.promised() + pool.reserved <= w.srq_buffers - len(w.held)
        # the pool's count is exact: promised frames plus credits on their way back
        assert pool.outstanding == w.promised() + w.returning()
        assert pool.free >= 0

    @rule()
    def no_connection_starves(self) -> None:
        """From here, with a slow receiver (one buffer a round) and nothing new queued, every
        connection with frames to send sends one within a bounded number of rounds, and all
        of them are sent in the end."""
        w = copy.deepcopy(self.world)
        k = len(w.senders)
        bound = 2 * (k + 2) + w.pool.share_max * k  # waiting in line, reclaim round trips
        last_progress = {c: 0 for c in w.senders}
        for r in range(1, 1 + bound * (1 + sum(w.queued.values()))):
            before = dict(w.queued)
            w.round(releases=1)
            for c in w.senders:
                if w.queued[c] < before[c] or not w.queued[c]:
                    last_progress[c] = r
                assert r - last_progress[c] <= bound, \
                    f"connection {c} sent nothing for {bound} rounds: {w.pool!r}"
            if not any(w.queued.values()):
                return
        raise AssertionError(f"frames still queued: {w.queued} {w.pool!r}")


    def teardown(self) -> None:
        if hasattr(self, "world"):
            self.no_connection_starves()


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
