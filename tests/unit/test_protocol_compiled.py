"""The compiled message protocol against its Python source, differentially (no device).

``scripts/build_fastpath.py`` compiles ``protocols/messages/_credits.py`` and ``_protocol.py``
with C types for their fields and locals (``_credits_c.pxd``, ``_protocol_c.pxd`` beside them);
endpoints run that build (:mod:`aiordma._verbs.compiled`). C integers, typed attributes and
C-level calls are where a compiled build could part from its source (an overflow, a coercion,
an error raised at another point), so two simulated devices (``message_sim.py``) run the same
hypothesis schedule, one with each build, and after every step everything observable must be
equal: what each side posted and delivered, its counters, credits, inbox and memory, and every
error, by type and message, at the step where it is raised. The schedules include frames
garbled on the wire and completions the protocol never asked for, so the error paths are
compared too.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiordma._verbs.compiled as _fast
from aiordma.protocols import messages as m
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.send_arena import SendChunk

from .message_sim import SIDES, Params, Sim
from .test_protocol_messages import params
from .test_protocol_messages_imm import ITEMS, load_mixed


@pytest.fixture(scope="module")
def compiled() -> type[m.MessageProtocol]:
    cls = _fast._load_protocol()
    if cls is None:
        pytest.fail(f"the compiled message protocol is missing: {_fast.describe()} "
                    f"(scripts/setup.sh builds it)")
    return cls


CREDIT_FIELDS = ("local_data_slots", "local_ctrl_slots", "peer_data_slots", "peer_ctrl_slots",
                 "threshold", "data_credits", "ctrl_credits", "peer_data_credits",
                 "peer_ctrl_credits", "owed_data", "owed_ctrl", "held_data", "held_ctrl")


def _item(x: Any) -> Any:
    if isinstance(x, (bytes, bytearray)):
        return bytes(x)
    if isinstance(x, m.Incoming):
        return ("incoming", x.index, x.slot, x.size, x.offset, x.rendezvous, x.address, x.rkey,
                x.token, x.reading, None if x.payload is None else bytes(x.payload))
    if isinstance(x, m.Immediate):
        return ("immediate", x.index, x.value, x.nbytes, x.slot)
    return repr(x)


def snapshot(sim: Sim) -> Any:
    """Everything observable about both sides and the simulated device."""
    out: list[Any] = [sim.possible(), [(n, _item(i), at) for n, i, at in sim.reads],
                      {k: list(v) for k, v in sim.wire.items()},
                      {k: list(v) for k, v in sim.control.items()}, dict(sim.memory)]
    for name in SIDES:
        side = sim.sides[name]
        p, cr = side.proto, side.proto.credits
        out.append((
            p.state, p.sent, p.received, p.delivered, p.buffered, p.queued, p.flushed,
            p.pending_rendezvous, p.head, p.eager_max, p.peer_total, p.answer_due, p.at_eof,
            p.receivers_waiting, p.reads_started, [_item(i) for i in p.inbox],
            [getattr(cr, k) for k in CREDIT_FIELDS],
            bytes(side.send_region), bytes(side.recv_region), list(side.rq),
            dict(side.send_busy), list(side.send_posted), list(side.completions),
            [_item(g) for g in side.got], dict(side.tickets), dict(side.rdv), side.dropped,
            side.waiting, side.closed_sent,
        ))
    return out


def run(sim: Sim, event: tuple[str, Any]) -> Any:
    """Run one event; the error it raised, by type and message (None: none)."""
    kind, arg = event
    try:
        if kind == "wait":
            sim.app_recv(arg)
        elif kind == "give_up":
            sim.app_gives_up(arg)
        elif kind == "close":
            sim.app_close(arg)
            sim.maybe_send_close(arg)
        elif kind == "garble":  # a byte of a frame on the wire changes before it lands
            name, index, pos, value = arg
            _, offset, length, _ = [w for w in sim.wire[name] if w[0] >= 0][index]
            sim.sides[name].send_region[offset + pos % length] = value
        elif kind == "stray":  # a completion the protocol never asked for
            name, wr_id, nbytes = arg
            sim.sides[name].proto.on_completion(wr_id, nbytes)
        elif kind == "stray_imm":  # a WRITE with immediate data nobody sent
            name, wr_id, nbytes = arg
            sim.sides[name].proto.on_immediate(wr_id, nbytes, 7)
        elif kind == "pop":  # a receiver that does not look first
            sim.sides[arg].proto.pop()
        else:
            sim.do(event)
    except (ProtocolError, AssertionError, ValueError, TypeError, OverflowError,
            IndexError, KeyError) as exc:
        return type(exc).__name__, str(exc)
    return None


def events(sim: Sim, data: st.DataObject) -> tuple[str, Any]:
    """The next event: mostly what the simulation allows (as in the protocol's own schedule
    test), sometimes a receiver that waits or gives up, now and then a side that closes, and
    a fault in about one step in 100: a garbled frame, a stray completion, a pop of an inbox
    whose head is not ready."""
    roll, possible = data.draw(st.integers(0, 99)), sim.possible()
    if roll < 1:
        fault = data.draw(st.sampled_from(["pop", "garble", "stray", "stray_imm"]))
        choices = {"pop": [("pop", s) for s in SIDES
                           if sim.sides[s].proto.head in (m.EMPTY, m.READING)],
                   "garble": [("garble", s) for s in SIDES
                              if any(w[0] >= 0 for w in sim.wire[s])]}.get(fault, [])
        choices = choices or [(fault if fault == "stray_imm" else "stray", None)]
    elif roll < 2:
        choices = [("close", s) for s in SIDES]
    elif roll < 15 or not possible:
        choices = [("wait", s) for s in SIDES] + [("give_up", s) for s in SIDES]
    else:
        choices = possible
    choice = data.draw(st.sampled_from(choices))
    if choice[0] == "garble":
        name = choice[1]
        frames = sum(1 for w in sim.wire[name] if w[0] >= 0)
        index = data.draw(st.integers(0, frames - 1))
        return "garble", (name, index, data.draw(st.integers(0, 40)),
                          data.draw(st.integers(0, 255)))
    if choice[0] in ("stray", "stray_imm"):
        wr_id = data.draw(st.integers(0, 40) | st.integers(0, 60).map(lambda n: m.SEND_BIT | n)
                          | st.integers(0, 2**32 - 1))
        return choice[0], (data.draw(st.sampled_from(SIDES)), wr_id,
                           data.draw(st.integers(0, 300)))
    return choice


@settings(max_examples=150)
@given(pa=params(), pb=params(), items_a=ITEMS, items_b=ITEMS, data=st.data())
def test_the_compiled_protocol_does_what_its_source_does(
        compiled: type[m.MessageProtocol], pa: Params, pb: Params,
        items_a: list[tuple[str, int]], items_b: list[tuple[str, int]],
        data: st.DataObject) -> None:
    """(The applications' messages include WRITEs with immediate data: see ``message_sim``.)"""
    high = 2**64 - 2**30  # addresses past 2**63, rkeys past 2**31: no C int holds them
    py, c = Sim(pa, pb, first_address=high), Sim(pa, pb, protocol=compiled, first_address=high)
    assert type(c.sides["A"].proto) is compiled and type(py.sides["A"].proto) is m.MessageProtocol
    for sim in (py, c):
        load_mixed(sim, "A", items_a)
        load_mixed(sim, "B", items_b)
    same_schedule(py, c, data, snapshot)


def same_schedule(py: Sim, c: Sim, data: st.DataObject, look: Any) -> None:
    """Run one hypothesis schedule on both simulations; ``look(sim)`` must agree after every
    step. A step that raised fails both connections, as an endpoint would."""
    assert look(py) == look(c)
    for _ in range(data.draw(st.integers(20, 300), label="steps")):
        event = events(py, data)
        raised = run(py, event)
        assert run(c, event) == raised, event
        assert look(c) == look(py), event
        if raised is not None and event[0] != "pop":  # (a misuse the caller is told of)
            # the peer broke a rule, or the driver did: an endpoint fails the connection
            for sim in (py, c):
                for s in SIDES:
                    sim.sides[s].proto.fail()
            break
    for sim in (py, c):  # (its queue pair destroyed: every send slot free again)
        sim.sides["A"].proto.release_sends()
    assert look(c) == look(py)


@settings(max_examples=200)
@given(p=st.fixed_dictionaries({k: st.integers(-2, 300) for k in (
    "slot_size", "send_slots", "data_slots", "ctrl_slots", "peer_slot_size", "peer_data_slots",
    "peer_ctrl_slots", "peer_max_message", "max_message", "recv_budget", "signal_every",
    "max_reads")}))
def test_both_builds_refuse_the_same_parameters(compiled: type[m.MessageProtocol],
                                                p: dict[str, int]) -> None:
    def make(cls: type[m.MessageProtocol]) -> Any:
        regions = {"send_region": memoryview(bytearray(4096)),
                   "recv_region": memoryview(bytearray(4096))}
        try:
            proto = cls(**regions, **p)
        except ProtocolError as exc:
            return type(exc).__name__, str(exc)
        return (proto.eager_max, proto.take_actions(),
                [getattr(proto.credits, k) for k in CREDIT_FIELDS])

    assert make(compiled) == make(m.MessageProtocol)


@settings(max_examples=100)
@given(pa=params(), pb=params(), items_a=ITEMS, items_b=ITEMS, shared=st.integers(0, 6),
       taken=st.integers(0, 6), data=st.data())
def test_both_builds_borrow_from_a_send_chunk_alike(
        compiled: type[m.MessageProtocol], pa: Params, pb: Params,
        items_a: list[tuple[str, int]], items_b: list[tuple[str, int]], shared: int,
        taken: int, data: st.DataObject) -> None:
    """A's send slots are a member's of a send arena's chunk (a reserve of 2, ``shared``
    slots, ``taken`` of them held by another member): the same schedules, the same posts,
    and the same shared slots free after every step."""
    sims = []
    for cls in (m.MessageProtocol, compiled):
        chunk = SendChunk(members=2, reserve=2, shared=shared)
        for _ in range(min(taken, shared)):
            chunk.shared.pop()
        sims.append(Sim(pa, pb, protocol=cls, chunk=(chunk, bytearray(chunk.slots * pa.slot_size))))
    py, c = sims
    for sim in (py, c):
        load_mixed(sim, "A", items_a)
        load_mixed(sim, "B", items_b)

    def look(sim: Sim) -> Any:
        return snapshot(sim), list(sim.chunk[0].shared)  # type: ignore[index]

    same_schedule(py, c, data, look)
