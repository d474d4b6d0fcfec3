"""Quick calls: a small collective on a group's formed, idle step engine in a few Python steps.

The general path (:meth:`~._core.GroupCore._run_engine`) serves every engine call: closures
for the call's two halves, a turn on the engine, the checks it shares with the links' path,
the engine's staging helpers. That is about sixty Python function calls per call, and in the
test VM (2 vCPUs under emulation) most of a small call's time: a 4 KiB float32 allreduce at
2 ranks took 1,050-1,190 us through it against 390-460 us for the compiled runner's
``start``, its poll and the wait alone, in the same processes.

A quick call does the same work with a handful: the call's arguments are looked up in a plan
made once per (dtype, count, op); the call is numbered and started at once (no turn: nothing
else runs before it ends or, if its poll does not end it, before it takes one); its future,
often done when the poll returns, is awaited only if it is not. It serves what most calls
are, on the compiled runner only (the Python runner keeps the general path):

- ``allreduce(array, op)`` in place on a writable C-contiguous numpy array of a native dtype
  with an op the runner has a typed loop for (not ``avg``), within the engine's size;
- ``barrier()``.

Anything else, an engine that is not formed or is busy, or a group that is closed or broken,
takes the general path, which says what is wrong. The rules are the general path's: the
call's number, the engine's mismatch checks (a message for it on the links), its bound once
it awaits, any failure breaking the group.
"""

from __future__ import annotations

import asyncio
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np

from aiordma.protocols import collectives as proto

from ._arrays import reduce_op
from ._engine import _BARRIER_SIG, ALLREDUCE, BARRIER, Engine, settled
from ._errors import CollectiveArgumentError

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
_ALLREDUCE = proto.kind_code("allreduce")
_BARRIER = proto.kind_code("barrier")
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
        self._plans: dict[tuple[Any, ...], tuple[int, int, int, int] | None] = {}
        self._number = 0  # the call under way (one at a time: the engine is idle first)
        self._sized = False

    # -- the calls ----------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, op: str) -> asyncio.Future[None] | None:
        """Start ``allreduce(array, op)`` in place, if it is quick (see the module): its
        future, for :meth:`ended`; None: run it the general way (nothing was done)."""
        plan = self._plans.get((array.dtype, array.size, op), _UNPLANNED)
        if plan is _UNPLANNED:
            plan = self._plan(array.dtype, array.size, op)
        if plan is None:
            return None
        flags = array.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
        nbytes, signature, opc, code = plan
        return self._start(_ALLREDUCE, True, ALLREDUCE, nbytes, signature, array, opc, code)

    def barrier(self) -> asyncio.Future[None] | None:
        """Start a barrier, as :meth:`allreduce`."""
        return self._start(_BARRIER, False, BARRIER, 0, _BARRIER_SIG, None, -1, -1)

    def ended(self, fut: asyncio.Future[None]) -> bool:
        """Whether the call started (its future ``fut``) is over: True once its outcome is
        taken; False: await :meth:`settle` (it did not end in its poll, or the event loop
        should run others now).

        Raises:
            as the general path: the call's failure, typed (the group breaks).
        """
        if not fut.done():
            return False
        self._end(fut)
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
            self._end(fut)
        finally:
            self._on_engine.discard(self._number)
            slot.finish(turn)

    # -- the work -----------------------------------------------------------------------------

    def _plan(self, dtype: np.dtype[Any], count: int, op: str
              ) -> tuple[int, int, int, int] | None:
        """An allreduce's (bytes, signature, op's and dtype's loop codes), or None if it is
        not quick."""
        engine = self._engine
        plan = None
        try:
            rop = reduce_op(op, dtype, "allreduce")
        except CollectiveArgumentError:
            rop = None
        nbytes = count * dtype.itemsize
        if (rop is not None and rop.name != "avg" and dtype.isnative and not dtype.hasobject
                and 0 < nbytes <= self._group._engine_max):
            code, opc = engine._loop_codes(dtype, rop)
            if code >= 0 and opc >= 0:
                plan = (nbytes, engine.sig("allreduce", rop.name, dtype.str, count), opc, code)
        if len(self._plans) >= _PLANS:
            self._plans.clear()
        self._plans[(dtype, count, op)] = plan
        return plan

    def _start(self, kind: int, sized: bool, program: int, nbytes: int, signature: int,
               array: np.ndarray | None, opc: int, code: int) -> asyncio.Future[None] | None:
        group, fabric, slot, engine = self._group, self._fabric, self._slot, self._engine
        runner = engine.runner
        if (slot.engine is not engine or not slot.idle or runner is None or group._closed
                or fabric.closed or fabric.failure is not None):
            return None
        number = group._number_call(kind)
        self._number, self._sized = number, sized
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
            runner.start(program, nbytes, signature, (), fut, array, array, opc, code)
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

    def _end(self, fut: asyncio.Future[None]) -> None:
        """Take the outcome of the call under way (its future done)."""
        number = self._number
        if self._sized:
            self._on_engine.discard(number)
        try:
            self._engine._outcome(fut)
        except BaseException as exc:
            self._fabric.fail(exc)
            raise
        self._group._order.finish(number)
