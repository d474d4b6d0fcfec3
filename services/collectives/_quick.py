"""Quick calls: a small collective on a group's formed, idle step engine in a few Python steps.

The general path (:meth:`~._core.GroupCore._run_engine`) serves every engine call: closures
for the call's two halves, a turn on the engine, the checks it shares with the links' path,
the engine's staging helpers. That is about sixty Python function calls per call, and in the
test VM (2 vCPUs under emulation) most of a small call's time: a 4 KiB float32 allreduce at
2 ranks took 1,050-1,190 us through it against 390-460 us for the compiled runner's
``start``, its poll and the wait alone, in the same processes.

A quick call does the same work with a handful: the call's arguments are looked up in a plan
made once per (kind, dtype, shape, op or root); the call is numbered and started at once (no turn: nothing
else runs before it ends or, if its poll does not end it, before it takes one); its future,
often done when the poll returns, is awaited only if it is not. It serves what most calls
are, on the compiled runner only (the Python runner keeps the general path):

- ``allreduce(array, op)`` in place on a writable C-contiguous numpy array of a native dtype
  with an op the runner has a typed loop for (not ``avg``), within the engine's size;
- ``reduce_scatter(array, op, out=)`` and ``alltoall(array, out=)`` with ``out`` given, both
  C-contiguous numpy arrays, their blocks within the engine's size (the reduce-scatter's
  dtype and op as the allreduce's);
- ``broadcast(array, root=)`` with a C-contiguous numpy array on every rank (the root's to
  send, the others' writable, to fill), within the engine's size: the runner copies the
  array and its description in, and, on the other ranks, out, if what landed is the
  description of the rank's own array (else a typed mismatch, as the general path's);
- ``allgather(array)`` and ``allgather(array, out=)`` with a C-contiguous numpy array, in
  groups the engine gathers in, within its size: the runner copies every rank's block out
  into a new array (or ``out``'s row) if it has this rank's dtype and shape; else the call
  goes on the general way from there (:meth:`~._core.GroupCore._engine_rest`: the blocks
  parsed, or, if one did not fit the engine, the call on the links);
- ``barrier()``.

Anything else, an engine that is not formed or is busy, or a group that is closed or broken,
takes the general path, which says what is wrong. The rules are the general path's: the
call's number, the engine's mismatch checks (a message for it on the links), its bound once
it awaits, any failure breaking the group.
"""

from __future__ import annotations

import asyncio
import math
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np

from aiordma.protocols import collectives as proto

from ._arrays import reduce_op
from ._engine import (
    _BARRIER_SIG,
    _OVERSIZE,
    _GATHER_SIG,
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    REDUCE_SCATTER,
    Engine,
    settled,
)
from ._errors import CollectiveArgumentError, CollectiveMismatchError
from ._meta import meta_dtype_shape, meta_for

if TYPE_CHECKING:
    from ._core import GroupCore

__all__ = ["QuickCalls"]

# An engine call that ended in its poll returns without the event loop turning; every
# UNYIELDED-th call by number (the same calls on every rank) that did gives it a turn, so that
# a loop of them does not starve other tasks. By number, not by a count of its own: a rank
# whose loop turns while its partners poll for its next WRITE makes their poll run out, and
# their wake-up by the completion channel costs far more than the turn. Measured in the test
# VM (4 KiB allreduces at 2 ranks, 200 back to back): a turn every 8th call counted per rank
# cost about 250 us per call on average against no turn; every 8th by number, 70-110 us (a
# turn of the loop there takes hundreds of microseconds); hence every 32nd.
UNYIELDED = 32
_ALLGATHER = proto.kind_code("allgather")
_ALLREDUCE = proto.kind_code("allreduce")
_ALLTOALL = proto.kind_code("alltoall")
_BARRIER = proto.kind_code("barrier")
_BROADCAST = proto.kind_code("broadcast")
_REDUCE_SCATTER = proto.kind_code("reduce_scatter")
_PLANS = 256  # plans kept per group
_UNPLANNED: Any = object()


