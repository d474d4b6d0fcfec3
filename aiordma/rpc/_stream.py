"""Stream calls in the RPC layer: the client's :class:`StreamCall`, the server's
:class:`RpcStream`, and running a streaming method on the server.

The wire is :mod:`aiordma.protocols.rpc._stream` (items both ways under per-stream credits,
until the call's answer); this module drives it. Flow control follows what each side reads:
a receiver grants its window (``window`` items) when the stream starts and grants again as its
application takes items (half a window at a time), so what it holds never exceeds the
window, and a producer waits when the consumer's window is full. On the server, a generator
method is resumed only when the client has room for its next item: it is never more than
``window`` items ahead of the client's reader.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import typing
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

from aiordma._errors import (
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    LocalProtocolError,
    OperationTimeout,
    again,
    from_protocol_error,
)
from aiordma.protocols import rpc as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.rpc._context import ClientCall, check_metadata, run_chain
from aiordma.rpc._sender import Sender

__all__ = ["DEFAULT_WINDOW", "RpcStream", "ServerStream", "StreamCall", "StreamKind",
           "run_stream", "stream_kind"]

T = TypeVar("T")

DEFAULT_WINDOW = 16
"""Items a receiver lets its peer send ahead of what it has read, unless told otherwise."""

_STREAM_ANNOTATION = re.compile(r"^(?:[\w.]+\.)?RpcStream(?:\[.*\])?$")


# -- what a method streams ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamKind:
    """How a streaming method streams: ``generator``, it yields items to the client (an
    ``async def`` with ``yield``); ``param``, the name of its parameter that receives the
    client's items (annotated :class:`RpcStream`), or None."""

    generator: bool
    param: str | None


def stream_kind(fn: Callable[..., Any]) -> StreamKind | None:
    """What ``fn`` streams, or None for a unary method (checked by :func:`aiordma.rpc.method`).

    Raises:
        LocalProtocolError: more than one parameter is an :class:`RpcStream`, it cannot be
            passed by keyword, or ``fn`` takes one without being an ``async def``.
    """
    params = [p for p in inspect.signature(fn).parameters.values() if _is_stream(p.annotation)]
    if len(params) > 1:
        raise LocalProtocolError(f"{fn.__qualname__}: one parameter may receive the client's "
                                 f"items, not {len(params)}")
    param = params[0] if params else None
    if param is not None and param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
        raise LocalProtocolError(f"{fn.__qualname__}: the RpcStream parameter {param.name!r} "
                                 f"must be one that can be passed by keyword")
    generator = inspect.isasyncgenfunction(fn)
    if param is not None and not (generator or inspect.iscoroutinefunction(fn)):
        raise LocalProtocolError(f"{fn.__qualname__}: a method that reads the client's items "
                                 f"is an async def")
    if not generator and param is None:
        return None
    return StreamKind(generator, None if param is None else param.name)


def _is_stream(annotation: Any) -> bool:
    if isinstance(annotation, str):  # (``from __future__ import annotations``)
        return bool(_STREAM_ANNOTATION.match(annotation.strip()))
    return annotation is RpcStream or typing.get_origin(annotation) is RpcStream


# -- waiting -------------------------------------------------------------------------------------


