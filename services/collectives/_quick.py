"""Quick calls: a small collective on a group's formed, idle step engine in one compiled call.

The general path (:meth:`~._core.GroupCore._run_engine`) serves every engine call: closures
for the call's two halves, a turn on the engine, the checks it shares with the links' path,
the engine's staging helpers. That is about sixty Python function calls per call, and in the
test VM (2 vCPUs under emulation) most of a small call's time: a 4 KiB float32 allreduce at
2 ranks took 1,050-1,190 us through it against 390-460 us for the compiled runner's
``start``, its poll and the wait alone, in the same processes.

A quick call does the same work in one call into C (``QuickCore``, in
``aiordma/_verbs/_fastpath_quick.pxi``) from the collective's method: the call's arguments
are looked up in a plan made here once per (kind, dtype, shape, op or root); the call is
numbered and started at once (no turn: nothing else runs before it ends or, if its poll does
not end it, before it takes one) and polled; if the poll ended it, its outcome is taken
there too, and a future is made only for a call still running. Written in Python, the same
steps took 190-240 us per 4 KiB allreduce at 2 ranks in the VM, about a third of it the
Python between the method and the runner. It serves what most calls are, on the compiled
runner only (the Python runner keeps the general path):

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
from collections.abc import Callable
from types import EllipsisType
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

import numpy as np

from aiordma._verbs import compiled
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

Started: TypeAlias = "asyncio.Future[None] | bool | None"  # (see QuickCalls)

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
    """A group's quick calls on its engine (see the module); made when the engine forms.

    The calls themselves are compiled (``QuickCore`` in ``aiordma/_verbs/_fastpath_quick.pxi``,
    bound here as :meth:`allreduce`, :meth:`reduce_scatter`, :meth:`alltoall`,
    :meth:`broadcast`, :meth:`allgather` and :meth:`barrier`): each takes the collective's
    arguments and returns None (not quick: nothing was done, run it the general way), True
    (over), False (over: :meth:`settle` lets the event loop run once) or a future (running:
    :meth:`settle` waits for it). :meth:`allgather` returns that and where its blocks go.
    They raise as the general path: the call's failure, typed (the group breaks).
    """

    allreduce: Callable[[np.ndarray, str], Started]
    reduce_scatter: Callable[[np.ndarray, str, np.ndarray], Started]
    alltoall: Callable[[np.ndarray, np.ndarray], Started]
    broadcast: Callable[[int, np.ndarray], Started]
    allgather: Callable[[np.ndarray, np.ndarray | None], tuple[Started, Any] | None]
    barrier: Callable[[], Started]

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
        # A call whose quick end left it open (see allgather): (number, future, the engine's
        # state for its general end), and the engine's turn it holds, if it took one.
        self.open: tuple[int, asyncio.Future[None], Any] | None = None
        self.held: int | None = None
        fast = compiled.fastpath()
        assert fast is not None  # (a compiled runner: see GroupCore)
        core = self._core = fast.QuickCore(
            self, (_ALLREDUCE, _REDUCE_SCATTER, _ALLTOALL, _BROADCAST, _ALLGATHER, _BARRIER),
            (ALLREDUCE, REDUCE_SCATTER, ALLTOALL, ALLGATHER, BARRIER), _GATHER_SIG,
            _BARRIER_SIG, UNYIELDED, np.empty)
        self.allreduce, self.reduce_scatter, self.alltoall = (core.allreduce,
                                                              core.reduce_scatter,
                                                              core.alltoall)
        self.broadcast, self.allgather, self.barrier = (core.broadcast, core.allgather,
                                                        core.barrier)

    @property
    def engine(self) -> Engine:
        return self._engine

    async def settle(self, started: asyncio.Future[None] | bool,
                     timeout: float | None | EllipsisType, kind: str) -> None:
        """The rest of a call that did not return True: if it is over (False), let the
        event loop run others once; else wait for its future (taking the engine's turn, so
        that calls started meanwhile wait for it) within ``timeout`` (``...``: the group's)
        and take its outcome."""
        if started is False:  # (over: the event loop's turn; a cancellation here finds the
            await asyncio.sleep(0)  # call over everywhere)
            return
        assert not isinstance(started, bool)
        slot, core, group = self._slot, self._core, self._group
        turn = slot.turn()
        try:
            await group._bounded(kind, group.timeout if timeout is ... else timeout,
                                 settled(started))
            if not core.end(started):
                self.held = turn  # (open: the caller goes on with the turn)
        finally:
            self._on_engine.discard(core.number)
            if self.held != turn:
                slot.finish(turn)

    # -- what the compiled half asks for ------------------------------------------------------

    def _plan_for(self, kind: int, dtype: np.dtype[Any], shape: tuple[int, ...], arg: Any
                  ) -> tuple[Any, ...] | None:
        """The call's plan (:meth:`_plan`) from the table, made if new (a dtype's hash is
        computed each time it is taken: ``QuickCore`` asks only when the kind's last plan
        is not this one)."""
        key = (kind, dtype, shape, type(arg), arg)
        plan = self._plans.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            plan = self._plan(kind, dtype, shape, arg)
            if len(self._plans) >= _PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan  # type: ignore[no-any-return]

    def _leftovers(self, number: int, kind: int) -> None:
        """Call ``number`` (of wire kind ``kind``) starts while the links hold messages
        filed for some call: none may be for it (see GroupCore._engine_enter)."""
        group = self._group
        try:
            group._check_leftovers(group._links_for(), proto.Tag(group._number, 0, number, kind))
        except BaseException as exc:
            self._fabric.fail(exc)
            raise

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
        return plan

    def _not_like_root(self, root: int, array: np.ndarray, tail: bytes) -> NoReturn:
        """A broadcast's block did not match this (non-root) rank's ``array`` (its bytes and
        ``tail``, its description): the typed mismatch, naming what the root sent."""
        engine = self._engine
        runner = engine._runner()
        kind, i = engine.programs[engine._roots + root].results[0]
        block = engine._view(kind, i, runner.landed(i), (runner.calls - 1) & 1)
        got = engine._read_block(block, root, meta_dtype_shape)
        sent = ("an array too large for the step engine" if got is None else
                f"{got[1][0]} of shape {got[1][1]}")
        raise CollectiveMismatchError(f"rank {engine.rank} passed a {array.dtype} array of "
                                      f"shape {array.shape} to broadcast; root {root} sent "
                                      f"{sent}")

