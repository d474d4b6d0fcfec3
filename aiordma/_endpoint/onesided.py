"""One-sided operations of an endpoint: RDMA WRITE, READ and atomics, each awaited.

:class:`OneSided` posts one signaled work request per operation on the endpoint's queue pair
and waits for its completion. At most ``max_onesided`` are in flight (more callers wait for a
place); each atomic gets 8 scratch bytes of its own for the old value.

Cancellation is real but safe: a cancelled caller leaves at once, while the work request's
place, its scratch bytes and the buffers it uses stay taken until its completion (or the flush
when the endpoint closes) arrives, because until then the device may still write into them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiordma._device.device import Device
from aiordma._endpoint.qp import QueuePair, _check_atomic
from aiordma._errors import ClosedResourceError, CompletionError, LocalProtocolError
from aiordma._memory.region import LocalSlice, MemoryRegion, RemoteBuffer
from aiordma._reactor.reactor import resolve_future

__all__ = ["OneSided"]


class OneSided:
    """The one-sided operations of one endpoint (see the module documentation).

    Args:
        device, qp: the endpoint's.
        max_onesided: operations in flight at once.
        check_open: raises the endpoint's typed error if it is closed or broken (and posts
            the SENDs the endpoint holds for the tick's end: called right before each post).
        failure: called with an operation's failed completion; the queue pair is in the error
            state, so the endpoint fails; returns what the operation raises (the completion
            error itself, e.g. ``RemoteAccessError``, if it was the cause).
    """

    def __init__(self, device: Device, qp: QueuePair, max_onesided: int, *,
                 check_open: Callable[[], None],
                 failure: Callable[[CompletionError], BaseException]) -> None:
        self._device = device
        self._qp = qp
        self._max = max_onesided
        self._places = asyncio.Semaphore(max_onesided)
        # The atomics' result slots, registered at the first atomic: most endpoints make
        # none, and a registration per connection cost 3.7 ms of its set-up in the VM.
        self._scratch_region: MemoryRegion | None = None
        self._scratch_free = list(range(max_onesided))
        self._ops: dict[int, asyncio.Future[Any]] = {}  # wr_id -> future, failed at close
        self._check_open = check_open
        self._failure = failure

    @property
    def places_free(self) -> int:
        """Operations that could start now without waiting."""
        return self._places._value

    @property
    def scratch_free(self) -> int:
        """Atomics' scratch slots not held by a work request."""
        return len(self._scratch_free)

    def _scratch(self) -> MemoryRegion:
        """The atomics' result slots (8 bytes each), registered on first use.

        Raises:
            DeviceError: the device refused the registration.
        """
        if self._scratch_region is None:
            self._scratch_region = MemoryRegion(self._device, bytearray(8 * self._max))
        return self._scratch_region

    async def atomic(self, opcode: int, target: RemoteBuffer, compare_add: int,
                     swap: int) -> int:
        self._check_open()
        await self._places.acquire()
        i = self._scratch_free.pop()
        try:
            local = self._scratch()[8 * i:8 * i + 8]
        except BaseException:
            self._scratch_free.append(i)
            self._places.release()
            raise
        try:
            _check_atomic(local, target)
        except BaseException:
            self._scratch_free.append(i)
            self._places.release()
            raise
        value = await self.run("atomic", opcode, local, target, compare_add, swap, scratch=i)
        assert value is not None
        return value

    async def start(self, what: str, opcode: int, local: LocalSlice,
                    remote: RemoteBuffer, *, post: Callable[..., None] | None = None,
                    imm_data: int = 0) -> asyncio.Future[None]:
        """Post one READ/WRITE once a place is free and return without waiting for it: the
        returned future completes when the work request does, or fails with what :meth:`run`
        would raise. Cancelling that future gives nothing back early: the place is held until
        the device is done with the buffers, as for a cancelled :meth:`run`. ``post``: how
        the work request is posted (see :meth:`QueuePair.post_future`), called once the
        place is taken, with no suspension in between; ``imm_data``: a WITH_IMM opcode's
        value (host order)."""
        self._check_open()
        if local.region.device is not self._device:
            raise LocalProtocolError("the local buffer is registered on another device")
        if local.region.closed:
            raise ClosedResourceError("the local buffer's memory region is deregistered")
        await self._places.acquire()
        try:
            self._check_open()
            wr_id, fut = self._qp.post_future(what, opcode, local, remote=remote,
                                              done=self._places.release, post=post,
                                              imm_data=imm_data)
        except BaseException:
            self._places.release()
            raise
        self._ops[wr_id] = fut  # the endpoint's teardown fails it if the queue pair goes first
        outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def over(f: asyncio.Future[Any]) -> None:
            self._ops.pop(wr_id, None)
            if outcome.done():
                return
            if f.cancelled():
                outcome.cancel()
                return
            exc = f.exception()
            if exc is None:
                outcome.set_result(None)
            elif isinstance(exc, CompletionError):
                err = self._failure(exc)
                outcome.set_exception(err)
            else:
                outcome.set_exception(exc)

        fut.add_done_callback(over)
        return outcome

    async def run(self, what: str, opcode: int, local: LocalSlice, remote: RemoteBuffer,
                  compare_add: int = 0, swap: int = 0, *,
                  scratch: int | None = None) -> int | None:
        """Post one READ/WRITE/atomic and wait for it. ``scratch``: an atomic's 8-byte scratch
        slot (its place already taken); its old value is returned.

        The place (and the scratch slot) is given back when the work request completes, not
        when a cancelled caller leaves: until then the device may still write into the
        scratch bytes, and the work request occupies the send queue.
        """
        try:
            self._check_open()
            if local.region.device is not self._device:
                raise LocalProtocolError("the local buffer is registered on another device")
            if local.region.closed:  # its lkey would dereference a freed MR (a pyverbs segfault)
                raise ClosedResourceError("the local buffer's memory region is deregistered")
        except BaseException:
            if scratch is not None:
                self._scratch_free.append(scratch)
                self._places.release()
            raise
        if scratch is None:
            await self._places.acquire()
        fut: asyncio.Future[Any] | None = None

        def completed() -> None:  # the reactor: the work request is over
            self._places.release()
            if scratch is not None and fut is not None and fut.cancelled():
                self._scratch_free.append(scratch)  # its caller left: nobody reads it

        try:
            self._check_open()
            wr_id, fut = self._qp.post_future(what, opcode, local, remote=remote,
                                              compare_add=compare_add, swap=swap,
                                              done=completed)
        except BaseException:
            self._places.release()
            if scratch is not None:
                self._scratch_free.append(scratch)
            raise
        self._ops[wr_id] = fut  # the endpoint's teardown fails it if the queue pair goes first
        try:
            await fut
            if scratch is not None:
                return int.from_bytes(local.memoryview(), "little")
            return None
        except CompletionError as exc:
            err = self._failure(exc)
            if err is exc:
                raise
            raise err from exc
        finally:
            self._ops.pop(wr_id, None)
            if scratch is not None and not fut.cancelled():
                self._scratch_free.append(scratch)  # read (or failed): free for the next

    def track(self, wr_id: int, fut: asyncio.Future[Any]) -> None:
        """Fail ``fut`` at teardown if its work request is still out (memory-window binds)."""
        self._ops[wr_id] = fut
        fut.add_done_callback(lambda _f: self._ops.pop(wr_id, None))

    def teardown(self, exc: BaseException, reactor: Any) -> None:
        """The queue pair is gone: fail every operation still waiting, wake callers waiting
        for a place (they find the endpoint closed), release the scratch memory."""
        for wr_id, fut in list(self._ops.items()):
            reactor.unwatch(wr_id)
            resolve_future(fut, exc)
        self._ops.clear()
        for _ in range(self._max):
            self._places.release()
        if self._scratch_region is not None:
            self._scratch_region.close()