class QuickCalls:
    """A group's quick calls on its engine (see the module); made when the engine forms."""

    def __init__(self, group: GroupCore, engine: Engine) -> None:
        self._group = group
        self._slot = group._engine
        self._engine = engine
        self._fabric = group._fabric
        self._reactor = engine._reactor
        self._spin = engine._spin
        self._loop = asyncio.get_running_loop()
        self._on_engine = self._fabric.on_engine.setdefault(group._number, set())
        # (what the links have filed from each rank, by call: empty while nothing waits)
        self._filed = [inb.filed for inb in group._links_for().ins.values()]
        self._plans: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}
        self._last: list[Any] = [None] * len(proto.KINDS)  # by kind: (dtype, shape, arg, plan)
        self._order = group._order
        self._number = 0  # the call under way (one at a time: the engine is idle first)
        self._sized = False
        self._into: tuple[int, np.ndarray, bytes] | None = None  # its result to copy out
        self._gather: tuple[Any, bytes, Any] | None = None  # ... its results
        # A call whose quick end left it open (see allgather): (number, future, the engine's
        # state for its general end), and the engine's turn it holds, if it took one.
        self.open: tuple[int, asyncio.Future[None], Any] | None = None
        self.held: int | None = None

    @property
    def engine(self) -> Engine:
        return self._engine

    # -- the calls ----------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, op: str) -> asyncio.Future[None] | None:
        """Start ``allreduce(array, op)`` in place, if it is quick (see the module): its
        future, for :meth:`ended`; None: run it the general way (nothing was done)."""
        plan = self._plan_for(_ALLREDUCE, array, op)
        if plan is None:
            return None
        flags = array.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
        nbytes, signature, opc, code = plan
        return self._start(_ALLREDUCE, True, ALLREDUCE, nbytes, signature, array, array, opc,
                           code)

    def reduce_scatter(self, array: np.ndarray, op: str, out: np.ndarray
                       ) -> asyncio.Future[None] | None:
        """Start ``reduce_scatter(array, op, out=out)``, as :meth:`allreduce`."""
        plan = self._plan_for(_REDUCE_SCATTER, array, op)
        if (plan is None or out.shape != plan[4] or out.dtype != array.dtype
                or not (array.flags.c_contiguous and _writable(out))):
            return None
        nbytes, signature, opc, code, _ = plan
        return self._start(_REDUCE_SCATTER, True, REDUCE_SCATTER, nbytes, signature, array,
                           out, opc, code)

    def alltoall(self, array: np.ndarray, out: np.ndarray) -> asyncio.Future[None] | None:
        """Start ``alltoall(array, out=out)``, as :meth:`allreduce`."""
        plan = self._plan_for(_ALLTOALL, array, None)
        if (plan is None or out.shape != array.shape or out.dtype != array.dtype
                or not (array.flags.c_contiguous and _writable(out))):
            return None
        nbytes, signature = plan
        return self._start(_ALLTOALL, True, ALLTOALL, nbytes, signature, array, out, -1, -1)

    def broadcast(self, root: int, array: np.ndarray) -> asyncio.Future[None] | None:
        """Start ``broadcast(array, root=root)``, as :meth:`allreduce`."""
        plan = self._plan_for(_BROADCAST, array, root)
        if plan is None:
            return None
        program, signature, tail = plan
        engine = self._engine
        if root == engine.rank:
            if not array.flags.c_contiguous:
                return None
            return self._start(_BROADCAST, False, program, array.nbytes + len(tail), signature,
                               array, None, -1, -1, tail)
        if not _writable(array):
            return None
        fut = self._start(_BROADCAST, False, program, 0, signature, None, None, -1, -1)
        if fut is not None:
            self._into = (root, array, tail)
        return fut

    def allgather(self, array: np.ndarray, out: np.ndarray | None
                  ) -> tuple[asyncio.Future[None], Any] | None:
        """Start ``allgather(array, out=out)`` (``out`` a numpy array, or None), as
        :meth:`allreduce` (an ``out`` that is not a writable C-contiguous array of shape
        ``(world, *array.shape)`` and ``array``'s dtype: None, the general way, which says
        so): its future and where its blocks go (``out``, or a list of new arrays). If a
        block is not of this rank's dtype and shape, :meth:`ended` or :meth:`settle` leave the
        call :attr:`open`."""
        plan = self._plan_for(_ALLGATHER, array, None)
        if plan is None or not array.flags.c_contiguous:
            return None
        tail, size, rows = plan
        if out is not None:
            if not (out.shape == rows and out.dtype == array.dtype and _writable(out)):
                return None
            into: Any = out  # (its rows in one copy)
        else:  # (allocated first: nothing may fail once it started)
            into = [np.empty(array.shape, array.dtype) for _ in range(self._engine.world)]
        runner = self._engine.runner
        parity = runner.calls & 1 if runner is not None else 0  # (the call's: start counts it)
        fut = self._start(_ALLGATHER, False, ALLGATHER, size, _GATHER_SIG, array, None, -1, -1,
                          tail)
        if fut is None:
            return None
        self._gather = (into, tail, (size, parity))
        return fut, into

    def barrier(self) -> asyncio.Future[None] | None:
        """Start a barrier, as :meth:`allreduce`."""
        return self._start(_BARRIER, False, BARRIER, 0, _BARRIER_SIG, None, None, -1, -1)

    def ended(self, fut: asyncio.Future[None]) -> bool:
        """Whether the call started (its future ``fut``) needs nothing more from the
        caller here: True once its outcome is taken (or it was left :attr:`open`, for the
        caller to go on with at once); False: await :meth:`settle` (it did not end in its
        poll, or the event loop should run others now).

        Raises:
            as the general path: the call's failure, typed (the group breaks).
        """
        if not fut.done():
            return False
        if not self._end(fut):
            return True  # (open: the caller goes on at once)
        return (self._number + 1) % UNYIELDED != 0

    async def settle(self, fut: asyncio.Future[None], timeout: float | None | EllipsisType,
                     kind: str) -> None:
        """The rest of a call :meth:`ended` did not end: if it is over, let the event loop
        run others once; else wait for it (taking the engine's turn, so that calls started
        meanwhile wait for it) within ``timeout`` (``...``: the group's) and take its
        outcome."""
        slot = self._slot
        if fut.done():  # (ended: the event loop's turn; a cancellation here finds the call
            await asyncio.sleep(0)  # over everywhere)
            return
        group = self._group
        turn = slot.turn()
        try:
            await group._bounded(kind, group.timeout if timeout is ... else timeout,
                                 settled(fut))
            if not self._end(fut):
                self.held = turn  # (open: the caller goes on with the turn)
        finally:
            self._on_engine.discard(self._number)
            if self.held != turn:
                slot.finish(turn)

    # -- the work -----------------------------------------------------------------------------

    def _plan_for(self, kind: int, array: np.ndarray, arg: Any) -> tuple[Any, ...] | None:
        """:meth:`_plan` for ``array`` and ``arg``: the kind's last plan if ``array`` has the
        same dtype object and shape and ``arg`` is equal (no dtype hashed), else the table's
        (a dtype's hash is computed each time it is taken)."""
        dtype, shape = array.dtype, array.shape
        last = self._last[kind]
        if last is not None and dtype is last[0] and shape == last[1] and arg == last[2]:
            return last[3]  # type: ignore[no-any-return]
        plan = self._plans.get((kind, dtype, shape, arg), _UNPLANNED)
        if plan is _UNPLANNED:
            plan = self._plan(kind, dtype, shape, arg)
        self._last[kind] = (dtype, shape, arg, plan)
        return plan  # type: ignore[no-any-return]

    def _plan(self, kind: int, dtype: np.dtype[Any], shape: tuple[int, ...], arg: Any
              ) -> tuple[Any, ...] | None:
        """The call's fixed arguments for the runner (by kind: see the callers), or None if
        it is not quick; kept per (kind, dtype, shape, op or root)."""
        engine = self._engine
        world = engine.world
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        plan: tuple[Any, ...] | None = None
        if dtype.hasobject or dtype.kind in "mM":  # (no buffer for the runner's copies)
            pass
        elif kind == _BROADCAST:
            if type(arg) is int and 0 <= arg < world and nbytes <= engine.cap:
                sig = engine._broadcast_sigs.get(arg)
                if sig is None:
                    sig = engine._broadcast_sigs[arg] = proto.signature("broadcast", arg)
                tail = proto.block_tail(meta_for(dtype, shape))
                if tail != _OVERSIZE:
                    plan = (engine._roots + arg, sig, tail)
        elif kind == _ALLGATHER:
            if engine.gathers and nbytes <= engine.cap:
                tail = proto.block_tail(meta_for(dtype, shape))
                if tail != _OVERSIZE:
                    plan = (tail, nbytes + len(tail), (world, *shape))
        elif kind == _ALLTOALL:
            if (engine.gathers and shape and shape[0] % world == 0
                    and 0 < nbytes // world <= self._group._engine_max):
                plan = (nbytes // world, engine.sig("alltoall", dtype.str, tuple(shape[1:])))
        else:
            try:
                rop = reduce_op(arg, dtype, "")
            except CollectiveArgumentError:
                rop = None
            block = nbytes if kind == _ALLREDUCE else nbytes // world
            fits = kind == _ALLREDUCE or (engine.gathers and shape and shape[0] % world == 0)
            if (fits and rop is not None and rop.name != "avg" and dtype.isnative
                    and 0 < block <= self._group._engine_max):
                code, opc = engine._loop_codes(dtype, rop)
                if code >= 0 and opc >= 0:
                    if kind == _ALLREDUCE:
                        plan = (nbytes, engine.sig("allreduce", rop.name, dtype.str, count),
                                opc, code)
                    else:
                        plan = (block, engine.sig("reduce_scatter", rop.name, dtype.str,
                                                  count), opc, code,
                                (shape[0] // world, *shape[1:]))
        if len(self._plans) >= _PLANS:
            self._plans.clear()
        self._plans[(kind, dtype, shape, arg)] = plan
        return plan

    def _start(self, kind: int, sized: bool, program: int, nbytes: int, signature: int,
               src: np.ndarray | None, dst: np.ndarray | None, opc: int, code: int,
               tail: bytes | None = None) -> asyncio.Future[None] | None:
        group, fabric, slot, engine = self._group, self._fabric, self._slot, self._engine
        runner = engine.runner
        if (slot.engine is not engine or slot._done != slot._turns or runner is None
                or group._closed or fabric.closed or fabric.failure is not None):
            return None  # (the turns' count: EngineSlot.idle)
        group.calls += 1  # (GroupCore._number_call, without its call)
        try:
            number = self._order.start(kind)
        except proto.MismatchError as disorder:
            raise group._out_of_order(disorder) from None
        self._number, self._sized, self._into, self._gather = number, sized, None, None
        if sized:  # (see GroupCore._engine_enter)
            for filed in self._filed:
                if filed:
                    try:
                        group._check_leftovers(group._links_for(),
                                               proto.Tag(group._number, 0, number, kind))
                    except BaseException as exc:
                        fabric.fail(exc)
                        raise
                    break
            self._on_engine.add(number)
        fut = self._loop.create_future()
        try:
            runner.start(program, nbytes, signature, (), fut, src, dst, opc, code, tail)
            if self._spin and not fut.done():
                self._reactor.spin_for(runner, self._spin)
        except BaseException as exc:
            self._on_engine.discard(number)
            err = engine._typed(exc)
            fabric.fail(err)
            if err is exc:
                raise
            raise err from None
        return fut

    def _end(self, fut: asyncio.Future[None]) -> bool:
        """Take the outcome of the call under way (its future done): True; or False, an
        allgather whose blocks are not all of this rank's dtype and shape, left
        :attr:`open`."""
        number = self._number
        if self._sized:
            self._on_engine.discard(number)
        try:
            exc = fut.exception()  # (Engine._outcome)
            if exc is not None:
                raise self._engine._typed(exc) from exc.__cause__
            if self._into is not None:
                into, self._into = self._into, None
                self._copy_out(*into)
            if self._gather is not None:
                (into, tail, state), self._gather = self._gather, None
                if not self._engine._runner().results_into(into, tail):
                    self.open = (number, fut, state)
                    return False
        except BaseException as exc:
            self._fabric.fail(exc)
            raise
        self._order.finish(number)
        return True

    def _copy_out(self, root: int, array: np.ndarray, tail: bytes) -> None:
        """A broadcast's block into this (non-root) rank's ``array``, if it is what landed
        (``array``'s bytes and ``tail``, its description)."""
        engine = self._engine
        runner = engine._runner()
        if runner.result_into(0, array, tail):
            return
        kind, i = engine.programs[engine._roots + root].results[0]
        block = engine._view(kind, i, runner.landed(i), (runner.calls - 1) & 1)
        got = engine._read_block(block, root, meta_dtype_shape)
        sent = ("an array too large for the step engine" if got is None else
                f"{got[1][0]} of shape {got[1][1]}")
        raise CollectiveMismatchError(f"rank {engine.rank} passed a {array.dtype} array of "
                                      f"shape {array.shape} to broadcast; root {root} sent "
                                      f"{sent}")


def _writable(array: np.ndarray) -> bool:
    flags = array.flags
    return bool(flags.c_contiguous and flags.writeable)
