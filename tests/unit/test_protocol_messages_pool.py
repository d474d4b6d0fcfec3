"""The message protocol on a shared receive pool (aiordma.protocols.messages with ``pool_slots``
and ``peer_pool``), device-free: several clients whose frames all land in one pool of posted
buffers at the listener, the pool's credit rules (aiordma.protocols.receive_pool) granting
and reclaiming through WANT/RECLAIM/RETURN frames, and a simulated device that fails the test
on any frame that finds no posted buffer (an RNR on a real queue). Hypothesis chooses the
interleaving of deliveries, sends and reads, and whether one reader is slow.
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
from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError
from aiordma.protocols.receive_pool import Grant, ReceivePool, Return, Want

SLOT = 128
CTRL = 3
SHARE = 4


class Conn:
    """One client and the listener's endpoint for it, joined by two in-order wires."""

    def __init__(self, world: World, key: int, grant: int, slow: bool) -> None:
        self.world, self.key, self.slow = world, key, slow
        self.server = m.MessageProtocol(
            send_region=memoryview(bytearray(4 * SLOT)), recv_region=world.pool_view,
            slot_size=SLOT, send_slots=4, data_slots=SHARE, ctrl_slots=CTRL,
            peer_slot_size=SLOT, peer_data_slots=4, peer_ctrl_slots=CTRL,
            peer_max_message=1 << 20, max_message=1 << 20, recv_budget=0 if slow else 1 << 20,
            signal_every=2, pool_slots=world.buffers, pool_grant=grant)
        self.client = m.MessageProtocol(
            send_region=memoryview(bytearray(4 * SLOT)),
            recv_region=memoryview(bytearray((4 + CTRL) * SLOT)), slot_size=SLOT, send_slots=4,
            data_slots=4, ctrl_slots=CTRL, peer_slot_size=SLOT, peer_data_slots=SHARE,
            peer_ctrl_slots=CTRL, peer_max_message=1 << 20, max_message=1 << 20,
            recv_budget=1 << 20, signal_every=2, peer_pool=True, peer_pool_grant=grant)
        self.to_server: deque[tuple[bytes, int, bool]] = deque()  # (frame, wr_id, signaled)
        self.to_client: deque[tuple[bytes, int, bool]] = deque()
        self.client_rq: deque[int] = deque()  # the client's posted receive slots
        self.held: dict[int, bool] = {}  # pool slots of this connection's frames -> data
        self.sent: list[bytes] = []
        self.got: list[bytes] = []
        self.run(self.client, self.client.take_actions(), server=False)
        assert not self.server.take_actions()  # a pool's slots are the pool's to post

    def run(self, proto: m.MessageProtocol, actions: list[Any], *, server: bool) -> None:
        wire = self.to_client if server else self.to_server
        for a in actions:
            if isinstance(a, m.PostSend):
                view = proto._send
                wire.append((bytes(view[a.offset:a.offset + a.length]), a.wr_id, a.signaled))
            elif isinstance(a, m.PostRecv):
                if server:
                    self.world.give_back(self, a.slot)
                else:
                    assert a.slot not in self.client_rq
                    self.client_rq.append(a.slot)
            elif isinstance(a, m.PoolWant):
                self.world.rules.on_want(self.key, Want(frames=a.frames))
            elif isinstance(a, m.PoolReturn):
                self.world.rules.on_return(self.key, Return(credits=a.credits))
        self.world.dispatch()

    def deliver(self, to_server: bool) -> None:
        wire = self.to_server if to_server else self.to_client
        frame, wr_id, signaled = wire.popleft()
        sender = self.client if to_server else self.server
        if to_server:
            world = self.world
            assert world.posted, "RNR: a frame found no posted buffer in the pool"
            slot = world.posted.popleft()
            world.pool[slot * SLOT:slot * SLOT + len(frame)] = frame
            data = frame[0] in (framing.Kind.DATA, framing.Kind.RTS)
            self.held[slot] = data
            if data:
                world.rules.on_frame(self.key)
            self.server.on_completion(slot, len(frame))
            self.run(self.server, self.server.take_actions(), server=True)
        else:
            assert self.client_rq, "RNR: a frame found no posted receive at the client"
            slot = self.client_rq.popleft()
            self.client._recv[slot * SLOT:slot * SLOT + len(frame)] = frame
            self.client.on_completion(slot, len(frame))
            self.run(self.client, self.client.take_actions(), server=False)
        if signaled:  # the sender's completion, after delivery
            sender.on_completion(wr_id, 0)
            self.run(sender, sender.take_actions(), server=not to_server)

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)
        self.client.send_data(payload)
        self.run(self.client, self.client.take_actions(), server=False)

    def read(self) -> bool:
        if self.server.head != m.READY:
            return False
        self.got.append(bytes(self.server.pop()))
        self.run(self.server, self.server.take_actions(), server=True)
        return True


