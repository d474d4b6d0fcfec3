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
``FWD``     ``(FWD, peer, src, landing)``: write what landed in this rank's landing ``src`` (its
            byte count as it came) into ``peer``'s landing ``landing``
``SIGNAL``  ``(SIGNAL, peer, landing)``: write nothing (0 bytes) into ``peer``'s landing
==========  ==================================================================================

and ``results``, the ``(kind, index)`` pairs holding the result when every step has run and
every WRITE has completed (one for a reduction, one per rank for an allgather, none for a
barrier). A *sized* program's WRITEs all carry the call's byte count (checked on arrival); an
unsized one's each carry their writer's own (up to the landing's size).

**One landing space, several programs.** An executor carries several programs (an allreduce,
a barrier, an allgather) over one set of landings, one call at a time: the landings of one
call are consumed within it, so the next call, whatever its program, may reuse them.

**Two calls in a row.** Every program here needs every rank's part of the call before any
rank finishes it (each rank's result depends on every rank's input, or, for the barrier, on
every rank having started), so a partner can run at most one call ahead of this rank, and
each landing has two places, by the parity of the call's number among the
executor's calls (:func:`landing_place`), and a write never lands on data not yet consumed.
:func:`simulate` runs programs against each other, in any interleaving, and checks that.

**The immediate value** of each WRITE (:func:`step_imm`) says which landing and parity it
fills, which program wrote it, and carries 16 bits of the collective's signature, so that
ranks that disagree on what the collective is (kind, op, dtype, count) are told so instead of
reducing garbage; the byte count of the WRITE is checked too. An executor checks a WRITE when
it arrives, not only when a step waits for it: one for the call under way (its parity) from
another program or with another signature is a mismatch at once, since a rank that runs
another program may never write the landing this one waits on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import LocalProtocolError, RemoteProtocolError
from ._schedules import recursive_doubling

__all__ = ["BUF", "FWD", "LAND", "PUT", "REDUCE", "SIGNAL", "TAIL_MAX", "WAIT", "Program",
           "allgather_program", "allreduce_program", "alltoall_program", "barrier_program",
           "block_tail", "broadcast_program", "imm_program", "landing_place", "read_imm",
           "reduce_scatter_program", "simulate", "split_block", "step_clash", "step_imm",
           "step_mismatch"]

PUT, WAIT, REDUCE, FWD, SIGNAL = 0, 1, 2, 3, 4
PROGRAM_MAX = 127  # (the immediate value's 7 bits for the writer's program)
BUF, LAND = 0, 1


@dataclass(frozen=True, slots=True)
class Program:
    """One rank's program (see the module): its steps, how many work buffers and landings it
    uses, where its results are, whether every WRITE carries the call's byte count, how its
    input is staged (``blocks``: 0 for work buffer 0, else that many blocks of the call's
    byte count, block ``p`` in work buffer ``p``, one per rank for an alltoall or a
    reduce-scatter), and the peers it writes to or waits on."""

    steps: tuple[tuple[int, ...], ...]
    buffers: int
    landings: int
    results: tuple[tuple[int, int], ...]
    sized: bool = True
    blocks: int = 0
    name: str = ""  # the collective's kind, for errors (another rank running another program)

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks this program exchanges with (sorted; each the only writer of its
        landings)."""
        return tuple(sorted({s[1] for s in self.steps if s[0] != REDUCE}))


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
        return Program(tuple(steps), 1, rounds + 2, ((LAND, fold_out),), name="allreduce")
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
    return Program(tuple(steps), cur + 1, rounds + 2, ((BUF, cur),), name="allreduce")


def broadcast_program(rank: int, world: int, root: int) -> Program:
    """Rank ``root``'s block (of its own size: an unsized program) to every rank, over
    recursive doubling's pairs (:func:`~._schedules.recursive_doubling`, the allreduce's
    partners and landings): in round ``k`` the rank of a pair that has the block writes it
    into the other's landing ``k``, and the other writes nothing (``SIGNAL``), so that, as in
    the allreduce, no rank ends a call before every rank began it (the broadcast's root
    included: it waits for its partners' empty writes). A folding pair goes through landings
    ``rounds`` (the block or nothing in) and ``rounds + 1`` (the block, or nothing to a root,
    back). The result: work buffer 0 on the root, else the landing the block came into."""
    plan = recursive_doubling(rank, world)
    rounds = world.bit_length() - 1
    fold_in, fold_out = rounds, rounds + 1
    extra = world - (1 << rounds)

    def core(r: int) -> int:  # a rank's place among the 2**rounds that run the rounds
        if r < 2 * extra:
            r += 1 - r % 2  # (a folding rank's partner)
            return r // 2
        return r - extra

    def send(have: tuple[int, int], peer: int, landing: int) -> tuple[int, ...]:
        if have[0] == BUF:
            return (PUT, peer, have[1], landing)
        return (FWD, peer, have[1], landing)

    if plan.fold_to is not None:
        p = plan.fold_to
        first = (PUT, p, 0, fold_in) if rank == root else (SIGNAL, p, fold_in)
        result = (BUF, 0) if rank == root else (LAND, fold_out)
        return Program((first, (WAIT, p, fold_out)), 1, rounds + 2, (result,), sized=False,
                       name="broadcast")
    have: tuple[int, int] | None = (BUF, 0) if rank == root else None
    steps: list[tuple[int, ...]] = []
    if plan.fold_from is not None:
        steps.append((WAIT, plan.fold_from, fold_in))
        if plan.fold_from == root:
            have = (LAND, fold_in)
    d = core(rank) ^ core(root)  # this rank's place relative to the block's first holder
    for k, (partner, _lower) in enumerate(plan.rounds):
        half = 1 << k  # (before round k, the places below this have the block)
        steps.append(send(have, partner, k) if have is not None and d < half
                     else (SIGNAL, partner, k))
        steps.append((WAIT, partner, k))
        if have is None and d ^ half < half:
            have = (LAND, k)
    if have is None:  # (cannot be: every place below 2**rounds has it by now)
        raise LocalProtocolError(f"rank {rank} of {world} never gets root {root}'s block")
    if plan.fold_from is not None:
        steps.append((SIGNAL, plan.fold_from, fold_out) if plan.fold_from == root
                     else send(have, plan.fold_from, fold_out))
    return Program(tuple(steps), 1, rounds + 2, (have,), sized=False, name="broadcast")


def barrier_program(rank: int, world: int) -> Program:
    """A dissemination barrier: round ``k`` writes nothing (0 bytes) into landing ``k`` of
    rank ``rank + 2**k`` and waits for rank ``rank - 2**k``'s (modulo ``world``);
    ``ceil(log2 world)`` rounds, after which every rank has heard, through others, from every
    rank."""
    steps: list[tuple[int, ...]] = []
    k = 0
    while world > 1 and 1 << k < world:
        d = 1 << k
        steps += [(PUT, (rank + d) % world, 0, k), (WAIT, (rank - d) % world, k)]
        k += 1
    return Program(tuple(steps), 1, max(k, 1), (), name="barrier")


def allgather_program(rank: int, world: int) -> Program:
    """Every rank's block straight to every rank: work buffer 0 (this rank's block, of its
    own size: an unsized program) into landing ``rank`` of every other rank, visiting them
    from ``rank + 1`` on (so no rank is everyone's first), then a wait for each; the results
    are rank ``r``'s block, in rank order: work buffer 0 for this rank, landing ``r`` for the
    others."""
    others = [(rank + i) % world for i in range(1, world)]
    steps = [(PUT, p, 0, rank) for p in others]
    steps += [(WAIT, (rank - i) % world, (rank - i) % world) for i in range(1, world)]
    results = tuple((BUF, 0) if r == rank else (LAND, r) for r in range(world))
    return Program(tuple(steps), 1, world, results, sized=False, name="allgather")


def alltoall_program(rank: int, world: int) -> Program:
    """Block ``p`` of this rank's input (work buffer ``p``: the input is staged as ``world``
    blocks of the call's byte count) into landing ``rank`` of rank ``p``, visiting ranks from
    ``rank + 1`` on, then a wait for each rank's block (a sized program: every block has the
    call's size). The results: rank ``q``'s block for this rank, in rank order (work buffer
    ``rank`` for this rank's own, landing ``q`` for the others)."""
    others = [(rank + i) % world for i in range(1, world)]
    steps = [(PUT, p, p, rank) for p in others]
    steps += [(WAIT, (rank - i) % world, (rank - i) % world) for i in range(1, world)]
    results = tuple((BUF, rank) if q == rank else (LAND, q) for q in range(world))
    return Program(tuple(steps), world, world, results, blocks=world, name="alltoall")


def reduce_scatter_program(rank: int, world: int) -> Program:
    """Block ``p`` of this rank's input (work buffer ``p``, staged as for
    :func:`alltoall_program`) into landing ``rank`` of rank ``p``; then this rank's own block
    reduced with each rank's as it is waited for, in the links' order (this rank's first,
    then ranks ``rank - 1``, ``rank - 2``, ...): ``acc = acc (op) theirs`` into work buffer
    ``world``, the one result."""
    steps: list[tuple[int, ...]] = [(PUT, (rank + i) % world, (rank + i) % world, rank)
                                    for i in range(1, world)]
    acc = (BUF, rank)
    for i in range(1, world):
        q = (rank - i) % world
        steps += [(WAIT, q, q), (REDUCE, *acc, LAND, q, world)]
        acc = (BUF, world)
    return Program(tuple(steps), world + 1, world, (acc,), blocks=world,
                   name="reduce_scatter")


TAIL_MAX = 512
"""Bytes a landing keeps, past the engine's size, for an allgather block's description."""
_OVERSIZE = b"\xff\xff"


def block_tail(description: Any) -> bytes:
    """What follows an allgather block's bytes in its WRITE: ``description`` (a msgpack
    value: the array's dtype and shape) and its length (2 bytes, little-endian); or, for
    ``None``, the *oversize* mark alone: the writer's block does not fit the landing, and every
    rank, seeing it, runs the call another way. A description past :data:`TAIL_MAX` bytes
    gives the mark too."""
    if description is None:
        return _OVERSIZE
    packed = msgpack.packb(description)
    if len(packed) + 2 > TAIL_MAX:
        return _OVERSIZE
    return packed + len(packed).to_bytes(2, "little")


def split_block(block: bytes | memoryview) -> tuple[int, Any] | None:
    """``(bytes of data, description)`` of a WRITE made of a block and its :func:`block_tail`,
    or None for the oversize mark.

    Raises:
        RemoteProtocolError: not a block with a tail.
    """
    n = len(block)
    if n < 2:
        raise RemoteProtocolError(f"an allgather block of {n} B has no description")
    m = int.from_bytes(block[n - 2:], "little")
    if m == 0xFFFF and n == 2:
        return None
    if m + 2 > n or m + 2 > TAIL_MAX:
        raise RemoteProtocolError(f"an allgather block of {n} B says its description takes "
                                  f"{m} B")
    try:
        description = msgpack.unpackb(block[n - 2 - m:n - 2])
    except (ValueError, msgpack.UnpackException) as exc:
        raise RemoteProtocolError(f"an allgather block's description does not decode: "
                                  f"{exc}") from None
    return n - 2 - m, description


def landing_place(landing: int, landings: int, parity: int) -> int:
    """Which of a rank's ``2 * landings`` landing places ``landing`` is in calls of ``parity``
    (0 or 1): the first ``landings`` places for even calls, the rest for odd ones."""
    return parity * landings + landing


def step_imm(landing: int, parity: int, signature: int, program: int = 0) -> int:
    """The immediate value of a program's WRITE: the landing in bits 0-7, the call's parity in
    bit 8, the program's number in the executor (:func:`imm_program`, up to 127; higher
    numbers are sent as 127) in bits 9-15, the low 16 bits of the collective's signature in
    bits 16-31.

    Raises:
        LocalProtocolError: a landing past 255, a parity other than 0 or 1, or a negative
            program number.
    """
    if not (0 <= landing < 256 and parity in (0, 1) and program >= 0):
        raise LocalProtocolError(f"no immediate value for landing {landing}, parity {parity}, "
                                 f"program {program}")
    return landing | parity << 8 | min(program, PROGRAM_MAX) << 9 | (signature & 0xFFFF) << 16


def read_imm(imm: int) -> tuple[int, int, int]:
    """``(landing, parity, signature16)`` of :func:`step_imm`'s value."""
    return imm & 0xFF, imm >> 8 & 1, imm >> 16 & 0xFFFF


def step_mismatch(writer: int, landing: int, theirs: str, their_sig: int, mine: str,
                  my_sig: int) -> str:
    """What an executor says of a WRITE for its call from another program or collective
    (both executors word it so)."""
    return (f"rank {writer} wrote landing {landing} for its {theirs} (signature "
            f"{their_sig:#06x}) while this rank runs its {mine} ({my_sig:#06x}): the ranks' "
            f"collectives differ (kind, op, dtype or size), or they started them in another "
            f"order")


def step_clash(landing: int, first: tuple[int, str, int], then: tuple[int, str, int]) -> str:
    """What an executor says of two WRITEs into one landing place in the same call, from
    ``first`` and ``then`` (each ``(rank, its program's name, its signature)``) that differ
    in program or signature: two ranks run different collectives in that call (both
    executors word it so)."""
    (p, theirs, their_sig), (q, other, other_sig) = first, then
    return (f"rank {p} wrote landing {landing} for its {theirs} (signature {their_sig:#06x}) "
            f"and rank {q} for its {other} ({other_sig:#06x}) in the same call: the ranks' "
            f"collectives differ (kind, op, dtype or size), or they started them in another "
            f"order")


def imm_program(imm: int) -> int:
    """The writer's program number in :func:`step_imm`'s value (:data:`PROGRAM_MAX` for any
    from 127 on)."""
    return imm >> 9 & PROGRAM_MAX


def simulate(programs: Sequence[Program] | Sequence[Sequence[Program]], inputs: Sequence[Any],
             op: Callable[[Any, Any], Any], calls: int = 1,
             choose: Callable[[list[int]], int] = lambda ready: ready[0],
             log: list[tuple[str, int, int]] | None = None) -> list[list[tuple[Any, ...]]]:
    """Run every rank's program ``calls`` times in a row against the others (or, given one
    list of every rank's programs per call, those calls in turn: programs mixed over one
    landing space), a WRITE landing at once, the next rank to move picked by ``choose`` from
    the ranks that can; return each rank's results per call (the values at its program's
    ``results``; ``inputs[r]`` is rank ``r``'s input in every call: the value of work buffer 0,
    or, for a program staging ``blocks``, ``inputs[r][i]`` that of buffer ``i``). ``log`` gets
    ``("start" | "end", rank, call)`` as ranks begin and end calls.

    The reference of an executor's semantics, without a device; checks that no WRITE lands on
    a landing place whose data has not been consumed and that no rank waits for ever.

    Raises:
        AssertionError: a landing overwritten, or every rank waiting (a deadlock).
    """
    plan: list[Sequence[Program]]
    if programs and isinstance(programs[0], Program):
        plan = [programs] * calls  # type: ignore[list-item]
    else:
        plan = list(programs)  # type: ignore[arg-type]
    calls = len(plan)
    n = len(plan[0]) if plan else 0
    space = max((p.landings for per in plan for p in per), default=1)
    pcs = [0] * n
    call = [0] * n

    def staged(r: int) -> dict[int, Any]:  # (rank r's work buffers as its call begins)
        prog = plan[call[r]][r] if call[r] < calls else None
        if prog is None or not prog.blocks:
            return {0: inputs[r]}
        return {i: inputs[r][i] for i in range(prog.blocks)}

    bufs: list[dict[int, Any]] = [staged(r) for r in range(n)]
    places: list[dict[int, Any]] = [{} for _ in range(n)]
    results: list[list[tuple[Any, ...]]] = [[] for _ in range(n)]
    waited: list[list[int]] = [[] for _ in range(n)]  # landing places read in this call

    def value(r: int, kind: int, i: int) -> Any:
        if kind == BUF:
            return bufs[r][i]
        return places[r][landing_place(i, space, call[r] % 2)]

    def runnable(r: int) -> bool:
        if call[r] >= calls:
            return False
        prog = plan[call[r]][r]
        if pcs[r] == len(prog.steps):
            return True  # (its results, then the next call)
        step = prog.steps[pcs[r]]
        if step[0] == WAIT:
            return landing_place(step[2], space, call[r] % 2) in places[r]
        return True

    while True:
        ready = [r for r in range(n) if runnable(r)]
        if not ready:
            if all(c >= calls for c in call):
                return results
            raise AssertionError(f"deadlock: calls {call}, steps {pcs}")
        r = choose(ready)
        prog = plan[call[r]][r]
        parity = call[r] % 2
        if pcs[r] == 0 and log is not None:
            log.append(("start", r, call[r]))
        if pcs[r] == len(prog.steps):
            results[r].append(tuple(value(r, kind, i) for kind, i in prog.results))
            for place in waited[r]:  # (consumed: the next call's data may land there)
                del places[r][place]
            waited[r].clear()
            if log is not None:
                log.append(("end", r, call[r]))
            call[r] += 1
            pcs[r] = 0
            bufs[r] = staged(r)
            continue
        step = prog.steps[pcs[r]]
        pcs[r] += 1
        if step[0] in (PUT, FWD, SIGNAL):
            peer, landing = step[1], step[-1]
            place = landing_place(landing, space, parity)
            if place in places[peer]:
                raise AssertionError(f"rank {r} overwrote rank {peer}'s landing {landing} "
                                     f"(parity {parity}) before it was consumed")
            places[peer][place] = (bufs[r][step[2]] if step[0] == PUT
                                   else value(r, LAND, step[2]) if step[0] == FWD else None)
        elif step[0] == WAIT:
            waited[r].append(landing_place(step[2], space, parity))
        elif step[0] == REDUCE:
            _, ka, a, kb, b, dst = step
            bufs[r][dst] = op(value(r, ka, a), value(r, kb, b))
