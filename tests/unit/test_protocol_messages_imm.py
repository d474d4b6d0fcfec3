"""RDMA WRITE with immediate data in the message protocol (aiordma.protocols.messages): the
sender's reservation of a data credit, the receiver's ``Immediate`` in the inbox, and
hypothesis schedules mixing them with messages over the simulated device. No device."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.protocols import framing
from aiordma.protocols import messages as m
from aiordma.protocols.errors import LocalProtocolError, RemoteProtocolError

from .message_sim import Params, Sim
from .test_protocol_messages import data_frame, finish, frame_into, one, params, run_schedule


def test_an_immediate_on_a_side_that_does_not_accept_them_is_a_remote_error() -> None:
    p = one()
    p.take_actions()
    with pytest.raises(RemoteProtocolError, match="does not accept"):
        p.on_immediate(0, 10, 7)


def test_an_immediate_is_filed_in_order_and_its_slot_reposted() -> None:
    p = one(data_slots=8)
    p.immediates = True
    p.take_actions()
    frame_into(p, 0, data_frame(b"first"))
    p.on_immediate(1, 4096, 0xDEADBEEF)
    frame_into(p, 2, data_frame(b"last"))
    assert p.take_actions() == [m.PostRecv(0), m.PostRecv(1), m.PostRecv(2)]
    assert p.received == 3 and p.credits.owed_data == 3 and p.credits.held_data == 0
    assert p.pop() == b"first"
    assert p.head == m.READY and p.head_size == 0
    imm = p.pop()
    assert type(imm) is m.Immediate and (imm.value, imm.nbytes, imm.index) == (0xDEADBEEF,
                                                                               4096, 2)
    assert p.pop() == b"last" and p.buffered == 0 and p.delivered == 3


def test_past_the_budget_an_immediate_holds_its_slot_until_read() -> None:
    p = one(recv_budget=0)
    p.immediates = True
    p.take_actions()
    p.on_immediate(3, 0, 1)
    assert p.take_actions() == [] and p.credits.held_data == 1
    assert p.pop().value == 1  # type: ignore[union-attr]
    assert p.take_actions() == [m.PostRecv(3)] and p.credits.held_data == 0


def test_an_immediate_needs_a_data_credit_and_counts_toward_close() -> None:
    p = one(data_slots=1, recv_budget=0)  # (the first holds its slot: no credit goes back)
    p.immediates = True
    p.take_actions()
    p.on_immediate(0, 1, 1)
    with pytest.raises(RemoteProtocolError, match="without a data credit"):
        p.on_immediate(1, 1, 2)
    q = one()
    q.immediates = True
    q.take_actions()
    q.on_immediate(0, 1, 1)
    q.peer_closed(1)
    assert q.answer_due
    with pytest.raises(RemoteProtocolError, match="after the peer's Close"):
        q.on_immediate(1, 1, 2)
    with pytest.raises(LocalProtocolError, match="receive slots"):
        q.on_immediate(m.send_wr_id(1), 1, 2)


def test_a_reservation_holds_back_what_is_queued_after_it() -> None:
    p = one(peer_data_slots=2, send_slots=8)
    p.take_actions()
    assert p.send_imm() == 0  # reserved now: a data credit spent, one message sent
    assert p.credits.data_credits == 1 and p.sent == 1 and not p.flushed
    assert p.try_send_data(b"x") is False  # not before the WRITE is posted
    t = p.send_data(b"after")
    assert t > 0 and p.take_actions() == []
    p.imm_posted()
    acts = p.take_actions()
    assert [type(a) for a in acts] == [m.PostSend, m.SendPosted] and acts[1].ticket == t
    assert p.sent == 2 and p.flushed
    with pytest.raises(LocalProtocolError, match="without a reservation"):
        p.imm_posted()


def test_a_queued_reservation_is_made_when_a_credit_returns() -> None:
    p = one(peer_data_slots=1, send_slots=8)
    p.take_actions()
    assert p.send_data(b"one") == 0
    p.take_actions()
    t_imm = p.send_imm()
    t_msg = p.send_data(b"two")
    assert t_imm and t_msg and p.take_actions() == []
    buf = bytearray(framing.HEADER_SIZE)
    framing.pack_credit(buf, 0, credits=1, ctrl=0)
    frame_into(p, 0, bytes(buf))
    assert p.take_actions() == [m.PostRecv(0), m.SendPosted(t_imm)]  # "two" waits for it
    p.imm_posted()
    assert p.take_actions() == []  # no credit left for "two"
    framing.pack_credit(buf, 0, credits=1, ctrl=0)
    frame_into(p, 1, bytes(buf))
    acts = p.take_actions()
    assert acts[-1] == m.SendPosted(t_msg) and p.sent == 3


def test_an_abandoned_reservation_gives_its_credit_back() -> None:
    p = one(peer_data_slots=1)
    p.take_actions()
    assert p.send_imm() == 0
    p.imm_abandoned()
    assert p.credits.data_credits == 1 and p.sent == 0 and p.flushed
    p.imm_abandoned()  # nothing reserved: nothing happens
    assert p.send_data(b"x") == 0
    t = p.send_imm()
    assert p.withdraw(t) and not p.withdraw(t)
    t = p.send_imm()
    p.peer_closed(0)
    assert p.take_actions()[-1] == m.SendDropped(t, False)
    with pytest.raises(LocalProtocolError):
        p.send_imm()


def test_a_failed_side_keeps_its_immediates_deliverable() -> None:
    p = one(recv_budget=0)
    p.immediates = True
    p.take_actions()
    p.on_immediate(0, 5, 9)
    p.fail()
    assert p.pop().value == 9 and p.buffered == 0  # type: ignore[union-attr]


# -- two instances over the simulated device --------------------------------------------------

ITEMS = st.lists(st.one_of(st.integers(0, 600).map(lambda n: ("m", n)),
                           st.integers(0, 2**32 - 1).map(lambda v: ("i", v))), max_size=40)


def load_mixed(sim: Sim, side: str, items: list[tuple[str, int]]) -> None:
    tag = 17 if side == "A" else 101
    sim.sides[side].outbox.extend(
        bytes([(tag + i + j) % 251 for j in range(n)]) if kind == "m" else n
        for i, (kind, n) in enumerate(items))


@pytest.mark.parametrize("budget", [0, 1 << 20])
def test_a_stream_of_immediates_and_messages_arrives_in_order(budget: int) -> None:
    sim = Sim(Params(), Params(recv_budget=budget))
    load_mixed(sim, "A", [("i", k) if k % 3 else ("m", k * 13) for k in range(60)])
    while sim.sides["A"].outbox:
        sim.app_send("A")
    finish(sim)


@settings(max_examples=200)
@given(pa=params(), pb=params(), items_a=ITEMS, items_b=ITEMS, data=st.data())
def test_any_schedule_with_immediates_delivers_everything_once_in_order(
        pa: Params, pb: Params, items_a: list[tuple[str, int]],
        items_b: list[tuple[str, int]], data: st.DataObject) -> None:
    """As the messages' schedule test, with WRITEs with immediate data among the messages:
    every one arrives once, in its place, with its value and length; no RNR, credits never
    negative, the budget kept."""
    sim = Sim(pa, pb)
    load_mixed(sim, "A", items_a)
    load_mixed(sim, "B", items_b)
    run_schedule(sim, data)
