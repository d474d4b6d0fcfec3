"""A simulated device joining two :class:`aiordma.protocols.messages.MessageProtocol` instances, and
the applications on top of them. No verbs: this is how the message protocol is tested on any
machine. The simulation is strict where a real RC queue pair would misbehave or fail:

* a SEND that finds the peer's receive queue empty is an RNR: the test fails;
* a send slot posted again before its completion, or a receive slot posted twice, fails;
* frames are copied out of the send slot when they are *delivered* (as a device's DMA reads
  them late), so a protocol that rewrites a posted slot corrupts what arrives;
* each direction delivers in order; signaled send completions come after delivery, in order,
  and free every unsignaled post before them;
* a rendezvous READ copies from the sender's memory at the time it runs; memory the sender
  released (after DONE) is gone, so a READ of it fails the test.

An application message that is an ``int`` ``v`` (not bytes) is an RDMA WRITE with immediate
data: value ``v``, :func:`imm_length` ``(v)`` bytes written (no frame: it takes a receive
slot, is delivered in order with the frames, and the receiver files an ``Immediate``).

Which event happens next (a delivery, a completion, a READ, an application call) is the
test's choice, so hypothesis explores interleavings.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiordma.protocols import messages as m
from aiordma.protocols.send_arena import SendChunk

SIDES = ("A", "B")


def other(side: str) -> str:
    return "B" if side == "A" else "A"


def imm_length(value: int) -> int:
    """The length of the simulated WRITE that carries immediate ``value``."""
    return value * 7 % 5000


@dataclass
class Params:
    slot_size: int = 128
    send_slots: int = 4
    data_slots: int = 4
    ctrl_slots: int = 3
    recv_budget: int = 1 << 20
    max_message: int = 1 << 20
    signal_every: int = 3
    max_reads: int = 2


@dataclass
class Side:
    name: str
    params: Params
    proto: m.MessageProtocol
    send_region: bytearray
    recv_region: bytearray
    rq: deque[int] = field(default_factory=deque)  # posted receive slots, FIFO
    send_busy: dict[int, int] = field(default_factory=dict)  # send slot -> seq posted
    send_posted: deque[tuple[int, int, bool]] = field(default_factory=deque)  # (seq, slot, sig)
    completions: deque[int] = field(default_factory=deque)  # signaled seqs done on the wire
    # application: sending
    outbox: deque[bytes | int] = field(default_factory=deque)  # messages still to hand to send
    sent_msgs: list[bytes | int] = field(default_factory=list)  # handed to the protocol, in order
    tickets: dict[int, bytes | int] = field(default_factory=dict)  # queued, not yet posted
    rdv: dict[int, int] = field(default_factory=dict)  # token -> memory address
    # application: receiving
    got: list[bytes | int] = field(default_factory=list)  # in the order receivers got them
    waiting: bool = False  # a receiver waits (counted in receivers_waiting)
    dropped: int = 0
    closed_sent: bool = False


class Sim:
    """Two sides, two wires, the pending READs. ``step(choice)`` runs one event.

    ``protocol``: the class both sides run (the Python source's by default; the differential
    test runs the compiled build's beside it). Rendezvous memory gets addresses from
    ``first_address`` on, and the low 32 bits of its address as its rkey."""

    def __init__(self, pa: Params, pb: Params,
                 protocol: type[m.MessageProtocol] = m.MessageProtocol,
                 first_address: int = 0x1000,
                 chunk: tuple[SendChunk, bytearray] | None = None) -> None:
        self.protocol = protocol
        # (A's send slots are a member's of a send arena's chunk: the chunk and its memory,
        # which other simulations may share; ``pa.send_slots`` is then its cap)
        self.chunk = chunk
        self.member = chunk[0].join() if chunk is not None else -1
        self.memory: dict[int, bytes] = {}  # "registered" rendezvous sources
        self._addr = itertools.count(first_address, 0x1000)
        self.sides = {"A": self._side("A", pa, pb), "B": self._side("B", pb, pa)}
        # (seq, offset, length, signaled); a WRITE with immediate data: (-1, value, length, False)
        self.wire: dict[str, deque[tuple[int, int, int, bool]]] = {"A": deque(), "B": deque()}
        # (side, Incoming, position in the application's ``got`` or -1) READs waiting to run
        self.reads: deque[tuple[str, m.Incoming, int]] = deque()
        self.control: dict[str, deque[int]] = {"A": deque(), "B": deque()}  # Close(sent) over TCP
        self.max_buffered = {"A": 0, "B": 0}
        for s in SIDES:
            self.run_actions(s)

    def _side(self, name: str, me: Params, peer: Params) -> Side:
        sr = bytearray(me.send_slots * me.slot_size)
        arena: dict[str, Any] = {}
        if name == "A" and self.chunk is not None:
            sr = self.chunk[1]
            arena = {"send_chunk": self.chunk[0], "send_member": self.member}
        rr = bytearray((me.data_slots + me.ctrl_slots) * me.slot_size)
        proto = self.protocol(
            send_region=memoryview(sr), recv_region=memoryview(rr), slot_size=me.slot_size,
            send_slots=me.send_slots, data_slots=me.data_slots, ctrl_slots=me.ctrl_slots,
            peer_slot_size=peer.slot_size, peer_data_slots=peer.data_slots,
            peer_ctrl_slots=peer.ctrl_slots, peer_max_message=peer.max_message,
            max_message=me.max_message, recv_budget=me.recv_budget,
            signal_every=me.signal_every, max_reads=me.max_reads, **arena)
        proto.immediates = True
        return Side(name, me, proto, sr, rr)

    # -- the device ----------------------------------------------------------------------------

    def run_actions(self, name: str) -> None:
        side = self.sides[name]
        while side.proto.actions:
            self._run_actions(name, side)

    def _post_imm(self, name: str, value: int) -> None:
        """Post the WRITE with immediate data whose credit the protocol reserved."""
        self.wire[name].append((-1, value, imm_length(value), False))
        self.sides[name].proto.imm_posted()

    def _run_actions(self, name: str, side: Side) -> None:
        for a in side.proto.take_actions():
            if isinstance(a, m.PostSend):
                slot = a.offset // side.params.slot_size
                assert slot not in side.send_busy, f"{name}: send slot {slot} reused while posted"
                seq = a.wr_id & 0x7FFF_FFFF
                assert a.wr_id & m.SEND_BIT
                side.send_busy[slot] = seq
                side.send_posted.append((seq, slot, a.signaled))
                self.wire[name].append((seq, a.offset, a.length, a.signaled))
            elif isinstance(a, m.PostRecv):
                assert a.slot not in side.rq, f"{name}: receive slot {a.slot} posted twice"
                side.rq.append(a.slot)
            elif isinstance(a, m.StartRead):
                self.reads.append((name, a.message, -1))
            elif isinstance(a, m.SendPosted):
                assert a.ticket in side.tickets
                msg = side.tickets.pop(a.ticket)
                if type(msg) is int:  # the reservation is made: post it now
                    self._post_imm(name, msg)
            elif isinstance(a, m.SendDone):
                addr = side.rdv.pop(a.token)
                del self.memory[addr]  # the sender releases it: a later READ would fail
            elif isinstance(a, m.SendDropped):
                side.dropped += 1
                if a.rendezvous:
                    del self.memory[side.rdv.pop(a.ticket)]
                else:
                    del side.tickets[a.ticket]
            else:
                raise TypeError(f"unknown action {a!r}")
        cr = side.proto.credits
        for k in ("data_credits", "ctrl_credits", "owed_data", "owed_ctrl", "peer_data_credits",
                  "peer_ctrl_credits", "held_data", "held_ctrl"):
            assert getattr(cr, k) >= 0, (name, k, cr)
        assert side.proto.buffered <= side.params.recv_budget
        self.max_buffered[name] = max(self.max_buffered[name], side.proto.buffered)

    def deliver(self, name: str) -> None:
        """The oldest frame ``name`` sent lands in the peer's next posted receive."""
        seq, offset, length, signaled = self.wire[name].popleft()
        tx, rx = self.sides[name], self.sides[other(name)]
        assert rx.rq, f"RNR: {name} sent with no receive posted at {rx.name}"
        slot = rx.rq.popleft()
        if seq < 0:  # a WRITE with immediate data: no frame lands in the slot
            rx.proto.on_immediate(slot, length, offset)
            self.run_actions(rx.name)
            return
        assert length <= rx.params.slot_size, "frame longer than the receive slot"
        base = slot * rx.params.slot_size
        rx.recv_region[base:base + length] = tx.send_region[offset:offset + length]
        if signaled:
            tx.completions.append(seq)
        rx.proto.on_completion(slot, length)
        self.run_actions(rx.name)

    def complete(self, name: str) -> None:
        """The oldest signaled send completion of ``name`` is polled."""
        side = self.sides[name]
        seq = side.completions.popleft()
        while side.send_posted:
            s, slot, _sig = side.send_posted.popleft()
            del side.send_busy[slot]
            if s == seq:
                break
        side.proto.on_completion(m.SEND_BIT | seq, 0)
        self.run_actions(name)

    def read(self, index: int = 0) -> None:
        """Run a pending READ (the ``index``-th)."""
        self.reads.rotate(-index)
        name, item, into_app = self.reads.popleft()  # into_app: the receiver's position
        self.reads.rotate(index)
        assert item.address in self.memory, f"{name}: READ of released memory {item!r}"
        data = self.memory[item.address]
        assert len(data) == item.size and item.rkey == item.address & 0xFFFF_FFFF
        side = self.sides[name]
        if into_app >= 0:
            side.got[into_app] = bytes(data)
            side.proto.read_done(item)
        else:
            side.proto.read_done(item, bytearray(data))
        self.run_actions(name)

    # -- the applications ----------------------------------------------------------------------

    def app_send(self, name: str) -> None:
        side = self.sides[name]
        msg = side.outbox.popleft()
        side.sent_msgs.append(msg)
        p = side.proto
        if type(msg) is int:
            ticket = p.send_imm()
            if ticket:
                side.tickets[ticket] = msg
            else:
                self._post_imm(name, msg)
        elif len(msg) <= p.eager_max:
            ticket = p.send_data(msg)
            if ticket:
                side.tickets[ticket] = msg
        else:
            addr = next(self._addr)
            self.memory[addr] = msg
            token = p.send_rts(len(msg), addr, addr & 0xFFFF_FFFF)
            side.rdv[token] = addr
        self.run_actions(name)

    def app_recv(self, name: str) -> bool:
        """One receive attempt; False if nothing could be taken (the receiver then waits)."""
        side = self.sides[name]
        p = side.proto
        head = p.head
        if head in (m.EMPTY, m.READING):
            if not side.waiting:
                side.waiting = True
                p.receivers_waiting += 1
            return False
        if side.waiting:
            side.waiting = False
            p.receivers_waiting -= 1
        out = p.pop()
        if type(out) is m.Immediate:
            assert out.nbytes == imm_length(out.value)
            side.got.append(out.value)
        elif isinstance(out, m.Incoming):  # handed out now, in order; its bytes come later
            self.reads.append((name, out, len(side.got)))
            side.got.append(b"<being read>")
        else:
            side.got.append(bytes(out))
        self.run_actions(name)
        return True

    def app_gives_up(self, name: str) -> None:
        side = self.sides[name]
        if side.waiting:
            side.waiting = False
            side.proto.receivers_waiting -= 1
            side.proto.receiver_left()
            self.run_actions(name)

    # -- close ---------------------------------------------------------------------------------

    def app_close(self, name: str) -> None:
        self.sides[name].proto.close()

    def maybe_send_close(self, name: str) -> bool:
        """Send Close when the side closes and is flushed, or when its answer is due."""
        side = self.sides[name]
        p = side.proto
        if side.closed_sent:
            return False
        if p.answer_due or (p.state is m.Lifecycle.CLOSING and p.flushed):
            self.control[name].append(p.close_sent())
            side.closed_sent = True
            return True
        return False

    def deliver_close(self, name: str) -> None:
        total = self.control[name].popleft()
        rx = self.sides[other(name)]
        rx.proto.peer_closed(total)
        self.run_actions(rx.name)

    # -- scheduling ----------------------------------------------------------------------------

    def possible(self) -> list[tuple[str, Any]]:
        """Every event that can happen now."""
        out: list[tuple[str, Any]] = []
        for s in SIDES:
            side = self.sides[s]
            if side.outbox and side.proto.state is m.Lifecycle.OPEN:
                out.append(("send", s))
            if self.wire[s]:
                out.append(("deliver", s))
            if side.completions:
                out.append(("complete", s))
            if side.proto.head in (m.READY, m.UNREAD):
                out.append(("recv", s))
            if self.control[s]:
                out.append(("close_arrives", s))
        for i in range(len(self.reads)):
            out.append(("read", i))
        return out

    def do(self, event: tuple[str, Any]) -> None:
        kind, arg = event
        if kind == "send":
            self.app_send(arg)
        elif kind == "deliver":
            self.deliver(arg)
        elif kind == "complete":
            self.complete(arg)
        elif kind == "recv":
            self.app_recv(arg)
        elif kind == "read":
            self.read(arg)
        elif kind == "close_arrives":
            self.deliver_close(arg)
        else:
            raise AssertionError(kind)

    def quiesce(self, *, receive: bool = True, limit: int = 100_000) -> int:
        """Run every event but new sends (and, ``receive=False``, application receives) until
        none is left; return how many ran."""
        for n in range(limit):
            events = [e for e in self.possible()
                      if e[0] != "send" and (receive or e[0] != "recv")]
            if not events:
                return n
            self.do(events[0])
        raise AssertionError("no quiescence")
