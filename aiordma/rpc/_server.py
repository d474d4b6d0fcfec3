"""The RPC layer's server: :class:`RpcServer` serves one :class:`~aiordma.rpc.Service` on a
listener (or on any :class:`~aiordma.transport.MessageChannel`), and :func:`serve` makes one.
The wire is :mod:`aiordma.protocols.rpc`; the frames leave through :mod:`aiordma.rpc._sender`;
stream calls run through :mod:`aiordma.rpc._stream`; what a method and the interceptors see of
a call is :mod:`aiordma.rpc._context`'s; the counters are :mod:`aiordma.rpc._stats`'; the
built-in methods (``aiordma.stats``) :mod:`aiordma.rpc._builtins`'."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import Any, Self

import aiordma.rpc._builtins as builtins
from aiordma._args import check_int, check_seconds
from aiordma._device.device import Device
from aiordma._endpoint.config import Config
from aiordma._endpoint.listener import Listener, listen
from aiordma._errors import ClosedResourceError, LocalProtocolError
from aiordma._places import Places
from aiordma._verbs.compiled import rpc_connection
from aiordma.protocols import rpc as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.errors import RemoteProtocolError as _WireRemoteError
from aiordma.rpc._context import (
    CallContext,
    ServerInterceptor,
    _current,
    check_interceptors,
    run_chain,
)
from aiordma.rpc._method import (
    Expired,
    NamedError,
    ServedMethod,
    error_answer,
    limited,
    within_deadline,
)
from aiordma.rpc._sender import Sender
from aiordma.rpc._service import (
    _RPC_LIMIT,
    _RPC_METHOD,
    _RPC_STREAM,
    DEADLINE_EXPIRED,
    MAX_CALLS,
    UNAVAILABLE,
    Service,
    Unavailable,
    _caller,
    _check_channel,
)
from aiordma.rpc._stats import WINDOW, LatencyHistogram, MethodStats
from aiordma.rpc._stream import DEFAULT_WINDOW, ServerStream, run_stream
from aiordma.transport import MessageChannel, ReadyChannel

__all__ = ["RpcServer", "serve"]

log = logging.getLogger("aiordma.rpc")

_MASK = WINDOW - 1
_CANCEL_WAIT = 1.0
"""How long a shutdown waits for the calls it cancelled (their grace over) to answer."""
CHUNK = 16
"""Requests of one connection served per loop turn (a ReadyChannel's wake-up): the rest of a
batch waits for the next turn, and the chunk's answers leave at this turn's end, so the
client works on them while this side serves the rest. Without it the two sides take turns on
whole batches (64 calls in flight in the test VM: 2,600-2,850 calls/s against 3,600-4,600
with chunks of 16). Each chunk is a message more: with both ends in one process, where
nothing runs meanwhile, 64 calls in flight cost 3-15 % more CPU per call in chunks of 16
(30 % in chunks of 8): docs/reports/2026-11-27-rpc-chunks.md. Once a drain begins, a
wake-up serves all it has: requests left for a later turn are refused, as those not yet
read are (tests/unit/test_rpc_over_memory.py::
test_requests_left_for_a_later_turn_are_refused_once_a_drain_begins)."""


class _Session:
    """One client's connection, on the server side."""

    def __init__(self, ep: MessageChannel, max_in_flight: int, max_streams: int) -> None:
        self.ep = ep
        # The wire accepts as many calls as any client may send (queued here); at most
        # max_in_flight of them run at once (admission).
        self.conn = rpc_connection()(proto.Role.SERVER,
                                     max_in_flight=max(max_in_flight, MAX_CALLS))
        # A failed send aborts the connection: serve_connection's recv then ends it.
        self.sender = Sender(ep, self.conn.max_message, lambda exc: None)
        self.admission = Places(max_in_flight)
        self.stream_places = Places(max_streams)  # stream calls: their own admission
        self.streams: dict[int, ServerStream] = {}  # stream calls whose method runs
        # what a Cancel can still cancel: each call's task and method (None: not a method)
        self.unanswered: dict[int, tuple[asyncio.Task[None], ServedMethod | None]] = {}
        self.open = True  # False once the client is gone: answers are dropped
        self.handoff: asyncio.Future[bool] | None = None  # (see serve_connection)
        self.arrived = 0.0  # when the last message came (its requests' arrival)
        self.left = False  # requests received and not yet served (a chunk ended the turn)
        self.wake: Callable[[], object] = lambda: None


def _leave(session: _Session) -> list[asyncio.Task[None]]:
    """The client left (or broke the protocol): its calls' tasks, cancelled (nobody to
    answer to)."""
    session.open = False
    left = [task for task, _ in session.unanswered.values()]
    for t in left:
        t.cancel()
    return left


async def _drain_and_close(session: _Session) -> None:
    await session.sender.drain()
    await session.ep.aclose()


class RpcServer:
    """Serves one :class:`Service` on a listener. Use as ``async with``.

    Each call of an ``async def`` method runs in its own task; per connection at most
    ``max_in_flight`` run at once, the others wait (in arrival order, their deadlines running).
    Stream calls are admitted apart: at most ``max_streams`` per connection at once, each
    letting the client send ``stream_window`` items ahead of what its method read.
    A call of a plain ``def`` method runs inline, as its request is read (see :func:`method`),
    unless the server has interceptors (then in a task, as the chain is async).
    ``interceptors`` wrap every call (see :mod:`aiordma.rpc._context`): each is
    ``async def interceptor(call: CallContext, proceed)``, the first the outermost.
    ``drain(timeout)`` and ``aclose()`` shut down gracefully; ``stats()`` has the counters.

    Attributes:
        calls: requests received so far (all connections).
        cancelled: calls answered as cancelled (by the client's cancel or its leaving).
        protocol_errors: connections this server closed because of a protocol error (a
            client that broke the protocol: :class:`~aiordma.RemoteProtocolError`).
        last_protocol_error: the latest such error, or None: what the server did about a
            client's garbage, by type (a test's handle; the log says it in words).
    """

    def __init__(self, service: Service, *, max_in_flight: int, grace: float,
                 max_streams: int = 16, stream_window: int = DEFAULT_WINDOW,
                 interceptors: Sequence[ServerInterceptor] = ()) -> None:
        if not isinstance(service, Service):
            raise LocalProtocolError(f"serve() takes a Service, not {service!r:.80}")
        check_int(max_in_flight, name="max_in_flight", low=1)
        check_seconds(grace, name="grace")
        check_int(max_streams, name="max_streams", low=1)
        check_int(stream_window, name="stream_window", low=1, high=proto.MAX_CREDIT)
        self.interceptors = check_interceptors(interceptors)
        self.service = service
        self.max_in_flight = max_in_flight
        self.max_streams = max_streams
        self.stream_window = stream_window
        self.grace = grace
        self.listener: Listener | None = None
        self.calls = 0
        self.cancelled = 0
        self.protocol_errors = 0
        self.last_protocol_error: ProtocolError | None = None
        self._histograms = False  # (see _keep_histograms)
        self._running: set[asyncio.Task[None]] = set()
        self._methods: dict[str, ServedMethod] = {}  # by name, bound on first call
        self._sessions: dict[MessageChannel, _Session] = {}  # the connections being served
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The port :func:`serve` listens on.

        Raises:
            LocalProtocolError: this server was made by ``RpcServer(...)``, not :func:`serve`,
                so it listens on nothing (it serves the channels given to
                :meth:`serve_connection`).
        """
        if self.listener is None:
            raise LocalProtocolError("this RpcServer listens on no port: serve() makes one "
                                     "that does")
        return self.listener.port

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` or :meth:`aclose` began: the service's methods are refused
        (built-ins such as ``aiordma.stats`` are still answered)."""
        return self._closing

    async def serve_connection(self, ep: MessageChannel) -> None:
        """Serve one client's connection until it ends (the client closed or left, or broke
        the protocol), then close it; :func:`serve` calls it for every endpoint its listener
        accepts. Any :class:`~aiordma.transport.MessageChannel` works, e.g. one end of
        :func:`aiordma.testing.channel_pair` (a ReadyChannel is read in its wake-ups)."""
        _check_channel(ep, "serve_connection()")
        session = _Session(ep, self.max_in_flight, self.max_streams)
        _caller.set(ep)  # copied into every call's task: current_endpoint()
        self._sessions[ep] = session
        ready = isinstance(ep, ReadyChannel)
        # (the wake-ups run in the connection's context: _caller is set)
        session.wake = functools.partial(contextvars.copy_context().run,
                                         self._on_readable, session)
        try:
            while True:
                if ready:  # the messages are taken in the channel's wake-up (_on_readable)
                    session.handoff = handoff = asyncio.get_running_loop().create_future()
                    self._on_readable(session)
                    if not await handoff:
                        return  # a protocol error
                if (msg := await ep.recv()) is None:
                    break
                if self._received(session, msg) < 0:
                    return
        except ClosedResourceError:
            if not self._closing:
                raise
            # aclose() closed this connection once its calls were answered
        finally:
            session.handoff = None  # (a wake-up still armed finds nobody)
            left = _leave(session)
            try:
                if left:  # bounded: a method that ignores cancellation is left behind
                    await asyncio.wait(left, timeout=self.grace)
            finally:
                # (a task cancelled before its first step never ran to discard itself, nor
                # to count its call as answered)
                self._running.difference_update([t for t in left if t.done()])
                for task, m in list(session.unanswered.values()):
                    if task.done() and m is not None:
                        m.stats.cancelled += 1
                        m.stats.answered += 1
                del self._sessions[ep]
                await session.sender.aclose()
                await ep.aclose()  # (bounded; the listener closes its endpoints too: idempotent)

    def _on_readable(self, session: _Session) -> None:
        """A ReadyChannel's wake-up (in the connection's context): take what it has ready;
        sleep again, or hand what is next to serve_connection (``recv()``; False: end)."""
        handoff = session.handoff
        if handoff is None or handoff.done():
            return  # serve_connection reads, or ended
        ep = session.ep
        try:
            budget = sys.maxsize if self._closing else CHUNK
            if session.left:  # (requests left from the last turn first)
                session.left = False
                budget = self._serve(session, budget)
            recv = ep.recv_nowait  # type: ignore[attr-defined]
            while budget > 0 and (msg := recv()) is not None:
                budget = self._received(session, msg, budget)
            if budget < 0:  # a protocol error
                _leave(session)  # (at once, as serve_connection would: see there)
                handoff.set_result(False)
            elif budget == 0:  # served a chunk: the next turn goes on (with what is left)
                session.left = True
                asyncio.get_running_loop().call_soon(session.wake)
            elif not ep.call_when_readable(session.wake):  # type: ignore[attr-defined]
                handoff.set_result(True)
        except Exception as exc:  # noqa: BLE001  # (serve_connection raises it)
            handoff.set_exception(exc)

    def _received(self, session: _Session, msg: bytearray, budget: int = sys.maxsize) -> int:
        """One message from the client, then :meth:`_serve` (``budget`` requests of it)."""
        session.arrived = perf_counter()  # (once per message: its calls' arrival)
        try:
            session.conn.receive_message(msg)
        except ProtocolError as exc:
            return self._broken(session, exc)
        return self._serve(session, budget)

    def _serve(self, session: _Session, budget: int) -> int:
        """Received events, up to ``budget`` requests: the requests started (a ``def``
        method's answered now), cancels and stream items passed on. The budget left; -1: a
        protocol error (end the connection)."""
        try:
            started = 0
            answers: list[list[bytes | memoryview]] = []  # answers of inline calls
            arrived = session.arrived
            while started < budget and (ev := session.conn.next_event()) is not proto.NEED_DATA:
                if isinstance(ev, proto.Request):
                    started += 1
                    if started == 2:  # a batch: its answers leave together
                        session.sender.cork()
                    m = self._methods.get(ev.method) or self._lookup(ev.method)
                    if (m is not None and m.inline and not ev.stream
                            and (not self._closing or m.builtin)):
                        answers.append(self._answer_inline(session, ev, m, arrived))
                    else:
                        self._start(session, ev, m, arrived)
                elif isinstance(ev, proto.Cancel):
                    entry = session.unanswered.get(ev.id)
                    if entry is not None:
                        # Soon, not now: a task cancelled before its first step never
                        # runs, so its call would never be answered (the answer frees
                        # the client's id). The task's first step is already queued.
                        entry[0].get_loop().call_soon(entry[0].cancel)
                else:  # a stream's Data, Credit or End
                    call = session.streams.get(ev.id)
                    if call is not None:  # (else not started: the protocol keeps it)
                        call.on_event(ev)
            if answers:  # (put after the whole message: a lone answer leaves at once)
                if started == 1:
                    session.sender.put(answers[0], alone=not session.unanswered)
                else:
                    for msgs in answers:
                        session.sender.put(msgs)
        except ProtocolError as exc:
            return self._broken(session, exc)
        return budget - started

    def _broken(self, session: _Session, exc: ProtocolError) -> int:
        """A protocol error on ``session``'s connection: counted and logged; -1."""
        self.protocol_errors += 1
        self.last_protocol_error = exc.with_traceback(None)  # (no frames kept)
        if isinstance(exc, _WireRemoteError):
            log.warning("aiordma.rpc: %s broke the protocol: %s", session.ep.peer_address, exc)
        else:  # this side's own (e.g. an answer it cannot encode)
            log.warning("aiordma.rpc: closing the connection of %s after a local protocol "
                        "error: %s", session.ep.peer_address, exc)
        return -1

    def _start(self, session: _Session, req: proto.Request, m: ServedMethod | None,
               arrived: float) -> None:
        self.calls += 1
        if m is None:
            coro = self._run_other(session, req, m, arrived)
        else:
            m.stats.calls += 1
            if req.stream or m.stream is not None or (self._closing and not m.builtin):
                coro = self._run_other(session, req, m, arrived)
            else:  # a unary call of a unary method (the common case)
                coro = self._run(session, req, m, arrived)
        task = asyncio.get_running_loop().create_task(coro)
        session.unanswered[req.id] = (task, m)
        self._running.add(task)  # (the task removes itself: no done callback to schedule)

    async def _run(self, session: _Session, req: proto.Request, m: ServedMethod,
                   arrived: float) -> None:
        """A unary call's task: its method within its deadline, after admission and through
        the interceptors; then its answer."""
        conn = session.conn
        ctx = CallContext(req)
        _current.set(ctx)  # (in this call's task: current_call(), and what its calls inherit)
        try:
            try:
                if req.deadline_ms is None and m.simple:
                    # the hot path (admission written out: one coroutine less per call)
                    places = session.admission
                    if not places.try_take():
                        await places.take()
                    try:
                        result = await m.fn(*req.args, **req.kwargs)
                    finally:
                        places.give()
                else:
                    def invoke() -> Awaitable[Any]:
                        return limited(m.limit, None if m.builtin else session.admission,
                                       m.acall, req.args, req.kwargs)

                    result = await within_deadline(req, ctx, (lambda: run_chain(
                        self.interceptors, ctx, invoke)) if self.interceptors else invoke)
                msgs = conn.send_response(req.id, result, ctx._answer_metadata)
            except asyncio.CancelledError:
                self.cancelled += 1
                m.stats.cancelled += 1
                msgs = conn.send_error(req.id, "CancelledError", "the call was cancelled",
                                       ctx._answer_metadata)
            except Exception as exc:  # noqa: BLE001  # any failure is the caller's answer
                msgs = self._failed(conn, req, ctx, m.stats, exc)
        finally:
            # Answered (the state machine says DONE): from now on a Cancel crossed the answer
            # and must not interrupt sending it, or the client would wait for it for good.
            session.unanswered.pop(req.id, None)
            self._running.discard(asyncio.current_task())  # type: ignore[arg-type]
            st = m.stats
            t = st.latencies[st.answered & _MASK] = perf_counter() - arrived
            st.answered += 1
            if st.histogram is not None:
                st.histogram.observe(t)
        if session.open:
            session.sender.put(msgs, alone=not session.unanswered)

    async def _run_other(self, session: _Session, req: proto.Request, m: ServedMethod | None,
                         arrived: float) -> None:
        """The task of any other call: a stream call, a call refused (the server drains), of
        no method, or of the wrong kind (unary and streaming mixed up)."""
        conn = session.conn
        try:
            if m is None:
                msgs = error_answer(conn, req.id, AttributeError(f"no RPC method "
                                                                  f"{req.method!r}"))
            elif self._closing and not m.builtin:
                m.stats.refused += 1
                msgs = conn.send_error(req.id, UNAVAILABLE, "the server is draining: it takes "
                                       "no new calls")
            elif req.stream:
                msgs = await self._answer_stream(session, req, m)
            else:
                m.stats.errors += 1
                msgs = error_answer(conn, req.id, LocalProtocolError(
                    f"{req.method}() streams: call it with stream() or stream_call()"))
        finally:
            session.unanswered.pop(req.id, None)
            self._running.discard(asyncio.current_task())  # type: ignore[arg-type]
            if m is not None:
                st = m.stats
                t = st.latencies[st.answered & _MASK] = perf_counter() - arrived
                st.answered += 1
                if st.histogram is not None:
                    st.histogram.observe(t)
        if session.open:
            session.sender.put(msgs, alone=not session.unanswered)

    def _lookup(self, name: str) -> ServedMethod | None:
        """The method called ``name`` (a service's, or a built-in), or None."""
        try:
            return self._methods[name]
        except KeyError:  # first call of this name (names that are not methods are not kept)
            builtin = name.startswith(builtins.PREFIX)
            fn = builtins.lookup(name, self) if builtin else self.service._rpc_lookup(name)
            if fn is None:
                return None
            m = self._methods[name] = ServedMethod(
                fn, getattr(fn, _RPC_STREAM, None), getattr(fn, _RPC_LIMIT, None), builtin,
                bool(self.interceptors))
            if self._histograms:
                m.stats.histogram = LatencyHistogram()
            return m

    def _keep_histograms(self) -> dict[str, LatencyHistogram]:
        """Count every method's latencies into a :class:`LatencyHistogram` from now on (for
        an exporter: :mod:`aiordma.rpc.metrics`); the histograms so far, by method.
        Idempotent."""
        self._histograms = True
        self.stats()  # (looks up every method of the service: each gets its histogram)
        out = {}
        for name, m in self._methods.items():
            if m.stats.histogram is None:
                m.stats.histogram = LatencyHistogram()
            out[name] = m.stats.histogram
        return out

    def _answer_inline(self, session: _Session, req: proto.Request, m: ServedMethod,
                       arrived: float) -> list[bytes | memoryview]:
        """Run a plain ``def`` method now (no task) and return its answer's frames."""
        self.calls += 1
        st = m.stats
        st.calls += 1
        conn = session.conn
        ctx = CallContext(req)
        run = contextvars.copy_context().run  # (the method's own context: current_call())
        run(_current.set, ctx)
        try:
            msgs = conn.send_response(req.id, run(m.fn, *req.args, **req.kwargs),
                                      ctx._answer_metadata)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001  # the caller's answer
            st.errors += 1
            msgs = error_answer(conn, req.id, exc, ctx._answer_metadata)
        t = st.latencies[st.answered & _MASK] = perf_counter() - arrived
        st.answered += 1
        if st.histogram is not None:
            st.histogram.observe(t)
        return msgs

    def _failed(self, conn: proto.RpcConnection, req: proto.Request, ctx: CallContext,
                st: MethodStats, exc: Exception) -> list[bytes | memoryview]:
        """The answer of a call that failed: its deadline passed, an interceptor refused it
        before it ran, or the method (or an interceptor) raised."""
        if isinstance(exc, Expired):
            st.expired += 1
            return error_answer(conn, req.id, NamedError(
                DEADLINE_EXPIRED, f"{req.method}(): the caller's deadline expired"),
                ctx._answer_metadata)
        if isinstance(exc, Unavailable) and getattr(ctx, "_ran", None) is False:
            # (an interceptor refused the call: the method did not run)
            st.refused += 1
            return error_answer(conn, req.id, NamedError(UNAVAILABLE, exc.message),
                                 ctx._answer_metadata)
        st.errors += 1
        return error_answer(conn, req.id, exc, ctx._answer_metadata)

    async def _answer_stream(self, session: _Session, req: proto.Request,
                             m: ServedMethod) -> list[bytes | memoryview]:
        """Run a stream call's method (see :func:`~aiordma.rpc._stream.run_stream`) within its
        deadline, after its limit and among the connection's ``max_streams``; its answer's
        frames."""
        conn = session.conn
        st = m.stats
        ctx = CallContext(req)
        _current.set(ctx)
        try:
            kind = m.stream
            if kind is None:
                raise LocalProtocolError(f"{req.method}() is not a streaming method: call it "
                                         f"with call()")

            def invoke() -> Awaitable[Any]:
                return limited(m.limit, session.stream_places, run_stream, (
                    session.streams, conn, session.sender, req, req.args, req.kwargs, m.fn,
                    kind, self.stream_window), {})

            result = await within_deadline(req, ctx, (lambda: run_chain(
                self.interceptors, ctx, invoke)) if self.interceptors else invoke)
            return conn.send_response(req.id, result, ctx._answer_metadata)
        except asyncio.CancelledError:
            self.cancelled += 1
            st.cancelled += 1
            return conn.send_error(req.id, "CancelledError", "the call was cancelled",
                                   ctx._answer_metadata)
        except Exception as exc:  # noqa: BLE001  # any failure is the caller's answer
            return self._failed(conn, req, ctx, st, exc)

    # -- counters ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The server's counters, as plain values (what the built-in ``aiordma.stats`` method
        answers and ``aiordma stats HOST:PORT`` prints): ``calls`` (requests received),
        ``cancelled``, ``connections`` (being served), ``draining``, ``protocol_errors``, and
        ``transports``: the connections being served per transport (``{"rdma": 2, "tcp": 1}``),
        ``methods``: for each of the service's methods (and each built-in called so far) its
        counters (see :meth:`~aiordma.rpc._stats.MethodStats.snapshot`: calls, errors,
        cancelled, expired, refused, in flight, a limited method's running and waiting calls,
        latency percentiles in ms from a request's arrival to its answer)."""
        for name in dir(type(self.service)):  # (every method, called or not)
            if name not in self._methods and getattr(getattr(type(self.service), name, None),
                                                     _RPC_METHOD, False):
                self._lookup(name)
        transports: dict[str, int] = {}
        for ep in self._sessions:
            kind = str(getattr(ep, "transport", "unknown"))
            transports[kind] = transports.get(kind, 0) + 1
        return {"calls": self.calls, "cancelled": self.cancelled,
                "connections": len(self._sessions), "transports": transports,
                "draining": self._closing,
                "protocol_errors": self.protocol_errors,
                "methods": {name: m.snapshot() for name, m in self._methods.items()}}

    # -- closing -------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Shut down gracefully within ``timeout`` seconds: stop accepting connections; refuse
        new calls of the service's methods (the caller gets :class:`~aiordma.rpc.Unavailable`:
        the method did not run, so the call may be made elsewhere); let the calls received so
        far, running or queued, finish; past ``timeout``, cancel those still running (their
        callers get ``RemoteError`` ``CancelledError``); deliver every answer and close each
        connection gracefully (bounded by ``Config.close_timeout``); then release
        everything. Built-ins (``aiordma.stats``) are answered until the connections close.
        If :meth:`aclose` or another ``drain()`` began first, this waits for that one.

        Raises:
            LocalProtocolError: ``timeout`` is not a non-negative, finite number.
        """
        check_seconds(timeout, name="timeout", zero_ok=True)
        await self._shutdown(timeout)

    async def aclose(self) -> None:
        """:meth:`drain` with the server's ``grace`` as the timeout. Idempotent."""
        await self._shutdown(self.grace)

    async def _shutdown(self, grace: float) -> None:
        if self._close_task is None:
            self._closing = True  # from now on, new calls are refused
            if self.listener is not None and self.listener._server is not None:
                self.listener._server.close()  # no new connections
            self._close_task = asyncio.ensure_future(self._close(grace))
        await asyncio.shield(self._close_task)

    async def _close(self, grace: float) -> None:
        listener = self.listener
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while (running := {t for t in self._running if not t.done()}) \
                    and (left := deadline - loop.time()) > 0:
                await asyncio.wait(running, timeout=left)
            # past the grace: what still runs is cancelled, and answered as such
            late = [t for t in self._running if not t.done()]
            for t in late:
                t.cancel()
            if late:  # bounded: a method that ignores cancellation is left behind
                await asyncio.wait(late, timeout=_CANCEL_WAIT)
            # the answers sent, then a graceful close each
            await asyncio.gather(*(_drain_and_close(s) for s in list(self._sessions.values())),
                                 return_exceptions=True)
        finally:
            if listener is not None:
                await listener.aclose()

    def abort(self) -> None:
        """Stop at once: every connection is aborted, running calls are cancelled."""
        self._closing = True
        if self.listener is not None:
            self.listener.abort()
        for ep in list(self._sessions):
            ep.abort()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def serve(service: Service, host: str = "127.0.0.1", port: int = 0, *,
                max_in_flight: int = 64, grace: float = 5.0, config: Config | None = None,
                device: str | Device | None = None, secret: bytes | None = None,
                max_connections_per_peer: int | None = None,
                max_connections: int | None = None, max_streams: int = 16,
                stream_window: int = DEFAULT_WINDOW,
                interceptors: Sequence[ServerInterceptor] = (),
                transport: str = "auto") -> RpcServer:
    """Serve ``service`` on ``host:port`` (``port=0``: a free one, see ``server.port``).

    Args:
        max_in_flight: the most calls that run at once per connection (more wait, queued).
        grace: how long :meth:`RpcServer.aclose` lets calls in flight finish.
        max_streams: the most stream calls whose methods run at once per connection (more
            wait, queued, their callers' items held back).
        stream_window: how many items a caller may send ahead of what a method read.
        interceptors: async middleware around every call, the first the outermost:
            ``async def interceptor(call: CallContext, proceed)`` (see
            :mod:`aiordma.rpc._context`).
        transport: which clients it takes, as :func:`aiordma.listen`: ``"auto"`` (default:
            RDMA and TCP on the one port; TCP only where this host has no RDMA device),
            ``"rdma"`` or ``"tcp"``. The service runs the same over either; ``stats()`` counts
            the connections per transport.
        config, device, secret, max_connections_per_peer, max_connections: as
            :func:`aiordma.listen`.
    """
    server = RpcServer(service, max_in_flight=max_in_flight, grace=grace,
                       max_streams=max_streams, stream_window=stream_window,
                       interceptors=interceptors)
    server.listener = await listen(server.serve_connection, host, port, config=config, device=device,
                                   secret=secret,
                                   max_connections_per_peer=max_connections_per_peer,
                                   max_connections=max_connections, transport=transport)
    return server
