"""The reference executor of step programs (:mod:`aiordma.protocols.collectives`'s
``_programs``): :class:`PyStepRunner`, used where the compiled module is not built; the
compiled ``StepRunner`` does the same in C and is tested against it.

A runner carries one rank's programs (an allreduce, a barrier, an allgather: each call runs
one of them, one call at a time, over one landing space) over queue pairs of its own to the
programs' peers, on a reactor's completion queue as a *route* (every completion of its ``wr_id`` range comes to
it): it posts the program's WRITEs with immediate data, takes the peers' WRITEs as their
receive completions arrive, and calls the reducers, all in the completion's callback, so an
awaiting collective is woken once, when its call is over.

Buffers: work buffer ``i`` is at ``work_address + i * cap`` (``work_lkey``); landing place
``p`` (see ``landing_place``) at ``land_address + p * cap``; a peer's at ``remote[peer]``'s
``(address, rkey, cap)`` the same way.

``wr_id``'s low 32 bits: the peer's rank, with bit 30 set for a receive.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Any

from aiordma._errors import BrokenResourceError, RemoteProtocolError
from aiordma._verbs.enums import value
from aiordma._verbs.pydrivers import _RECV_RDMA_WITH_IMM
from aiordma.protocols.collectives._programs import (
    FWD,
    PROGRAM_MAX,
    PUT,
    SIGNAL,
    WAIT,
    step_clash,
    step_mismatch,
)

__all__ = ["DTYPE_CODES", "OP_CODES", "RECV_BIT", "PyStepRunner", "recv_count"]

RECV_BIT = 1 << 30
# The compiled runner's typed reduction loops (``_fastpath.reduce_into``): their op codes, and
# their dtype codes by numpy's (kind, itemsize), native byte order.
OP_CODES = {"sum": 0, "prod": 1, "min": 2, "max": 3, "band": 4, "bor": 5, "bxor": 6}
DTYPE_CODES = {("f", 4): 0, ("f", 8): 1, ("i", 1): 2, ("i", 2): 3, ("i", 4): 4, ("i", 8): 5,
               ("u", 1): 6, ("u", 2): 7, ("u", 4): 8, ("u", 8): 9}


def recv_count(landings: int) -> int:
    """Receives each queue pair keeps posted: a peer fills at most two calls' landings."""
    return 2 * landings + 2


