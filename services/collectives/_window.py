"""Windows: one-sided access to every rank's array, to write collective algorithms of your own.

``win = await g.window(array)`` registers ``array`` (this rank's part of the window) for
remote read and write and gives every rank the others' access keys; then any rank reads and
writes any rank's part with RDMA READ and WRITE, which the target's CPU takes no part in.

Offsets and sizes
    Offsets count *elements* of the window's dtype (the same on every rank), in the C order
    of each rank's array (flattened); a ``put`` of ``src`` writes ``src.size`` elements from
    ``offset``, a ``get`` into ``dst`` reads ``dst.size`` from ``offset``. Ranks' arrays may
    differ in size: each rank knows every part's size, so a range outside the target's part
    raises :class:`CollectiveArgumentError` before anything is sent (the group stays usable).

Signals (why a message after the WRITE)
    ``put(..., signal=k)`` posts the WRITE and, right behind it on the same queue pair, a small
    message (a ``Value`` on :data:`~aiordma.protocols.collectives.SIGNAL_CHANNEL`):
    :meth:`aiordma.Endpoint.post_write` with ``notify``, which the links already use to
    announce written pieces. A reliable connection delivers the message only after the data
    is in place, and the target's link reader (which reads every link all the time) counts it
    and wakes ``wait_signal`` at once. aiordma's endpoint offers no WRITE with immediate data;
    a WRITE followed by an atomic fetch-add on a registered counter raises no event at the
    target, so ``wait_signal`` would have to poll memory (a wake-up costs hundreds of
    microseconds here: see RXE.md), and a dead writer would be noticed only by the timeout.

    ``wait_signal(k, count)`` waits until counter ``k`` has received ``count`` signals not yet
    consumed, then *consumes* them (subtracts ``count``), as a semaphore's acquire or MPI's
    matched receives: a loop that waits for one signal per round needs no running total.
    :meth:`Window.signals` reads a counter without consuming.

Completion
    ``put`` returns once its WRITE is acknowledged (the data is in the target's memory) and
    its signal, if any, is posted; ``src`` is copied first (the caller's memory is never
    registered), so it may change at once. ``get`` returns once the data is in ``dst``.
    ``fence()`` waits for this rank's puts still running, then is a barrier of the group:
    afterwards every rank's puts issued before its fence are in place everywhere (their
    signals arrive in order, but a ``wait_signal`` is how to know they were counted).

Collective calls and failure
    ``window()``, ``fence()`` and ``aclose()`` are collectives of the group (every rank calls
    them, in its order, as the others); ``put``, ``get`` and ``wait_signal`` are not. Every
    wait is bounded by the group's ``timeout`` (or the call's) and by peer death (the links'
    readers break the group). A failed, timed out or cancelled ``put``/``get`` breaks the
    group, as any operation does (a WRITE may be half done); ``wait_signal`` is local: its
    timeout (:class:`~aiordma.OperationTimeout`) or cancellation leaves the group and the
    counter as they were. Windows need RDMA links: over a group whose links are TCP,
    ``window()`` raises :class:`~aiordma.UnsupportedOperationError`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from aiordma import (
    ClosedResourceError,
    MemoryRegion,
    OperationTimeout,
    RemoteBuffer,
    RemoteProtocolError,
    UnsupportedOperationError,
)
from aiordma._args import check_int
from aiordma.protocols import collectives as proto

from . import _rounds
from ._arrays import as_input, as_output
from ._core import MAX_TAG, GroupCore, arg, timeout_arg
from ._errors import CollectiveArgumentError, CollectiveMismatchError
from ._errors import fresh as _fresh

if TYPE_CHECKING:
    from ._plane import CallPlane

__all__ = ["Signals", "Window", "Windows", "element_span"]

Timeout = float | None | EllipsisType
MAX_SIGNAL = MAX_TAG  # counters are numbered 0 .. 2**31 - 1


def element_span(offset: Any, count: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """Elements ``offset .. offset + count`` of a part of ``size`` elements (rank ``rank``'s),
    checked: ``(offset, offset + count)``.

    Raises:
        CollectiveArgumentError: ``offset`` is not an int >= 0, or the range ends past the
            part (``what`` names the call).
    """
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise CollectiveArgumentError(f"{what}: offset must be an int (elements), not "
                                      f"{type(offset).__name__}")
    lo = int(offset)
    if lo < 0 or lo + count > size:
        raise CollectiveArgumentError(f"{what}: elements {lo}..{lo + count} are outside rank "
                                      f"{rank}'s part of the window ({size} elements)")
    return lo, lo + count


class Signals:
    """A window's signal counters on this rank, and who waits on them (FIFO per counter)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._waiters: dict[int, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._ended: BaseException | None = None

    def signal(self, counter: int, n: int = 1) -> None:
        """``n`` signals for ``counter`` arrived: wake the waiters they satisfy, in order."""
        have = self.counts.get(counter, 0) + n
        q = self._waiters.get(counter)
        while q:
            want, fut = q[0]
            if fut.done():  # (left: cancelled or timed out)
                q.popleft()
                continue
            if have < want:
                break
            q.popleft()
            have -= want
            fut.set_result(None)
        self.counts[counter] = have

    def take(self, counter: int, count: int) -> asyncio.Future[None] | None:
        """Consume ``count`` signals of ``counter`` now (None), or a future that completes
        once they are consumed for the caller (in the order callers came)."""
        if self._ended is not None:
            raise _fresh(self._ended)
        q = self._waiters.get(counter)
        while q and q[0][1].done():  # (waiters that left)
            q.popleft()
        have = self.counts.get(counter, 0)
        if not q and have >= count:
            self.counts[counter] = have - count
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(counter, deque()).append((count, fut))
        return fut

    def give_back(self, counter: int, count: int) -> None:
        """A waiter whose signals were consumed left before it saw them: they count again."""
        self.signal(counter, count)

    def end(self, exc: BaseException) -> None:
        """Fail every waiter with ``exc`` (the window or its group closed, or the group
        broke); later waits raise it too."""
        if self._ended is None:
            self._ended = exc
        waiters, self._waiters = self._waiters, {}
        for q in waiters.values():
            for _, fut in q:
                if not fut.done():
                    fut.set_exception(_fresh(exc))


def window_array(array: Any) -> np.ndarray:
    """``array`` as this rank's part of a window: a writable, C-contiguous numpy view of the
    caller's own memory.

    Raises:
        CollectiveArgumentError: not an array, DLPack tensor or buffer; read-only; not
            C-contiguous; an object dtype.
    """
    arr = as_output(array, "window")
    if not arr.flags.c_contiguous:
        raise CollectiveArgumentError("window: the array must be C-contiguous (its memory is "
                                      "registered as it is); pass np.ascontiguousarray(a) and "
                                      "read the results from that")
    return arr


class Window:
    """One rank's handle on a window (see the module): made by ``Group.window``, used with
    ``async with`` or closed with :meth:`aclose`.

    Attributes:
        group: the group it was made on.
        array: this rank's part (the caller's own memory, as numpy sees it).
        dtype: the window's dtype (every rank's).
        counts: every rank's part, in elements, by rank.
    """

    def __init__(self, group: Windows, array: np.ndarray, number: int,
                 counts: list[int], remotes: dict[int, RemoteBuffer],
                 region: MemoryRegion | None) -> None:
        self.group = group
        self.array = array
        self.dtype: np.dtype[Any] = array.dtype
        self.counts = counts  # every rank's part, in elements
        self._flat = array.reshape(-1)
        self._number = number  # the window's call number in its group
        self._remotes = remotes
        self._region = region
        self._signals = Signals()
        self._puts: set[asyncio.Future[None]] = set()
        self._closed = False

    @property
    def key(self) -> tuple[int, int, int]:
        """Where the links' reader files this window's signals."""
        return (self.group._number, proto.SIGNAL_CHANNEL, self._number)

    @property
    def closed(self) -> bool:
        return self._closed

    def signals(self, counter: int) -> int:
        """Signals counter ``counter`` holds now (arrived, not consumed)."""
        return self._signals.counts.get(self._counter(counter), 0)

    # -- checks --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the window is closed")
        self.group._check_usable()

    def _counter(self, k: Any) -> int:
        return arg(check_int, k, name="signal", low=0, high=MAX_SIGNAL)

    def _target(self, rank: Any, data: np.ndarray, offset: Any, what: str) -> tuple[int, int, int]:
        t = arg(check_int, rank, name="rank", low=0, high=self.group.world_size - 1)
        if data.dtype != self.dtype:
            raise CollectiveArgumentError(f"{what}: the window holds {self.dtype}, not "
                                          f"{data.dtype}")
        lo, hi = element_span(offset, data.size, self.counts[t], t, what)
        return t, lo, hi

    # -- one-sided operations ----------------------------------------------------------------

    async def put(self, src: Any, rank: int, offset: int = 0, *, signal: int | None = None,
                  timeout: Timeout = ...) -> None:
        """Write ``src``'s elements (C order) into rank ``rank``'s part from element
        ``offset`` (RDMA WRITE; a copy on this rank's own part). With ``signal=k``, rank
        ``rank``'s counter ``k`` counts one more once the data is there (see the module).
        Returns once the data is in the target's memory; ``src`` may change at once.

        Raises:
            CollectiveArgumentError: ``rank`` out of range, ``signal`` not in
                ``0 .. 2**31 - 1``, ``src`` of another dtype than the window, or a range
                outside the target's part (nothing is sent).
            ClosedResourceError: the window (or the group) is closed.
            BrokenResourceError, OperationTimeout: the group broke, or this put took longer
                than ``timeout`` (default: the group's; the group is broken).
        """
        self._check_open()
        timeout = timeout_arg(timeout)
        data = as_input(src, "put")
        t, lo, hi = self._target(rank, data, offset, "put")
        k = None if signal is None else self._counter(signal)
        g = self.group
        if t == g.rank:
            self._flat[lo:hi] = data.reshape(-1)
            if k is not None:
                self._signals.signal(k)
            return
        size = self.dtype.itemsize
        remote = self._remotes[t][lo * size:hi * size] if hi > lo else None
        note = None if k is None else proto.encode(proto.Value(
            group=g._number, channel=proto.SIGNAL_CHANNEL, call=self._number,
            op=proto.kind_code("window"), step=k, origin=g.rank, value=None))

        async def run(plane: CallPlane, call: proto.Tag) -> None:
            ep = plane.outs[t].ep
            nbytes = data.nbytes
            if remote is not None:
                work = plane.work(nbytes)
                np.copyto(work.view(self.dtype).reshape(data.shape), data)
                region = plane.region(0)
                assert region is not None  # (RDMA links: window() refuses others)
                ack = await ep.post_write(region[0:nbytes], remote, notify=note)
                await ack
            elif note is not None:
                await ep.send(note)

        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._puts.add(done)
        try:
            await g._run("window", timeout, run, channel=proto.SIGNAL_CHANNEL,
                         number=self._number, what="window put")
        finally:
            self._puts.discard(done)
            done.set_result(None)

    async def get(self, dst: Any, rank: int, offset: int = 0, *,
                  timeout: Timeout = ...) -> Any:
        """Read ``dst.size`` elements of rank ``rank``'s part from element ``offset`` into
        ``dst`` (a writable array, DLPack tensor or buffer of the window's dtype, any shape:
        filled in C order) by RDMA READ (a copy on this rank's own part); returns ``dst``.

        Raises:
            CollectiveArgumentError: ``rank`` out of range, ``dst`` read-only or of another
                dtype, or a range outside the target's part (nothing is sent).
            ClosedResourceError, BrokenResourceError, OperationTimeout: as :meth:`put`.
        """
        self._check_open()
        timeout = timeout_arg(timeout)
        out = as_output(dst, "get")
        t, lo, hi = self._target(rank, out, offset, "get")
        g = self.group
        if t == g.rank:
            np.copyto(out, self._flat[lo:hi].reshape(out.shape))
            return dst
        if hi == lo:
            return dst
        size = self.dtype.itemsize
        remote = self._remotes[t][lo * size:hi * size]

        async def run(plane: CallPlane, call: proto.Tag) -> None:
            nbytes = out.nbytes
            work = plane.work(nbytes)
            region = plane.region(0)
            assert region is not None  # (RDMA links: window() refuses others)
            await plane.outs[t].ep.read(region[0:nbytes], remote)
            np.copyto(out, work.view(self.dtype).reshape(out.shape))

        await g._run("window", timeout, run, channel=proto.SIGNAL_CHANNEL, number=self._number,
                     what="window get")
        return dst

    async def wait_signal(self, signal: int, count: int = 1, *,
                          timeout: Timeout = ...) -> None:
        """Wait until counter ``signal`` holds ``count`` signals, then consume them (see the
        module); waiters on one counter are served in the order they came.

        Raises:
            CollectiveArgumentError: ``signal`` not in ``0 .. 2**31 - 1``, ``count`` < 0.
            OperationTimeout: ``timeout`` (default: the group's) expired; nothing was
                consumed and the group stays usable.
            ClosedResourceError: the window (or the group) is closed, before or during.
            BrokenResourceError: the group broke (e.g. a rank died) before or during.
        """
        self._check_open()
        bound = timeout_arg(timeout)
        bound = self.group.timeout if bound is ... else bound
        k = self._counter(signal)
        n = arg(check_int, count, name="count", low=0, high=(1 << 63) - 1)
        fut = self._signals.take(k, n)
        if fut is None:
            return
        fabric = self.group._fabric
        task = asyncio.current_task()
        assert task is not None
        fabric.running.add(task)  # (a group that breaks cancels it: see _fabric)
        seen = False
        try:
            async with asyncio.timeout(bound):
                await fut
                seen = True
        except TimeoutError:
            raise OperationTimeout(f"rank {self.group.rank}: wait_signal({k}, {n}) took longer "
                                   f"than {bound} s ({self.signals(k)} signals there)") from None
        except asyncio.CancelledError:
            if fabric.failure is not None and task.uncancel() == 0:
                echo = fabric.echo()
                raise echo from echo.__cause__
            raise
        finally:
            fabric.running.discard(task)
            if not fut.done():
                fut.cancel()  # (Signals skips it)
            elif not seen and not fut.cancelled() and fut.exception() is None:
                self._signals.give_back(k, n)  # consumed for us, but we leave: they count again

    # -- collective calls ----------------------------------------------------------------------

    async def fence(self, *, timeout: Timeout = ...) -> None:
        """Wait for this rank's puts still running, then a barrier of the group (a collective:
        every rank calls it): afterwards every put issued before any rank's fence is in
        place.

        Raises:
            ClosedResourceError, BrokenResourceError, OperationTimeout: as
                :meth:`~._group.Group.barrier`.
        """
        self._check_open()
        timeout = timeout_arg(timeout)
        if self._puts:
            await asyncio.gather(*self._puts)
        g = self.group
        if g.world_size == 1:
            g._alone()
            return
        await g._run("window", timeout, _rounds.barrier, what="window fence")

    async def aclose(self) -> None:
        """Close the window: a collective (a fence, so that no rank still reads or writes
        this rank's part), then deregister the array and fail the signal waiters with
        :class:`~aiordma.ClosedResourceError`. The release happens even if the fence fails
        (its error is raised) or the group is closed or broken (then without a fence).
        Idempotent."""
        if self._closed:
            return
        try:
            if not (self.group.closed or self.group.broken):
                await self.fence()
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        fabric = self.group._fabric
        if fabric.signals.get(self.key) is self._signals:
            del fabric.signals[self.key]
        self._signals.end(ClosedResourceError("the window is closed"))
        if self._region is not None:
            self._region.close()
            self._region = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<Window #{self._number} of rank {self.group.rank}: {self.dtype}, "
                f"{self.counts} elements, {state}>")


