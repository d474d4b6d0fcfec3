"""RPC over aiordma endpoints: services of ``async`` methods, called like local coroutines.

.. code-block:: python

    from aiordma.rpc import Service, method, serve, connect

    class Calc(Service):
        @method
        async def add(self, a: int, b: int) -> int:
            return a + b

    async with await serve(Calc(), host, port) as server:
        async with await connect(host, port) as client:
            assert await client.call("add", 1, 2) == 3
            assert await client.add(1, 2) == 3          # the same, through the proxy

The wire protocol is :mod:`aiordma.protocols.rpc` (sans-I/O): the frames one side produces in a
loop tick travel as one message (a batch), large ``bytes``, ``memoryview`` and numpy values as
out-of-band messages, which the endpoint moves by rendezvous (RDMA READ, no copy) when they
exceed its eager size. Many calls share a connection; a call of an ``async def`` method runs
in its own task on the server, at most the server's ``max_in_flight`` at once per connection
(more are queued there), and a call of a plain ``def`` method runs inline, as its request is
read, with no task (see :func:`method`); a client has at most its own ``max_in_flight``
outstanding (callers beyond wait for a free place: backpressure). A call's ``timeout`` bounds the whole call and
travels as its deadline: when it expires the client raises :class:`~aiordma.OperationTimeout`
and sends a cancel, which cancels the server's task.
An exception in a method reaches the caller as :class:`RemoteError` with the remote type name
and message.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import math
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

from aiordma.protocols import rpc as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.errors import RemoteProtocolError as _WireRemoteError

from ._args import check_int, check_seconds
from ._connect import Listener, listen
from ._connect import connect as _connect_endpoint
from ._device import Device
from ._endpoint import Config
from ._errors import (
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    LocalProtocolError,
    OperationTimeout,
    again,
    from_protocol_error,
)
from ._places import Places
from ._rpc_sender import Sender
from ._rpc_stream import (
    DEFAULT_WINDOW,
    RpcStream,
    ServerStream,
    StreamCall,
    StreamKind,
    run_stream,
    stream_kind,
    weak,
)
from .transport import MessageChannel

__all__ = [
    "RemoteError", "RpcClient", "RpcServer", "RpcStream", "Service", "StreamCall", "connect",
    "current_endpoint", "method", "serve",
]

log = logging.getLogger("aiordma.rpc")
F = TypeVar("F", bound=Callable[..., Any])
_RPC_METHOD = "__aiordma_rpc_method__"
_RPC_STREAM = "__aiordma_rpc_stream__"  # a method's StreamKind (None: unary)
_caller: contextvars.ContextVar[Any] = contextvars.ContextVar("aiordma_rpc_caller")


def current_endpoint() -> Any:
    """The connection of the client whose call is running (inside a :func:`method` only): an
    :class:`~aiordma.Endpoint` when served over RDMA (any
    :class:`~aiordma.transport.MessageChannel` given to :meth:`RpcServer.serve_connection`).

    Services use it to register memory on the caller's device and to tell callers apart.

    Raises:
        LookupError: not inside a remote call.
    """
    return _caller.get()


class RemoteError(AiordmaError):
    """The remote method raised. ``type_name`` and ``message`` describe the remote exception."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(type_name, message)
        self.type_name = type_name
        self.message = message

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


def method(fn: F) -> F:
    r"""Mark a method of a :class:`Service` subclass as callable remotely.

    An ``async def`` method runs in a task of its own per call: it may await, the caller's
    deadline bounds it and a cancel reaches it, and at most ``max_in_flight`` of a connection's
    calls run at once. A plain ``def`` method runs inline, as soon as its request is read, with
    no task (cheaper: no task to create and schedule): for a method that returns at once
    without I/O, such as a lookup in memory. It must not block, since the connection reads
    nothing meanwhile; it runs in a copy of the connection's context (so
    :func:`current_endpoint` works), and what it returns is the answer (an awaitable it returns
    is not awaited: declare such a method ``async def``).

    A method streams when it is an ``async def`` that ``yield``s (each item goes to the
    caller, who reads them with :meth:`RpcClient.stream`), or when one of its parameters is
    annotated :class:`RpcStream` (it receives the items the caller sends through
    :meth:`RpcClient.stream_call`); both make a bidirectional method. A generator is resumed
    only when the caller has room for its next item; a cancel or the deadline cancels it
    (its ``finally`` blocks run).

    Raises:
        LocalProtocolError: ``fn`` is not a function, is a plain generator, or takes an
            :class:`RpcStream` without being an ``async def`` (or takes more than one).
    """
    if not inspect.isfunction(fn) or inspect.isgeneratorfunction(fn):
        raise LocalProtocolError(f"@method needs an async def or a def, not {fn!r:.80}")
    setattr(fn, _RPC_STREAM, stream_kind(fn))
    setattr(fn, _RPC_METHOD, True)
    return fn


