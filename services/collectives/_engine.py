"""The step engine: small collectives run as step programs, with no Python per step.

A group over RDMA links runs on an engine of its own its recursive-doubling allreduces (up to
``thresholds.engine`` bytes: 1 MiB by default, at most :func:`engine_max`), its barriers
(dissemination), its
broadcasts once formed, and, in groups of up to :data:`GATHER_WORLD` ranks, its allgathers,
alltoalls and reduce-scatters whose every block fits the engine (up to that size too; each
block straight to its rank). The engine is a queue pair to each rank its
programs exchange with, a work area and a landing area registered once, and a step runner
(:mod:`aiordma._verbs.pysteps`, compiled where the fast path is built) that carries the
programs (:func:`aiordma.protocols.collectives.allreduce_program`, ``barrier_program``,
``allgather_program``, ``broadcast_program``, ``alltoall_program``,
``reduce_scatter_program``) in the completions' callback: each step is one RDMA WRITE with
immediate data into a partner's landing, and a reduction runs as soon as the partner's data
arrives. Python runs once per call and per wake-up.

Formation: the first call that could run on the engine forms it, on every rank in the same
call (the ranks start their collectives in the same order): each rank offers its queue pairs'
addresses and landing area to every rank (or offers nothing: no device, or
``AIORDMA_COLL_ENGINE=0``), and the engine is used only if every rank offered; then each
connects its queue pairs, posts their receives, and tells its partners it is ready. Calls on
the engine run one at a time, in the order they started (the order every rank shares).

An allgather's block carries its description (dtype and shape) behind its bytes
(:func:`~aiordma.protocols.collectives.block_tail`), so ranks' arrays may differ as on the
links; a rank whose block does not fit writes the *oversize* mark instead, and every rank,
having heard from every rank, then runs that call on the links.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from aiordma import BrokenResourceError, MemoryRegion, RemoteProtocolError
from aiordma._endpoint.qp import QPAddress, QueuePair
from aiordma._reactor.reactor import release_shared, shared_reactor
from aiordma._verbs.drivers import step_runner
from aiordma._verbs.pysteps import DTYPE_CODES, OP_CODES, recv_count
from aiordma.lowlevel import Device
from aiordma.protocols import collectives as proto

from ._arrays import ReduceOp, mapped
from ._errors import CollectiveMismatchError
from ._plane import CallPlane
from ._rounds import exchange

__all__ = ["ENGINE_MAX", "ENV", "GATHER_WORLD", "Engine", "EngineSlot", "engine_max", "settled"]

ENV = "AIORDMA_COLL_ENGINE"  # "0": run every collective on the links (no engine)
ENGINE_MAX = 1 << 20  # bytes: larger calls run on the links, whatever the threshold
ENGINE_MAX_LARGE = 256 << 10  # ... in groups of more than SMALL_WORLD ranks
SMALL_WORLD = 4
GATHER_WORLD = 16  # ranks: larger groups run their allgathers on the links (a queue pair each)
ALLREDUCE, BARRIER, ALLGATHER, ALLTOALL, REDUCE_SCATTER = 0, 1, 2, 3, 4  # programs' numbers
SPIN_ENV = "AIORDMA_COLL_SPIN_US"
# A call's poll before it sleeps (see Engine). 3 ms, as the reactor's spins: at 4 ranks on 2
# vCPUs (the test VM) a 4 KiB call takes 1-3 ms, and one that outlives its poll sleeps on the
# channel's event; there, a 3 ms poll halved the five small kinds' calls against 300 us (bench
# timing, 4 rounds alternated in the same processes), and changed nothing at 2 ranks, whose
# calls end within 300 us (docs/reports/2026-11-29-longer-polls.md).
SPIN_US = 3000.0
_SEND_WR = 16
_REDUCERS = 32  # reducer lists kept per engine (by count, dtype, op, parity)
_BARRIER_SIG = proto.signature("barrier")
_GATHER_SIG = proto.signature("allgather")
_OVERSIZE = proto.block_tail(None)
_OFFER = "step engine"  # an engine offer's first item
_UFUNC_CODES = {np.add: OP_CODES["sum"], np.multiply: OP_CODES["prod"],  # (avg: add, finished)
                np.minimum: OP_CODES["min"], np.maximum: OP_CODES["max"],
                np.bitwise_and: OP_CODES["band"], np.bitwise_or: OP_CODES["bor"],
                np.bitwise_xor: OP_CODES["bxor"]}


def engine_max(world: int) -> int:
    """The largest call (bytes; a block's, for allgather, alltoall and reduce_scatter) a group
    of ``world`` ranks runs on its engine, whatever its threshold: :data:`ENGINE_MAX` up to
    :data:`SMALL_WORLD` ranks, else :data:`ENGINE_MAX_LARGE`. The engine registers
    ``(b + 2 x l)`` buffers of that size (its largest program's work buffers and landings,
    which grow with the world: 9 at 2 ranks, 13 at 4, 49 at 16). At 2 and 4 ranks, 1 MiB calls
    of every kind took 0.54-1.05x the links' time on the engine in the test VM (both in the
    same processes: docs/reports/2026-11-29-quick-calls-compiled.md); at 4 ranks a 4 MiB
    allreduce took 1.16x (recursive doubling sends the whole array at every round), hence no
    larger; larger groups are not measured and keep the earlier 256 KiB."""
    return ENGINE_MAX if world <= SMALL_WORLD else ENGINE_MAX_LARGE


async def settled(fut: asyncio.Future[Any]) -> None:
    """Until ``fut`` is done, whatever its outcome (an engine call's ``end_*`` reads it)."""
    try:
        await fut
    except Exception:  # noqa: BLE001, S110  (read by end_*, typed)
        pass


class Engine:
    """One group's engine on one rank (see the module); made by :meth:`EngineSlot.form`."""

    def __init__(self, device: Device, rank: int, world: int, cap: int) -> None:
        self.rank, self.world, self.cap = rank, world, cap
        self.stride = cap + proto.TAIL_MAX  # bytes between buffers (an allgather's tail)
        self.programs = [proto.allreduce_program(rank, world),
                         proto.barrier_program(rank, world)]
        if world <= GATHER_WORLD:  # (a queue pair to every rank)
            self.programs += [proto.allgather_program(rank, world),
                              proto.alltoall_program(rank, world),
                              proto.reduce_scatter_program(rank, world)]
        self._roots = len(self.programs)  # broadcast from root r: program _roots + r
        self.programs += [proto.broadcast_program(rank, world, r) for r in range(world)]
        self.program = self.programs[ALLREDUCE]
        self.landings = max(p.landings for p in self.programs)
        self._device = device
        peers = sorted({q for p in self.programs for q in p.peers})
        rq = recv_count(self.landings) + 2
        self._entries = len(peers) * (_SEND_WR + rq)
        self._reactor = shared_reactor(device, self._entries)
        self.qps: dict[int, QueuePair] = {}
        self._regions: list[MemoryRegion] = []
        self._route: int | None = None
        self.runner: Any = None
        try:
            for p in peers:
                self.qps[p] = QueuePair(device, self._reactor, max_send_wr=_SEND_WR,
                                        max_recv_wr=rq, max_inline=0)
            buffers = max(p.buffers for p in self.programs)
            self._work = mapped(buffers * self.stride)
            self._land = mapped(2 * self.landings * self.stride)
            self._blocks = self._work.reshape(buffers, self.stride)  # (work buffer i: row i)
            self._places = self._land.reshape(2 * self.landings, self.stride)
            self._regions.append(MemoryRegion(device, self._work))
            self._regions.append(MemoryRegion(device, self._land, remote_write=True))
        except BaseException:
            self.close()
            raise
        self._reducers: dict[tuple[Any, ...], list[Any]] = {}
        self._codes: dict[tuple[Any, ...], tuple[int, int]] = {}  # (dtype, op) -> C loop
        self._tails: dict[tuple[Any, ...], bytes] = {}  # (dtype, shape) -> its block tail
        self._read_tails: dict[bytes, Any] = {}  # a block's tail -> its description, parsed
        self._broadcast_sigs: dict[int, int] = {}  # root -> its broadcast's signature
        self._sigs: dict[tuple[Any, ...], int] = {}  # (kind, ...) -> its signature
        self._spin = float(os.environ.get(SPIN_ENV, SPIN_US)) / 1e6

    def sig(self, *parts: Any) -> int:
        """:func:`~aiordma.protocols.collectives.signature` of ``parts`` (a call's kind and
        arguments, as the links' path computes it), cached."""
        sig = self._sigs.get(parts)
        if sig is None:
            if len(self._sigs) >= 256:
                self._sigs.clear()
            sig = self._sigs[parts] = proto.signature(*parts)
        return sig

    @property
    def gathers(self) -> bool:
        """Allgathers, alltoalls and reduce-scatters run here (the group is small enough:
        each has a queue pair to every rank)."""
        return self.world <= GATHER_WORLD

    def offer(self) -> list[Any]:
        """What the peers need: the landing area (address, rkey, cap) and, by rank, the
        address of this rank's queue pair to it (None for a rank it does not exchange with),
        behind :data:`_OFFER` (a rank whose call is not on the engine sends something else
        in the same exchange)."""
        land = self._regions[1].expose(write=True)
        qps: list[Any] = [None] * self.world
        for p, qp in self.qps.items():
            a = qp.local_address()
            qps[p] = [a.qp_num, a.psn, a.gid, a.lid, a.mtu]
        return [_OFFER, land.address, land.rkey, self.cap, qps]

    def connect(self, offers: list[Any]) -> None:
        """Connect every queue pair to its partner's, make the runner and post its receives."""
        remote: dict[int, tuple[int, int, int]] = {}
        for p, qp in self.qps.items():
            offer = offers[p]
            if not (type(offer) is list and offer and offer[0] == _OFFER):
                raise CollectiveMismatchError(
                    f"rank {self.rank}: rank {p}'s call is not on the step engine, this "
                    f"rank's is: the ranks' calls differ (kind, op, dtype or size)")
            try:
                address, rkey, cap, theirs = offer[1:]
                qp_num, psn, gid, lid, mtu = theirs[self.rank]
                ints = (address, rkey, cap, qp_num, psn, lid, mtu)
                if not all(type(v) is int and v >= 0 for v in ints):
                    raise ValueError("a field out of range")
                there = QPAddress(qp_num=qp_num, psn=psn, gid=bytes(gid), lid=lid, mtu=mtu)
            except (TypeError, ValueError, IndexError) as exc:
                raise RemoteProtocolError(f"rank {p} offered a malformed step engine "
                                          f"({exc})") from None
            if cap != self.cap:
                raise CollectiveMismatchError(
                    f"rank {self.rank}: rank {p}'s step engine takes {cap} B, this rank's "
                    f"{self.cap} B: the ranks' thresholds differ (every rank must pass the "
                    f"same)")
            qp.connect(there)
            remote[p] = (address, rkey, self.stride)
        work, land = self._regions
        runner = step_runner(self.programs, self.landings,
                             {p: qp.driver for p, qp in self.qps.items()}, remote,
                             work.address, work.lkey, land.address, self.stride, 0,
                             land.lkey)
        self._route = self._reactor.add_route(runner)  # (the runner is the route: no Python)
        runner.wr_base = self._route << 32
        self.runner = runner
        runner.post_receives(recv_count(self.landings))

    def _view(self, kind: int, i: int, nbytes: int, parity: int) -> np.ndarray:
        if kind == proto.BUF:
            start = i * self.stride
            return self._work[start:start + nbytes]
        start = proto.landing_place(i, self.landings, parity) * self.stride
        return self._land[start:start + nbytes]

    def _reducers_for(self, count: int, dtype: np.dtype[Any], op: ReduceOp,
                      parity: int, program: int = ALLREDUCE) -> list[Any]:
        key = (count, dtype.str, op.name, parity, program)
        got = self._reducers.get(key)
        if got is None:
            nbytes = count * dtype.itemsize
            got = []
            for step in self.programs[program].steps:
                if step[0] == proto.REDUCE:
                    _, ka, a, kb, b, dst = step
                    got.append(functools.partial(
                        op.ufunc, self._view(ka, a, nbytes, parity).view(dtype),
                        self._view(kb, b, nbytes, parity).view(dtype),
                        out=self._view(proto.BUF, dst, nbytes, parity).view(dtype)))
            if len(self._reducers) >= _REDUCERS:
                self._reducers.clear()
            self._reducers[key] = got
        return got

    # Each call comes in two halves: ``begin_*`` stages it, starts the runner and polls for a
    # while (see SPIN_US); it returns the call's future, often done already, and a state for
    # ``end_*``, which takes the result once the future is done (raising the call's failure,
    # typed). ``GroupCore._engine_or_links`` runs both halves, with an await between them
    # only if the poll did not end the call.

    def _loop_codes(self, dtype: np.dtype[Any], op: ReduceOp) -> tuple[int, int]:
        """The compiled runner's codes of ``dtype`` and ``op`` (-1: it has no copy or typed
        loop for them), cached per (dtype, op)."""
        codes = self._codes.get((dtype, op.name))
        if codes is None:
            code = DTYPE_CODES.get((dtype.kind, dtype.itemsize), -1)
            opc = _UFUNC_CODES.get(op.ufunc, -1) if code >= 0 else -1
            codes = self._codes[(dtype, op.name)] = (code, opc)
        return codes

    def begin_allreduce(self, src: np.ndarray, dst: np.ndarray, dtype: np.dtype[Any],
                        op: ReduceOp, signature: int) -> tuple[asyncio.Future[None], Any]:
        """Start reducing ``src`` over the group into ``dst`` (both of ``src``'s shape;
        ``dtype`` is its dtype in native byte order)."""
        runner = self._runner()
        count = src.size
        nbytes = count * dtype.itemsize
        parity = runner.calls & 1
        if not runner.compiled:
            self._stage(src, dtype, nbytes)
            fut = self._start(runner, ALLREDUCE, nbytes, signature,
                              self._reducers_for(count, dtype, op, parity))
            return fut, (False, nbytes, parity, dtype)
        code, opc = self._loop_codes(dtype, op)
        inside = src.dtype == dtype and src.flags.c_contiguous
        if dst is src:
            direct = inside and op.name != "avg"
        else:
            direct = dst.dtype == dtype and op.name != "avg" and dst.flags.c_contiguous
        if not inside:
            self._stage(src, dtype, nbytes)
        reducers = () if opc >= 0 else self._reducers_for(count, dtype, op, parity)
        fut = self._start(runner, ALLREDUCE, nbytes, signature, reducers,
                          src if inside else None, dst if direct else None, opc, code)
        return fut, (direct, nbytes, parity, dtype)

    def end_allreduce(self, fut: asyncio.Future[None], state: Any) -> np.ndarray | None:
        """None: ``dst`` holds the result; else the result, a typed view of the engine's
        memory valid until its next call, for the caller to finish (``op.finish``) and copy
        (a layout or an op the runner does not copy for)."""
        self._outcome(fut)
        direct, nbytes, parity, dtype = state
        if direct:
            return None
        kind, i = self.program.results[0]
        return self._view(kind, i, nbytes, parity).view(dtype)

    def begin_reduce_scatter(self, src: np.ndarray, dst: np.ndarray, dtype: np.dtype[Any],
                             op: ReduceOp, signature: int
                             ) -> tuple[asyncio.Future[None], Any]:
        """Start a reduce-scatter of ``src`` (``world`` blocks along its first axis) whose
        block for this rank goes into ``dst``; ``dtype`` is ``src``'s in native byte order."""
        runner = self._runner()
        world = self.world
        count = src.size // world  # (items per block)
        nbytes = count * dtype.itemsize
        parity = runner.calls & 1
        inside = runner.compiled and src.dtype == dtype and src.flags.c_contiguous
        if nbytes and not inside:
            self._blocks[:world, :nbytes].view(dtype)[...] = src.reshape(world, count)
        code, opc = self._loop_codes(dtype, op)
        if not runner.compiled:
            opc = -1
        direct = (runner.compiled and dst.dtype == dtype and op.name != "avg"
                  and dst.flags.c_contiguous)
        reducers = (() if opc >= 0 else
                    self._reducers_for(count, dtype, op, parity, REDUCE_SCATTER))
        fut = self._start(runner, REDUCE_SCATTER, nbytes, signature, reducers,
                          src if inside else None, dst if direct else None, opc, code)
        return fut, (direct, nbytes, parity, dtype)

    def end_reduce_scatter(self, fut: asyncio.Future[None], state: Any) -> np.ndarray | None:
        """As :meth:`end_allreduce`: None (``dst`` holds this rank's block) or the block to
        finish and copy."""
        self._outcome(fut)
        direct, nbytes, parity, dtype = state
        if direct:
            return None
        kind, i = self.programs[REDUCE_SCATTER].results[0]
        return self._view(kind, i, nbytes, parity).view(dtype)

    def begin_alltoall(self, src: np.ndarray, dst: np.ndarray | None, signature: int
                       ) -> tuple[asyncio.Future[None], Any]:
        """Start an alltoall of ``src`` (``world`` blocks of equal size along its first
        axis, any dtype but object) into ``dst`` (an array of ``src``'s shape and dtype, or
        None)."""
        runner = self._runner()
        world = self.world
        nbytes = src.nbytes // world
        parity = runner.calls & 1
        # (the compiled runner copies contiguous arrays in and out: any dtype that has a
        # buffer, which datetimes have not)
        inside = runner.compiled and src.flags.c_contiguous and src.dtype.kind not in "mM"
        direct = (runner.compiled and dst is not None and dst.flags.c_contiguous
                  and dst.dtype.kind not in "mM")
        if nbytes and not inside:
            self._blocks[:world, :nbytes] = np.ascontiguousarray(src).view(np.uint8).reshape(
                world, nbytes)
        fut = self._start(runner, ALLTOALL, nbytes, signature, (), src if inside else None,
                          dst if direct else None)
        return fut, (direct, nbytes, parity)

    def end_alltoall(self, fut: asyncio.Future[None], state: Any) -> np.ndarray | None:
        """None (``dst`` holds every rank's block for this rank), or those blocks, in rank
        order: a ``(world, bytes)`` uint8 view of the engine's memory (valid until its next
        call)."""
        self._outcome(fut)
        direct, nbytes, parity = state
        if direct:
            return None
        base = parity * self.landings
        got = self._places[base:base + self.world, :nbytes]
        got[self.rank] = self._blocks[self.rank, :nbytes]  # (no rank writes that landing)
        return got

    def begin_barrier(self) -> tuple[asyncio.Future[None], Any]:
        return self._start(self._runner(), BARRIER, 0, _BARRIER_SIG), None

    def end_barrier(self, fut: asyncio.Future[None], state: Any) -> None:
        self._outcome(fut)

    def begin_allgather(self, arr: np.ndarray, describe: Callable[[np.ndarray], Any]
                        ) -> tuple[asyncio.Future[None], Any]:
        """Start an allgather of ``arr`` (see :meth:`allgather`)."""
        runner = self._runner()
        size = self._stage_block(arr, describe)
        parity = runner.calls & 1  # (the call's: start counts it)
        return self._start(runner, ALLGATHER, size, _GATHER_SIG), (size, parity)

    def _stage_block(self, arr: np.ndarray, describe: Callable[[np.ndarray], Any]) -> int:
        """``arr``'s bytes and its description (or the oversize mark) into work buffer 0;
        their size."""
        nbytes = arr.nbytes
        key = (arr.dtype, arr.shape)
        tail = self._tails.get(key)
        if tail is None:
            if len(self._tails) >= 256:
                self._tails.clear()
            tail = self._tails[key] = proto.block_tail(describe(arr) if nbytes <= self.cap
                                                       else None)
        size = nbytes + len(tail) if tail != _OVERSIZE else len(tail)
        if tail != _OVERSIZE and nbytes:
            self._work[:nbytes].view(arr.dtype).reshape(arr.shape)[...] = arr
        self._work[size - len(tail):size] = np.frombuffer(tail, np.uint8)
        return size

    def end_allgather(self, fut: asyncio.Future[None], state: Any,
                      parse: Callable[[Any], Any]) -> list[tuple[np.ndarray, Any]] | None:
        """Every rank's block as a uint8 view of the engine's memory (valid until its next
        call) with ``parse`` of its description (cached by the description's bytes; it
        raises for a malformed one): ``(bytes, parsed)`` per rank in rank order; or None: a
        block did not fit (this rank's or another's), and the call must run on the links."""
        self._outcome(fut)
        size, parity = state
        runner = self._runner()
        blocks: list[Any] = []
        fits = True
        for r, (kind, i) in enumerate(self.programs[ALLGATHER].results):
            n = size if r == self.rank else runner.landed(i)
            got = self._read_block(self._view(kind, i, n, parity), r, parse)
            if got is None:
                fits = False
            else:
                blocks.append(got)
        return blocks if fits else None

    def _read_block(self, block: np.ndarray, origin: int, parse: Callable[[Any], Any]
                    ) -> tuple[np.ndarray, Any] | None:
        """``(data, parse(description))`` of a block and its tail written by rank ``origin``,
        or None for the oversize mark (descriptions cached by their bytes)."""
        n = len(block)
        m = int(block[n - 2]) | int(block[n - 1]) << 8 if n >= 2 else 0xFFFF
        key = block[n - 2 - m:n].tobytes() if m + 2 <= min(n, proto.TAIL_MAX) else b""
        parsed = self._read_tails.get(key)
        if parsed is None:
            try:
                got = proto.split_block(block.data)
            except RemoteProtocolError as exc:
                raise RemoteProtocolError(f"rank {origin}: {exc}") from None
            if got is None:  # (the oversize mark)
                return None
            parsed = parse(got[1])
            if len(self._read_tails) >= 256:
                self._read_tails.clear()
            self._read_tails[key] = parsed
        return block[:n - len(key)], parsed

    def begin_broadcast(self, root: int, arr: np.ndarray | None,
                        describe: Callable[[np.ndarray], Any]
                        ) -> tuple[asyncio.Future[None], Any]:
        """Start a broadcast of rank ``root``'s ``arr`` (None on the other ranks)."""
        runner = self._runner()
        size = self._stage_block(arr, describe) if arr is not None else 0
        parity = runner.calls & 1
        sig = self._broadcast_sigs.get(root)
        if sig is None:
            sig = self._broadcast_sigs[root] = proto.signature("broadcast", root)
        return self._start(runner, self._roots + root, size, sig), (root, size, parity)

    def end_broadcast(self, fut: asyncio.Future[None], state: Any, parse: Callable[[Any], Any]
                      ) -> tuple[np.ndarray, Any] | None:
        """The root's block as a uint8 view of the engine's memory (valid until its next
        call) with ``parse`` of its description, or None: it did not fit, and the call must
        run on the links."""
        self._outcome(fut)
        root, size, parity = state
        kind, i = self.programs[self._roots + root].results[0]
        n = size if root == self.rank else self._runner().landed(i)
        return self._read_block(self._view(kind, i, n, parity), root, parse)

    def _runner(self) -> Any:
        runner = self.runner
        if runner is None:
            raise BrokenResourceError(f"rank {self.rank}: the group's engine was closed")
        return runner

    def _start(self, runner: Any, program: int, nbytes: int, signature: int,
               reducers: Any = (), src: Any = None, dst: Any = None, opc: int = -1,
               code: int = -1) -> asyncio.Future[None]:
        """Start ``program`` (staged already) and poll for a while; its future."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            if runner.compiled:
                runner.start(program, nbytes, signature, reducers, fut, src, dst, opc, code)
                if self._spin and not fut.done():
                    self._reactor.spin_for(runner, self._spin)
            else:
                runner.start(program, nbytes, signature, reducers, fut)
        except (RemoteProtocolError, OSError) as exc:
            raise self._typed(exc) from None
        return fut

    def _outcome(self, fut: asyncio.Future[None]) -> None:
        """Raise the finished call's failure, typed."""
        exc = fut.exception()
        if exc is not None:
            raise self._typed(exc) from exc.__cause__

    def _typed(self, exc: BaseException) -> BaseException:
        if isinstance(exc, RemoteProtocolError):
            return CollectiveMismatchError(f"rank {self.rank}: {exc}")
        if isinstance(exc, OSError):
            err = BrokenResourceError(f"rank {self.rank}: a collective's work request "
                                      f"failed: {exc}")
            err.__cause__ = exc
            return err
        return exc

    def _stage(self, src: np.ndarray, dtype: np.dtype[Any], nbytes: int) -> None:
        """Copy ``src`` into work buffer 0 as ``dtype``, in C order."""
        self._work[:nbytes].view(dtype).reshape(src.shape)[...] = src

    def close(self) -> None:
        """Release everything (idempotent); a call under way fails."""
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.fail(BrokenResourceError("the group's engine was closed"))
        if self._route is not None:
            self._reactor.remove_route(self._route)
            self._route = None
        for qp in self.qps.values():
            qp.close()
        self.qps = {}
        for mr in self._regions:
            mr.close()
        self._regions = []
        self._work = self._land = np.empty(0, np.uint8)  # (a closed group may stay referenced)
        self._blocks = self._places = np.empty((0, self.stride), np.uint8)
        self._reducers = {}  # (the Python runner's reductions hold views of those buffers)
        if self._entries:
            release_shared(self._reactor, self._entries)
            self._entries = 0


class EngineSlot:
    """A group's engine, from the first allreduce that could use it: None until formed, then
    the engine or False (not every rank offered). Calls that may use it take a turn
    (:meth:`turn`, a number) when they start, and run on it in the turns' order
    (:meth:`wait`), giving their turn back when they end (:meth:`finish`)."""

    def __init__(self) -> None:
        self.engine: Engine | None | bool = None
        self._turns = 0  # turns taken
        self._done = 0  # the turns below this one are over
        self._over: set[int] = set()  # turns over before an earlier one
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self.quick: Any = None  # the group's QuickCalls once the engine is formed (_quick)

    @property
    def off(self) -> bool:
        return self.engine is False

    @property
    def idle(self) -> bool:
        """No call holds a turn (none waits or runs)."""
        return self._done == self._turns

    def turn(self) -> int:
        self._turns += 1
        return self._turns - 1

    def ready(self, turn: int) -> Engine | None:
        """The engine, if it is formed and ``turn``'s to use now (no waiting)."""
        engine = self.engine
        if self._done == turn and isinstance(engine, Engine):
            return engine
        return None

    async def wait(self, turn: int) -> None:
        """Until every earlier turn is over."""
        if self._done < turn:
            fut = self._waiters[turn] = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                self._waiters.pop(turn, None)

    def finish(self, turn: int) -> None:
        """``turn`` is over (its call ended, or failed before it ran)."""
        if turn == self._done and not self._over:  # (the usual case: turns end in order)
            self._done += 1
        else:
            self._over.add(turn)
            while self._done in self._over:
                self._over.discard(self._done)
                self._done += 1
        if self._waiters:
            fut = self._waiters.get(self._done)
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def form(self, plane: CallPlane, call: proto.Tag, device: Device | None,
                   cap: int) -> Engine | None:
        """The engine (formed now, in call ``call``, on every rank), or None if it is off."""
        if isinstance(self.engine, Engine):
            return self.engine
        if self.engine is False:
            return None
        engine = None
        if device is not None and os.environ.get(ENV, "1") != "0" and plane.world > 1:
            try:
                engine = Engine(device, plane.rank, plane.world, cap)
            except Exception:  # noqa: BLE001  (no engine here: the group runs without one)
                engine = None
        try:
            offers = await exchange(plane, call, engine.offer() if engine else None)
            if engine is None or any(o is None for i, o in enumerate(offers)
                                     if i != plane.rank):
                self.engine = False
                if engine is not None:
                    engine.close()
                return None
            engine.connect(offers)
            for p in engine.qps:  # ready: receives posted, queue pairs connected
                await plane.outs[p].send_value(call, 1, plane.rank, None)
            for p in engine.qps:
                await plane.ins[p].recv_value(call, 1, p)
        except BaseException:
            if engine is not None:
                engine.close()
            raise
        self.engine = engine
        return engine

    def close(self) -> None:
        if isinstance(self.engine, Engine):
            self.engine.close()
        self.engine = False
        self.quick = None
