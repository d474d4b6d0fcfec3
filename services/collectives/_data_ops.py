"""The collectives of a :class:`~._group.Group` that move data without reducing it:
``barrier``, ``broadcast``, ``allgather``, ``gather``, ``scatter``, ``alltoall`` and
``alltoallv`` (arrays as :mod:`._arrays` takes them)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from types import EllipsisType
from typing import Any, cast

import numpy as np

from aiordma import RemoteProtocolError
from aiordma._args import check_int
from aiordma.protocols import collectives as proto

from . import _direct, _ring, _rounds, _written
from ._arrays import as_input, as_output, check_like
from ._core import GroupCore, arg, timeout_arg
from ._engine import GATHER_WORLD, Engine
from ._errors import CollectiveArgumentError, CollectiveMismatchError
from ._meta import meta_dtype_shape, meta_of
from ._plane import CallPlane

__all__ = ["DataMovement"]

Timeout = float | None | EllipsisType


def _stage(plane: CallPlane, arrays: Sequence[np.ndarray]) -> list[int]:
    """Copy ``arrays`` back to back into work buffer 0 (raw bytes, C order); their sizes."""
    sizes = [a.nbytes for a in arrays]
    work = plane.work(sum(sizes))
    at = 0
    for a, n in zip(arrays, sizes, strict=True):
        np.copyto(work[at:at + n].view(a.dtype).reshape(a.shape), a)
        at += n
    return sizes


def _parse_block(description: Any) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """An allgather block's description from the engine: ``(dtype, shape, bytes)``."""
    dtype, shape = meta_dtype_shape(description)
    return dtype, shape, dtype.itemsize * math.prod(shape)


def _arrays(blocks: list[tuple[np.ndarray, Any]],
            check: Callable[[list[tuple[np.dtype[Any], tuple[int, ...]]]], None]
            ) -> list[np.ndarray]:
    """The arrays of an allgather's blocks from the engine (``(bytes, _parse_block)`` by
    rank), ``check``-ed."""
    check([(dt, sh) for _, (dt, sh, _n) in blocks])
    got = []
    for r, (b, (dt, sh, nbytes)) in enumerate(blocks):
        if b.nbytes != nbytes:
            raise RemoteProtocolError(f"rank {r} sent {b.nbytes} B for an array of {dt} of "
                                      f"shape {sh}")
        got.append(b.view(dt).reshape(sh))
    return got


def _fresh_like(meta: Any) -> np.ndarray:
    dtype, shape = meta_dtype_shape(meta)
    return np.empty(shape, dtype)


def _rows(arr: np.ndarray, what: str) -> tuple[int, ...]:
    if arr.ndim == 0:
        raise CollectiveArgumentError(f"{what} cuts the first axis into blocks: a 0-d array "
                                      f"has none")
    return tuple(arr.shape[1:])


def _counts(counts: Any, world: int, name: str) -> list[int]:
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
        raise CollectiveArgumentError(f"{name} must be a sequence of {world} counts, not "
                                      f"{type(counts).__name__}")
    if len(counts) != world:
        raise CollectiveArgumentError(f"{name} has {len(counts)} counts for {world} ranks")
    return [arg(check_int, c, name=name, low=0, high=(1 << 62)) for c in counts]


