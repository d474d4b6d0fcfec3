"""The RPC layer's server: :class:`RpcServer` serves one :class:`~aiordma.rpc.Service` on a
listener (or on any :class:`~aiordma.transport.MessageChannel`), and :func:`serve` makes one.
The wire is :mod:`aiordma.protocols.rpc`; the frames leave through :mod:`aiordma._rpc_sender`;
stream calls run through :mod:`aiordma._rpc_stream`."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Self

from aiordma.protocols import rpc as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.errors import RemoteProtocolError as _WireRemoteError

from ._args import check_int, check_seconds
from ._connect import Listener, listen
from ._device import Device
from ._endpoint import Config
from ._errors import ClosedResourceError, LocalProtocolError
from ._places import Places
from ._rpc_health import BUILTIN_PREFIX, builtin_method
from ._rpc_sender import Sender
from ._rpc_service import (
    _RPC_STREAM,
    DEADLINE_EXPIRED,
    MAX_CALLS,
    Service,
    _caller,
    _check_channel,
)
from ._rpc_stream import DEFAULT_WINDOW, ServerStream, StreamKind, run_stream
from .transport import MessageChannel

__all__ = ["RpcServer", "serve"]

log = logging.getLogger("aiordma.rpc")


def _error_answer(conn: proto.RpcConnection, call_id: int,
                  exc: BaseException) -> list[bytes | memoryview]:
    type_name = type(exc).__name__[:proto.MAX_NAME] or "Exception"
    try:
        text = str(exc)[:4000]
    except Exception:  # noqa: BLE001  # a broken __str__ must not lose the answer
        text = "(unprintable)"
    try:
        return conn.send_error(call_id, type_name, text)
    except ProtocolError:  # e.g. a lone surrogate in the message
        return conn.send_error(call_id, type_name, "(unprintable)")


async def _admitted(places: Places, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """``await fn(*args, **kwargs)`` in one of ``places``, waiting for one if none is free."""
    if not places.try_take():
        await places.take()
    try:
        return await fn(*args, **kwargs)
    finally:
        places.give()


async def _within_deadline(conn: proto.RpcConnection, req: proto.Request, places: Places,
                           fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> list[bytes | memoryview]:
    """:func:`_admitted` within the caller's deadline (none: unbounded); the answer's frames:
    the result, or ``DEADLINE_EXPIRED`` once the deadline passed. A method's own timeout, or
    any other failure, propagates to the caller's handling."""
    bound = asyncio.timeout(None if req.deadline_ms is None else req.deadline_ms / 1000)
    try:
        async with bound:
            result = await _admitted(places, fn, args, kwargs)
    except TimeoutError:
        if not bound.expired():
            raise  # the method's own timeout: an ordinary error
        return conn.send_error(req.id, DEADLINE_EXPIRED,
                               f"{req.method}(): the caller's deadline expired")
    return conn.send_response(req.id, result)


class _Session:
    """One client's connection, on the server side."""

    def __init__(self, ep: MessageChannel, max_in_flight: int, max_streams: int) -> None:
        self.ep = ep
        # The wire accepts as many calls as any client may send (queued here); at most
        # max_in_flight of them run at once (admission).
        self.conn = proto.RpcConnection(proto.Role.SERVER,
                                        max_in_flight=max(max_in_flight, MAX_CALLS))
        # A failed send aborts the connection: serve_connection's recv then ends it.
        self.sender = Sender(ep, self.conn.max_message, lambda exc: None)
        self.admission = Places(max_in_flight)
        self.stream_places = Places(max_streams)  # stream calls: their own admission
        self.streams: dict[int, ServerStream] = {}  # stream calls whose method runs
        self.unanswered: dict[int, asyncio.Task[None]] = {}  # what a Cancel can still cancel
        self.open = True  # False once the client is gone: answers are dropped


async def _drain_and_close(session: _Session) -> None:
    await session.sender.drain()
    await session.ep.aclose()


