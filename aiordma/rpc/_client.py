"""The RPC layer's client: :class:`RpcClient`, one connection to an
:class:`~aiordma.rpc.RpcServer`, and :func:`connect`, which makes one. The wire is
:mod:`aiordma.protocols.rpc`; stream calls are :mod:`aiordma.rpc._stream`'s
:class:`~aiordma.rpc._stream.StreamCall`; interceptors and the deadline a call inherits from
the call being served are :mod:`aiordma.rpc._context`'s."""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Self

from aiordma._args import check_int, check_seconds
from aiordma._device.device import Device
from aiordma._endpoint.config import Config
from aiordma._endpoint.connect import connect as _connect_endpoint
from aiordma._errors import (
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    LocalProtocolError,
    OperationTimeout,
    again,
    from_protocol_error,
)
from aiordma._places import Places
from aiordma._verbs.compiled import rpc_connection
from aiordma.protocols import rpc as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.errors import RemoteProtocolError as _WireRemoteError
from aiordma.rpc._context import (
    ClientCall,
    ClientInterceptor,
    _current,
    call_deadline,
    check_interceptors,
    check_metadata,
    run_chain,
)
from aiordma.rpc._sender import Sender
from aiordma.rpc._service import (
    DEADLINE_EXPIRED,
    MAX_CALLS,
    MAX_TIMEOUT,
    RemoteError,
    _check_channel,
    remote_error,
)
from aiordma.rpc._stream import DEFAULT_WINDOW, StreamCall, weak
from aiordma.transport import MessageChannel, ReadyChannel

__all__ = ["Answer", "RpcClient", "connect"]


class Answer(NamedTuple):
    """What :meth:`RpcClient.call_with_metadata` returns: the method's ``result`` and the
    answer's ``metadata`` (empty if the server sent none)."""

    result: Any
    metadata: dict[str, str | bytes]


