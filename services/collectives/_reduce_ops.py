"""The reductions of a :class:`~._group.Group`: ``allreduce``, ``reduce`` and
``reduce_scatter`` (the ops and dtypes they take: :mod:`._arrays`)."""

from __future__ import annotations

from types import EllipsisType
from typing import Any

import numpy as np

from aiordma._args import check_int
from aiordma.protocols import collectives as proto

from . import _direct, _ring, _rounds, _written
from ._arrays import ReduceOp, as_input, as_output, check_like, reduce_op
from ._core import GroupCore, arg, timeout_arg
from ._engine import GATHER_WORLD, Engine
from ._errors import CollectiveArgumentError
from ._plane import CallPlane

__all__ = ["Reductions"]

Timeout = float | None | EllipsisType


def _staged(plane: CallPlane, src: np.ndarray, dtype: np.dtype[Any]) -> None:
    """Copy ``src`` into work buffer 0 as ``dtype`` (native byte order), in C order."""
    values = plane.work(src.size * dtype.itemsize).view(dtype)
    values.reshape(src.shape)[...] = src  # (np.copyto's, without its Python dispatcher)


class Reductions(GroupCore):
    """``allreduce``, ``reduce`` and ``reduce_scatter`` (see :class:`~._group.Group`)."""

    async def allreduce(self, array: Any, op: str = "sum", *, out: Any = None,
                        timeout: Timeout = ...) -> Any:
        """Reduce ``array`` element-wise over all ranks; returns the array holding the result
        (``array`` itself, changed in place, or ``out``).

        ``op`` is one of ``"sum"``, ``"prod"``, ``"max"``, ``"min"`` (any boolean, integer,
        floating or complex dtype; integers wrap as numpy's do), ``"avg"`` (floating and
        complex: the sum divided by the group's size) or ``"band"``, ``"bor"``, ``"bxor"``
        (integers and bools). Every rank passes an array of the same dtype and element count
        (any shape and layout; non-contiguous arrays are copied in and out). Without ``out``,
        ``array`` must be writable (a numpy array, a CPU tensor through DLPack such as a torch
        tensor, or a writable buffer) and receives the result; with ``out`` (an array of
        ``array``'s shape and dtype) ``array`` is only read, as MPI's ``Allreduce`` with a
        receive buffer. Up to ``thresholds.allreduce`` bytes (over RDMA links, up to
        ``thresholds.engine``, on the step engine), recursive doubling: ``log2 world_size``
        rounds, each rank sending the whole array per round; beyond, a ring reduce-scatter
        then allgather, each rank sending about ``2 (world_size - 1) / world_size`` times the
        array (over RDMA from ``thresholds.written_allreduce`` bytes, each chunk written into
        place). Either way all ranks end with bit-identical results.

        Raises:
            CollectiveArgumentError: an unknown op, a dtype it cannot reduce, a read-only
                ``array`` without ``out``, an ``out`` of another shape or dtype (before
                anything is sent).
            CollectiveMismatchError: ranks disagree on op, dtype or size; the group is broken.
            BrokenResourceError, OperationTimeout: as :meth:`~._group.Group.barrier`.
        """
        if timeout is not ...:
            timeout = timeout_arg(timeout)
        quick = self._engine.quick  # (the common case in a few steps: see _quick)
        if quick is not None and out is None and type(array) is np.ndarray and type(op) is str:
            started = quick.allreduce(array, op)
            if started is not None:
                if started is not True:
                    await quick.settle(started, timeout, "allreduce")
                return array
        if out is None:
            src = dst = as_output(array, "allreduce")
            result: Any = array
        else:
            src = as_input(array, "allreduce")
            dst = as_output(out, "allreduce's out")
            check_like(dst, src.shape, src.dtype, "allreduce's out")
            result = out
        rop = reduce_op(op, src.dtype, "allreduce")
        dtype = src.dtype if src.dtype.isnative else src.dtype.newbyteorder("=")

        nbytes = src.size * dtype.itemsize

        def returned(values: np.ndarray | None) -> Any:
            if values is not None:  # (else the runner copied the result into dst)
                rop.finish(values, self.world_size)
                dst[...] = values.reshape(src.shape)
            return result

        def begin(engine: Engine) -> Any:
            return engine.begin_allreduce(src, dst, dtype, rop,
                                          engine.sig("allreduce", rop.name, dtype.str, src.size))

        def end(engine: Engine, fut: Any, state: Any) -> Any:
            return returned(engine.end_allreduce(fut, state))

        async def links(plane: CallPlane, call: proto.Tag) -> Any:
            _staged(plane, src, dtype)
            name = self._choose("allreduce", nbytes)
            algo = _written if name == "written" else _ring if name == "ring" else _rounds
            values = await algo.allreduce(plane, call, src.size, dtype, rop)
            rop.finish(values, self.world_size)
            dst[...] = values.reshape(src.shape)  # (same dtype, checked; no dispatcher)
            return result

        if self.world_size == 1:
            self._alone()
            if dst is not src:
                np.copyto(dst, src)
            return result
        return await self._engine_or_links("allreduce", timeout, nbytes, begin, end, links)

    async def reduce(self, array: Any, op: str = "sum", *, root: int = 0, out: Any = None,
                     timeout: Timeout = ...) -> Any:
        """Reduce ``array`` element-wise over all ranks onto rank ``root`` (MPI's ``Reduce``,
        torch's ``reduce``): the root gets the array holding the result (``out``, or else
        ``array`` itself, changed in place), the other ranks None (their arrays are only
        read, and ``out`` is ignored there). Ops and dtypes as :meth:`allreduce`. Up to
        ``thresholds.reduce`` bytes a binomial tree (``ceil(log2 world_size)`` rounds);
        beyond, a ring reduce-scatter whose chunks then go to the root.

        Raises:
            CollectiveArgumentError: as :meth:`allreduce` (on the root: a read-only ``array``
                without ``out``), or ``root`` out of range.
            CollectiveMismatchError: ranks disagree on op, dtype, size or root; the group is
                broken.
            BrokenResourceError, OperationTimeout: as :meth:`~._group.Group.barrier`.
        """
        timeout = timeout_arg(timeout)
        root = arg(check_int, root, name="root", low=0, high=self.world_size - 1)
        is_root = self.rank == root
        result: Any = None
        if is_root and out is None:
            src = dst = as_output(array, "reduce")
            result = array
        else:
            src = as_input(array, "reduce")
            dst = None
            if is_root:
                dst = as_output(out, "reduce's out")
                check_like(dst, src.shape, src.dtype, "reduce's out")
                result = out
        rop = reduce_op(op, src.dtype, "reduce")
        dtype = src.dtype.newbyteorder("=")

        async def run(plane: CallPlane, call: proto.Tag) -> Any:
            _staged(plane, src, dtype)
            count, item = src.size, dtype.itemsize
            name = self._choose("reduce", count * item)
            if name == "binomial":
                values = await _rounds.reduce(plane, call, root, count, dtype, rop)
            else:
                values = await self._reduce_by_ring(plane, call, root, count, dtype, rop)
            if values is None:
                return None
            assert dst is not None
            rop.finish(values, self.world_size)
            np.copyto(dst, values.reshape(src.shape))
            return result

        if self.world_size == 1:
            self._alone()
            if dst is not None and dst is not src:
                np.copyto(dst, src)
            return result
        return await self._run("reduce", timeout, run)

    async def _reduce_by_ring(self, plane: CallPlane, call: proto.Tag, root: int, count: int,
                              dtype: np.dtype[Any], op: ReduceOp) -> np.ndarray | None:
        """Ring reduce-scatter (steps ``0 .. world - 2``), then every rank's chunk to the root
        (step ``world - 1``)."""
        values = await _ring.reduce_scatter(plane, call, count, dtype, op)
        item, world = dtype.itemsize, self.world_size
        chunks = proto.chunk_bounds(count, world)
        sig = proto.signature("reduce", op.name, dtype.str, count, root)
        if self.rank != root:
            lo, hi = chunks[self.rank]
            await plane.outs[root].put(plane.region(0), plane.buffer(0), call, world - 1,
                                       lo * item, hi * item, sig, item)
            return None
        as_bytes = values.view(np.uint8)
        region, right = plane.region(0), plane.outs[plane.right]

        def copy(a: int, b: int, got: np.ndarray) -> None:
            as_bytes[a:b] = got

        async def unread(a: int, b: int) -> None:  # the ring sent these bytes to the right
            await right.settle(region, a, b)

        for _, peer in proto.pairwise(root, world):
            lo, hi = chunks[peer]
            await plane.ins[peer].take(call, world - 1, lo * item, hi * item, sig, copy, item,
                                       guard=unread)
        return values

    async def reduce_scatter(self, array: Any, op: str = "sum", *, out: Any = None,
                             timeout: Timeout = ...) -> Any:
        """Reduce ``array`` element-wise over all ranks and give rank ``r`` the ``r``-th of
        ``world_size`` equal blocks of the result, cut along the first axis (MPI's
        ``Reduce_scatter_block``, torch's ``reduce_scatter_tensor``): an array of shape
        ``(n * world_size, *rest)`` gives one of shape ``(n, *rest)``, returned new, or in
        ``out`` (of that shape and ``array``'s dtype). ``array`` is only read. Ops and dtypes
        as :meth:`allreduce`. Over RDMA, in groups of up to 16 ranks, while a block is within
        the group's step engine (``thresholds.engine`` bytes: 1 MiB, 256 KiB past 4 ranks),
        each block goes straight to its rank in one RDMA WRITE, reduced as it lands.
        Otherwise, up to ``thresholds.reduce_scatter`` bytes (the whole input), each block
        goes straight to its rank; beyond, a ring of ``world_size - 1`` steps, each rank
        sending ``(world_size - 1) / world_size`` of the array.

        Raises:
            CollectiveArgumentError: as :meth:`allreduce`, or a first axis that is missing or
                not a multiple of ``world_size``.
            CollectiveMismatchError: ranks disagree on op, dtype or size; the group is broken.
            BrokenResourceError, OperationTimeout: as :meth:`~._group.Group.barrier`.
        """
        if timeout is not ...:
            timeout = timeout_arg(timeout)
        quick = self._engine.quick  # (into out=, in a few steps: see _quick)
        if (quick is not None and type(array) is np.ndarray and type(out) is np.ndarray
                and type(op) is str):
            started = quick.reduce_scatter(array, op, out)
            if started is not None:
                if started is not True:
                    await quick.settle(started, timeout, "reduce_scatter")
                return out
        src = as_input(array, "reduce_scatter")
        world = self.world_size
        if src.ndim == 0 or src.shape[0] % world:
            raise CollectiveArgumentError(f"reduce_scatter cuts the first axis into "
                                          f"{world} equal blocks: shape {src.shape} has none")
        shape = (src.shape[0] // world, *src.shape[1:])
        rop = reduce_op(op, src.dtype, "reduce_scatter")
        if out is None:
            dst = np.empty(shape, src.dtype)
            result: Any = dst
        else:
            dst = as_output(out, "reduce_scatter's out")
            check_like(dst, shape, src.dtype, "reduce_scatter's out")
            result = out
        dtype = src.dtype if src.dtype.isnative else src.dtype.newbyteorder("=")
        if world == 1:
            self._alone()
            np.copyto(dst, src)
            return result

        def returned(values: np.ndarray | None) -> Any:
            if values is not None:  # (else the runner copied this rank's block into dst)
                rop.finish(values, world)
                np.copyto(dst, values.reshape(shape))
            return result

        def begin(engine: Engine) -> Any:
            sig = engine.sig("reduce_scatter", rop.name, dtype.str, src.size)
            return engine.begin_reduce_scatter(src, dst, dtype, rop, sig)

        def end(engine: Engine, fut: Any, state: Any) -> Any:
            return returned(engine.end_reduce_scatter(fut, state))

        async def links(plane: CallPlane, call: proto.Tag) -> Any:
            _staged(plane, src, dtype)
            count = src.size
            name = self._choose("reduce_scatter", count * dtype.itemsize)
            if name in ("ring", "written"):
                algo = _written if name == "written" else _ring
                values = await algo.reduce_scatter(plane, call, count, dtype, rop)
                lo, hi = proto.chunk_bounds(count, world)[self.rank]
                mine = values[lo:hi]
            else:
                mine = await _direct.reduce_scatter(plane, call, count, dtype, rop)
            return returned(mine)

        if world > GATHER_WORLD:  # (the engine has no queue pair to every rank)
            return await self._run("reduce_scatter", timeout, links)
        return await self._engine_or_links("reduce_scatter", timeout,
                                           src.size // world * dtype.itemsize, begin, end,
                                           links)
