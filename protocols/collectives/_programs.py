"""Step programs: a collective's schedule as a list of plain steps that an executor runs
without Python per step (sans-I/O).

A *program* is one rank's part in one collective, over a small set of numbered buffers:

- *work* buffers (``BUF``) of this rank, ``buffers`` of them; the input is in work buffer 0;
- *landings* (``LAND``): where partners write, ``landings`` of them, each written by one
  partner only (the same partner in every call).

Its steps, each a tuple of ints (so a compiled executor copies them into a C array once):

==========  ==================================================================================
step        meaning
==========  ==================================================================================
``PUT``     ``(PUT, peer, buf, landing)``: write work buffer ``buf`` (the call's byte count)
            into ``peer``'s landing ``landing`` (one RDMA WRITE with immediate data)
``WAIT``    ``(WAIT, peer, landing)``: wait until ``peer``'s data is in landing ``landing``
``REDUCE``  ``(REDUCE, kind_a, a, kind_b, b, buf)``: ``buf = a (op) b`` (``kind_*``: ``BUF`` or
            ``LAND``), ``a`` first: the order every rank keeps so that results are
            bit-identical
==========  ==================================================================================

and ``result``, the ``(kind, index)`` holding the result when every step has run and every
WRITE has completed.

**Two calls in a row.** A landing is written in every call by the same partner; a partner
can run at most one call ahead of this rank (it cannot finish a call without this rank's data
of that call), so each landing has two places, by the parity of the call's number among the
executor's calls (:func:`landing_place`), and a write never lands on data not yet consumed.
:func:`simulate` runs programs against each other, in any interleaving, and checks that.

**The immediate value** of each WRITE (:func:`step_imm`) says which landing and parity it
fills and carries 16 bits of the collective's signature, so that ranks that disagree on what
the collective is (op, dtype, count) are told so instead of reducing garbage; the byte count
of the WRITE is checked too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LocalProtocolError
from ._schedules import recursive_doubling

__all__ = ["BUF", "LAND", "PUT", "REDUCE", "WAIT", "Program", "allreduce_program",
           "landing_place", "read_imm", "simulate", "step_imm"]

PUT, WAIT, REDUCE = 0, 1, 2
BUF, LAND = 0, 1


@dataclass(frozen=True, slots=True)
class Program:
    """One rank's program (see the module): its steps, how many work buffers and landings it
    uses, where its result is, and the peers it writes to or waits on."""

    steps: tuple[tuple[int, ...], ...]
    buffers: int
    landings: int
    result: tuple[int, int]

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks this program exchanges with (sorted; each the only writer of its
        landings)."""
        return tuple(sorted({s[1] for s in self.steps if s[0] in (PUT, WAIT)}))


def allreduce_program(rank: int, world: int) -> Program:
    """Recursive doubling (:func:`~._schedules.recursive_doubling`) as a program: round ``k``
    writes into the partner's landing ``k``; a folding pair uses landings ``rounds`` (the
    data in) and ``rounds + 1`` (the result back). Partial results go through fresh work
    buffers, so no WRITE's source is overwritten while it may be read."""
    plan = recursive_doubling(rank, world)
    rounds = (world.bit_length() - 1)  # log2 of the largest power of two <= world
    fold_in, fold_out = rounds, rounds + 1
    steps: list[tuple[int, ...]] = []
    if plan.fold_to is not None:
        steps += [(PUT, plan.fold_to, 0, fold_in), (WAIT, plan.fold_to, fold_out)]
        return Program(tuple(steps), 1, rounds + 2, (LAND, fold_out))
    cur = 0
    if plan.fold_from is not None:  # the lower rank's data first
        steps += [(WAIT, plan.fold_from, fold_in), (REDUCE, LAND, fold_in, BUF, 0, 1)]
        cur = 1
    for k, (partner, lower) in enumerate(plan.rounds):
        theirs, mine = (LAND, k), (BUF, cur)
        a, b = (theirs, mine) if lower else (mine, theirs)
        steps += [(PUT, partner, cur, k), (WAIT, partner, k), (REDUCE, *a, *b, cur + 1)]
        cur += 1
    if plan.fold_from is not None:
        steps.append((PUT, plan.fold_from, cur, fold_out))
    return Program(tuple(steps), cur + 1, rounds + 2, (BUF, cur))


