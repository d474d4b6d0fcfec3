"""The machinery of a :class:`~._group.Group`: formation, running an operation, subgroups,
and the lifecycle. The operations themselves are in :mod:`._data_ops` (moving data),
:mod:`._reduce_ops` (reductions) and :mod:`._p2p` (point to point).

Running an operation (:meth:`GroupCore._run`)
    An operation gets its call number the moment it starts (before its first ``await``), so
    the order in which a rank starts a group's collectives is the order that
    :class:`~aiordma.protocols.collectives.CallOrder` checks across ranks. It leases work
    buffers from the plane, runs its algorithm under the timeout, and, on any failure or
    cancellation, breaks the group (:mod:`._fabric`).

Subgroups
    :meth:`GroupCore.split` and :meth:`GroupCore.subgroup` make groups over some of the ranks
    that use the same links (no new connection): a subgroup's rank ``i`` is one rank of its
    parent, its messages carry its own group number (derived from how it was made, the same
    on every member), its collectives have their own order, and they may run at the same
    time as the parent's and other subgroups'. A subgroup breaks with its parent (they share
    the links); closing a subgroup ends only that subgroup.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from types import EllipsisType
from typing import Any, Self, TypeVar

from aiordma import (
    BrokenResourceError,
    ClosedResourceError,
    Config,
    LocalProtocolError,
    OperationTimeout,
)
from aiordma._args import check_host, check_int, check_port, check_seconds, check_type
from aiordma._bound import TaskBound
from aiordma.lowlevel import Device
from aiordma.protocols import collectives as proto

from . import _rounds
from ._engine import Engine, EngineSlot, engine_max, settled
from ._env import launch_environment
from ._errors import CollectiveArgumentError, CollectiveMismatchError, GroupError
from ._fabric import Fabric
from ._mesh import SLOTS, Mesh
from ._plane import CallPlane, GroupLinks
from ._quick import UNYIELDED, QuickCalls

TRANSPORTS = ("auto", "rdma", "tcp")

__all__ = ["MAX_WORLD", "GroupCore", "arg", "timeout_arg"]

T = TypeVar("T")

MAX_WORLD = 4096  # ranks; each holds 2 (world - 1) connections
MAX_TAG = (1 << 31) - 1
_THRESHOLDS = tuple(f.name for f in dataclasses.fields(proto.Thresholds))


def arg(check: Callable[..., T], value: Any, *args: Any, **kwargs: Any) -> T:
    """``check(value, ...)`` (the library's argument rule), raising
    :class:`CollectiveArgumentError` (also a ``LocalProtocolError``) instead."""
    try:
        return check(value, *args, **kwargs)
    except LocalProtocolError as exc:
        raise CollectiveArgumentError(str(exc)) from None


def timeout_arg(timeout: Any) -> float | None | EllipsisType:
    """An operation's ``timeout``: ``...`` (the group's), None (unbounded) or seconds (0: a
    bound already spent)."""
    if timeout is ...:
        return timeout
    return arg(check_seconds, timeout, name="timeout", none_ok=True, zero_ok=True)


class GroupCore:
    """See :class:`~._group.Group` (the public class) and the module documentation."""

    def __init__(self, *, rank: int, world_size: int, timeout: float | None,
                 fabric: Fabric | None = None, members: Sequence[int] | None = None,
                 number: int = 0, thresholds: proto.Thresholds | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.calls = 0
        self.thresholds = thresholds or proto.Thresholds()
        self._engine_max = min(self.thresholds.engine, engine_max(world_size))  # bytes
        self._fabric = fabric if fabric is not None else Fabric(rank)
        self._members = tuple(members) if members is not None else tuple(range(world_size))
        self._number = number  # the group's number on the wire (0: the whole group)
        name = "the group" if number == 0 else f"subgroup {number:#x}"
        self._order = self._fabric.orders.setdefault(number, proto.CallOrder(name))
        self._links: GroupLinks | None = None
        self._closed = False
        self._sends: Counter[tuple[int, int]] = Counter()  # (dst, tag) -> sends started
        self._recvs: Counter[tuple[int, int]] = Counter()  # (src, tag) -> receives started
        self._made: Counter[tuple[int, ...]] = Counter()  # subgroup(ranks) calls per ranks
        self._engine = EngineSlot()  # (see _engine: small allreduces as step programs)
        self._fabric.engines.append(self._engine)

    # -- formation -----------------------------------------------------------------------------

    @classmethod
    async def from_env(cls, *, timeout: float | None = 60.0, **kwargs: Any) -> Self:
        """Join the group the environment describes (see :mod:`aiordma.services.collectives._env`:
        ``RANK``/``WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``/``_SIZE`` or
        ``SLURM_PROCID``/``SLURM_NTASKS``, with ``MASTER_ADDR`` and ``MASTER_PORT``); other
        arguments as :meth:`join`.

        Raises:
            LaunchEnvironmentError: the variables are missing or invalid (it says which).
        """
        env = launch_environment()
        return await cls.join(env.rank, env.world_size, env.master_addr, env.master_port,
                              timeout=timeout, **kwargs)

    @classmethod
    async def join(cls, rank: int, world_size: int, master_addr: str, master_port: int, *,
                   timeout: float | None = 60.0, host: str | None = None,
                   device: str | Device | None = None, config: Config | None = None,
                   slots: int = SLOTS, slot_bytes: int | None = None,
                   thresholds: proto.Thresholds | None = None,
                   transport: str = "auto") -> Self:
        """Form the group: rank 0 serves the rendezvous on ``master_addr:master_port``.

        Args:
            rank, world_size: this process's place (``0 <= rank < world_size``).
            master_addr, master_port: where rank 0 serves the rendezvous.
            timeout: bound on the formation, and the default bound on each operation.
            host: the address this rank's listener is advertised on (default: the local
                address that reaches rank 0; ``master_addr`` for rank 0).
            device, config: passed to every endpoint (device choice, endpoint tunables).
            slots, slot_bytes: this rank's receive slots from each other rank (the unit of
                pipelining; ranks may differ). ``slot_bytes`` is rounded up to 64; by
                default 2 slots of 1 MiB, 2 MiB registered per link (a piece is a Python
                round on both ends, so large arrays go in few). Over TCP, ``slot_bytes``
                is the size of the pieces this rank receives (default 256 KiB, at most 1 MiB
                less 1 KiB: every piece travels in a message) and ``slots`` is unused.
            thresholds: the sizes up to which each collective runs its few-rounds algorithm
                (default :class:`~aiordma.protocols.collectives.Thresholds`: 64 KiB), runs
                on the step engine (1 MiB; 256 KiB in groups of more than 4 ranks) and from
                which it is written (1 MiB); every rank must pass the same.
            transport: the links: ``"auto"`` (default: RDMA, unless some rank has no usable
                RDMA device or asked for TCP: then TCP for the whole group, decided at the
                rendezvous), ``"rdma"`` (this rank requires RDMA links) or ``"tcp"`` (TCP
                links: no device is used). :attr:`transport` says what the group got.

        Raises:
            RendezvousError: rank 0 refused the group (duplicate rank, world size mismatch,
                one rank asked for ``"rdma"`` and another for ``"tcp"``).
            OperationTimeout: the group did not form in ``timeout`` seconds.
            BrokenResourceError: a rank died during formation.
            CollectiveArgumentError: invalid arguments.
            UnsupportedOperationError: ``transport="rdma"`` and this host has no usable
                RDMA device.
        """
        world_size = arg(check_int, world_size, name="world_size", low=1, high=MAX_WORLD)
        rank = arg(check_int, rank, name="rank", low=0, high=world_size - 1)
        arg(check_host, master_addr, name="master_addr")
        arg(check_port, master_port, name="master_port")
        timeout = arg(check_seconds, timeout, name="timeout", none_ok=True)
        if host is not None:
            arg(check_host, host, name="host")
        arg(check_type, device, (str, Device, type(None)), name="device",
            what="a device name, a Device or None")
        arg(check_type, config, (Config, type(None)), name="config", what="a Config or None")
        if transport not in TRANSPORTS or not isinstance(transport, str):
            raise CollectiveArgumentError(f"transport must be 'auto', 'rdma' or 'tcp', not "
                                          f"{transport!r:.80}")
        slots = arg(check_int, slots, name="slots", low=1, high=1024)
        if slot_bytes is not None:
            slot_bytes = arg(check_int, slot_bytes, name="slot_bytes", low=1, high=1 << 30)
            slot_bytes = -(-slot_bytes // 64) * 64
        if thresholds is not None:
            arg(check_type, thresholds, proto.Thresholds, name="thresholds",
                what="a Thresholds")
            for f in _THRESHOLDS:
                arg(check_int, getattr(thresholds, f), name=f"thresholds.{f}", low=0)
        group = cls(rank=rank, world_size=world_size, timeout=timeout, thresholds=thresholds)
        if world_size == 1:
            return group
        fabric = group._fabric
        fabric.mesh = mesh = Mesh(rank, world_size, timeout)
        formation = group._order.start(proto.kind_code("formation"))  # call 0
        try:
            async with asyncio.timeout(timeout):
                fabric.plane = await mesh.form(master_addr, master_port, host, device, config,
                                               slots, slot_bytes, fabric, formation, transport)
        except TimeoutError:
            await group._abandon(mesh)
            raise OperationTimeout(f"rank {rank}: the group of {world_size} did not form "
                                   f"within {timeout} s") from None
        except BaseException:
            await group._abandon(mesh)
            raise
        group._order.finish(formation)
        return group

    async def _abandon(self, mesh: Mesh) -> None:
        """Formation failed: stop the links' readers (their reports no longer matter), then
        let the mesh release everything (rank 0 gives the others a moment to read a refusal
        first)."""
        self._fabric.closed = True
        if mesh.plane is not None:
            mesh.plane.stop()
        await mesh.abort_quietly()

    @property
    def transport(self) -> str | None:
        """What the group's links are: ``"rdma"`` or ``"tcp"`` (the same on every rank and in
        every subgroup: see :meth:`join`); None for a group of one rank (no link)."""
        mesh = self._fabric.mesh
        return mesh.transport if mesh is not None else None

    # -- subgroups -----------------------------------------------------------------------------

    async def split(self, color: int | None, key: int | None = None, *,
                    timeout: float | None | EllipsisType = ...) -> Self | None:
        """MPI's ``Comm_split``: a collective of this group that makes one new group per
        ``color``, of the ranks that passed it; ``None`` for the ranks that passed ``color``
        None (MPI's ``UNDEFINED``: they join none).

        Ranks of a color are ordered by ``key`` (default: their rank here), ties by their rank
        here. The new groups use this group's links (no new connection) and run their
        collectives at the same time as this group's and each other's. Every rank of this
        group must call it (it is one of its collectives, in its order).

        Args:
            color: an int ``>= 0``, or None.
            key: an int (default: this rank's rank here).

        Raises:
            CollectiveArgumentError: a negative or non-int color, or a non-int key.
            BrokenResourceError, OperationTimeout: as :meth:`~._group.Group.barrier`.
        """
        timeout = timeout_arg(timeout)
        if color is not None:
            color = arg(check_int, color, name="color", low=0, high=MAX_TAG)
        key = self.rank if key is None else arg(check_int, key, name="key",
                                                low=-(1 << 63), high=(1 << 63) - 1)

        async def run(plane: CallPlane, call: proto.Tag) -> list[Any]:
            return await _rounds.exchange(plane, call, [color, key])

        if self.world_size == 1:
            self._alone()
            entries: list[Any] = [[color, key]]
            call_number = self._order.start(proto.kind_code("split"))
            self._order.finish(call_number)
        else:
            entries, call_number = await self._run("split", timeout, run, with_call=True)
        try:
            local = proto.split_members(entries, self.rank)
        except proto.ProtocolError as exc:
            raise CollectiveMismatchError(f"rank {self.rank}: split: {exc}") from None
        if local is None:
            return None
        number = proto.group_id(self._number, "split", call_number, color)
        return self._child(local, number)

    def subgroup(self, ranks: Sequence[int]) -> Self | None:
        """The group of ``ranks`` (ranks of this group; rank ``i`` of the new group is
        ``ranks[i]``), or None on a rank not in it. Local: nothing is sent, so every member
        must make the subgroups of the same ``ranks`` in the same order (a member's second
        subgroup of the same ranks is another group than its first). The new group uses this
        group's links and runs its collectives at the same time as this group's and others'.

        Raises:
            CollectiveArgumentError: ``ranks`` is empty, has duplicates, or a rank out of range.
        """
        self._check_usable()
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise CollectiveArgumentError(f"ranks must be a sequence of ranks, not "
                                          f"{type(ranks).__name__}")
        picked = tuple(arg(check_int, r, name="rank", low=0, high=self.world_size - 1)
                       for r in ranks)
        if not picked or len(set(picked)) != len(picked):
            raise CollectiveArgumentError(f"a subgroup needs distinct ranks, at least one: "
                                          f"{list(picked)}")
        self._made[picked] += 1
        if self.rank not in picked:
            return None
        number = proto.group_id(self._number, "subgroup", picked, self._made[picked])
        return self._child(list(picked), number)

    def _child(self, local: Sequence[int], number: int) -> Self:
        child = type(self)(rank=local.index(self.rank), world_size=len(local),
                           timeout=self.timeout, fabric=self._fabric,
                           members=[self._members[i] for i in local], number=number,
                           thresholds=self.thresholds)
        return child

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks of this group in the whole group it was made from (``(0, 1, ..., n - 1)``
        for a group that was formed, not made by ``split`` or ``subgroup``)."""
        return self._members

    # -- running an operation --------------------------------------------------------------------

    def _check_usable(self) -> None:
        fabric = self._fabric
        if self._closed or fabric.closed:
            raise ClosedResourceError("the group is closed")
        if fabric.failure is not None:
            raise BrokenResourceError(f"the group is broken ({fabric.failure!r}); form a new "
                                      f"one") from fabric.failure

    def _choose(self, kind: str, nbytes: int) -> str:
        """:func:`~aiordma.protocols.collectives.choose` for this group: its size, its
        thresholds, and its links (one-sided over RDMA)."""
        return proto.choose(kind, nbytes, self.world_size, self.thresholds,
                            self.transport == "rdma")

    def _alone(self) -> None:
        """A collective of a group of one starts (and ends: there is no one to wait for)."""
        self._check_usable()
        self.calls += 1

    def _links_for(self) -> GroupLinks:
        if self._links is None:
            plane = self._fabric.plane
            if plane is None:
                raise GroupError("this group was never formed: make groups with Group.join() "
                                 "or Group.from_env()")
            self._links = GroupLinks(plane, self._members, self.rank)
        return self._links

    async def _run(self, kind: str, timeout: float | None | EllipsisType,
                   fn: Callable[[CallPlane, proto.Tag], Awaitable[Any]], *,
                   channel: int = 0, number: int | None = None, what: str | None = None,
                   with_call: bool = False) -> Any:
        """Run one operation (see the module): state checks, its number, the timeout, the
        work buffers, and the rule that a failed or cancelled operation breaks the group.
        ``channel`` 0 is the group's collectives (numbered here); point-to-point operations
        pass their channel and ``number``. ``what`` names it in errors (default ``kind``).
        ``with_call``: return ``(result, call number)``."""
        self._check_usable()
        self._links_for()
        bound = self.timeout if timeout is ... else timeout
        op = proto.kind_code(kind)
        if channel == 0:
            number = self._number_call(op)
        assert number is not None
        tag = proto.Tag(self._number, channel, number, op)
        result = await self._bounded(what or kind, bound, self._on_links(tag, fn))
        if channel == 0:
            self._order.finish(number)
        return (result, number) if with_call else result

    def _number_call(self, op: int) -> int:
        """The number of the collective (of wire kind ``op``) starting now; a rank that heard
        of this call as another kind breaks the group."""
        self.calls += 1
        try:
            return self._order.start(op)
        except proto.MismatchError as disorder:
            raise self._out_of_order(disorder) from None

    def _out_of_order(self, disorder: proto.MismatchError) -> CollectiveMismatchError:
        """A call this rank started as another kind than another rank: the group breaks."""
        err = CollectiveMismatchError(f"rank {self.rank}: {disorder}")
        self._fabric.fail(err)
        return err

    async def _on_links(self, tag: proto.Tag,
                        fn: Callable[[CallPlane, proto.Tag], Awaitable[T]]) -> T:
        """Run ``fn``, an algorithm on the links, for call ``tag``, with work buffers leased
        from the plane; a collective must have taken every message sent for it."""
        links = self._links_for()
        plane = self._fabric.plane
        assert plane is not None
        work = plane.lease()
        try:
            view = CallPlane(links, work, plane)
            if plane.writing:  # (no coroutine for the common case: nothing to wait for)
                await view.settle()  # WRITEs of the work buffers' last user
            result = await fn(view, tag)
            if tag.channel == 0:
                self._check_leftovers(links, tag)
            return result
        finally:
            plane.give_back(work)

    async def _bounded(self, what: str, bound: float | None, body: Awaitable[T]) -> T:
        """Await ``body`` (an operation) within ``bound`` seconds: a timer that cancels this
        task (as asyncio.timeout does, at a fifth of its cost: 7.7 us per call on the host, a
        third of a small collective's Python) raises :class:`OperationTimeout`; any failure
        or cancellation breaks the group."""
        fabric = self._fabric
        task = asyncio.current_task()
        assert task is not None
        fabric.running.add(task)
        base = task.cancelling()
        timer = None
        if bound is not None:  # (a bound of 0 is spent first thing, as in asyncio)
            loop = asyncio.get_running_loop()
            timer = TaskBound(loop, task, loop.time() + bound if bound > 0 else None)
        try:
            try:
                return await body
            except asyncio.CancelledError:
                if timer is not None and timer.expired():  # the bound's own cancellation
                    raise TimeoutError from None
                # The group broke (Fabric.fail cancelled this task): that cancellation is
                # the group's, not the caller's.
                if fabric.failure is not None and task.uncancel() <= base:
                    echo = fabric.echo()
                    raise echo from echo.__cause__
                raise
            finally:
                if timer is not None:
                    timer.close()
        except TimeoutError:
            exc: BaseException = OperationTimeout(f"rank {self.rank}: {what} took longer "
                                                  f"than {bound} s")
            fabric.fail(exc)
            raise exc from None
        except BaseException as e:
            fabric.fail(e)
            raise
        finally:
            fabric.running.discard(task)

    def _engine_now(self, nbytes: int) -> Engine | None:
        """The group's engine if it is formed, takes ``nbytes`` and has no call waiting or
        running on it: a call starting now may run on it at once (:meth:`_run_engine`)."""
        slot = self._engine
        engine = slot.engine
        if type(engine) is Engine and slot.idle and nbytes <= self._engine_max:
            return engine
        return None

    async def _run_engine(self, kind: str, timeout: float | None | EllipsisType,
                          engine: Engine,
                          begin: Callable[[Engine], tuple[asyncio.Future[None], Any]],
                          end: Callable[[Engine, asyncio.Future[None], Any], T],
                          fallback: Callable[[CallPlane, proto.Tag], Awaitable[T]] | None = None,
                          sized: bool = False) -> T:
        """Run one call of ``engine`` (as :meth:`_engine_now` gave it), as one collective with
        :meth:`_run`'s checks, number, bound and failure rule but none of the links' work
        buffers: ``begin(engine)`` starts it (and polls a while), giving its future and a
        state; once the future is done (within the bound, without a timer or a coroutine
        when it is done already), ``end(engine, future, state)`` gives the result, or, with
        ``fallback``, None for "run it there instead" (``fallback`` on the links, same call).
        ``sized``: the call runs on the engine only while its size is within it on every rank
        (an allreduce, alltoall or reduce-scatter): a message for it on the links is a typed
        mismatch at once (see :meth:`_engine_enter`)."""
        slot = self._engine
        turn = slot.turn()
        entered = None
        waited = False
        try:
            self._check_usable()
            op = proto.kind_code(kind)
            number = self._number_call(op)
            try:
                if sized:
                    entered = proto.Tag(self._number, 0, number, op)
                    self._engine_enter(self._links_for(), entered)
                fut, state = begin(engine)
                if not fut.done():
                    waited = True
                    await self._bounded(kind, self.timeout if timeout is ... else timeout,
                                        settled(fut))
                result = end(engine, fut, state)
                if result is None and fallback is not None:
                    waited = True
                    result = await self._on_links_instead(kind, timeout, number, op, fallback)
            except BaseException as exc:
                self._fabric.fail(exc)  # (unless the bound's failure came first)
                raise
            self._order.finish(number)
        finally:
            if entered is not None:
                self._engine_exit(entered)
            slot.finish(turn)
        if not waited and (number + 1) % UNYIELDED == 0:  # (see _quick.UNYIELDED)
            await asyncio.sleep(0)  # (a cancellation here finds the call over everywhere)
        return result

    async def _engine_rest(self, kind: str, timeout: float | None | EllipsisType,
                           quick: QuickCalls, call: tuple[int, Any, Any],
                           end: Callable[[Any, Any], T | None],
                           fallback: Callable[[CallPlane, proto.Tag], Awaitable[T]]) -> T:
        """The rest of a quick call that its quick end left open (``call``, which was
        ``quick.open``: see :mod:`._quick`), as :meth:`_run_engine` would go on:
        ``end(future, state)``, the general end, gives the result, or None: the call runs on
        the links (``fallback``); holding the engine's turn meanwhile, so that the calls
        after it wait."""
        (number, fut, state), quick.open = call, None
        slot = self._engine
        turn, quick.held = (quick.held if quick.held is not None else slot.turn()), None
        waited = False
        try:
            try:
                result = end(fut, state)
                if result is None:
                    waited = True
                    result = await self._on_links_instead(kind, timeout, number,
                                                          proto.kind_code(kind), fallback)
            except BaseException as exc:
                self._fabric.fail(exc)  # (unless the bound's failure came first)
                raise
            self._order.finish(number)
        finally:
            slot.finish(turn)
        if not waited and (number + 1) % UNYIELDED == 0:  # (as _run_engine's)
            await asyncio.sleep(0)
        return result

    def _on_links_instead(self, kind: str, timeout: float | None | EllipsisType, number: int,
                          op: int, fallback: Callable[[CallPlane, proto.Tag], Awaitable[T]]
                          ) -> Awaitable[T]:
        """Engine call ``number`` (of wire kind ``op``) on the links after all (its end said
        so on every rank): ``fallback`` within the call's bound."""
        tag = proto.Tag(self._number, 0, number, op)
        return self._bounded(kind, self.timeout if timeout is ... else timeout,
                             self._on_links(tag, fallback))

    def _engine_or_links(
            self, kind: str, timeout: float | None | EllipsisType, nbytes: int,
            begin: Callable[[Engine], tuple[asyncio.Future[None], Any]],
            end: Callable[[Engine, asyncio.Future[None], Any], T],
            links: Callable[[CallPlane, proto.Tag], Awaitable[T]], *, sized: bool = True,
            fallback: bool = False, forms: bool = True) -> Awaitable[T]:
        """A call of ``nbytes`` on the engine if it takes it: at once if the engine is formed
        and idle (:meth:`_run_engine`), else in its turn (forming the engine if this is the
        first such call and ``forms``); otherwise ``links(plane, call)``. ``begin(engine)``
        and ``end(engine, future, state)``: the engine's halves; with ``fallback``, ``end``
        giving None means the call runs on the links instead. ``sized``: see
        :meth:`_run_engine`."""
        now = self._engine_now(nbytes)
        if now is not None:
            return self._run_engine(kind, timeout, now, begin, end,
                                    links if fallback else None, sized)
        return self._engine_in_turn(kind, timeout, nbytes, begin, end, links, sized, fallback,
                                    forms)

    async def _engine_in_turn(
            self, kind: str, timeout: float | None | EllipsisType, nbytes: int,
            begin: Callable[[Engine], tuple[asyncio.Future[None], Any]],
            end: Callable[[Engine, asyncio.Future[None], Any], T],
            links: Callable[[CallPlane, proto.Tag], Awaitable[T]], sized: bool,
            fallback: bool, forms: bool) -> T:
        """:meth:`_engine_or_links` when the engine is not ready at once."""
        turn = self._engine_turn(nbytes)
        if turn is None:
            return await self._run(kind, timeout, links)

        async def run(plane: CallPlane, call: proto.Tag) -> T:
            engine = self._engine.ready(turn) or await (
                self._engine_for(plane, call, turn) if forms else self._engine_formed(turn))
            if engine is not None:
                if self._engine.quick is None and getattr(engine.runner, "compiled", False):
                    self._engine.quick = QuickCalls(self, engine)
                if sized:
                    self._engine_enter(plane, call)
                try:
                    fut, state = begin(engine)
                    await settled(fut)
                    result = end(engine, fut, state)
                finally:
                    if sized:
                        self._engine_exit(call)
                if result is not None or not fallback:
                    return result
            return await links(plane, call)

        try:
            return await self._run(kind, timeout, run)
        finally:
            self._engine.finish(turn)

    def _engine_turn(self, nbytes: int) -> int | None:
        """A turn on the group's engine for a call of ``nbytes`` about to start, if it may
        run there: taken before the call's number, so turns follow the numbers' order."""
        if self._engine.off or self.world_size < 2 or nbytes > self._engine_max:
            return None
        return self._engine.turn()

    async def _engine_for(self, plane: CallPlane, call: proto.Tag, turn: int) -> Engine | None:
        """The engine, once the calls before this one on it are over (formed by the first
        such call on every rank), or None: the call runs on the links."""
        await self._engine.wait(turn)
        plane_all = self._fabric.plane
        device = plane_all.device if plane_all is not None else None
        return await self._engine.form(plane, call, device, self._engine_max)

    async def _engine_formed(self, turn: int) -> Engine | None:
        """The engine if earlier calls formed it, once they are over (this call does not form
        it: the same answer on every rank, the earlier calls being the same)."""
        await self._engine.wait(turn)
        engine = self._engine.engine
        return engine if isinstance(engine, Engine) else None

    def _engine_enter(self, plane: CallPlane | GroupLinks, call: proto.Tag) -> None:
        """Call ``call`` runs on the engine from now until :meth:`_engine_exit`: a message
        for it on the links (filed already, or arriving) is a peer running it there instead
        (another size): a typed mismatch at once, instead of both waiting until the bound."""
        self._check_leftovers(plane, call)
        self._fabric.on_engine.setdefault(self._number, set()).add(call.call)

    def _engine_exit(self, call: proto.Tag) -> None:
        self._fabric.on_engine.get(self._number, set()).discard(call.call)

    def _check_leftovers(self, links: GroupLinks | CallPlane, tag: proto.Tag) -> None:
        """A collective that ended here must have taken every message its peers sent for it:
        anything left means a peer ran something else (see ``CallOrder``)."""
        key = tag.key
        for peer, inb in links.ins.items():
            d = inb.leftover(key)
            if d is not None:
                raise CollectiveMismatchError(
                    f"rank {self.rank}: rank {peer} sent a {proto.KINDS[d.event.op]} message "
                    f"for collective #{tag.call}, which this rank ran as "
                    f"{proto.KINDS[tag.op]}: every rank must start a group's collectives in "
                    f"the same order, with the same arguments")

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """This group (or the group it was made from) was closed here."""
        return self._closed or self._fabric.closed

    @property
    def broken(self) -> bool:
        """An operation failed (here or on another rank): the group is unusable."""
        return self._fabric.failure is not None

    async def aclose(self) -> None:
        """Close this group. The group that was formed closes every link gracefully
        (messages in flight are delivered), then releases everything, bounded by the
        endpoints' ``Config.close_timeout``, and its subgroups with it; a subgroup only ends
        itself. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.close()
        if self._number == 0:
            await self._fabric.aclose()
        else:
            self._fabric.end_subgroup_windows(self._number)

    def abort(self) -> None:
        """Close at once: the group that was formed closes every link (the other ranks'
        operations fail with :class:`~aiordma.BrokenResourceError`); a subgroup only ends
        itself. Idempotent."""
        self._engine.close()
        if self._number == 0:
            self._fabric.close_now()
        else:
            self._closed = True
            self._fabric.end_subgroup_windows(self._number)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "open"
        what = "Group" if self._number == 0 else "Subgroup"
        return f"<{what} rank {self.rank} of {self.world_size} {state}>"
