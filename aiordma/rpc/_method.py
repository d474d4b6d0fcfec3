"""A method as an RPC server runs it: :class:`ServedMethod` (the bound function, how it runs,
its ``max_concurrency`` and its counters), admission (a method's limit, then a place among
its connection's ``max_in_flight``), the caller's deadline, and the error answers
(:mod:`aiordma.rpc._server` drives them per connection)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from aiordma._bound import TaskBound
from aiordma._places import Places
from aiordma.protocols import rpc as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.rpc._context import CallContext
from aiordma.rpc._stats import MethodStats
from aiordma.rpc._stream import StreamKind

__all__ = ["Expired", "NamedError", "ServedMethod", "admitted", "as_async", "error_answer",
           "limited", "within_deadline"]


def error_answer(conn: proto.RpcConnection, call_id: int, exc: BaseException,
                 metadata: dict[str, str | bytes] | None = None) -> list[bytes | memoryview]:
    """The error answer for ``exc`` (the type name of a :class:`NamedError` is its own),
    with ``metadata`` if it can be sent."""
    type_name = (exc.type_name if isinstance(exc, NamedError)
                 else type(exc).__name__[:proto.MAX_NAME] or "Exception")
    try:
        text = str(exc)[:4000]
    except Exception:  # noqa: BLE001  # a broken __str__ must not lose the answer
        text = "(unprintable)"
    try:
        return conn.send_error(call_id, type_name, text, metadata)
    except ProtocolError:  # the answer's metadata is bad (the error says so), or the text is
        try:
            return conn.send_error(call_id, type_name, text)
        except ProtocolError:  # e.g. a lone surrogate in the message
            return conn.send_error(call_id, type_name, "(unprintable)")


class NamedError(Exception):
    """An error answer whose type name is given (the server's own: a deadline, a refusal)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


async def admitted(places: Places, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    """``await fn(*args, **kwargs)`` in one of ``places``, waiting for one if none is free."""
    if not places.try_take():
        await places.take()
    try:
        return await fn(*args, **kwargs)
    finally:
        places.give()


def limited(limit: Places | None, places: Places | None, fn: Callable[..., Awaitable[Any]],
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Awaitable[Any]:
    """:func:`admitted` among ``places`` (the connection's; None: at once), after a place
    among ``limit`` (a method's ``max_concurrency``, if any): a call waiting for its method's
    limit holds no place of its connection."""
    if places is None:
        return fn(*args, **kwargs) if limit is None else admitted(limit, fn, args, kwargs)
    if limit is None:
        return admitted(places, fn, args, kwargs)
    return admitted(limit, admitted, (places, fn, args, kwargs), {})


class Expired(Exception):
    """The caller's deadline passed at the server (answered ``DEADLINE_EXPIRED``)."""


class ServedMethod:
    """A method as this server runs it: the bound function, how it runs, its limit and
    counters. ``inline``: a plain ``def`` that runs as its request is read (only without
    interceptors); ``awaits``: an ``async def``; ``simple``: an ``async def`` of the service
    without a limit, on a server without interceptors (the unary hot path). A built-in takes
    no place among its connection's ``max_in_flight``: it answers at once, also behind busy
    methods (and while the server drains)."""

    __slots__ = ("acall", "awaits", "builtin", "fn", "inline", "limit", "max_concurrency",
                 "simple", "stats", "stream")

    def __init__(self, fn: Callable[..., Any], stream: StreamKind | None,
                 max_concurrency: int | None, builtin: bool, intercepted: bool) -> None:
        self.fn = fn
        self.stream = stream
        self.awaits = inspect.iscoroutinefunction(fn)
        self.acall: Callable[..., Awaitable[Any]] = fn if self.awaits else as_async(fn)
        self.inline = stream is None and not self.awaits and not intercepted
        self.max_concurrency = max_concurrency
        self.limit = None if max_concurrency is None else Places(max_concurrency)
        self.simple = self.awaits and self.limit is None and not intercepted and not builtin
        self.builtin = builtin
        self.stats = MethodStats()

    def snapshot(self) -> dict[str, Any]:
        limit, most = self.limit, self.max_concurrency
        if limit is None or most is None:
            return self.stats.snapshot()
        waiting = sum(not w.done() for w in limit.waiters)
        # (a place handed to a waiter that has not resumed yet counts as running)
        return self.stats.snapshot(most, waiting, most - limit.free)


async def within_deadline(req: proto.Request, ctx: CallContext,
                          run: Callable[[], Awaitable[Any]]) -> Any:
    """``await run()`` within the caller's deadline (none: unbounded), which ``ctx`` then
    carries (loop time, for :func:`~aiordma.rpc.current_call` and the calls the method makes).

    Raises:
        Expired: the deadline passed. A method's own timeout, or any other failure,
            propagates as it is.
    """
    if req.deadline_ms is None:
        return await run()
    loop = asyncio.get_running_loop()
    ctx.deadline = loop.time() + req.deadline_ms / 1000
    task = asyncio.current_task()
    if task is None:  # (not in a task: asyncio.timeout_at cannot bound it either)
        return await run()
    bound = TaskBound(loop, task, ctx.deadline if req.deadline_ms > 0 else None)
    try:
        return await run()
    except asyncio.CancelledError:
        if bound.expired():  # the deadline's own cancellation
            raise Expired from None
        raise
    finally:
        bound.close()


def as_async(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    async def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return call