class _Wakeup:
    """Tasks waiting for something to change; :meth:`fire` wakes them all (each checks again)."""

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    async def wait(self, deadline: float | None = None) -> None:
        """Until :meth:`fire`; TimeoutError at ``deadline`` (loop time)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            if deadline is None:
                await fut
            else:
                async with asyncio.timeout_at(deadline):
                    await fut
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def fire(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


class _Inbox:
    """Items received on one stream, held for the reader, and the credits returned as it reads
    (half the window at a time; ``can_grant`` says whether the protocol still takes them)."""

    __slots__ = ("conn", "id", "items", "owed", "regrant", "sender", "wakeup")

    def __init__(self, conn: proto.RpcConnection, sender: Sender, call_id: int,
                 window: int) -> None:
        self.conn, self.sender, self.id = conn, sender, call_id
        self.items: deque[Any] = deque()
        self.owed = 0
        self.regrant = max(1, window // 2)
        self.wakeup = _Wakeup()

    def take(self, can_grant: bool) -> Any:
        item = self.items.popleft()
        self.owed += 1
        if self.owed >= self.regrant and can_grant:
            self.sender.put(self.conn.send_credit(self.id, self.owed))
            self.owed = 0
        return item


# -- the server's side ------------------------------------------------------------------------


class RpcStream(Generic[T]):
    """The client's items in a stream call, as a method receives them: ``async for item in
    stream`` (or ``await anext(stream)``), ending when the client calls
    :meth:`StreamCall.send_eof`.

    Declare it as a parameter of a :func:`~aiordma.rpc.method`, annotated ``RpcStream`` (or
    ``RpcStream[T]``); the client calls such a method with
    :meth:`~aiordma.rpc.RpcClient.stream_call`. The client can send at most the server's
    ``stream_window`` items ahead of what the method has read. A method that stops reading
    leaves the client's :meth:`StreamCall.send` waiting until the call ends.
    """

    def __init__(self, inbox: _Inbox, ended: bool) -> None:
        self._inbox = inbox
        self._ended = ended

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        inbox = self._inbox
        while not inbox.items:
            if self._ended:
                raise StopAsyncIteration
            await inbox.wakeup.wait()  # bounded by the call's deadline (the task's)
        # (credit only while the client's items have not ended: the protocol takes none after)
        return inbox.take(inbox.conn.stream_state(inbox.id) is proto.StreamState.OPEN)  # type: ignore[no-any-return]

    def _end(self) -> None:
        self._ended = True
        self._inbox.wakeup.fire()


class ServerStream:
    """A stream call being served: its credits and the client's items (see :func:`run_stream`)."""

    __slots__ = ("conn", "id", "inbound", "sender", "wakeup")

    def __init__(self, conn: proto.RpcConnection, sender: Sender, call_id: int) -> None:
        self.conn, self.sender, self.id = conn, sender, call_id
        self.inbound: RpcStream[Any] | None = None
        self.wakeup = _Wakeup()  # a credit came

    def on_event(self, ev: proto.RpcEvent) -> None:
        """A Data, Credit or End the client sent for this call."""
        if type(ev) is proto.Credit:
            self.wakeup.fire()
        elif self.inbound is not None:
            if type(ev) is proto.Data:
                self.inbound._inbox.items.append(ev.value)
                self.inbound._inbox.wakeup.fire()
            else:
                self.inbound._end()

    def open_inbound(self, window: int) -> RpcStream[Any]:
        """The method's :class:`RpcStream`, with the client's first credits granted."""
        ended = self.conn.stream_state(self.id) is not proto.StreamState.OPEN
        self.inbound = RpcStream(_Inbox(self.conn, self.sender, self.id, window), ended)
        if not ended:
            self.sender.put(self.conn.send_credit(self.id, window))
        return self.inbound

    async def send(self, item: Any) -> None:
        """Send the next item once the client has room for it (a Cancel cancels the task)."""
        conn = self.conn
        while conn.stream_credit(self.id) < 1:
            await self.wakeup.wait()
        if conn.stream_state(self.id) is proto.StreamState.CANCELLED:
            raise asyncio.CancelledError  # (its task's cancel is on its way)
        self.sender.put(conn.send_data(self.id, item))


async def run_stream(streams: dict[int, ServerStream], conn: proto.RpcConnection,
                     sender: Sender, req: proto.Request, args: tuple[Any, ...],
                     kwargs: dict[str, Any], fn: Callable[..., Any], kind: StreamKind,
                     window: int) -> Any:
    """Run a streaming method for ``req`` with ``args`` and ``kwargs`` (the request's, or
    what an interceptor made of them): its items go out as the client grants room (the
    generator is resumed only then); returns what the call answers (None for a generator).
    The caller bounds it (deadline) and turns exceptions into the answer."""
    call = ServerStream(conn, sender, req.id)
    streams[req.id] = call
    try:
        if kind.param is not None:
            if kind.param in kwargs:
                raise TypeError(f"{req.method}(): {kind.param!r} receives the client's items, "
                                f"not an argument")
            kwargs = {**kwargs, kind.param: call.open_inbound(window)}
        if not kind.generator:
            return await fn(*args, **kwargs)
        items: AsyncIterator[Any] = fn(*args, **kwargs)
        try:
            while True:
                while conn.stream_credit(req.id) < 1:  # room first: never ahead of the window
                    await call.wakeup.wait()
                try:
                    item = await items.__anext__()
                except StopAsyncIteration:
                    return None
                await call.send(item)
        finally:
            await items.aclose()  # type: ignore[attr-defined]  # (its finally blocks run now)
    finally:
        del streams[req.id]


# -- the client's side ------------------------------------------------------------------------