def landing_place(landing: int, landings: int, parity: int) -> int:
    """Which of a rank's ``2 * landings`` landing places ``landing`` is in calls of ``parity``
    (0 or 1): the first ``landings`` places for even calls, the rest for odd ones."""
    return parity * landings + landing


def step_imm(landing: int, parity: int, signature: int) -> int:
    """The immediate value of a program's WRITE: the landing in bits 0-7, the call's parity in
    bit 8, the low 16 bits of the collective's signature in bits 16-31.

    Raises:
        LocalProtocolError: a landing past 255 or a parity other than 0 or 1.
    """
    if not (0 <= landing < 256 and parity in (0, 1)):
        raise LocalProtocolError(f"no immediate value for landing {landing}, parity {parity}")
    return landing | parity << 8 | (signature & 0xFFFF) << 16


def read_imm(imm: int) -> tuple[int, int, int]:
    """``(landing, parity, signature16)`` of :func:`step_imm`'s value."""
    return imm & 0xFF, imm >> 8 & 1, imm >> 16 & 0xFFFF


def simulate(programs: Sequence[Program], inputs: Sequence[Any], op: Callable[[Any, Any], Any],
             calls: int = 1, choose: Callable[[list[int]], int] = lambda ready: ready[0]
             ) -> list[list[Any]]:
    """Run every rank's program ``calls`` times in a row against the others, a WRITE landing
    at once, the next rank to move picked by ``choose`` from the ranks that can; return each
    rank's result per call (``inputs[r]`` is rank ``r``'s input in every call).

    The reference of an executor's semantics, without a device; checks that no WRITE lands on
    a landing place whose data has not been consumed and that no rank waits for ever.

    Raises:
        AssertionError: a landing overwritten, or every rank waiting (a deadlock).
    """
    n = len(programs)
    pcs = [0] * n
    call = [0] * n
    bufs: list[dict[int, Any]] = [{0: inputs[r]} for r in range(n)]
    places: list[dict[int, Any]] = [{} for _ in range(n)]
    results: list[list[Any]] = [[] for _ in range(n)]

    def value(r: int, kind: int, i: int) -> Any:
        if kind == BUF:
            return bufs[r][i]
        return places[r][landing_place(i, programs[r].landings, call[r] % 2)]

    def runnable(r: int) -> bool:
        if call[r] >= calls:
            return False
        prog = programs[r]
        if pcs[r] == len(prog.steps):
            return True  # (its result, then the next call)
        step = prog.steps[pcs[r]]
        if step[0] == WAIT:
            return landing_place(step[2], prog.landings, call[r] % 2) in places[r]
        return True

    while True:
        ready = [r for r in range(n) if runnable(r)]
        if not ready:
            if all(c >= calls for c in call):
                return results
            raise AssertionError(f"deadlock: calls {call}, steps {pcs}")
        r = choose(ready)
        prog = programs[r]
        parity = call[r] % 2
        if pcs[r] == len(prog.steps):
            kind, i = prog.result
            results[r].append(value(r, kind, i))
            if kind == LAND:  # (consumed: the next call's data may land there)
                del places[r][landing_place(i, prog.landings, parity)]
            call[r] += 1
            pcs[r] = 0
            bufs[r] = {0: inputs[r]}
            continue
        step = prog.steps[pcs[r]]
        pcs[r] += 1
        if step[0] == PUT:
            _, peer, buf, landing = step
            place = landing_place(landing, programs[peer].landings, parity)
            if place in places[peer]:
                raise AssertionError(f"rank {r} overwrote rank {peer}'s landing {landing} "
                                     f"(parity {parity}) before it was consumed")
            places[peer][place] = bufs[r][buf]
        elif step[0] == REDUCE:
            _, ka, a, kb, b, dst = step
            bufs[r][dst] = op(value(r, ka, a), value(r, kb, b))
            for kind, i in ((ka, a), (kb, b)):
                if kind == LAND:
                    del places[r][landing_place(i, prog.landings, parity)]
