"""The message protocol with both ends of a connection on receive pools (a client's own pool,
since 2026-11-28, beside the listener's), device-free: connections whose two sides each take
their receives from a shared pool (``pool_slots``) and follow the other's grants
(``peer_pool``), or one side on a pool and the other on slots of its own, messages sent both
ways, some readers slow. The pools are the two processes' (client, server), or one pool that
both sides share (both ends in one event loop, as the device tests run them). A simulated
device fails the test on any frame that finds no posted buffer (an RNR on a real queue).
Hypothesis chooses the layout and the interleaving of sends, deliveries and reads.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.protocols import framing
from aiordma.protocols import messages as m
from aiordma.protocols.receive_pool import Grant, ReceivePool, Return, Want

SLOT = 128
CTRL = 3
SHARE = 4
OWN = 4  # data slots of a side without a pool


class Pool:
    """One process's (or one loop's) shared receive pool: its buffers and its credit rules."""

    def __init__(self, buffers: int) -> None:
        self.buffers = buffers
        self.mem = bytearray(buffers * SLOT)
        self.view = memoryview(self.mem)
        self.posted: deque[int] = deque(range(buffers))
        self.rules = ReceivePool(buffers=buffers, share_max=SHARE, ctrl_reserve=CTRL, initial=1)
        self.members: dict[int, Side] = {}
        self._keys = iter(range(1 << 30))

    def join(self, side: Side) -> int:
        key = next(self._keys)
        self.members[key] = side
        side.key = key
        return self.rules.attach(key)

    def give_back(self, side: Side, slot: int) -> None:
        assert slot not in self.posted
        self.posted.append(slot)
        if side.held.pop(slot):
            self.rules.release(side.key)


class Side:
    """One end of a connection: its protocol, its pool (or its own posted slots)."""

    def __init__(self, pool: Pool | None, slow: bool) -> None:
        self.pool, self.slow = pool, slow
        self.key = -1
        self.grant = pool.join(self) if pool is not None else 0
        self.proto: m.MessageProtocol = None  # type: ignore[assignment]  (Conn makes it)
        self.conn: Conn | None = None
        self.rq: deque[int] = deque()  # posted receive slots of its own
        self.held: dict[int, bool] = {}  # pool slots of its frames -> a data frame
        self.inbound: deque[tuple[bytes, int, bool]] = deque()  # (frame, wr_id, signaled)
        self.sent: list[bytes] = []
        self.got: list[bytes] = []

    def make(self, peer: Side) -> None:
        pooled, peer_pooled = self.pool is not None, peer.pool is not None
        own = 0 if pooled else (OWN + CTRL) * SLOT
        self.proto = m.MessageProtocol(
            send_region=memoryview(bytearray(4 * SLOT)),
            recv_region=self.pool.view if self.pool is not None else memoryview(bytearray(own)),
            slot_size=SLOT, send_slots=4, data_slots=SHARE if pooled else OWN, ctrl_slots=CTRL,
            peer_slot_size=SLOT, peer_data_slots=SHARE if peer_pooled else OWN,
            peer_ctrl_slots=CTRL, peer_max_message=1 << 20, max_message=1 << 20,
            recv_budget=0 if self.slow else 1 << 20, signal_every=2,
            pool_slots=self.pool.buffers if self.pool is not None else 0,
            pool_grant=self.grant, peer_pool=peer_pooled, peer_pool_grant=peer.grant)


class Conn:
    def __init__(self, world: World, a: Side, b: Side) -> None:
        self.world, self.a, self.b = world, a, b
        a.conn = b.conn = self
        a.make(b)
        b.make(a)
        for s in (a, b):
            self.run(s, s.proto.take_actions())

    def peer(self, side: Side) -> Side:
        return self.b if side is self.a else self.a

    def run(self, side: Side, actions: list[Any]) -> None:
        peer = self.peer(side)
        for act in actions:
            if isinstance(act, m.PostSend):
                view = side.proto._send
                peer.inbound.append((bytes(view[act.offset:act.offset + act.length]),
                                     act.wr_id, act.signaled))
            elif isinstance(act, m.PostRecv):
                if side.pool is not None:
                    side.pool.give_back(side, act.slot)
                else:
                    assert act.slot not in side.rq
                    side.rq.append(act.slot)
            elif isinstance(act, m.PoolWant):  # (the peer's WANT frame, for this side's pool)
                assert side.pool is not None
                side.pool.rules.on_want(side.key, Want(frames=act.frames))
            elif isinstance(act, m.PoolReturn):  # (the peer's RETURN frame)
                assert side.pool is not None
                side.pool.rules.on_return(side.key, Return(credits=act.credits))
        self.world.dispatch()

    def deliver(self, to: Side) -> None:
        frame, wr_id, signaled = to.inbound.popleft()
        if to.pool is not None:
            pool = to.pool
            assert pool.posted, "RNR: a frame found no posted buffer in the pool"
            slot = pool.posted.popleft()
            pool.mem[slot * SLOT:slot * SLOT + len(frame)] = frame
            data = frame[0] in (framing.Kind.DATA, framing.Kind.RTS)
            to.held[slot] = data
            if data:
                pool.rules.on_frame(to.key)
        else:
            assert to.rq, "RNR: a frame found no posted receive slot"
            slot = to.rq.popleft()
            to.proto._recv[slot * SLOT:slot * SLOT + len(frame)] = frame
        to.proto.on_completion(slot, len(frame))
        self.run(to, to.proto.take_actions())
        if signaled:  # the sender's completion, after delivery
            sender = self.peer(to)
            sender.proto.on_completion(wr_id, 0)
            self.run(sender, sender.proto.take_actions())

    def send(self, side: Side, payload: bytes) -> None:
        side.sent.append(payload)
        side.proto.send_data(payload)
        self.run(side, side.proto.take_actions())

    def read(self, side: Side) -> bool:
        if side.proto.head != m.READY:
            return False
        side.got.append(bytes(side.proto.pop()))
        self.run(side, side.proto.take_actions())
        return True


class World:
    def __init__(self, layout: list[tuple[bool, bool]], shared: bool, spare: int,
                 slow: list[tuple[bool, bool]]) -> None:
        n = sum(a + b for a, b in layout)
        if shared:  # both ends in one loop: one pool
            one = Pool(max(1, n) * (CTRL + 1) + spare)
            self.pools = [one]
            pa = pb = one
        else:
            pa = Pool(max(1, sum(a for a, _ in layout)) * (CTRL + 1) + spare)
            pb = Pool(max(1, sum(b for _, b in layout)) * (CTRL + 1) + spare)
            self.pools = [pa, pb]
        self.conns = [Conn(self, Side(pa if a_pool else None, a_slow),
                           Side(pb if b_pool else None, b_slow))
                      for (a_pool, b_pool), (a_slow, b_slow) in zip(layout, slow)]

    def dispatch(self) -> None:
        busy = True
        while busy:
            busy = False
            for pool in self.pools:
                while pool.rules.actions:
                    busy = True
                    for ev in pool.rules.take_actions():
                        side = pool.members[ev.conn]
                        if isinstance(ev, Grant):
                            side.proto.grant(ev.credits)
                        else:
                            side.proto.reclaim()
                        if side.conn is not None and side.proto is not None:
                            side.conn.run(side, side.proto.take_actions())


LAYOUT = st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), layout=LAYOUT, shared=st.booleans(),
       spare=st.integers(1, 6), per_side=st.integers(1, 20), data=st.data())
def test_both_ways_every_message_arrives_and_no_frame_meets_an_empty_buffer(
        seed: int, layout: list[tuple[bool, bool]], shared: bool, spare: int, per_side: int,
        data: st.DataObject) -> None:
    slow = data.draw(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=len(layout),
                              max_size=len(layout)))
    rnd = random.Random(seed)
    w = World(layout, shared, spare, slow)
    sides = [s for c in w.conns for s in (c.a, c.b)]
    todo = {id(s): [bytes([i % 256, len(s.sent)]) * (1 + i % 30) for i in range(per_side)]
            for s in sides}
    for _ in range(40_000):
        moves: list[tuple[str, Conn, Side]] = []
        for c in w.conns:
            for s in (c.a, c.b):
                if todo[id(s)]:
                    moves.append(("send", c, s))
                if s.inbound:
                    moves.append(("deliver", c, s))
                if s.proto.head == m.READY and (not s.slow or rnd.random() < 0.1):
                    moves.append(("read", c, s))
        if not moves:  # a slow reader reads when nothing else can happen
            moves = [("read", c, s) for c in w.conns for s in (c.a, c.b)
                     if s.proto.head == m.READY]
        if not moves:
            break
        what, c, s = rnd.choice(moves)
        if what == "send":
            c.send(s, todo[id(s)].pop(0))
        elif what == "deliver":
            c.deliver(s)
        else:
            c.read(s)
        for pool in w.pools:  # no connection holds more than its share of a pool
            for k in pool.members:
                st_ = pool.rules._conns[k]
                assert st_.outstanding + st_.held <= SHARE
    else:
        pytest.fail("no progress within the bound")
    for c in w.conns:
        for s in (c.a, c.b):
            assert c.peer(s).got == s.sent and not s.proto.queued
    for pool in w.pools:  # every buffer is back
        assert len(pool.posted) == pool.buffers and pool.rules.held == 0