class StreamCall:
    """A stream call from the client: made by :meth:`~aiordma.rpc.RpcClient.stream` (the
    server's items only) or :meth:`~aiordma.rpc.RpcClient.stream_call` (items both ways).

    ``async for item in call`` reads the server's items (``await anext(call)`` one at a time);
    :meth:`send` and :meth:`send_eof` send the client's; :meth:`result` is the method's answer.
    The call starts (its request leaves) at the first of these, or on entering
    ``async with``. Leaving ``async with`` or :meth:`aclose` ends it: if it is still running,
    the server's method is cancelled. A call that is dropped while running (e.g. after
    ``break`` out of ``async for`` without ``async with``) is cancelled too, when it is garbage
    collected.

    The call's ``timeout`` bounds all of it: past it, every operation raises
    :class:`~aiordma.OperationTimeout` and the server's method is cancelled (its own clock
    runs out too). Cancelling a task that waits in one operation leaves the call as it was.
    """

    def __init__(self, client: Any, conn: proto.RpcConnection, sender: Sender, name: str,
                 args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None,
                 window: int, sends: bool, metadata: dict[str, str | bytes] | None = None
                 ) -> None:
        # The client sends the request and gives the call up (RpcClient._open_call,
        # _give_up); the call's items and credits go through its connection and sender.
        self._client = client
        self._conn = conn
        self._sender = sender
        self._name, self._args, self._kwargs = name, args, kwargs
        self._metadata = metadata
        self._timeout, self._window = timeout, window
        self._eof = not sends  # the client sends no (more) items
        self._sends = sends
        self._id = -1
        self._answer: asyncio.Future[Any] | None = None
        self._opening: asyncio.Future[None] | None = None
        self._closed = False
        self._failure: AiordmaError | None = None  # the deadline passed
        self._deadline: float | None = None  # (loop time; from the first operation on)
        self._inbox: _Inbox | None = None
        self._wakeup = _Wakeup()

    # -- the API

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        """The server's next item.

        Raises:
            StopAsyncIteration: the call ended (the method returned).
            RemoteError: the method raised, after the items it sent before.
            OperationTimeout: the call's deadline passed.
            ClosedResourceError: this call (or its client) was closed.
            BrokenResourceError: the connection broke.
        """
        if self._answer is None:
            await self._open()
        inbox = typing.cast(_Inbox, self._inbox)  # (set by _open)
        while True:
            if self._closed or self._client.closed:  # (items that came are not handed out)
                raise ClosedResourceError(f"{self._name}(): the call or its client was closed")
            if inbox.items:
                return inbox.take(self._can_grant())
            self._check_end(StopAsyncIteration)
            await self._wait()

    async def send(self, item: Any) -> None:
        """Send ``item`` to the server's method; waits while the server's window is full.

        Raises:
            LocalProtocolError: ``item`` cannot travel (nothing is sent; the call goes on), or
                this call came from :meth:`~aiordma.rpc.RpcClient.stream` (it sends nothing).
            ClosedResourceError: after :meth:`send_eof` or :meth:`aclose`.
            BrokenResourceError: the server answered before taking it (see :meth:`result`),
                or the connection broke.
            RemoteError, OperationTimeout: the call failed.
        """
        if not self._sends:
            raise LocalProtocolError("a call made with stream() sends no items: use "
                                     "stream_call()")
        if self._answer is None:
            await self._open()
        conn = self._conn
        while True:
            if self._eof and not self._closed:
                raise ClosedResourceError("send_eof() was called: this call sends no more items")
            self._check_end(None)
            if conn.stream_credit(self._id) > 0:
                break
            await self._wait()
        try:
            msgs = conn.send_data(self._id, item)
        except ProtocolError as exc:
            raise from_protocol_error(exc, "rpc") from exc
        self._sender.put(msgs)

    async def send_eof(self) -> None:
        """Tell the server's method that no more items come (its ``async for`` ends).
        Idempotent; nothing to do once the call ended."""
        if self._answer is None:
            await self._open()
        conn = self._conn
        if not self._eof and conn.stream_state(self._id) is proto.StreamState.OPEN:
            self._sender.put(conn.send_end(self._id))
        self._eof = True

    async def result(self) -> Any:
        """The method's answer: what it returned (None for a method that yields), once the
        call ended. The server's items not read by then are read and dropped.

        Raises:
            RemoteError, OperationTimeout, ClosedResourceError, BrokenResourceError: as
                iterating does.
        """
        async for _ in self:
            pass
        return typing.cast(asyncio.Future[Any], self._answer).result().result

    @property
    def answer_metadata(self) -> dict[str, str | bytes]:
        """The metadata of the call's answer, once the call ended with one (empty before, and
        if the server sent none; an error answer's is also its ``RemoteError``'s)."""
        answer = self._answer
        if answer is None or not answer.done() or answer.cancelled():
            return {}
        exc = answer.exception()
        if exc is not None:
            return dict(getattr(exc, "metadata", {}))
        return answer.result().metadata or {}

    async def aclose(self) -> None:
        """End the call: if it is still running, the server's method is cancelled (its place
        among ``max_in_flight`` is free once the server confirms). Operations waiting on it
        raise :class:`ClosedResourceError`. Idempotent; returns at once."""
        if self._closed:
            return
        self._closed = True
        self._give_up()
        self._wakeup.fire()

    def __del__(self) -> None:
        # Dropped while running (no aclose): cancel it, as the server would otherwise keep a
        # generator waiting for room until its deadline. Synchronous, and only if possible.
        answer = getattr(self, "_answer", None)
        if answer is not None and not answer.done() and not self._closed:
            try:
                self._give_up()
            except Exception:  # noqa: BLE001, S110  # e.g. the loop is closed: nothing to do
                pass

    # -- internals

    def _can_grant(self) -> bool:
        return self._conn.stream_state(self._id) in _CLIENT_GRANTS

    def _give_up(self) -> None:
        answer = self._answer
        if answer is not None and not answer.done():
            self._client._give_up(self._id, answer)

    def _check_end(self, normal: type[BaseException] | None) -> None:
        """Raise why the call is over, if it is: ``normal`` when it ended with an answer."""
        if self._failure is not None:
            raise again(self._failure)
        answer = typing.cast(asyncio.Future[Any], self._answer)  # (the call started)
        if answer.done() and not answer.cancelled():
            exc = answer.exception()
            if exc is not None:
                raise again(exc) if isinstance(exc, AiordmaError) else exc
            if normal is not None:
                raise normal
            raise BrokenResourceError(f"{self._name}(): the server ended the call before "
                                      f"taking this item (its answer: result())")
        if self._closed or answer.done():
            raise ClosedResourceError(f"{self._name}(): the call was closed")

    async def _wait(self) -> None:
        """Until an item, a credit, the answer or a close comes; at the deadline, give up."""
        try:
            await self._wakeup.wait(self._deadline)
        except TimeoutError:
            self._expire()
            raise again(self._failure) from None  # type: ignore[arg-type]

    def _expire(self) -> None:
        if self._failure is None:
            self._failure = OperationTimeout(f"{self._name}(): the stream took longer than "
                                             f"{self._timeout} s")
            self._give_up()
            self._wakeup.fire()

    def _on_event(self, ev: proto.RpcEvent | None) -> None:
        """From the client's reader: a Data or a Credit for this call, or None: its answer
        came, or the connection ended."""
        if type(ev) is proto.Data and self._inbox is not None:
            self._inbox.items.append(ev.value)  # type: ignore[union-attr]
        self._wakeup.fire()

    async def _open(self) -> None:
        """Send the request (once): the call's first operation, or ``async with``."""
        if self._opening is not None:
            await self._opening  # another task is opening it
            return
        loop = asyncio.get_running_loop()
        opening = self._opening = loop.create_future()
        try:
            # its deadline: its own timeout from now, or the one it inherits if earlier
            self._deadline, timeout = self._client._deadline(self._name, self._timeout)
            interceptors = self._client.interceptors
            if interceptors:
                call = ClientCall(self._name, self._args, self._kwargs,
                                  dict(self._metadata or {}), self._deadline, True)
                await run_chain(interceptors, call,
                                lambda: self._send_intercepted(call, timeout))
            else:
                await self._send_request(timeout)
        except BaseException as exc:
            self._closed = True
            opening.set_exception(ClosedResourceError(f"{self._name}(): the call did not start: "
                                                      f"{exc!r:.200}"))
            opening.exception()  # (retrieved: only concurrent openers see it)
            raise
        opening.set_result(None)

    async def _send_intercepted(self, call: ClientCall, timeout: float | None) -> None:
        """The end of the interceptors' chain: the call as they left it, sent (once)."""
        if self._answer is not None:
            raise LocalProtocolError(f"{self._name}(): a stream call is opened once (an "
                                     f"interceptor proceeded twice)")
        self._name, self._args, self._kwargs = call.method, call.args, call.kwargs
        self._metadata, self._deadline = check_metadata(call.metadata), call.deadline
        await self._send_request(timeout)

    async def _send_request(self, timeout: float | None) -> None:
        if self._closed:
            raise ClosedResourceError(f"{self._name}(): the call was closed")
        conn, window, sends = self._conn, self._window, self._sends

        def frames(call_id: int) -> list[bytes | memoryview]:
            first = [*conn.send_credit(call_id, window)]
            return first if sends else first + conn.send_end(call_id)

        self._id, self._answer = await self._client._open_call(
            self._name, self._args, self._kwargs, self._deadline, timeout, self._metadata,
            stream=self, frames=frames)
        self._inbox = _Inbox(conn, self._sender, self._id, window)


_CLIENT_GRANTS = frozenset({proto.StreamState.OPEN, proto.StreamState.ENDED})


def weak(call: StreamCall) -> weakref.ref[StreamCall]:
    """How a client keeps its open stream calls: weakly, so a dropped one is collected (and
    cancelled by its ``__del__``)."""
    return weakref.ref(call)