class Service:
    """Base class of services: only methods marked with :func:`method` can be called."""

    def _rpc_lookup(self, name: str) -> Callable[..., Any] | None:
        fn = getattr(type(self), name, None)
        if fn is None or not getattr(fn, _RPC_METHOD, False):
            return None
        bound: Callable[..., Any] = getattr(self, name)
        return bound


def _check_channel(ep: Any, what: str) -> None:
    if not isinstance(ep, MessageChannel):
        raise LocalProtocolError(f"{what} takes a MessageChannel (an aiordma.Endpoint, or one "
                                 f"end of aiordma.testing.channel_pair()), not "
                                 f"{type(ep).__name__}")


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


DEADLINE_EXPIRED = "DeadlineExpired"
"""The error type a server answers when a call's deadline runs out at the server (its clock
starts when the request arrives); the client raises :class:`~aiordma.OperationTimeout` for it,
as for its own clock running out (whichever comes first, e.g. over a fast link)."""

MAX_TIMEOUT = 1e15
"""The largest ``timeout`` of a call, in seconds (about 31 million years): its deadline
travels in milliseconds in a signed 64-bit field."""

MAX_CALLS = proto.DEFAULT_MAX_IN_FLIGHT
"""The most calls a client may have outstanding on one connection (a client's ``max_in_flight``
is at most this); a server accepts that many per connection, runs at most its own
``max_in_flight`` of them at once and queues the rest, in arrival order."""


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
            fn = self.service._rpc_lookup(name)
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