class RpcClient:
    """A connection to an :class:`RpcServer`. ``await client.call("name", *args)`` or
    ``await client.name(*args)``. Use as ``async with``; ``aclose()`` and ``abort()`` fail
    pending calls with :class:`ClosedResourceError`.

    A call holds one of ``max_in_flight`` places from sending its request until its answer
    arrives, also after its caller gave up (the server always answers, a cancelled call too):
    so the client never sends more calls than the server accepts.

    ``interceptors`` wrap every call (see :mod:`aiordma.rpc._context`): each is
    ``async def interceptor(call: ClientCall, proceed)``, the first the outermost.
    """

    def __init__(self, ep: MessageChannel, max_in_flight: int, *,
                 interceptors: Sequence[ClientInterceptor] = ()) -> None:
        _check_channel(ep, "RpcClient()")
        check_int(max_in_flight, name="max_in_flight", low=1, high=MAX_CALLS)
        self._interceptors = check_interceptors(interceptors)
        self.endpoint = ep
        self.max_in_flight = max_in_flight
        self._conn = rpc_connection()(proto.Role.CLIENT, peer_max_in_flight=max_in_flight)
        self._sender = Sender(ep, self._conn.max_message, self._send_failed)
        self._places = Places(max_in_flight)
        self._waiting: dict[int, asyncio.Future[Any]] = {}  # each holds a place
        self._streams: dict[int, weakref.ref[StreamCall]] = {}  # stream calls not answered
        self._failure: AiordmaError | None = None
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._handoff: asyncio.Future[None] | None = None  # the reader sleeps (see _read)
        self._reader = self._loop.create_task(self._read())

    @property
    def closed(self) -> bool:
        """This client was closed (:meth:`aclose`, :meth:`abort`)."""
        return self._closed

    @property
    def transport(self) -> str:
        """What carries this client's connection: ``"rdma"``, ``"tcp"`` or ``"memory"`` (its
        channel's ``transport``)."""
        return str(getattr(self.endpoint, "transport", "unknown"))

    @property
    def interceptors(self) -> tuple[ClientInterceptor, ...]:
        """The interceptors that wrap every call, the first the outermost."""
        return self._interceptors

    async def call(self, name: str, *args: Any, timeout: float | None = None,
                   metadata: dict[str, str | bytes] | None = None, **kwargs: Any) -> Any:
        """Call ``name`` remotely; its result, or :class:`RemoteError`.

        ``timeout`` bounds the whole call: waiting for a place among ``max_in_flight``, sending
        and the answer. What is left of it when the request goes out travels as its deadline.
        Inside a method that serves a call, the call also ends no later than that call's
        deadline (it inherits what is left of it; see
        :func:`~aiordma.rpc.ignore_caller_deadline`). ``metadata`` travels with the request
        (keys of ``0-9 a-z _ . -``, ``str`` or ``bytes`` values; the method reads them with
        :func:`~aiordma.rpc.current_call`); :meth:`call_with_metadata` also returns the
        answer's.

        Raises:
            OperationTimeout: ``timeout`` or the inherited deadline expired (the server's task
                is cancelled).
            RemoteError: the method raised (``type_name``, ``message``; ``metadata``, the
                answer's); :class:`~aiordma.rpc.Unavailable`: the server refused the call
                without running the method (it is draining).
            ClosedResourceError: this client was closed.
            BrokenResourceError: the connection broke, or the server closed it.
            RemoteProtocolError: the server broke the protocol (the connection is closed).
            LocalProtocolError: an argument or the metadata cannot be sent.
        """
        if timeout is None and not self._interceptors and type(name) is str:
            ctx = _current.get(None)
            if ctx is None or ctx.deadline is None:
                # The common call (no bound of its own or inherited, no interceptors):
                # what _deadline and _exchange do for it, in this frame (a coroutine and
                # five Python calls less per call).
                if self._places.try_take():
                    call_id, answer = self._send_call(name, args, kwargs, None, metadata)
                else:
                    self._check_usable()
                    call_id, answer = await self._open_call(name, args, kwargs, None, None,
                                                            metadata)
                try:
                    return (await answer).result
                except asyncio.CancelledError:
                    self._give_up(call_id, answer)
                    raise
        deadline, timeout = self._deadline(name, timeout)
        if self._interceptors:
            return (await self._intercepted(name, args, kwargs, deadline, timeout,
                                            metadata)).result
        return (await self._exchange(name, args, kwargs, deadline, timeout, metadata)).result

    async def call_with_metadata(self, name: str, *args: Any, timeout: float | None = None,
                                 metadata: dict[str, str | bytes] | None = None,
                                 **kwargs: Any) -> Answer:
        """:meth:`call`, returning the answer's metadata too::

            result, answer_metadata = await client.call_with_metadata(
                "get", key, metadata={"request-id": rid})

        (the pair is an :class:`Answer`). The metadata of an error answer is the
        :class:`RemoteError`'s ``metadata``.

        Raises:
            AiordmaError: as :meth:`call`.
        """
        deadline, timeout = self._deadline(name, timeout)
        ev = await self._answer(name, args, kwargs, deadline, timeout, metadata)
        return Answer(ev.result, ev.metadata or {})

    async def _answer(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      deadline: float | None, timeout: float | None,
                      metadata: dict[str, str | bytes] | None) -> Any:
        """A call through this client's interceptors, if it has any; its answer (an event
        with ``result`` and ``metadata``). (A pool's attempt ends here, after its own
        interceptors.)"""
        if self._interceptors:
            return await self._intercepted(name, args, kwargs, deadline, timeout, metadata)
        return await self._exchange(name, args, kwargs, deadline, timeout, metadata)

    def _deadline(self, name: Any, timeout: Any) -> tuple[float | None, float | None]:
        """A call's checks; its deadline (loop time: its own timeout, or the deadline it
        inherits if earlier) and its timeout for the messages (None once inherited). (Its
        metadata is checked where its request is built, before anything is sent.)

        Raises:
            LocalProtocolError: a bad name or timeout.
            ClosedResourceError, BrokenResourceError: this client cannot call any more.
        """
        if not isinstance(name, str):
            raise LocalProtocolError(f"a method name is a str, not {name!r:.80}")
        if timeout is not None:  # (0: a bound already spent: OperationTimeout at once)
            check_seconds(timeout, none_ok=True, zero_ok=True, high=MAX_TIMEOUT)
        deadline, timeout = call_deadline(timeout)
        self._check_usable()
        return deadline, timeout

    async def _intercepted(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                           deadline: float | None, timeout: float | None,
                           metadata: dict[str, str | bytes] | None) -> Any:
        """:meth:`_exchange` inside the interceptors' chain; a Response event of what the
        outermost interceptor returned and the answer's metadata (as they left them)."""
        call = ClientCall(name, args, kwargs, dict(check_metadata(metadata) or {}), deadline,
                          False)
        result = await run_chain(self._interceptors, call,
                                 lambda: self._chain_end(call, timeout, own=False))
        return proto.Response(id=0, result=result, metadata=call.answer_metadata)

    async def _chain_end(self, call: ClientCall, timeout: float | None, *, own: bool) -> Any:
        """The end of a chain of interceptors: ``call`` as they left it, sent; its result,
        with ``call.answer_metadata`` set (from the answer or its RemoteError). ``own``: the
        chain was a pool's, so this client's own interceptors (if any) run now."""
        md = check_metadata(call.metadata)
        try:
            if own:
                ev = await self._answer(call.method, call.args, call.kwargs, call.deadline,
                                        timeout, md)
            else:
                ev = await self._exchange(call.method, call.args, call.kwargs, call.deadline,
                                          timeout, md)
        except RemoteError as exc:
            call.answer_metadata = exc.metadata
            raise
        call.answer_metadata = ev.metadata or {}
        return ev.result

    async def _exchange(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                        deadline: float | None, timeout: float | None,
                        metadata: dict[str, str | bytes] | None) -> Any:
        """Send the request and wait for its answer until ``deadline`` (loop time); the
        Response event. ``timeout``: the caller's, for the messages (None: the deadline was
        inherited)."""
        if self._places.try_take():  # (a free place is taken without suspending)
            call_id, answer = self._send_call(name, args, kwargs, deadline, metadata)
        else:
            call_id, answer = await self._open_call(name, args, kwargs, deadline, timeout,
                                                    metadata)
        try:
            if deadline is None:
                return await answer
            # The deadline fails the answer itself (asyncio.timeout_at would cancel this task
            # and take it back: five times the cost, 7.7 us of a call on the host).
            loop = self._loop  # (a deadline passed already expires first thing, as in asyncio)
            timer = (loop.call_at(deadline, _expire, answer) if deadline > loop.time()
                     else loop.call_soon(_expire, answer))
            try:
                return await answer
            finally:
                timer.cancel()
        except _Expired:
            self._give_up(call_id, answer)
            raise OperationTimeout(f"{name}() took longer than {_bound(timeout)}") from None
        except asyncio.CancelledError:
            self._give_up(call_id, answer)
            raise

    async def _open_call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                         deadline: float | None, timeout: float | None,
                         metadata: dict[str, str | bytes] | None, *,
                         stream: StreamCall | None = None,
                         frames: Callable[[int], list[bytes | memoryview]] | None = None
                         ) -> tuple[int, asyncio.Future[Any]]:
        """Take a place among ``max_in_flight`` (waiting until ``deadline``), then
        :meth:`_send_call`; its id and the future of its answer (the Response event).

        Raises:
            OperationTimeout: no place became free before ``deadline``.
            AiordmaError: as :meth:`_send_call`.
        """
        if not self._places.try_take():  # (a free place is taken without suspending)
            await self._take_place(name, deadline, timeout)
        return self._send_call(name, args, kwargs, deadline, metadata, stream=stream,
                               frames=frames)

    def _send_call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   deadline: float | None, metadata: dict[str, str | bytes] | None, *,
                   stream: StreamCall | None = None,
                   frames: Callable[[int], list[bytes | memoryview]] | None = None
                   ) -> tuple[int, asyncio.Future[Any]]:
        """The one place a request is sent (calls, stream calls, and so the pool's calls), in
        a place among ``max_in_flight`` that the caller took (:meth:`_open_call`): build the
        request (what is left of the deadline travels with it), register its answer, send
        it. A stream call's request goes with ``frames(call_id)`` (its first credits, its
        End), in one message when they fit. Its id and the future of its answer (the
        Response event).

        The place is the call's until its answer arrives or the connection ends, and is given
        back if the request cannot go. The request leaves at once if it is the only call in
        flight, else at the end of this tick with the tick's other frames; a send that fails
        aborts the connection, and the reader then fails the answer. (A caller cancelled
        while awaiting the answer cancels it: the reader then just frees the place when the
        answer comes.)

        Raises:
            LocalProtocolError: an argument or the metadata cannot be sent.
            ClosedResourceError, BrokenResourceError: this client cannot call any more.
        """
        loop = self._loop
        try:
            self._check_usable()
            # rounded up: the server must never give up before the caller does
            left = None if deadline is None else max(0, math.ceil((deadline - loop.time()) * 1000))
            call_id, request = self._conn.send_request(name, tuple(args), kwargs, left,
                                                       stream is not None, metadata)
        except ProtocolError as exc:
            self._places.give()
            raise from_protocol_error(exc, "rpc") from exc
        except BaseException:
            self._places.give()
            raise
        answer: asyncio.Future[Any] = loop.create_future()
        waiting = self._waiting
        waiting[call_id] = answer
        alone = len(waiting) == 1
        sender = self._sender
        if stream is None:
            sender.put(request, alone=alone)
            return call_id, answer
        self._streams[call_id] = weak(stream)
        more = frames(call_id) if frames is not None else []
        if len(request) == 1 and len(request[0]) + sum(map(len, more)) <= sender.outbox.limit:
            sender.put([proto.join([request[0], *more])], alone=alone)  # type: ignore[list-item]
        else:
            sender.put(request, alone=alone)
            for frame in more:
                sender.put([frame])
        return call_id, answer

    async def _take_place(self, name: str, deadline: float | None,
                          timeout: float | None) -> None:
        """Wait for a place among ``max_in_flight`` until ``deadline`` (after ``try_take()``
        found none)."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._places.take()
        except TimeoutError:
            raise OperationTimeout(f"{name}(): no free place among {self.max_in_flight} "
                                   f"calls in flight within {_bound(timeout)}") from None

    def stream(self, name: str, *args: Any, timeout: float | None = None,
               window: int = DEFAULT_WINDOW, metadata: dict[str, str | bytes] | None = None,
               **kwargs: Any) -> StreamCall:
        """Call ``name``, a method that yields, and read what it yields::

            async for row in client.stream("rows", 100, timeout=30):
                ...
            async with client.stream("rows", 100) as rows:   # ends the call on leaving
                async for row in rows:
                    if done(row):
                        break                                   # the server stops

        The call starts when first used. At most ``window`` items travel ahead of what the
        caller has read (the server's generator waits meanwhile). ``timeout`` bounds the whole
        call (and it inherits the deadline of the call being served, as :meth:`call` does).
        ``metadata`` travels with the request; the answer's is ``StreamCall.answer_metadata``
        once the call ended. See :class:`StreamCall`.

        Raises:
            LocalProtocolError: ``name``, ``timeout``, ``window`` or ``metadata`` is not valid
                (at once); an argument cannot be sent (when the call starts).
        """
        return self._stream_call(name, args, kwargs, timeout, window, metadata, sends=False)

    def stream_call(self, name: str, *args: Any, timeout: float | None = None,
                    window: int = DEFAULT_WINDOW, metadata: dict[str, str | bytes] | None = None,
                    **kwargs: Any) -> StreamCall:
        """Call ``name``, a method that takes an :class:`RpcStream`, and send it items
        (client streaming, or bidirectional if it also yields)::

            async with client.stream_call("upload", "name") as call:
                for chunk in chunks:
                    await call.send(chunk)        # waits while the server's window is full
                await call.send_eof()
                size = await call.result()        # what the method returned

        ``window``, ``timeout`` and ``metadata`` as for :meth:`stream`. See
        :class:`StreamCall`.
        """
        return self._stream_call(name, args, kwargs, timeout, window, metadata, sends=True)

    def _stream_call(self, name: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     timeout: Any, window: Any, metadata: Any, sends: bool) -> StreamCall:
        if not isinstance(name, str):
            raise LocalProtocolError(f"a method name is a str, not {name!r:.80}")
        check_seconds(timeout, none_ok=True, zero_ok=True, high=MAX_TIMEOUT)
        check_int(window, name="window", low=1, high=proto.MAX_CREDIT)
        return StreamCall(self, self._conn, self._sender, name, args, kwargs, timeout, window,
                          sends, check_metadata(metadata))

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
        """The connection's reader: every answer (and a stream call's Data and Credit) from
        the channel, until it ends; then fail what still waits. Over a
        :class:`~aiordma.transport.ReadyChannel` the messages are taken in the channel's
        wake-up (:meth:`_on_readable`) and this task only reads what needs ``recv()``: the
        end, a failure, a message still to be read."""
        exc: AiordmaError = BrokenResourceError("the server closed the connection")
        ep = self.endpoint
        ready = isinstance(ep, ReadyChannel)
        try:
            while True:
                if ready:
                    self._handoff = handoff = self._loop.create_future()
                    self._on_readable()
                    await handoff
                if (msg := await ep.recv()) is None:
                    break
                self._received(msg)
        except ProtocolError as e:
            exc = from_protocol_error(e, "rpc")
            self.endpoint.abort()
        except AiordmaError as e:
            exc = e
        finally:
            self._handoff = None  # (a callback still armed finds nobody)
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

    def _on_readable(self) -> None:
        """The channel's wake-up (a :class:`~aiordma.transport.ReadyChannel`): take every
        message it has ready, then sleep until the next one, or hand what is next to the
        reader task (``recv()``)."""
        handoff = self._handoff
        if handoff is None or handoff.done():
            return  # the reader task reads, or ended
        ep = self.endpoint
        try:
            while (msg := ep.recv_nowait()) is not None:  # type: ignore[attr-defined]
                self._received(msg)
            if not ep.call_when_readable(self._on_readable):  # type: ignore[attr-defined]
                handoff.set_result(None)
        except Exception as e:  # noqa: BLE001  # (a ProtocolError: the reader ends it)
            handoff.set_exception(e)

    def _received(self, msg: bytearray) -> None:
        """One message from the server: its answers complete their callers' futures."""
        conn = self._conn
        conn.receive_message(msg)
        answered = 0
        while (ev := conn.next_event()) is not proto.NEED_DATA:
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
                    answer.set_result(ev)  # (its result and its metadata)
                elif ev.type == DEADLINE_EXPIRED:  # type: ignore[union-attr]
                    # the server's clock ran out first
                    answer.set_exception(OperationTimeout(ev.message))  # type: ignore[union-attr]
                else:
                    answer.set_exception(remote_error(
                        ev.type, ev.message, ev.metadata))  # type: ignore[union-attr]
            if ref is not None:  # a stream call, whose reader may never ask
                if not answer.cancelled():
                    answer.exception()  # (marks an exception as retrieved)
                _tell(ref, ev)

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
                  secret: bytes | None = None,
                  interceptors: Sequence[ClientInterceptor] = (),
                  transport: str = "auto") -> RpcClient:
    """Connect to an :func:`serve`\\ d service.

    Args:
        max_in_flight: the most calls outstanding at once (1..1024); more callers wait.
        interceptors: async middleware around every call, the first the outermost:
            ``async def interceptor(call: ClientCall, proceed)`` (see
            :mod:`aiordma.rpc._context`).
        transport: ``"auto"`` (default), ``"rdma"`` or ``"tcp"``, as :func:`aiordma.connect`;
            calls, streams and metadata work the same over either (:attr:`RpcClient.transport`
            says which was chosen).
        timeout, config, device, secret: as :func:`aiordma.connect`.
    """
    check_int(max_in_flight, name="max_in_flight", low=1, high=MAX_CALLS)
    interceptors = check_interceptors(interceptors)
    ep = await _connect_endpoint(host, port, timeout=timeout, config=config, device=device,
                                 secret=secret, transport=transport)
    return RpcClient(ep, max_in_flight, interceptors=interceptors)


class _Expired(Exception):
    """A call's deadline passed before its answer came (see ``RpcClient._exchange``)."""


def _expire(answer: asyncio.Future[Any]) -> None:
    if not answer.done():
        answer.set_exception(_Expired())


def _bound(timeout: float | None) -> str:
    """How a call's bound is named in its timeout's message."""
    return "the deadline inherited from the call being served" if timeout is None else (
        f"{timeout} s")