class DataMovement(GroupCore):
    """The data-moving collectives (see :class:`~._group.Group`)."""

    async def barrier(self, *, timeout: Timeout = ...) -> None:
        """Return once every rank has called ``barrier()`` (a dissemination barrier:
        ``ceil(log2 world_size)`` rounds of one small message; over RDMA, of an empty RDMA
        WRITE on the group's step engine).

        Raises:
            BrokenResourceError: a rank died or left, or the group broke; the group is broken.
            OperationTimeout: ``timeout`` (default: the group's) expired; the group is broken.
        """
        if timeout is not ...:
            timeout = timeout_arg(timeout)
        quick = self._engine.quick  # (in a few steps: see _quick)
        if quick is not None:
            started = quick.barrier()
            if started is not None:
                if started is not True:
                    await quick.settle(started, timeout, "barrier")
                return
        if self.world_size == 1:
            self._alone()
            return
        await self._engine_or_links("barrier", timeout, 0, Engine.begin_barrier,
                                    Engine.end_barrier, _rounds.barrier, sized=False)

    async def broadcast(self, array: Any = None, *, root: int = 0,
                        timeout: Timeout = ...) -> Any:
        """Rank ``root``'s array, on every rank.

        The root passes its array (any dtype without Python objects, any shape) and gets it
        back unchanged. Another rank passes None to get a new numpy array, or an array of the
        root's shape and dtype (a numpy array, a CPU tensor through DLPack, a writable
        buffer) to have it filled in place (and returned). Once the group's step engine is
        formed (by an allreduce, barrier or allgather before), an array that fits it goes
        over recursive doubling's pairs, each rank writing the array or nothing to its
        partner, so the call returns on no rank, the root included, before every rank has
        started it (as MPI allows a broadcast to). Otherwise, up to ``thresholds.broadcast``
        bytes a binomial tree (``ceil(log2 world_size)`` rounds; an array that fits a message
        travels in it); larger arrays a pipelined chain round the ring (each rank forwards a
        piece as soon as it arrived).

        Raises:
            CollectiveArgumentError: ``root`` out of range, an object dtype, or a read-only
                array to fill (before anything is sent).
            CollectiveMismatchError: a non-root's array does not match the root's shape and
                dtype, or ranks disagree on ``root``; the group is broken.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        if timeout is not ...:
            timeout = timeout_arg(timeout)
        quick = self._engine.quick  # (an array on every rank, in a few steps: see _quick)
        if quick is not None and type(array) is np.ndarray:
            started = quick.broadcast(root, array)
            if started is not None:
                if started is not True:
                    await quick.settle(started, timeout, "broadcast")
                return array
        root = arg(check_int, root, name="root", low=0, high=self.world_size - 1)
        if self.rank == root:
            arr = as_input(array, "broadcast")
        elif array is not None:
            arr = as_output(array, "broadcast")
        else:
            arr = None

        def by_tree(nbytes: int) -> bool:
            return self._choose("broadcast", nbytes) == "binomial"

        def received(got: np.ndarray) -> Any:
            """A non-root's result from the root's array ``got`` (a view to copy from)."""
            if arr is None:
                return got.copy()
            if arr.shape != got.shape or arr.dtype != got.dtype:
                raise CollectiveMismatchError(f"rank {self.rank} passed a {arr.dtype} array of "
                                              f"shape {arr.shape} to broadcast; root {root} "
                                              f"sent {got.dtype} of shape {got.shape}")
            np.copyto(arr, got)
            return array

        async def on_links(plane: CallPlane, call: proto.Tag) -> Any:
            if self.rank == root:
                assert arr is not None
                _stage(plane, [arr])
                await _rounds.broadcast(plane, call, root, arr.nbytes, meta_of(arr), by_tree)
                if not by_tree(arr.nbytes):
                    await _ring.broadcast(plane, call, root, arr.nbytes)
                return array
            meta, nbytes = await _rounds.broadcast(plane, call, root, None, None, by_tree)
            if not by_tree(nbytes):
                await _ring.broadcast(plane, call, root, nbytes)
            dtype, shape = meta_dtype_shape(meta)
            return received(plane.work(nbytes).view(dtype).reshape(shape))

        def from_engine(got: tuple[np.ndarray, Any] | None) -> Any:
            """The result of the engine's call; None: run it on the links."""
            if got is None:
                return None
            if self.rank == root:
                return array
            data, (dtype, shape, nbytes) = got
            if data.nbytes != nbytes:
                raise RemoteProtocolError(f"root {root} sent {data.nbytes} B for an array of "
                                          f"{dtype} of shape {shape}")
            return received(data.view(dtype).reshape(shape))

        if self.world_size == 1:
            self._alone()
            return array
        mine = arr if self.rank == root else None
        # (the links only if the array is too large for the engine; a broadcast does not
        # form the engine: see the docstring)
        return await self._engine_or_links(
            "broadcast", timeout, 0, lambda e: e.begin_broadcast(root, mine, meta_of),
            lambda e, fut, state: from_engine(e.end_broadcast(fut, state, _parse_block)),
            on_links, sized=False, fallback=True, forms=False)

    async def allgather(self, array: Any, *, out: Any = None,
                        timeout: Timeout = ...) -> Any:
        """Every rank's array, in rank order: a list of new arrays (this rank's is a copy), or,
        with ``out`` (an array of shape ``(world_size, *array.shape)`` and ``array``'s dtype,
        as torch's ``all_gather_into_tensor``), ``out`` filled (``out[r]`` is rank ``r``'s).

        Without ``out``, arrays may differ in shape and dtype between ranks. Over RDMA, in
        groups of up to 16 ranks, while every rank's array fits the group's step engine
        (``thresholds.engine`` bytes: 1 MiB, 256 KiB past 4 ranks), every block goes
        straight to every rank with its description behind it, in one RDMA WRITE each. Otherwise the
        descriptions go to every rank first (one round of small messages), then the data: up
        to ``thresholds.allgather`` bytes in all, every block straight to every rank; beyond,
        a ring allgather.

        Raises:
            CollectiveArgumentError: an object dtype, or an ``out`` of the wrong shape or dtype.
            CollectiveMismatchError: with ``out``, another rank's array has another shape or
                dtype; the group is broken.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        if timeout is not ...:
            timeout = timeout_arg(timeout)
        quick = self._engine.quick  # (in a few steps if every block is like this one's)
        if (quick is not None and type(array) is np.ndarray
                and (out is None or type(out) is np.ndarray)):
            started = quick.allgather(array, out)  # (None: the general way, which checks)
            if started is not None:
                how, into = started
                if how is not True:
                    await quick.settle(how, timeout, "allgather")
                left = quick.open  # (set only by this call's end, taken at once below)
                if left is None:  # (over)
                    return into  # (out, or the new arrays)
                engine = quick.engine
                end, links = self._allgather_halves(array, out, out)
                return await self._engine_rest("allgather", timeout, quick, left,
                                               lambda f, state: end(engine, f, state), links)
        arr = as_input(array, "allgather")
        dst = None
        if out is not None:
            dst = as_output(out, "allgather's out")
            check_like(dst, (self.world_size, *arr.shape), arr.dtype, "allgather's out")
        if self.world_size == 1:
            self._alone()
            if dst is None:
                return [arr.copy()]
            np.copyto(dst[0, ...], arr)
            return out
        end, links = self._allgather_halves(arr, dst, out)
        if self.world_size > GATHER_WORLD:  # (the engine has no queue pair to every rank)
            return await self._run("allgather", timeout, links)
        # (on the links: no engine, or a block too large for it)
        return await self._engine_or_links(
            "allgather", timeout, 0, lambda e: e.begin_allgather(arr, meta_of), end, links,
            sized=False, fallback=True)

    def _allgather_halves(self, arr: np.ndarray, dst: np.ndarray | None, out: Any
                          ) -> tuple[Callable[[Engine, Any, Any], Any],
                                     Callable[[CallPlane, proto.Tag], Awaitable[Any]]]:
        """An allgather's general halves, of ``arr`` into ``dst`` (``out``'s array, or None):
        its engine end (the blocks parsed; None: on the links after all) and its run on the
        links."""

        def check(described: list[tuple[np.dtype[Any], tuple[int, ...]]]) -> None:
            if dst is not None:
                for r, (dt, sh) in enumerate(described):
                    if (dt, sh) != (arr.dtype, arr.shape):
                        raise CollectiveMismatchError(
                            f"rank {self.rank}: allgather into out= needs the same shape and "
                            f"dtype on every rank: rank {r} has {dt} of shape {sh}, this rank "
                            f"{arr.dtype} of shape {arr.shape}")

        def returned(got: list[np.ndarray]) -> Any:
            if dst is None:
                return [g.copy() for g in got]
            for r, g in enumerate(got):
                np.copyto(dst[r, ...], g)
            return out

        async def on_links(plane: CallPlane, call: proto.Tag) -> list[np.ndarray]:
            descr = [meta_dtype_shape(m) for m in await _rounds.exchange(plane, call,
                                                                         meta_of(arr))]
            check(descr)
            sizes = [dt.itemsize * int(np.prod(sh, dtype=np.int64)) for dt, sh in descr]
            name = self._choose("allgather", sum(sizes))
            algo = _written if name == "written" else _ring if name == "ring" else _rounds
            blocks = await algo.allgather(plane, call, sizes, arr)
            return [b.view(dt).reshape(sh) for b, (dt, sh) in zip(blocks, descr, strict=True)]

        def end(e: Engine, fut: Any, state: Any) -> Any:
            blocks = e.end_allgather(fut, state, _parse_block)
            return None if blocks is None else returned(_arrays(blocks, check))

        async def links(plane: CallPlane, call: proto.Tag) -> Any:
            return returned(await on_links(plane, call))

        return end, links

    async def gather(self, array: Any, *, root: int = 0, out: Any = None,
                     timeout: Timeout = ...) -> Any:
        """Every rank's array, on rank ``root`` (MPI's ``Gather``, torch's ``gather``): the
        root gets a list of new arrays in rank order (its own a copy), or ``out`` filled (of
        shape ``(world_size, *array.shape)`` and ``array``'s dtype: ``out[r]`` is rank
        ``r``'s); the other ranks get None (``out`` is ignored there). Without ``out``, arrays
        may differ in shape and dtype between ranks. Each rank's array goes straight to the
        root.

        Raises:
            CollectiveArgumentError: ``root`` out of range, an object dtype, an ``out`` of the
                wrong shape or dtype on the root.
            CollectiveMismatchError: with ``out``, a rank's array has another shape or dtype
                (or ranks disagree on ``root``); the group is broken.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        timeout = timeout_arg(timeout)
        root = arg(check_int, root, name="root", low=0, high=self.world_size - 1)
        arr = as_input(array, "gather")
        is_root = self.rank == root
        dst = None
        if is_root and out is not None:
            dst = as_output(out, "gather's out")
            check_like(dst, (self.world_size, *arr.shape), arr.dtype, "gather's out")

        def describe(peer: int, meta: Any) -> np.ndarray:
            dtype, shape = meta_dtype_shape(meta)
            if dst is not None and (dtype, shape) != (arr.dtype, arr.shape):
                raise CollectiveMismatchError(
                    f"rank {self.rank}: gather into out= needs the same shape and dtype on "
                    f"every rank: rank {peer} sent {dtype} of shape {shape}, this rank has "
                    f"{arr.dtype} of shape {arr.shape}")
            return np.empty(shape, dtype)

        def result(parts: list[np.ndarray | None]) -> Any:
            parts[self.rank] = arr.copy() if dst is None else arr
            if dst is None:
                return parts
            for r, p in enumerate(parts):
                np.copyto(dst[r, ...], p)  # type: ignore[arg-type]
            return out

        async def run(plane: CallPlane, call: proto.Tag) -> Any:
            _stage(plane, [arr])
            parts = await _direct.gather(plane, call, root, meta_of(arr), arr.nbytes, describe)
            return None if parts is None else result(parts)  # type: ignore[arg-type]

        if self.world_size == 1:
            self._alone()
            return result([None])
        return await self._run("gather", timeout, run)

    async def scatter(self, array: Any = None, *, root: int = 0, out: Any = None,
                      timeout: Timeout = ...) -> Any:
        """Rank ``r`` gets the ``r``-th part of the root's ``array`` (MPI's ``Scatter``,
        torch's ``scatter``): on the root, ``array`` is a sequence of ``world_size`` arrays
        (they may differ in shape and dtype), or one array whose first axis has
        ``world_size`` entries; elsewhere it is ignored (pass None). Each rank gets its part
        as a new array, or in ``out`` (an array of its part's shape and dtype), and the root
        its own part too. Each part goes straight from the root to its rank.

        Raises:
            CollectiveArgumentError: ``root`` out of range; on the root, not ``world_size``
                parts, or an object dtype; an ``out`` that is not a writable array.
            CollectiveMismatchError: a rank's ``out`` does not match its part's shape and
                dtype, or ranks disagree on ``root``; the group is broken.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        timeout = timeout_arg(timeout)
        world = self.world_size
        root = arg(check_int, root, name="root", low=0, high=world - 1)
        dst = as_output(out, "scatter's out") if out is not None else None
        parts: list[np.ndarray] = []
        if self.rank == root:
            if isinstance(array, (list, tuple)):
                parts = [as_input(a, "scatter") for a in array]
            else:
                whole = as_input(array, "scatter")
                parts = [whole[r, ...] for r in range(whole.shape[0])] if whole.ndim else []
            if len(parts) != world:
                raise CollectiveArgumentError(f"scatter's root needs {world} parts (a "
                                              f"sequence, or an array's first axis), not "
                                              f"{len(parts)}")
            if dst is not None:
                check_like(dst, parts[root].shape, parts[root].dtype, "scatter's out")

        def place(meta: Any) -> np.ndarray:
            if dst is None:
                return _fresh_like(meta)
            dtype, shape = meta_dtype_shape(meta)
            if (dtype, shape) != (dst.dtype, dst.shape):
                raise CollectiveMismatchError(
                    f"rank {self.rank}: scatter's out is {dst.dtype} of shape {dst.shape}; "
                    f"root {root} sent {dtype} of shape {shape}")
            return np.empty(shape, dtype)

        def own() -> Any:
            mine = parts[root]
            if dst is None:
                return mine.copy()
            np.copyto(dst, mine)
            return out

        async def run(plane: CallPlane, call: proto.Tag) -> Any:
            if self.rank == root:
                sizes = _stage(plane, parts)
                await _direct.scatter(plane, call, root, [meta_of(p) for p in parts], sizes,
                                      place)
                return own()
            got = await _direct.scatter(plane, call, root, None, None, place)
            assert got is not None
            if dst is None:
                return got
            np.copyto(dst, got)
            return out

        if world == 1:
            self._alone()
            return own()
        return await self._run("scatter", timeout, run)

    async def alltoall(self, array: Any, *, out: Any = None, timeout: Timeout = ...) -> Any:
        """Rank ``r`` sends block ``p`` of ``array`` to rank ``p`` and gets block ``r`` of
        every rank's (MPI's ``Alltoall``, torch's ``all_to_all_single`` with equal splits):
        ``array``'s first axis is cut into ``world_size`` equal blocks, and the result (a new
        array of ``array``'s shape and dtype, or ``out``) holds rank ``q``'s block as its
        block ``q``. Every block goes straight to its rank (``world_size - 1`` steps, each
        rank sending to one and receiving from another at each); over RDMA, in groups of up
        to 16 ranks, a block within the group's step engine (``thresholds.engine`` bytes:
        1 MiB, 256 KiB past 4 ranks) goes in one RDMA WRITE.

        Raises:
            CollectiveArgumentError: a first axis that is missing or not a multiple of
                ``world_size``, an object dtype, an ``out`` of the wrong shape or dtype.
            CollectiveMismatchError: ranks disagree on the dtype, the block shape or size; the
                group is broken.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        quick = self._engine.quick  # (into out=, in a few steps: see _quick)
        if quick is not None and type(array) is np.ndarray and type(out) is np.ndarray:
            bound = timeout if timeout is ... else timeout_arg(timeout)
            started = quick.alltoall(array, out)
            if started is not None:
                if started is not True:
                    await quick.settle(started, bound, "alltoall")
                return out
        src = as_input(array, "alltoall")
        rows = _rows(src, "alltoall")
        world = self.world_size
        if src.shape[0] % world:
            raise CollectiveArgumentError(f"alltoall cuts the first axis into {world} equal "
                                          f"blocks: shape {src.shape} has none")
        counts = [src.shape[0] // world] * world
        if world == 1 or world > GATHER_WORLD:  # (no engine for it)
            return await self._alltoall("alltoall", src, rows, counts, counts, out, timeout)
        dst = None
        if out is not None:
            dst = as_output(out, "alltoall's out")
            check_like(dst, src.shape, src.dtype, "alltoall's out")
        nbytes = src.nbytes // world
        into = dst  # (the result's array: dst if it is contiguous, else a new one)

        def begin(engine: Engine) -> Any:
            nonlocal into
            if dst is None or not dst.flags.c_contiguous:
                into = np.empty(src.shape, src.dtype)
            return engine.begin_alltoall(src, into,
                                         engine.sig("alltoall", src.dtype.str, rows))

        def end(engine: Engine, fut: Any, state: Any) -> Any:
            blocks = engine.end_alltoall(fut, state)  # (world, nbytes): rank q's in row q
            got = cast(np.ndarray, into)  # (set by begin)
            if blocks is not None and nbytes:  # (else the runner filled it)
                got.reshape(-1).view(np.uint8).reshape(world, nbytes)[...] = blocks
            if dst is None:
                return got
            if got is not dst:
                np.copyto(dst, got)
            return out

        def links(plane: CallPlane, call: proto.Tag) -> Awaitable[Any]:
            return self._alltoall_links("alltoall", src, rows, counts, counts, dst, out)(
                plane, call)

        return await self._engine_or_links("alltoall", timeout_arg(timeout), nbytes, begin,
                                           end, links)

    async def alltoallv(self, array: Any, send_counts: Sequence[int],
                        recv_counts: Sequence[int] | None = None, *, out: Any = None,
                        timeout: Timeout = ...) -> Any:
        """:meth:`alltoall` with blocks of their own sizes (MPI's ``Alltoallv``, torch's
        ``all_to_all_single`` with split sizes): ``send_counts[p]`` rows (entries of the
        first axis) of ``array``, in order, go to rank ``p``, and ``recv_counts[q]`` rows come
        from rank ``q``, stacked in rank order into a new array (or ``out``, of shape
        ``(sum(recv_counts), *array.shape[1:])``). With ``recv_counts`` None (and no ``out``)
        each rank learns them from the blocks' headers.

        Raises:
            CollectiveArgumentError: counts that are not ``world_size`` non-negative ints,
                ``send_counts`` that do not add up to ``array``'s first axis, an ``out``
                without ``recv_counts`` or of the wrong shape or dtype.
            CollectiveMismatchError: a rank sends another count than this rank's
                ``recv_counts`` says, or another dtype or row shape; the group is broken.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        src = as_input(array, "alltoallv")
        rows = _rows(src, "alltoallv")
        world = self.world_size
        sends = _counts(send_counts, world, "send_counts")
        if sum(sends) != src.shape[0]:
            raise CollectiveArgumentError(f"send_counts add up to {sum(sends)} rows; the array "
                                          f"has {src.shape[0]}")
        recvs: list[int | None]
        if recv_counts is None:
            if out is not None:
                raise CollectiveArgumentError("alltoallv into out= needs recv_counts")
            recvs = [None] * world
            recvs[self.rank] = sends[self.rank]
        else:
            recvs = list(_counts(recv_counts, world, "recv_counts"))
            if recvs[self.rank] != sends[self.rank]:
                raise CollectiveArgumentError(f"this rank sends itself {sends[self.rank]} rows "
                                              f"but expects {recvs[self.rank]}")
        return await self._alltoall("alltoallv", src, rows, sends, recvs, out, timeout)

    async def _alltoall(self, kind: str, src: np.ndarray, rows: tuple[int, ...],
                        sends: list[int], recvs: list[int | None], out: Any,
                        timeout: Any) -> Any:
        timeout = timeout_arg(timeout)
        dst = None
        if out is not None:
            dst = as_output(out, f"{kind}'s out")
            total = sum(c for c in recvs if c is not None)  # (all known: alltoallv checked)
            check_like(dst, (total, *rows), src.dtype, f"{kind}'s out")
        if self.world_size == 1:
            self._alone()
            if dst is None:
                return src.copy()
            np.copyto(dst, src)
            return out
        return await self._run(kind, timeout,
                               self._alltoall_links(kind, src, rows, sends, recvs, dst, out))

    def _alltoall_links(self, kind: str, src: np.ndarray, rows: tuple[int, ...],
                        sends: list[int], recvs: list[int | None], dst: np.ndarray | None,
                        out: Any) -> Callable[[CallPlane, proto.Tag], Awaitable[Any]]:
        """The call on the links (see :func:`._direct.alltoall`)."""
        row = src.dtype.itemsize * int(np.prod(rows, dtype=np.int64))

        def result(data: np.ndarray, total_rows: int) -> Any:
            got = data[:total_rows * row].view(src.dtype).reshape((total_rows, *rows))
            if dst is None:
                return got.copy()
            np.copyto(dst, got)
            return out

        async def run(plane: CallPlane, call: proto.Tag) -> Any:
            _stage(plane, [src])
            sig = proto.signature(kind, src.dtype.str, rows)
            if kind == "alltoall" and self._choose(kind, src.nbytes) == "written":
                count = sends[0]  # (every block's rows, on every rank: the signature says)
                await _written.alltoall(plane, call, count * row,
                                        proto.signature(kind, src.dtype.str, rows, count))
                return result(plane.work(self.world_size * count * row, 1),
                              self.world_size * count)
            got = await _direct.alltoall(plane, call, sends, recvs, row, sig)
            return result(plane.work(sum(got) * row, 1), sum(got))

        return run