class RpcClient:
    """A connection to an :class:`RpcServer`. ``await client.call("name", *args)`` or
    ``await client.name(*args)``. Use as ``async with``; ``aclose()`` and ``abort()`` fail
    pending calls with :class:`ClosedResourceError`.

    A call holds one of ``max_in_flight`` places from sending its request until its answer
    arrives, also after its caller gave up (the server always answers, a cancelled call too):
    so the client never sends more calls than the server accepts.
    """

    def __init__(self, ep: MessageChannel, max_in_flight: int) -> None:
        _check_channel(ep, "RpcClient()")
        check_int(max_in_flight, name="max_in_flight", low=1, high=MAX_CALLS)
        self.endpoint = ep
        self.max_in_flight = max_in_flight
        self._conn = proto.RpcConnection(proto.Role.CLIENT, peer_max_in_flight=max_in_flight)
        self._sender = Sender(ep, self._conn.max_message, self._send_failed)
        self._places = Places(max_in_flight)
        self._waiting: dict[int, asyncio.Future[Any]] = {}  # each holds a place
        self._streams: dict[int, weakref.ref[StreamCall]] = {}  # stream calls not answered
        self._failure: AiordmaError | None = None
        self._closed = False
        self._reader = asyncio.ensure_future(self._read())

    async def call(self, name: str, *args: Any, timeout: float | None = None,
                   **kwargs: Any) -> Any:
        """Call ``name`` remotely; its result, or :class:`RemoteError`.

        ``timeout`` bounds the whole call: waiting for a place among ``max_in_flight``, sending
        and the answer. What is left of it when the request goes out travels as its deadline.

        Raises:
            OperationTimeout: ``timeout`` expired (the server's task is cancelled).
            RemoteError: the method raised (``type_name``, ``message``).
            ClosedResourceError: this client was closed.
            BrokenResourceError: the connection broke, or the server closed it.
            RemoteProtocolError: the server broke the protocol (the connection is closed).
            LocalProtocolError: an argument cannot be sent.
        """
        if not isinstance(name, str):
            raise LocalProtocolError(f"a method name is a str, not {name!r:.80}")
        # 0: a bound already spent (OperationTimeout at once)
        check_seconds(timeout, none_ok=True, zero_ok=True, high=MAX_TIMEOUT)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._check_usable()
        places = self._places
        if not places.try_take():  # (a free place is taken without suspending: no bound needed)
            try:
                async with asyncio.timeout_at(deadline):
                    await places.take()
            except TimeoutError:
                raise OperationTimeout(f"{name}(): no free place among {self.max_in_flight} "
                                       f"calls in flight within {timeout} s") from None
        # The place is this call's until its answer arrives or the connection ends.
        try:
            self._check_usable()
            # rounded up: the server must never give up before the caller does
            left = None if deadline is None else max(0, math.ceil((deadline - loop.time()) * 1000))
            call_id, msgs = self._conn.send_request(name, tuple(args), kwargs, left)
        except ProtocolError as exc:
            self._places.give()
            raise from_protocol_error(exc, "rpc") from exc
        except BaseException:
            self._places.give()
            raise
        answer: asyncio.Future[Any] = loop.create_future()
        self._waiting[call_id] = answer
        # Sent at once if it is the only call in flight, else at the end of this tick with the
        # tick's other frames; a send that fails aborts the connection, and the reader then
        # fails ``answer``. (A caller cancelled
        # while awaiting ``answer`` cancels it: the reader then just frees the place when the
        # answer comes.)
        self._sender.put(msgs, alone=len(self._waiting) == 1)
        try:
            if deadline is None:
                return await answer
            async with asyncio.timeout_at(deadline) as bound:
                return await answer
        except TimeoutError:
            if deadline is None or not bound.expired():
                raise
            self._give_up(call_id, answer)
            raise OperationTimeout(f"{name}() took longer than {timeout} s") from None
        except asyncio.CancelledError:
            self._give_up(call_id, answer)
            raise

    def stream(self, name: str, *args: Any, timeout: float | None = None,
               window: int = DEFAULT_WINDOW, **kwargs: Any) -> StreamCall:
        """Call ``name``, a method that yields, and read what it yields::

            async for row in client.stream("rows", 100, timeout=30):
                ...
            async with client.stream("rows", 100) as rows:   # ends the call on leaving
                async for row in rows:
                    if done(row):
                        break                                   # the server stops

        The call starts when first used. At most ``window`` items travel ahead of what the
        caller has read (the server's generator waits meanwhile). ``timeout`` bounds the whole
        call. See :class:`StreamCall`.

        Raises:
            LocalProtocolError: ``name``, ``timeout`` or ``window`` is not valid (at once); an
                argument cannot be sent (when the call starts).
        """
        return self._stream_call(name, args, kwargs, timeout, window, sends=False)

    def stream_call(self, name: str, *args: Any, timeout: float | None = None,
                    window: int = DEFAULT_WINDOW, **kwargs: Any) -> StreamCall:
        """Call ``name``, a method that takes an :class:`RpcStream`, and send it items
        (client streaming, or bidirectional if it also yields)::

            async with client.stream_call("upload", "name") as call:
                for chunk in chunks:
                    await call.send(chunk)        # waits while the server's window is full
                await call.send_eof()
                size = await call.result()        # what the method returned

        ``window`` and ``timeout`` as for :meth:`stream`. See :class:`StreamCall`.
        """
        return self._stream_call(name, args, kwargs, timeout, window, sends=True)

    def _stream_call(self, name: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     timeout: Any, window: Any, sends: bool) -> StreamCall:
        if not isinstance(name, str):
            raise LocalProtocolError(f"a method name is a str, not {name!r:.80}")
        check_seconds(timeout, none_ok=True, zero_ok=True, high=MAX_TIMEOUT)
        check_int(window, name="window", low=1, high=proto.MAX_CREDIT)
        return StreamCall(self, name, args, kwargs, timeout, window, sends)

    def _open_stream(self, call_id: int, call: StreamCall, request: list[bytes | memoryview],
                     frames: list[bytes | memoryview]) -> asyncio.Future[Any]:
        """Register a stream call whose request ``call`` made, and send it with ``frames``
        (its first credits, and its End): in one message when they fit one. Its answer."""
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = answer
        self._streams[call_id] = weak(call)
        alone = len(self._waiting) == 1
        sender = self._sender
        if len(request) == 1 and len(request[0]) + sum(map(len, frames)) <= sender.outbox.limit:
            sender.put([proto.join([request[0], *frames])], alone=alone)  # type: ignore[list-item]
        else:
            sender.put(request, alone=alone)
            for frame in frames:
                sender.put([frame])
        return answer

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name.startswith("_"):
            raise AttributeError(name)

        async def proxy(*args: Any, **kwargs: Any) -> Any:
            return await self.call(name, *args, **kwargs)

        return proxy

    # -- internals ---------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedResourceError("the RPC client is closed")
        if self._failure is not None:
            raise again(self._failure)

    def _send_failed(self, exc: AiordmaError) -> None:
        # A request the server never got would hold its place for good: the connection is
        # unusable (the sender aborted it; the reader fails every waiting call).
        if self._failure is None and not self._closed:
            self._failure = exc

    def _give_up(self, call_id: int, answer: asyncio.Future[Any]) -> None:
        """The caller left: nobody wants the answer; ask the server to cancel the call (the
        cancel leaves after the request, in order). Its place is freed when the answer (which
        the server always sends) arrives."""
        if not answer.done():
            answer.cancel()
        if (call_id in self._waiting and self._failure is None
                and self._conn.call_state(call_id) is proto.CallState.WAITING):
            self._sender.put(self._conn.send_cancel(call_id))

    async def _read(self) -> None:
        exc: AiordmaError = BrokenResourceError("the server closed the connection")
        try:
            while (msg := await self.endpoint.recv()) is not None:
                self._conn.receive_message(msg)
                answered = 0
                while (ev := self._conn.next_event()) is not proto.NEED_DATA:
                    cls = type(ev)
                    if cls is not proto.Response and cls is not proto.Error:
                        if cls is proto.Data or cls is proto.Credit:
                            _tell(self._streams.get(ev.id), ev)
                            continue
                        raise _WireRemoteError(  # (the client's state tables let nothing
                            f"rpc: the server sent a {cls.__name__}")  # else through)
                    answered += 1
                    if answered == 2:  # a batch: the callers' next requests leave together
                        self._sender.cork()
                    answer = self._waiting.pop(ev.id)
                    self._places.give()
                    ref = self._streams.pop(ev.id, None) if self._streams else None
                    if not answer.done():  # (else its caller gave up)
                        if cls is proto.Response:
                            answer.set_result(ev.result)  # type: ignore[union-attr]
                        elif ev.type == DEADLINE_EXPIRED:  # type: ignore[union-attr]
                            # the server's clock ran out first
                            answer.set_exception(OperationTimeout(ev.message))  # type: ignore[union-attr]
                        else:
                            answer.set_exception(RemoteError(ev.type, ev.message))  # type: ignore[union-attr]
                    if ref is not None:  # a stream call, whose reader may never ask
                        if not answer.cancelled():
                            answer.exception()  # (marks an exception as retrieved)
                        _tell(ref, ev)
        except ProtocolError as e:
            exc = from_protocol_error(e, "rpc")
            self.endpoint.abort()
        except AiordmaError as e:
            exc = e
        finally:
            if self._closed:
                exc = ClosedResourceError("the RPC client was closed")
            if self._failure is None:
                self._failure = exc
            waiting, self._waiting = self._waiting, {}
            for call_id, answer in waiting.items():
                self._places.give()
                if not answer.done():
                    answer.set_exception(again(self._failure))
                    if call_id in self._streams:  # (its reader may never ask for it)
                        answer.exception()
            streams, self._streams = self._streams, {}
            for ref in streams.values():
                _tell(ref, None)

    # -- closing -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connection gracefully (bounded by ``Config.close_timeout``); pending calls
        fail with :class:`ClosedResourceError`. Idempotent."""
        self._closed = True
        try:
            await self._sender.drain()  # (cancels asked for go out before the close)
            await self.endpoint.aclose()
        finally:
            await asyncio.gather(self._reader, return_exceptions=True)  # the endpoint is closed
            await self._sender.aclose()

    def abort(self) -> None:
        """Close at once; pending calls fail with :class:`ClosedResourceError`."""
        self._closed = True
        self.endpoint.abort()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _tell(ref: weakref.ref[StreamCall] | None, ev: proto.RpcEvent | None) -> None:
    """Pass a stream call's Data or Credit, or its end (None), to it if it is still there (a
    function: the client's reader keeps no reference that would keep it alive)."""
    call = None if ref is None else ref()
    if call is not None:
        call._on_event(ev)


async def connect(host: str, port: int, *, timeout: float = 10.0, max_in_flight: int = 64,
                  config: Config | None = None, device: str | Device | None = None,
                  secret: bytes | None = None) -> RpcClient:
    """Connect to an :func:`serve`\\ d service.

    Args:
        max_in_flight: the most calls outstanding at once (1..1024); more callers wait.
        timeout, config, device, secret: as :func:`aiordma.connect`.
    """
    check_int(max_in_flight, name="max_in_flight", low=1, high=MAX_CALLS)
    ep = await _connect_endpoint(host, port, timeout=timeout, config=config, device=device,
                                 secret=secret)
    return RpcClient(ep, max_in_flight)