class RpcServer:
    """Serves one :class:`Service` on a listener. Use as ``async with``.

    Each call of an ``async def`` method runs in its own task; per connection at most
    ``max_in_flight`` run at once, the others wait (in arrival order, their deadlines running).
    Stream calls are admitted apart: at most ``max_streams`` per connection at once, each
    letting the client send ``stream_window`` items ahead of what its method read.
    A call of a plain ``def`` method runs inline, as its request is read (see :func:`method`).
    ``aclose()`` shuts down gracefully.

    Attributes:
        calls: requests received so far (all connections).
        cancelled: calls answered as cancelled (by the client's cancel or its leaving).
        protocol_errors: connections this server closed because of a protocol error (a
            client that broke the protocol: :class:`~aiordma.RemoteProtocolError`).
        last_protocol_error: the latest such error, or None: what the server did about a
            client's garbage, by type (a test's handle; the log says it in words).
    """

    def __init__(self, service: Service, *, max_in_flight: int, grace: float,
                 max_streams: int = 16, stream_window: int = DEFAULT_WINDOW) -> None:
        if not isinstance(service, Service):
            raise LocalProtocolError(f"serve() takes a Service, not {service!r:.80}")
        check_int(max_in_flight, name="max_in_flight", low=1)
        check_seconds(grace, name="grace")
        check_int(max_streams, name="max_streams", low=1)
        check_int(stream_window, name="stream_window", low=1, high=proto.MAX_CREDIT)
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
        self._running: set[asyncio.Task[None]] = set()
        # bound, by name, with whether it runs inline (a plain def) and what it streams
        self._methods: dict[str, tuple[Callable[..., Any], bool, StreamKind | None]] = {}
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

    async def serve_connection(self, ep: MessageChannel) -> None:
        """Serve one client's connection until it ends (the client closed or left, or broke
        the protocol), then close it; :func:`serve` calls it for every endpoint its listener
        accepts. Any
        :class:`~aiordma.transport.MessageChannel` works, e.g. one end of
        :func:`aiordma.testing.channel_pair`."""
        _check_channel(ep, "serve_connection()")
        session = _Session(ep, self.max_in_flight, self.max_streams)
        _caller.set(ep)  # copied into every call's task: current_endpoint()
        self._sessions[ep] = session
        try:
            while (msg := await ep.recv()) is not None:
                try:
                    session.conn.receive_message(msg)
                    started = 0
                    ready: list[list[bytes | memoryview]] = []  # answers of inline calls
                    while (ev := session.conn.next_event()) is not proto.NEED_DATA:
                        if isinstance(ev, proto.Request):
                            started += 1
                            if started == 2:  # a batch: its answers leave together
                                session.sender.cork()
                            found = self._lookup(ev.method)
                            if (found is not None and found[1] and not self._closing
                                    and not ev.stream):
                                ready.append(self._answer_inline(session, ev, found[0]))
                            else:
                                self._start(session, ev)
                        elif isinstance(ev, proto.Cancel):
                            task = session.unanswered.get(ev.id)
                            if task is not None:
                                # Soon, not now: a task cancelled before its first step never
                                # runs, so its call would never be answered (the answer frees
                                # the client's id). The task's first step is already queued.
                                task.get_loop().call_soon(task.cancel)
                        else:  # a stream's Data, Credit or End
                            call = session.streams.get(ev.id)
                            if call is not None:  # (else not started: the protocol keeps it)
                                call.on_event(ev)
                    if ready:  # (put after the whole message: a lone answer leaves at once)
                        if started == 1:
                            session.sender.put(ready[0], alone=not session.unanswered)
                        else:
                            for msgs in ready:
                                session.sender.put(msgs)
                except ProtocolError as exc:
                    self.protocol_errors += 1
                    self.last_protocol_error = exc.with_traceback(None)  # (no frames kept)
                    if isinstance(exc, _WireRemoteError):
                        log.warning("aiordma.rpc: %s broke the protocol: %s", ep.peer_address,
                                    exc)
                    else:  # this side's own (e.g. an answer it cannot encode)
                        log.warning("aiordma.rpc: closing the connection of %s after a local "
                                    "protocol error: %s", ep.peer_address, exc)
                    return
        except ClosedResourceError:
            if not self._closing:
                raise
            # aclose() closed this connection once its calls were answered
        finally:
            # The client left (or broke the protocol): its calls have nobody to answer to.
            session.open = False
            left = list(session.unanswered.values())
            for t in left:
                t.cancel()
            try:
                if left:  # bounded: a method that ignores cancellation is left behind
                    await asyncio.wait(left, timeout=self.grace)
            finally:
                # (a task cancelled before its first step never ran to discard itself)
                self._running.difference_update([t for t in left if t.done()])
                del self._sessions[ep]
                await session.sender.aclose()
                await ep.aclose()  # (bounded; the listener closes its endpoints too: idempotent)

    def _start(self, session: _Session, req: proto.Request) -> None:
        self.calls += 1
        task = asyncio.get_running_loop().create_task(
            self._run(session, req, refuse=self._closing))
        session.unanswered[req.id] = task
        self._running.add(task)  # (the task removes itself: no done callback to schedule)

    async def _run(self, session: _Session, req: proto.Request, *, refuse: bool) -> None:
        try:
            if req.stream and not refuse:
                msgs = await self._answer_stream(session, req)
            else:
                msgs = await self._answer(session, req, refuse)
        finally:
            # Answered (the state machine says DONE): from now on a Cancel crossed the answer
            # and must not interrupt sending it, or the client would wait for it for good.
            session.unanswered.pop(req.id, None)
            self._running.discard(asyncio.current_task())  # type: ignore[arg-type]
        if session.open:
            session.sender.put(msgs, alone=not session.unanswered)

    def _lookup(self, name: str) -> tuple[Callable[..., Any], bool, StreamKind | None] | None:
        """The bound method called ``name``, whether it runs inline and what it streams, or
        None."""
        try:
            return self._methods[name]
        except KeyError:  # first call of this name (names that are not methods are not kept)
            fn = (builtin_method(self.service, name) if name.startswith(BUILTIN_PREFIX)
                  else self.service._rpc_lookup(name))  # (_aiordma.health: _rpc_health.py)
            if fn is None:
                return None
            kind = getattr(fn, _RPC_STREAM, None)
            inline = kind is None and not inspect.iscoroutinefunction(fn)
            found = self._methods[name] = (fn, inline, kind)
            return found

    def _answer_inline(self, session: _Session, req: proto.Request,
                       fn: Callable[..., Any]) -> list[bytes | memoryview]:
        """Run a plain ``def`` method now (no task) and return its answer's frames."""
        self.calls += 1
        conn = session.conn
        try:
            return conn.send_response(
                req.id, contextvars.copy_context().run(fn, *req.args, **req.kwargs))
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001  # the caller's answer
            return _error_answer(conn, req.id, exc)

    async def _answer(self, session: _Session, req: proto.Request,
                      refuse: bool) -> list[bytes | memoryview]:
        conn = session.conn
        if refuse:
            return conn.send_error(req.id, "ClosedResourceError", "the server is shutting down")
        found = self._lookup(req.method)
        try:
            if found is None:
                raise AttributeError(f"no RPC method {req.method!r}")
            fn = found[0]
            if found[2] is not None:
                raise LocalProtocolError(f"{req.method}() streams: call it with stream() or "
                                         f"stream_call()")
            if req.deadline_ms is None:  # (asyncio.timeout(None) costs as much as a real one)
                places = session.admission
                if not places.try_take():
                    await places.take()
                try:  # (_admitted, inline: one coroutine less per call)
                    result = await fn(*req.args, **req.kwargs)
                finally:
                    places.give()
            else:
                return await _within_deadline(conn, req, session.admission, fn, req.args,
                                              req.kwargs)
            return conn.send_response(req.id, result)
        except asyncio.CancelledError:
            self.cancelled += 1
            return conn.send_error(req.id, "CancelledError", "the call was cancelled")
        except Exception as exc:  # noqa: BLE001  # any failure is the caller's answer
            return _error_answer(conn, req.id, exc)

    async def _answer_stream(self, session: _Session,
                             req: proto.Request) -> list[bytes | memoryview]:
        """Run a stream call's method (see :func:`~aiordma._rpc_stream.run_stream`) within its
        deadline, among the connection's ``max_streams``; its answer's frames."""
        conn = session.conn
        found = self._lookup(req.method)
        try:
            if found is None:
                raise AttributeError(f"no RPC method {req.method!r}")
            if found[2] is None:
                raise LocalProtocolError(f"{req.method}() is not a streaming method: call it "
                                         f"with call()")
            return await _within_deadline(
                conn, req, session.stream_places, run_stream,
                (session.streams, conn, session.sender, req, found[0], found[2],
                 self.stream_window), {})
        except asyncio.CancelledError:
            self.cancelled += 1
            return conn.send_error(req.id, "CancelledError", "the call was cancelled")
        except Exception as exc:  # noqa: BLE001  # any failure is the caller's answer
            return _error_answer(conn, req.id, exc)

    async def aclose(self) -> None:
        """Shut down gracefully: stop accepting connections, refuse new calls (the caller gets
        :class:`RemoteError` ``ClosedResourceError``), let the calls received so far finish for
        up to ``grace`` seconds, deliver their answers and close each connection gracefully
        (bounded by ``Config.close_timeout``); then release everything. Idempotent."""
        if self._close_task is None:
            self._closing = True  # from now on, new calls are refused
            if self.listener is not None and self.listener._server is not None:
                self.listener._server.close()  # no new connections
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        listener = self.listener
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.grace
            while (running := {t for t in self._running if not t.done()}) \
                    and (left := deadline - loop.time()) > 0:
                await asyncio.wait(running, timeout=left)
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
                stream_window: int = DEFAULT_WINDOW) -> RpcServer:
    """Serve ``service`` on ``host:port`` (``port=0``: a free one, see ``server.port``).

    Args:
        max_in_flight: the most calls that run at once per connection (more wait, queued).
        grace: how long :meth:`RpcServer.aclose` lets calls in flight finish.
        max_streams: the most stream calls whose methods run at once per connection (more
            wait, queued, their callers' items held back).
        stream_window: how many items a caller may send ahead of what a method read.
        config, device, secret, max_connections_per_peer, max_connections: as
            :func:`aiordma.listen`.
    """
    server = RpcServer(service, max_in_flight=max_in_flight, grace=grace,
                       max_streams=max_streams, stream_window=stream_window)
    server.listener = await listen(server.serve_connection, host, port, config=config, device=device,
                                   secret=secret,
                                   max_connections_per_peer=max_connections_per_peer,
                                   max_connections=max_connections)
    return server