class Windows(GroupCore):
    """``window()`` (see :class:`~._group.Group` and :mod:`._window`)."""

    async def window(self, array: Any, *, timeout: Timeout = ...) -> Window:
        """Make ``array`` (a writable, C-contiguous numpy array, DLPack CPU tensor or buffer)
        this rank's part of a window that every rank can read and write one-sidedly (see
        :mod:`aiordma.services.collectives._window`). A collective: every rank calls it, in
        its order; ranks may pass arrays of different sizes, of one dtype. ``array`` stays
        registered (and is written by other ranks) until the window is closed.

        Raises:
            CollectiveArgumentError: ``array`` read-only, not C-contiguous, or not an array.
            CollectiveMismatchError: ranks passed arrays of different dtypes (the group is
                broken).
            UnsupportedOperationError: the group's links are TCP (no one-sided access).
            BrokenResourceError, OperationTimeout: as :meth:`~._group.Group.barrier`.
        """
        timeout = timeout_arg(timeout)
        arr = window_array(array)
        self._check_usable()
        if self.world_size == 1:
            self._alone()
            win = Window(self, arr, self.calls, [arr.size], {}, None)
            self._fabric.signals[win.key] = win._signals
            return win
        self._links_for()  # (a group that was never formed: GroupError)
        if self.transport != "rdma":
            raise UnsupportedOperationError(
                "a window needs RDMA links (one-sided READ and WRITE); this group's links are "
                f"{self.transport}", operation="window", transport=str(self.transport))
        plane = self._fabric.plane
        assert plane is not None
        made: list[Window] = []
        dtype = repr(arr.dtype)  # (one dtype per window: compared across ranks)

        async def run(view: CallPlane, call: proto.Tag) -> None:
            region = None
            if arr.nbytes:
                ep = next(iter(plane.ins.values())).ep  # (its close deregisters the array)
                region = ep.register(arr.reshape(-1).view(np.uint8), remote_read=True,
                                     remote_write=True)  # (bytes: any dtype's format)
            win = Window(self, arr, call.call, [], {}, region)
            self._fabric.signals[win.key] = win._signals  # before any rank can signal it
            made.append(win)
            desc = None if region is None else list(region.expose(read=True, write=True)
                                                    .to_wire())
            parts = await _rounds.exchange(view, call, [desc, arr.size, dtype])
            win.counts = [int(p[1]) for p in parts]
            for i, (d, n, dt) in enumerate(parts):
                if dt != dtype:
                    raise CollectiveMismatchError(
                        f"rank {self.rank}: window of {dtype}; rank {i} passed {dt:.100}: a "
                        f"window has one dtype")
                if i == self.rank or not n:
                    continue
                remote = RemoteBuffer.from_wire(d)
                if remote.length < n * arr.itemsize or not (remote.readable and
                                                             remote.writable):
                    raise RemoteProtocolError(f"rank {i}'s window part {remote} does not hold "
                                              f"{n} elements readable and writable")
                win._remotes[i] = remote

        try:
            await self._run("window", timeout, run)
        except BaseException:
            for w in made:
                w._release()
            raise
        return made[0]