class World:
    def __init__(self, conns: int, spare: int, slow: int) -> None:
        self.buffers = conns * (CTRL + 1) + spare
        self.pool = bytearray(self.buffers * SLOT)
        self.pool_view = memoryview(self.pool)
        self.posted: deque[int] = deque(range(self.buffers))
        self.rules = ReceivePool(buffers=self.buffers, share_max=SHARE, ctrl_reserve=CTRL,
                                 initial=1)
        self.conns = [Conn(self, i, self.rules.attach(i), slow=i < slow) for i in range(conns)]

    def give_back(self, conn: Conn, slot: int) -> None:
        assert slot not in self.posted
        self.posted.append(slot)
        if conn.held.pop(slot):
            self.rules.release(conn.key)

    def dispatch(self) -> None:
        while self.rules.actions:
            for ev in self.rules.take_actions():
                c = self.conns[ev.conn]
                if isinstance(ev, Grant):
                    c.server.grant(ev.credits)
                else:
                    c.server.reclaim()
                c.run(c.server, c.server.take_actions(), server=True)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), conns=st.integers(1, 4), spare=st.integers(1, 6),
       slow=st.integers(0, 2), per_conn=st.integers(1, 30))
def test_every_message_arrives_and_no_frame_meets_an_empty_pool(
        seed: int, conns: int, spare: int, slow: int, per_conn: int) -> None:
    rnd = random.Random(seed)
    w = World(conns, spare, min(slow, conns))
    todo = {c.key: [bytes([c.key, i % 256]) * (1 + i % 40) for i in range(per_conn)]
            for c in w.conns}
    for _ in range(20_000):
        moves: list[Any] = []
        for c in w.conns:
            if todo[c.key]:
                moves.append(("send", c))
            if c.to_server:
                moves.append(("up", c))
            if c.to_client:
                moves.append(("down", c))
            if c.server.head == m.READY and (not c.slow or rnd.random() < 0.1):
                moves.append(("read", c))
        if not moves:  # a slow reader reads when nothing else can happen
            moves = [("read", c) for c in w.conns if c.server.head == m.READY]
        if not moves:
            break
        what, c = rnd.choice(moves)
        if what == "send":
            c.send(todo[c.key].pop(0))
        elif what == "up":
            c.deliver(True)
        elif what == "down":
            c.deliver(False)
        else:
            c.read()
        # a connection never holds more than its share of the pool
        for k in range(conns):
            st_ = w.rules._conns[k]
            assert st_.outstanding + st_.held <= SHARE
    else:
        pytest.fail("no progress within the bound")
    for c in w.conns:
        assert c.got == c.sent and not c.client.queued
    assert len(w.posted) == w.buffers and w.rules.held == 0  # every buffer is back


def test_pool_frames_are_refused_without_a_pool() -> None:
    p = m.MessageProtocol(send_region=memoryview(bytearray(4 * SLOT)),
                          recv_region=memoryview(bytearray(7 * SLOT)), slot_size=SLOT,
                          send_slots=4, data_slots=4, ctrl_slots=CTRL, peer_slot_size=SLOT,
                          peer_data_slots=4, peer_ctrl_slots=CTRL, peer_max_message=1 << 20,
                          max_message=1 << 20, recv_budget=1 << 20)
    p.take_actions()
    for kind, count in ((framing.Kind.WANT, 2), (framing.Kind.RETURN, 1),
                        (framing.Kind.RECLAIM, 0)):
        buf = bytearray(SLOT)
        n = framing.pack_pool(buf, 0, kind=kind, count=count, credits=0, ctrl=0)
        p._recv[0:n] = buf[:n]
        with pytest.raises(RemoteProtocolError, match="unknown frame kind"):
            p.on_completion(0, n)
    with pytest.raises(LocalProtocolError):
        p.grant(1)
    with pytest.raises(LocalProtocolError):
        p.reclaim()


def test_a_return_beyond_the_credits_granted_is_the_peers_fault() -> None:
    w = World(1, 2, 0)
    c = w.conns[0]
    buf = bytearray(SLOT)
    n = framing.pack_pool(buf, 0, kind=framing.Kind.RETURN, count=5, credits=0, ctrl=0)
    w.pool[0:n] = buf[:n]
    with pytest.raises(RemoteProtocolError, match="RETURN of 5"):
        c.server.on_completion(0, n)


def _frames(w: World, c: Conn, kinds: list[str]) -> None:
    """Deliver everything in flight on ``c``, noting each frame's kind."""
    while c.to_server or c.to_client:
        up = bool(c.to_server)
        kinds.append(framing.Kind((c.to_server if up else c.to_client)[0][0][0]).name)
        c.deliver(up)


def test_a_message_that_finds_a_credit_asks_for_none_ahead() -> None:
    # 8 clients on a pool with 2 buffers to spare: if each asked ahead after its one
    # message, the pool would reclaim from everyone (RECLAIM, RETURN and CREDIT frames).
    w = World(8, 2, 0)
    kinds: list[str] = []
    for c in w.conns:
        c.send(b"one")
    for c in w.conns:
        _frames(w, c, kinds)
    assert kinds == ["DATA"] * 8 and all(c.read() for c in w.conns)


def test_a_sender_that_waits_for_a_credit_asks_ahead() -> None:
    w = World(1, 20, 0)
    c = w.conns[0]
    kinds: list[str] = []
    c.send(b"first")  # (the credit granted at set-up)
    c.send(b"second")  # waits: it asks for it and for the ones ahead
    _frames(w, c, kinds)
    assert kinds[:3] == ["DATA", "WANT", "CREDIT"] and "DATA" in kinds[3:]
    assert c.client.credits.data_credits + c.client._asked > 0  # some ahead, unspent