class PyStepRunner:
    """See the module. ``programs``: the :class:`~aiordma.protocols.collectives.Program`
    objects a call may run (by index); ``landings``: the landings of the largest;
    ``qps[peer]``: the posting driver of this rank's queue pair to ``peer``; ``remote[peer]``:
    ``(address, rkey, cap)`` of its landing places (``cap`` bytes apart); ``land_lkey``: the
    local key of this rank's landing area (the source of a ``FWD``)."""

    compiled = False

    def __init__(self, programs: Sequence[Any], landings: int, qps: dict[int, Any],
                 remote: dict[int, tuple[int, int, int]], work_address: int, work_lkey: int,
                 land_address: int, cap: int, wr_base: int, land_lkey: int = 0) -> None:
        self._programs = [(tuple(tuple(s) for s in p.steps), bool(p.sized)) for p in programs]
        self._names = [getattr(p, "name", "") or f"program {i}" for i, p in enumerate(programs)]
        self._program = 0
        self._steps: tuple[tuple[int, ...], ...] = ()
        self._sized = True
        self._landings = landings
        self._landed = [0] * landings
        self._qps = dict(qps)
        self._remote = dict(remote)
        self._work, self._lkey, self._land, self._cap = work_address, work_lkey, land_address, cap
        self._land_lkey = land_lkey  # (a FWD's source: what landed here)
        self.wr_base = wr_base
        self._write_imm = value("WR_RDMA_WRITE_WITH_IMM")
        self._signaled = value("SEND_SIGNALED")
        # place -> (peer, sig16, bytes, program)
        self._arrived: dict[int, tuple[int, int, int, int]] = {}
        self._pc = 0
        self._outstanding = 0
        self._running = False
        self._nbytes = self._sig = self._parity = 0
        self._reducers: Sequence[Callable[[], object]] = ()
        self._next_reducer = 0
        self._future: asyncio.Future[None] | None = None
        self.failure: BaseException | None = None
        self.calls = 0

    def post_receives(self, count: int) -> None:
        """Post ``count`` receives on each queue pair (once, before the peers may write):
        :func:`recv_count` of the landings."""
        for peer, qp in self._qps.items():
            for _ in range(count):
                self._post_recv(peer, qp)

    def _post_recv(self, peer: int, qp: Any) -> None:
        rc = qp.post_recv(self.wr_base | RECV_BIT | peer, 0, 0, 0)
        if rc:
            raise OSError(rc, "ibv_post_recv failed")

    def start(self, program: int, nbytes: int, signature: int,
              reducers: Sequence[Callable[[], object]], future: asyncio.Future[None]) -> None:
        """Run program ``program`` for one call whose WRITEs carry ``nbytes`` bytes: ``future``
        is done once every step has run and every WRITE has completed, or failed with the
        runner's failure."""
        if self.failure is not None:
            future.set_exception(self.failure)
            return
        if self._running:
            raise RuntimeError("a step runner runs one call at a time")
        self._steps, self._sized = self._programs[program]
        self._nbytes, self._sig, self._parity = nbytes, signature & 0xFFFF, self.calls & 1
        self._program = program
        self._reducers, self._next_reducer = reducers, 0
        self._future, self._pc, self._running = future, 0, True
        self.calls += 1
        base = self._parity * self._landings
        for landing in range(self._landings):  # (WRITEs for this call that came first)
            got = self._arrived.get(base + landing)
            if got is not None and self._differs(got):
                self.fail(self._mismatch(landing, got))
                return
        self._advance()

    def _advance(self) -> None:
        steps, n = self._steps, len(self._steps)
        base = self._parity * self._landings
        try:
            while self._pc < n:
                step = steps[self._pc]
                kind = step[0]
                if kind == PUT:
                    _, peer, buf, landing = step
                    self._write(peer, self._work + buf * self._cap, self._nbytes, self._lkey,
                                landing, base)
                elif kind == FWD:
                    _, peer, src, landing = step
                    self._write(peer, self._land + (base + src) * self._cap, self._landed[src],
                                self._land_lkey, landing, base)
                elif kind == SIGNAL:
                    self._write(step[1], 0, 0, 0, step[2], base)
                elif kind == WAIT:
                    got = self._arrived.pop(base + step[2], None)
                    if got is None:
                        return  # (the receive's completion runs the rest)
                    self._check(step[1], step[2], got)
                    self._landed[step[2]] = got[2]
                else:
                    self._reducers[self._next_reducer]()
                    self._next_reducer += 1
                self._pc += 1
            self._maybe_done()
        except Exception as exc:
            self.fail(exc)

    def _write(self, peer: int, address: int, length: int, lkey: int, landing: int,
               base: int) -> None:
        raddr, rkey, cap = self._remote[peer]
        imm = (landing | self._parity << 8 | min(self._program, PROGRAM_MAX) << 9
               | self._sig << 16)
        rc = self._qps[peer].post_send(
            self.wr_base | peer, self._write_imm, address, length, lkey, self._signaled,
            raddr + (base + landing) * cap, rkey, imm_data=socket.htonl(imm))
        if rc:
            raise OSError(rc, "ibv_post_send failed")
        self._outstanding += 1

    def _check(self, peer: int, landing: int, got: tuple[int, int, int, int]) -> None:
        writer, sig, nbytes, _ = got
        if self._differs(got):
            raise self._mismatch(landing, got)
        if writer != peer or (self._sized and nbytes != self._nbytes):
            raise RemoteProtocolError(
                f"rank {writer} wrote {nbytes} B of a collective with signature {sig:#06x} "
                f"into landing {landing}; this rank expected {self._nbytes} B with "
                f"{self._sig:#06x} from rank {peer}")

    def _differs(self, got: tuple[int, int, int, int]) -> bool:
        """A WRITE for this call's parity from another program or another collective."""
        return got[1] != self._sig or got[3] != min(self._program, PROGRAM_MAX)

    def _mismatch(self, landing: int, got: tuple[int, int, int, int]) -> RemoteProtocolError:
        return RemoteProtocolError(step_mismatch(
            got[0], landing, self._name(got[3]), got[1], self._name(self._program), self._sig))

    def _name(self, program: int) -> str:
        return self._names[program] if program < min(len(self._names), PROGRAM_MAX) \
            else "collective"

    def landed(self, landing: int) -> int:
        """The bytes written into ``landing`` in the last call that waited on it."""
        return self._landed[landing]

    def _maybe_done(self) -> None:
        if self._running and self._pc == len(self._steps) and not self._outstanding:
            self._running = False
            fut, self._future, self._reducers = self._future, None, ()
            if fut is not None and not fut.done():
                fut.set_result(None)

    # -- the route -------------------------------------------------------------------------

    def __call__(self, wc: Any) -> None:
        """A completion of this runner's range (or the reactor's exception at close)."""
        if isinstance(wc, BaseException):
            self.fail(wc)
            return
        low = wc.wr_id & 0xFFFF_FFFF
        if wc.status:
            self.fail(BrokenResourceError(
                f"a collective's {'receive from' if low & RECV_BIT else 'WRITE to'} rank "
                f"{low & ~RECV_BIT} failed (work completion status {wc.status})"))
            return
        if low & RECV_BIT:
            peer = low & ~RECV_BIT
            if wc.opcode != _RECV_RDMA_WITH_IMM:
                self.fail(RemoteProtocolError(f"rank {peer} sent a message, not a WRITE "
                                              f"with immediate data"))
                return
            imm = socket.ntohl(wc.imm_data)
            landing, parity = imm & 0xFF, imm >> 8 & 1
            place = parity * self._landings + landing
            got = (peer, imm >> 16, wc.byte_len, imm >> 9 & PROGRAM_MAX)
            if landing >= self._landings or place in self._arrived:
                first = self._arrived.get(place)
                if first is not None and (first[1], first[3]) != (got[1], got[3]):
                    self.fail(RemoteProtocolError(step_clash(
                        landing, (first[0], self._name(first[3]), first[1]),
                        (peer, self._name(got[3]), got[1]))))
                else:
                    self.fail(RemoteProtocolError(f"rank {peer} wrote landing {landing} "
                                                  f"(parity {parity}) out of turn"))
                return
            self._arrived[place] = got
            try:
                self._post_recv(peer, self._qps[peer])
            except OSError as exc:
                self.fail(exc)
                return
            if self._running:
                if parity == self._parity and self._differs(got):  # (see the protocol)
                    self.fail(self._mismatch(landing, got))
                    return
                self._advance()
            return
        self._outstanding -= 1
        self._maybe_done()

    def fail(self, exc: BaseException) -> None:
        """Fail the call under way (if any) and every later one with ``exc``."""
        if self.failure is None:
            self.failure = exc
        self._running = False
        fut, self._future, self._reducers = self._future, None, ()
        if fut is not None and not fut.done():
            fut.set_exception(self.failure)
