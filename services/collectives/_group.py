"""The public :class:`Group`: its collectives, which algorithm each one runs, and failure.

Formation (the rendezvous and the mesh of links) is :mod:`._mesh`; the algorithms are
:mod:`._rounds` (few rounds, for small arrays) and :mod:`._ring` (bandwidth-optimal, for large
ones), picked per call by :func:`aiordma.protocols.collectives.choose` from the array's size
and the world size, the same way on every rank.

Failure
    Every wait on a peer is bounded: by the endpoint's peer-death detection (a dead process
    closes its TCP liveness connection; keepalive notices a dead host in seconds), which fails
    the operation with :class:`~aiordma.BrokenResourceError`, and by the group's ``timeout``
    (:class:`~aiordma.OperationTimeout`). A collective that fails in any way, or is cancelled,
    leaves the ranks out of step, so it *aborts the group*: its endpoints close at once, which
    fails the other ranks' collectives in turn, so a failure reaches every rank in a few
    round trips instead of leaving ranks waiting for their timeouts. An aborted group raises
    :class:`~aiordma.BrokenResourceError` from then on; form a new one.

    For that, a rank watches every one of its links, not only those its collective is
    waiting on: a rank waits on one or two neighbours at a time (the ring), and a neighbour
    that aborted on another side of it would otherwise go unnoticed until the one it waits on
    fails or its timeout expires. Once any link breaks (not a graceful close), the collective
    under way is cancelled and raises :class:`~aiordma.BrokenResourceError`, and the group is
    aborted (also between collectives).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import EllipsisType
from typing import Any, Self, TypeVar

import numpy as np

from aiordma import (
    BrokenResourceError,
    BusyResourceError,
    ClosedResourceError,
    Config,
    Endpoint,
    LocalProtocolError,
    OperationTimeout,
)
from aiordma._args import check_host, check_int, check_port, check_seconds, check_type
from aiordma.lowlevel import Device
from aiordma.protocols import collectives as proto

from . import _ring, _rounds
from ._env import launch_environment
from ._errors import CollectiveArgumentError, CollectiveMismatchError, GroupError
from ._mesh import Mesh, Rendezvous
from ._meta import meta_dtype_shape, meta_of
from ._plane import Plane

__all__ = ["REDUCE_OPS", "Group", "Rendezvous", "Thresholds"]

Thresholds = proto.Thresholds

log = logging.getLogger("aiordma.services.collectives")
T = TypeVar("T")

DEFAULT_SLOTS = 4
DEFAULT_SLOT_BYTES = 256 << 10
_REDUCIBLE_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex

#: The reduction ops of ``allreduce`` and the numpy ufuncs that implement them.
REDUCE_OPS: dict[str, np.ufunc] = {
    "sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
}


class Group:
    """A group of ``world_size`` ranks (processes, usually on several hosts) that run
    collectives over RDMA: :meth:`barrier`, :meth:`broadcast`, :meth:`allgather` and
    :meth:`allreduce` of numpy arrays.

    Form it with :meth:`from_env` (under torchrun, srun, or ``python -m
    aiordma.services.collectives.launch``) or :meth:`join`, and use it as ``async with``. Every rank
    must call the same collectives in the same order with matching arguments (as with MPI);
    one collective at a time per group. A mismatch that the ranks can see (kind, op, dtype,
    size, root) raises :class:`CollectiveMismatchError`.

    Attributes:
        rank, world_size: this rank and the group's size.
        timeout: the default bound, in seconds, on each collective (``None``: unbounded, only
            peer death ends a wait).
        calls: collectives run so far.
    """

    def __init__(self, *, rank: int, world_size: int, timeout: float | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.calls = 0
        self._mesh: Mesh | None = None
        self._plane: Plane | None = None
        self.thresholds = proto.Thresholds()
        self._busy = False
        self._closed = False
        self._broken: BaseException | None = None
        self._running: asyncio.Task[Any] | None = None  # the task running a collective
        self._link_error: BrokenResourceError | None = None  # a link broke under it
        self._watchers: list[asyncio.Task[None]] = []

    # -- formation -----------------------------------------------------------------------------

    @classmethod
    async def from_env(cls, *, timeout: float | None = 60.0, **kwargs: Any) -> Group:
        """Join the group the environment describes (see :mod:`aiordma.services.collectives._env`:
        ``RANK``/``WORLD_SIZE`` or ``SLURM_PROCID``/``SLURM_NTASKS``, with ``MASTER_ADDR`` and
        ``MASTER_PORT``); other arguments as :meth:`join`.

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
                   slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES,
                   thresholds: proto.Thresholds | None = None) -> Group:
        """Form the group: rank 0 serves the rendezvous on ``master_addr:master_port``.

        Args:
            rank, world_size: this process's place (``0 <= rank < world_size``).
            master_addr, master_port: where rank 0 serves the rendezvous.
            timeout: bound on the formation, and the default bound on each collective.
            host: the address this rank's ring listener is advertised on (default: the local
                address that reaches rank 0; ``master_addr`` for rank 0).
            device, config: passed to every endpoint (device choice, endpoint tunables).
            slots, slot_bytes: this rank's receive slots from each other rank (the unit of
                pipelining; ranks may differ). ``slot_bytes`` is rounded up to 64.
            thresholds: the sizes up to which each collective runs its few-rounds algorithm
                (default :class:`~aiordma.protocols.collectives.Thresholds`: 64 KiB); every
                rank must pass the same.

        Raises:
            RendezvousError: rank 0 refused the group (duplicate rank, world size mismatch).
            OperationTimeout: the group did not form in ``timeout`` seconds.
            BrokenResourceError: a rank died during formation.
            CollectiveArgumentError: invalid arguments.
            UnsupportedOperationError: this host has no usable RDMA device (a group's links
                are RDMA only: see :mod:`._mesh`).
        """
        world_size = _arg(check_int, world_size, name="world_size", low=1, high=MAX_WORLD)
        rank = _arg(check_int, rank, name="rank", low=0, high=world_size - 1)
        _arg(check_host, master_addr, name="master_addr")
        _arg(check_port, master_port, name="master_port")
        timeout = _arg(check_seconds, timeout, name="timeout", none_ok=True)
        if host is not None:
            _arg(check_host, host, name="host")
        _arg(check_type, device, (str, Device, type(None)), name="device",
             what="a device name, a Device or None")
        _arg(check_type, config, (Config, type(None)), name="config", what="a Config or None")
        slots = _arg(check_int, slots, name="slots", low=1, high=1024)
        slot_bytes = _arg(check_int, slot_bytes, name="slot_bytes", low=1, high=1 << 30)
        slot_bytes = -(-slot_bytes // 64) * 64
        if thresholds is not None:
            _arg(check_type, thresholds, proto.Thresholds, name="thresholds",
                 what="a Thresholds")
            for f in ("allreduce", "broadcast", "allgather"):
                _arg(check_int, getattr(thresholds, f), name=f"thresholds.{f}", low=0)
        group = cls(rank=rank, world_size=world_size, timeout=timeout)
        group.thresholds = thresholds or proto.Thresholds()
        if world_size == 1:
            return group
        group._mesh = mesh = Mesh(rank, world_size, timeout)
        try:
            async with asyncio.timeout(timeout):
                group._plane = await mesh.form(master_addr, master_port, host, device, config,
                                               slots, slot_bytes)
        except TimeoutError:
            await mesh.abort_quietly()
            raise OperationTimeout(f"rank {rank}: the group of {world_size} did not form "
                                   f"within {timeout} s") from None
        except BaseException:
            await mesh.abort_quietly()
            raise
        group._watch_links(mesh)
        return group

    def _watch_links(self, mesh: Mesh) -> None:
        """One task per link, until the group ends: a link that breaks breaks the group (see
        the module's "Failure")."""
        loop = asyncio.get_running_loop()
        links = [(f"to rank {p}", ep) for p, ep in mesh.outgoing.items()]
        links += [(f"from rank {p}", ep) for p, ep in mesh.incoming.items()]
        self._watchers = [loop.create_task(self._watch(what, ep)) for what, ep in links]

    async def _watch(self, what: str, ep: Endpoint) -> None:
        error = await ep._wait_gone()
        if error is None or self._closed or self._broken is not None:
            return  # closed (by either side), or the group already knows
        exc = BrokenResourceError(f"rank {self.rank}: the link {what} broke: {error}")
        exc.__cause__ = error
        if self._running is not None:  # the collective under way raises it (see _run)
            if self._link_error is None:
                self._link_error = exc
                self._running.cancel()
        else:
            self._break(exc)

    # -- collectives ---------------------------------------------------------------------------

    async def barrier(self, *, timeout: float | None | EllipsisType = ...) -> None:
        """Return once every rank has called ``barrier()`` (a dissemination barrier:
        ``ceil(log2 world_size)`` rounds of one small message).

        Raises:
            BrokenResourceError: a rank died or left; the group is aborted.
            OperationTimeout: ``timeout`` (default: the group's) expired; the group is aborted.
        """
        await self._run("barrier", _timeout(timeout), _rounds.barrier)

    async def broadcast(self, array: Any = None, *, root: int = 0,
                        timeout: float | None | EllipsisType = ...) -> np.ndarray:
        """Rank ``root``'s array, on every rank.

        The root passes its array (anything ``np.asarray`` takes; any dtype without Python
        objects, any shape) and gets it back unchanged. Another rank passes ``None`` to get a
        new array, or an array of the root's shape and dtype to have it filled in place (and
        returned). Up to ``thresholds.broadcast`` bytes a binomial tree (``ceil(log2
        world_size)`` rounds; an array that fits a message travels in it); larger arrays a
        pipelined chain round the ring (each rank forwards a piece as soon as it arrived).

        Raises:
            CollectiveArgumentError: ``root`` out of range, an object dtype, or a read-only
                array to fill (before anything is sent).
            CollectiveMismatchError: a non-root's array does not match the root's shape and
                dtype, or ranks disagree on ``root``; the group is aborted.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        timeout = _timeout(timeout)
        root = _arg(check_int, root, name="root", low=0, high=self.world_size - 1)
        if self.rank == root:
            arr = _as_array(array, "broadcast")
        elif array is not None:
            arr = _writable(array, "broadcast")
        else:
            arr = None

        def by_tree(nbytes: int) -> bool:
            return proto.choose("broadcast", nbytes, self.world_size,
                                self.thresholds) == "binomial"

        async def run(plane: Plane, call: int) -> np.ndarray:
            if self.rank == root:
                assert arr is not None
                work = plane.work(arr.nbytes)
                np.copyto(work.view(arr.dtype).reshape(arr.shape), arr)
                await _rounds.broadcast(plane, call, root, arr.nbytes, meta_of(arr), by_tree)
                if not by_tree(arr.nbytes):
                    await _ring.broadcast(plane, call, root, arr.nbytes)
                return arr
            meta, nbytes = await _rounds.broadcast(plane, call, root, None, None, by_tree)
            if not by_tree(nbytes):
                await _ring.broadcast(plane, call, root, nbytes)
            data = plane.work(nbytes)
            dtype, shape = meta_dtype_shape(meta)
            got = data.view(dtype).reshape(shape)
            if arr is None:
                return got.copy()
            if arr.shape != shape or arr.dtype != dtype:
                raise CollectiveMismatchError(f"rank {self.rank} passed a {arr.dtype} array of "
                                              f"shape {arr.shape} to broadcast; root {root} "
                                              f"sent {dtype} of shape {shape}")
            np.copyto(arr, got)
            return arr

        if self.world_size == 1:
            self._check_usable()
            assert arr is not None  # the only rank is the root
            return arr
        return await self._run("broadcast", timeout, run)

    async def allgather(self, array: Any, *,
                        timeout: float | None | EllipsisType = ...) -> list[np.ndarray]:
        """Every rank's array, in rank order (new arrays; this rank's is a copy).

        Arrays may differ in shape and dtype between ranks: their descriptions go to every rank
        first (one round of small messages), then the data: up to ``thresholds.allgather``
        bytes in all, every block straight to every rank; beyond, a ring allgather.

        Raises:
            CollectiveArgumentError: an object dtype.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        timeout = _timeout(timeout)
        arr = _as_array(array, "allgather")

        async def run(plane: Plane, call: int) -> list[np.ndarray]:
            metas = await _rounds.exchange(plane, call, meta_of(arr))
            described = [meta_dtype_shape(m) for m in metas]
            sizes = [dt.itemsize * int(np.prod(sh, dtype=np.int64)) for dt, sh in described]
            algo = self._algorithm("allgather", sum(sizes))
            blocks = await algo.allgather(plane, call, sizes, arr)
            return [b.view(dt).reshape(sh).copy()
                    for b, (dt, sh) in zip(blocks, described, strict=True)]

        if self.world_size == 1:
            self._check_usable()
            return [arr.copy()]
        return await self._run("allgather", timeout, run)

    async def allreduce(self, array: np.ndarray, op: str = "sum", *,
                        timeout: float | None | EllipsisType = ...) -> np.ndarray:
        """Reduce ``array`` element-wise over all ranks, in place; returns ``array``.

        ``op`` is ``"sum"``, ``"prod"``, ``"max"`` or ``"min"``; the dtype any boolean,
        integer, floating or complex one (integers wrap as numpy's do). Every rank passes an
        array of the same dtype and element count (any shape and layout; non-contiguous
        arrays are copied in and out). Up to ``thresholds.allreduce`` bytes, recursive
        doubling: ``log2 world_size`` rounds, each rank sending the
        whole array per round; beyond, a ring reduce-scatter then allgather, each rank sending
        about ``2 (world_size - 1) / world_size`` times the array. Either way all ranks end
        with bit-identical results. Ranks must pass the same size: sizes on either side of a
        threshold make ranks run different algorithms, which ends in
        :class:`~aiordma.OperationTimeout` rather than :class:`CollectiveMismatchError`.

        Raises:
            CollectiveArgumentError: an unknown op, a dtype it cannot reduce, or a read-only
                or non-numpy ``array`` (before anything is sent).
            CollectiveMismatchError: ranks disagree on op, dtype or size; the group is aborted.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        timeout = _timeout(timeout)
        if not isinstance(op, str) or op not in REDUCE_OPS:
            raise CollectiveArgumentError(f"op {op!r:.80} is not one of {sorted(REDUCE_OPS)}")
        arr = _writable(array, "allreduce")
        if arr.dtype.kind not in _REDUCIBLE_KINDS or arr.dtype.fields is not None:
            raise CollectiveArgumentError(f"allreduce cannot reduce dtype {arr.dtype}")

        async def run(plane: Plane, call: int) -> np.ndarray:
            dtype = arr.dtype.newbyteorder("=")
            values = plane.work(arr.size * dtype.itemsize).view(dtype)
            np.copyto(values.reshape(arr.shape), arr)
            algo = self._algorithm("allreduce", values.nbytes)
            result = await algo.allreduce(plane, call, arr.size, dtype, REDUCE_OPS[op])
            np.copyto(arr, result.reshape(arr.shape))
            return arr

        if self.world_size == 1:
            self._check_usable()
            return arr
        return await self._run("allreduce", timeout, run)

    def _algorithm(self, kind: str, nbytes: int) -> Any:
        """The module whose algorithm runs this collective (:mod:`._rounds` or
        :mod:`._ring`), chosen the same way on every rank."""
        name = proto.choose(kind, nbytes, self.world_size, self.thresholds)
        return _ring if name in ("ring", "chain") else _rounds

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedResourceError("the group is closed")
        if self._broken is not None:
            raise BrokenResourceError(f"the group is broken ({self._broken!r}); form a new "
                                      f"one") from self._broken
        if self._busy:
            raise BusyResourceError("another collective of this group is running (one at a "
                                    "time, in the same order on every rank)")

    async def _run(self, what: str, timeout: float | None | EllipsisType,
                   fn: Callable[[Plane, int], Awaitable[T]]) -> T:
        """Run one collective: state checks, the call number, the timeout, and the rule that
        a failed or cancelled collective aborts the group."""
        self._check_usable()
        if self.world_size == 1:  # only barrier gets here: nothing to wait for
            self.calls += 1
            return None  # type: ignore[return-value]
        plane = self._plane
        if plane is None:
            raise GroupError("this group was never formed: make groups with Group.join() or "
                             "Group.from_env()")
        bound = self.timeout if timeout is ... else timeout
        self._busy = True
        self.calls += 1
        task = self._running = asyncio.current_task()
        try:
            async with asyncio.timeout(bound):  # type: ignore[arg-type]
                try:
                    await plane.settle()  # the last collective's WRITEs read the work buffers
                    return await fn(plane, self.calls)
                except asyncio.CancelledError:
                    # A link broke (_watch cancelled this task): that cancellation is this
                    # group's, not the caller's (nor the timeout's, which counts its own).
                    if (self._link_error is not None and task is not None
                            and task.uncancel() == 0):
                        raise self._link_error from self._link_error.__cause__
                    raise
        except TimeoutError:
            exc: BaseException = OperationTimeout(f"rank {self.rank}: {what} took longer than "
                                                  f"{bound} s")
            self._break(exc)
            raise exc from None
        except BaseException as e:
            self._break(e)
            raise
        finally:
            self._busy = False
            self._running = None

    def _break(self, exc: BaseException) -> None:
        if self._broken is None:
            self._broken = exc
        self.abort()

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        return self._broken is not None

    async def aclose(self) -> None:
        """Close every link gracefully (messages in flight are delivered), then release
        everything; bounded by the endpoints' ``Config.close_timeout``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_watching()
        if self._mesh is not None:
            await self._mesh.aclose()

    def abort(self) -> None:
        """Close everything at once; the other ranks' collectives fail with
        :class:`~aiordma.BrokenResourceError`. Idempotent."""
        self._closed = self._closed or self._broken is None
        self._stop_watching()
        if self._mesh is not None:
            self._mesh.abort()

    def _stop_watching(self) -> None:
        current = asyncio.current_task()
        for t in self._watchers:
            if t is not current:  # (a watcher that breaks the group ends by itself)
                t.cancel()
        self._watchers = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "open"
        return f"<Group rank {self.rank} of {self.world_size} {state}>"


