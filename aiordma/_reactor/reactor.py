"""The completion reactor: a completion queue's channel fd watched by the asyncio event loop.

One :class:`CompletionReactor` owns one completion channel and one CQ. The channel's fd is
set ``O_NONBLOCK`` and registered with ``loop.add_reader``; there is no progress thread, and
the same code runs on the default loop and on uvloop.

When the fd becomes readable the reactor:

1. reads the channel event (``ibv_get_cq_event``; one per wake-up, see ``_on_readable``);
2. polls the CQ until it is empty, dispatching each work completion by ``wr_id``;
3. re-arms the CQ (``ibv_req_notify_cq``) and **polls again**: a completion that landed after
   the last poll but before the arm raised no event, and would otherwise wait for the next one;
4. acknowledges events in batches (``ibv_ack_cq_events`` takes a mutex in libibverbs).

The verbs calls of these steps are the completion queue's driver's
(:class:`aiordma._verbs.cq.CompletionQueue`): where the compiled fast path is built, one call
into it does steps 1-4 per wake-up, handing handlers a light ``Completion`` instead of
pyverbs' ``WC``.

Each posted work request that needs an answer is registered under its ``wr_id`` with a
handler; the handler receives the work completion, or an exception when the reactor closes
first. The handler keeps the buffers of its request alive: a cancelled waiter does not free a
buffer the device may still write into, because the entry lives until the completion (or the
flush at close) arrives.
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

from aiordma._device.device import Device
from aiordma._errors import (
    ClosedResourceError,
    DeviceError,
    error_from_status,
)
from aiordma._resources import count_resource
from aiordma._verbs.cq import CompletionQueue

__all__ = ["CompletionReactor", "Handler"]

DEFAULT_BUSY_POLL_US = 3000.0  # a spin's length; adaptive (see CompletionReactor)
CADENCE = 2  # a spin starts when completions come within this many spins of the last ones
SHARE_WINDOW = 0.001  # a spin looks at its thread's share of the CPU this often (seconds)
MIN_SHARE = 0.5  # below this share, the CPU is crowded: the spin gives way
CROWDED_PAUSE = 0.1  # and no spin starts for this long (seconds)
# A handler receives a work completion (pyverbs' WC, or the compiled path's Completion with the
# same field names), or a BaseException when the reactor closes.
Handler = Callable[[Any], None]


def resolve_future(fut: asyncio.Future[Any], outcome: Any, what: str = "") -> None:
    """Complete ``fut`` from a work completion or an exception; ignore a done future.

    The one callback-to-future helper: a waiter that was cancelled (or a loop that closed)
    leaves a done future, and completing it again must be harmless.
    """
    if fut.done():
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    elif outcome.status:
        fut.set_exception(error_from_status(outcome.status, opcode=outcome.opcode,
                                            vendor_err=outcome.vendor_err, what=what))
    else:
        fut.set_result(outcome)


class CompletionReactor:
    """Dispatches one completion queue's work completions to handlers, from the event loop.

    Args:
        device: the opened device; the reactor closes with it.
        cqe: CQ capacity. Must cover every work request that can complete at once.
        poll_batch: completions taken per ``ibv_poll_cq`` call.
        ack_batch: events acknowledged per ``ibv_ack_cq_events`` call.
        busy_poll_us: a spin's length: after a wake-up that found completions, keep polling
            the CQ from the loop (``call_soon`` ticks, so tasks still run; a tick that finds
            nothing yields the CPU with ``sched_yield``) until this long has passed with none
            found, then re-arm; 0 turns spinning off. Default: ``$AIORDMA_BUSY_POLL_US``, else
            :data:`DEFAULT_BUSY_POLL_US`.

    **Adaptive busy polling.** A spin starts only while completions come in a cadence it can
    catch: when a wake-up finds completions within :data:`CADENCE` x ``busy_poll_us`` of the
    last ones found (a conversation: a request and its answer, a stream of messages; a wake-up
    through the fd takes longer than a completion a spin catches, hence the factor). A spin
    that runs out (no completion for ``busy_poll_us``) stops spinning until two wake-ups come
    that close again. So a quiet connection costs one wasted spin at most per pause, one whose
    peer answers later than that at most one spin in two wake-ups, and an idle process sleeps
    in the loop as before. **On a crowded CPU** a spin gives way: every :data:`SHARE_WINDOW`
    it looks at the CPU time its thread got; below :data:`MIN_SHARE` of the time (other
    threads ran when it yielded), it ends, and no spin starts for :data:`CROWDED_PAUSE`.

    In the test VM a 64 B round trip takes about half as long with it and an RPC call at one
    in flight about two thirds (rxe's completion event and the sleeping process's wake-up cost
    more than the spin): see docs/reports/2026-11-27-busy-polling.md. 64 RPC calls in flight
    did a fifth fewer per second with it until the RPC server served batches in chunks (the
    spins tipped client and server into taking turns on whole batches); with chunks, the same
    with it and without (docs/reports/2026-11-27-rpc-chunks.md).

    Must be created while an event loop is running (it registers with that loop). ``close()``
    is idempotent: it unregisters the fd, fails every pending handler with
    :class:`ClosedResourceError`, acknowledges outstanding events and destroys the CQ and the
    channel (queue pairs on the CQ are closed first, as pyverbs requires).

    Attributes:
        wakeups: how many times the fd woke the loop (a cheap, honest cost counter).
        completions: how many work completions were dispatched.
    """

    def __init__(self, device: Device, *, cqe: int = 4096, poll_batch: int = 64,
                 ack_batch: int = 64, busy_poll_us: float | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if busy_poll_us is None:
            env = os.environ.get("AIORDMA_BUSY_POLL_US")
            busy_poll_us = float(env) if env else DEFAULT_BUSY_POLL_US
        self.device = device
        self._handlers: dict[int, Handler] = {}  # wr_id (< 2**32) -> one-shot handler
        self._routes: dict[int, Handler] = {}  # wr_id >> 32 -> handler for a whole range
        self._next_route = 1
        self._next_wr_id = 1
        self.capacity = cqe
        self.reserved = 0
        self._closed = False
        self.busy_poll = busy_poll_us / 1e6
        self._spinning = False
        self._spin_until = 0.0
        self._last_found = -1e9  # perf_counter of the last drain that found completions
        self.poll_finds = 0  # drains besides a wake-up's first that found completions
        self.spins_run_out = 0  # spins ended: nothing found for busy_poll_us, or gave way
        self.spins_crowded = 0  # spins that gave way to other threads (see _crowded)
        self._calm_at = 0.0  # no spin starts before this (perf_counter), after a crowded one
        self._share_since = self._share_cpu = 0.0  # the spin's last look at its CPU share
        self._qps: weakref.WeakSet[Any] = weakref.WeakSet()  # queue pairs on this CQ
        self._spin_wakeups = 0  # wake-ups through _on_readable (busy polling on)
        self._cq = CompletionQueue(device.context, cqe, ack_batch=ack_batch,
                                   report=self._handler_failed, device_name=device.name,
                                   poll_batch=poll_batch)
        self._fd = self._cq.fd
        if self.busy_poll > 0:
            self._loop.add_reader(self._fd, self._on_readable)
        else:  # the verbs layer's whole wake-up, called by the loop itself: no Python between
            self._loop.add_reader(self._fd, self._cq.wake, self._handlers, self._routes)
        for kind in ("completion_channels", "cqs", "fd_readers"):
            count_resource(kind, 1)
        device._adopt(self)
        device._reactor_opened(self)
        device.watch()  # the loop that uses a device notices its loss (until its last reactor
        # of this device closes)

    # -- public --------------------------------------------------------------------------------

    @property
    def cq(self) -> Any:
        """The pyverbs ``CQ`` (for :mod:`aiordma.lowlevel` users)."""
        return self._cq.raw

    @property
    def completion_queue(self) -> CompletionQueue:
        """The verbs layer's completion queue (queue pairs are created on it)."""
        return self._cq

    @property
    def closed(self) -> bool:
        return self._closed

    def _adopt(self, qp: Any) -> None:
        """A queue pair whose CQ is this reactor's (it is closed before the CQ)."""
        self._qps.add(qp)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this reactor serves."""
        return self._loop

    @property
    def wakeups(self) -> int:
        """How many times the fd woke the loop (a cheap, honest cost counter)."""
        return self._cq.wakeups + self._spin_wakeups

    @property
    def completions(self) -> int:
        """How many work completions were dispatched."""
        return self._cq.completions

    @property
    def batch(self) -> Any:
        """The completion queue's driver, as :class:`aiordma._places.Notify` takes it: while
        it drains (``draining``), calls appended to its ``later`` list wait for the drain's end."""
        return self._cq.driver

    @property
    def compiled(self) -> bool:
        """The compiled fast path polls this CQ (else pyverbs' ``CQ.poll``)."""
        return self._cq.compiled

    @property
    def pending(self) -> int:
        """Work requests registered and not yet completed."""
        return len(self._handlers)

    def next_wr_id(self) -> int:
        """A fresh one-shot ``wr_id`` (below 2**32; the range above belongs to routes)."""
        wr_id = self._next_wr_id
        self._next_wr_id = wr_id + 1 if wr_id < 0xFFFF_FFFF else 1
        return wr_id

    def add_route(self, handler: Handler) -> int:
        """Route every ``wr_id`` whose high 32 bits are the returned id to ``handler``.

        This is how an endpoint receives the completions of its receive slots and unsignaled
        sends without one dict entry per work request. The handler is also called with a
        :class:`ClosedResourceError` when the reactor closes.
        """
        if self._closed:
            raise ClosedResourceError("the completion reactor is closed")
        route = self._next_route
        self._next_route += 1
        self._routes[route] = handler
        return route

    def remove_route(self, route: int) -> None:
        """Stop routing; completions still in the CQ for that range are dropped."""
        self._routes.pop(route, None)

    def reserve(self, entries: int) -> bool:
        """Claim ``entries`` CQ entries for a queue pair's work requests, if they fit."""
        if self._closed or self.reserved + entries > self.capacity:
            return False
        self.reserved += entries
        return True

    def release(self, entries: int) -> None:
        self.reserved = max(0, self.reserved - entries)

    def watch(self, wr_id: int, handler: Handler) -> None:
        """Call ``handler`` with the completion of ``wr_id`` (or an exception at close)."""
        if self._closed:
            raise ClosedResourceError("the completion reactor is closed")
        self._handlers[wr_id] = handler

    def unwatch(self, wr_id: int) -> None:
        """Forget a registration whose work request was never posted."""
        self._handlers.pop(wr_id, None)

    def expect(self, wr_id: int, what: str = "", keep: Any = None,
               done: Callable[[], None] | None = None) -> asyncio.Future[Any]:
        """A future for the completion of ``wr_id``, resolved with the WC or a typed error.

        ``keep`` is held until the completion arrives, even if the future is cancelled: pass
        the buffers the work request uses. ``done`` is called then too (after the future is
        resolved, whether or not it was cancelled): to give back what the work request held.
        """
        fut: asyncio.Future[Any] = self._loop.create_future()

        def handler(outcome: Any, _keep: Any = keep) -> None:
            resolve_future(fut, outcome, what)
            if done is not None:
                done()

        self.watch(wr_id, handler)
        return fut

    def poll_now(self) -> int:
        """Drain the CQ without waiting for an event; return how many completions ran."""
        return self._drain()

    # -- the fd callback -----------------------------------------------------------------------

    def _on_readable(self) -> None:
        """The fd's callback while busy polling is on (else the loop calls the completion
        queue's ``wake`` directly): read the event and drain; completions found start a spin
        (see :meth:`_start_spin`), else re-arm."""
        self._spin_wakeups += 1
        self._cq.get_event()
        found = self._drain()
        if self._closed:  # a handler closed the reactor
            return
        if found:
            now = time.perf_counter()
            if self._in_cadence(now):
                self._start_spin(now)
                return
        self._arm()

    def _in_cadence(self, now: float) -> bool:
        """Completions were just found at ``now``: whether they came within :data:`CADENCE`
        spins of the last ones (then the next ones likely will too, and a spin catches them),
        and no spin gave way to other threads lately."""
        last, self._last_found = self._last_found, now
        return now - last <= CADENCE * self.busy_poll and now >= self._calm_at

    def _start_spin(self, now: float) -> None:
        """Stay disarmed and poll from the loop for a while (from ``now``, the completions'
        time): the tasks these completions woke will likely post work whose completion comes
        soon, and catching it by polling saves a wake-up through the fd (hundreds of
        microseconds on rxe)."""
        self._spin_until = now + self.busy_poll
        if not self._spinning:
            self._spinning = True
            self._share_since, self._share_cpu = now, time.thread_time()
            self._loop.call_soon(self._spin)

    def _arm(self) -> None:
        """Re-arm, then poll again: the race-free order (a completion that landed after the
        last poll but before the arm raised no event)."""
        if self._closed:
            return
        self._cq.arm()
        if not self._drain():
            return
        self.poll_finds += 1
        if self.busy_poll > 0 and not self._spinning:
            now = time.perf_counter()
            if self._in_cadence(now):
                self._start_spin(now)

    def _spin(self) -> None:
        """One busy-poll tick; runs between other ready callbacks, so tasks make progress."""
        if self._closed:
            self._spinning = False
            return
        now = time.perf_counter()
        if self._drain():
            self.poll_finds += 1
            self._last_found = now
            self._spin_until = now + self.busy_poll
        elif now < self._spin_until:
            os.sched_yield()  # (runnable threads first: the kernel's own, e.g. rxe's, and peers)
            if now - self._share_since >= SHARE_WINDOW and self._crowded(now):
                self._spin_until = now  # give way: the CPU is wanted by others
        if now < self._spin_until:
            self._loop.call_soon(self._spin)
            return
        self._spinning = False
        self.spins_run_out += 1
        self._last_found = -1e9  # out of cadence: two close wake-ups start the next spin
        self._arm()

    def _crowded(self, now: float) -> bool:
        """Whether this thread got less than :data:`MIN_SHARE` of the time since the last look
        (other runnable threads took the CPU when the spin yielded it): then spinning would
        take the CPU from them, so spins stop for :data:`CROWDED_PAUSE`."""
        cpu = time.thread_time()
        got = (cpu - self._share_cpu) / (now - self._share_since)
        self._share_since, self._share_cpu = now, cpu
        if got >= MIN_SHARE:
            return False
        self.spins_crowded += 1
        self._calm_at = now + CROWDED_PAUSE
        return True

    def _handler_failed(self, exc: Exception) -> None:
        self._loop.call_exception_handler({
            "message": "aiordma completion handler failed", "exception": exc})

    def _drain(self) -> int:
        return self._cq.drain(self._handlers, self._routes)

    def spin_for(self, runner: Any, budget: float) -> bool:
        """Poll this CQ while ``runner`` (a compiled step runner on it) runs its call, for at
        most ``budget`` seconds (see its ``spin``); whether the call is over. Completions
        found are dispatched as a wake-up would; the caller awaits the call's future
        afterwards either way."""
        if self._closed:
            return False
        return bool(runner.spin(self._cq.driver, self._handlers, self._routes, budget))

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister, fail pending handlers with :class:`ClosedResourceError`, destroy the CQ."""
        if self._closed:
            return
        self._closed = True
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        handlers, self._handlers = self._handlers, {}
        routes, self._routes = self._routes, {}
        # A lost device is not this process's doing: pending work fails as broken.
        err = self.device.lost or ClosedResourceError("the completion reactor was closed")
        for h in [*handlers.values(), *routes.values()]:
            try:
                h(err)
            except RuntimeError:  # the waiter's event loop is already closed: nobody to wake
                pass
        # Children first: the queue pairs on this CQ, through their own close() (pyverbs'
        # CQ.close would destroy them too, behind their backs: their counts, and their slots,
        # would never be released). Then the CQ, its outstanding events acknowledged.
        try:
            for qp in list(self._qps):
                qp.close()
            self._cq.close()  # acknowledges the events read, destroys the CQ and its channel
        finally:
            for kind in ("completion_channels", "cqs", "fd_readers"):
                count_resource(kind, -1)
            self.device._reactor_closed(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd {self._fd}, {len(self._handlers)} pending"
        return f"<CompletionReactor {state}, {self.wakeups} wake-ups>"


# One reactor per (event loop, device) serves many endpoints: one fd to watch, completions of
# all queue pairs drained in one batch. A new reactor is opened when CQ capacity runs out.
_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                   dict[int, list[CompletionReactor]]] = weakref.WeakKeyDictionary()


def shared_reactor(device: Device, entries: int, *, cqe: int = 8192) -> CompletionReactor:
    """A reactor of the running loop on ``device`` with ``entries`` CQ entries reserved."""
    loop = asyncio.get_running_loop()
    per_device = _shared.setdefault(loop, {}).setdefault(id(device), [])
    for r in per_device:
        if r.device is device and not r.closed and r.reserve(entries):
            return r
    size = max(cqe, entries)
    max_cqe = int(getattr(device.attr, "max_cqe", size) or size)
    r = CompletionReactor(device, cqe=min(size, max_cqe))
    if not r.reserve(entries):
        r.close()
        raise DeviceError(f"a queue pair needs {entries} CQ entries; {device.name} allows "
                          f"{max_cqe}")
    per_device.append(r)
    return r


def release_shared(reactor: CompletionReactor, entries: int) -> None:
    """Give back reserved entries; the reactor closes when nothing uses it any more."""
    reactor.release(entries)
    if reactor.reserved == 0 and not reactor.closed:
        for per_device in _shared.values():
            lst = per_device.get(id(reactor.device))
            if lst and reactor in lst:
                lst.remove(reactor)
        reactor.close()