MAX_WORLD = 4096  # ranks; each holds 2 (world - 1) connections


def _arg(check: Callable[..., T], value: Any, *args: Any, **kwargs: Any) -> T:
    """``check(value, ...)`` (the library's argument rule), raising
    :class:`CollectiveArgumentError` (also a ``LocalProtocolError``) instead."""
    try:
        return check(value, *args, **kwargs)
    except LocalProtocolError as exc:
        raise CollectiveArgumentError(str(exc)) from None


def _timeout(timeout: Any) -> float | None | EllipsisType:
    """A collective's ``timeout``: ``...`` (the group's), None (unbounded) or seconds (0: a
    bound already spent)."""
    if timeout is ...:
        return timeout
    return _arg(check_seconds, timeout, name="timeout", none_ok=True, zero_ok=True)


def _as_array(array: Any, what: str) -> np.ndarray:
    arr = np.asarray(array)
    if arr.dtype.hasobject:
        raise CollectiveArgumentError(f"{what} cannot send Python objects (dtype {arr.dtype})")
    return arr


def _writable(array: Any, what: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise CollectiveArgumentError(f"{what} fills a numpy array in place, not "
                                      f"{type(array).__name__}")
    if not array.flags.writeable:
        raise CollectiveArgumentError(f"{what} needs a writable array")
    if array.dtype.hasobject:
        raise CollectiveArgumentError(f"{what} cannot send Python objects (dtype {array.dtype})")
    return array

