"""What a service is, on both sides of the RPC layer: :class:`Service`, the :func:`method`
marker, :func:`current_endpoint`, :class:`RemoteError` and the limits calls share
(:mod:`aiordma.rpc` is the public face; the server is :mod:`aiordma.rpc._server`, the client
:mod:`aiordma.rpc._client`)."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

from aiordma._args import check_bool, check_optional_int
from aiordma._errors import AiordmaError, LocalProtocolError
from aiordma.protocols import rpc as proto
from aiordma.rpc._stream import stream_kind
from aiordma.transport import MessageChannel

__all__ = ["DEADLINE_EXPIRED", "MAX_CALLS", "MAX_TIMEOUT", "UNAVAILABLE", "RemoteError",
           "Service", "Unavailable", "current_endpoint", "method", "remote_error"]

F = TypeVar("F", bound=Callable[..., Any])
_RPC_METHOD = "__aiordma_rpc_method__"
_RPC_STREAM = "__aiordma_rpc_stream__"  # a method's StreamKind (None: unary)
_RPC_IDEMPOTENT = "__aiordma_rpc_idempotent__"  # @method(idempotent=True): safe to run twice
_RPC_LIMIT = "__aiordma_rpc_max_concurrency__"  # a method's max_concurrency (None: no limit)
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
    """The remote method raised. ``type_name`` and ``message`` describe the remote exception;
    ``metadata`` is the answer's metadata (empty if the server sent none)."""

    def __init__(self, type_name: str, message: str,
                 metadata: dict[str, str | bytes] | None = None) -> None:
        super().__init__(type_name, message)
        self.type_name = type_name
        self.message = message
        self.metadata: dict[str, str | bytes] = {} if metadata is None else metadata

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


UNAVAILABLE = "aiordma.Unavailable"
"""The error type a server answers a call with when it did not run the method: the server is
draining or closing, or an interceptor refused the call with :class:`Unavailable` before
proceeding. (A name with a dot: no exception's own type name is it, so an ``Unavailable``
that a method lets through, from a service it called, does not pass for a refusal.)"""


class Unavailable(RemoteError):
    """The server refused the call without running its method: it is draining or closing, or
    an interceptor refused it (``type_name`` is :data:`UNAVAILABLE`). Safe to make again
    elsewhere, also for a method that is not idempotent.

    A server interceptor may raise it to refuse a call (before ``proceed()``): the caller
    then gets this class, and the server counts the call as refused."""

    def __init__(self, message: str = "the server is not taking calls",
                 metadata: dict[str, str | bytes] | None = None) -> None:
        super().__init__(UNAVAILABLE, message, metadata)


def remote_error(type_name: str, message: str,
                 metadata: dict[str, str | bytes] | None) -> RemoteError:
    """The exception for a call's error answer: :class:`Unavailable` for a refusal, else
    :class:`RemoteError`."""
    if type_name == UNAVAILABLE:
        return Unavailable(message, metadata)
    return RemoteError(type_name, message, metadata)


@overload
def method(fn: F, /) -> F: ...


@overload
def method(*, idempotent: bool = False,
           max_concurrency: int | None = None) -> Callable[[F], F]: ...


def method(fn: Any = None, /, *, idempotent: bool = False,
           max_concurrency: int | None = None) -> Any:
    r"""Mark a method of a :class:`Service` subclass as callable remotely: ``@method``, or
    ``@method(idempotent=True, max_concurrency=N)``.

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

    ``@method(idempotent=True)`` declares that running a call twice has the effect of running
    it once (a read, a put of a value, a delete): the server advertises such methods in its
    built-in health answer, and a pool of replicas (:func:`aiordma.rpc.connect_pool`) may then
    send a call again to another replica when the connection carrying it broke. Undeclared
    methods are never sent twice. (A call a server refused with :class:`Unavailable` did not
    run: the pool sends it to another replica whatever the method.)

    ``max_concurrency=N``: at most N calls of this method run at once on the server (all
    connections together); more wait in arrival order, each bounded by its deadline (past
    it the caller gets :class:`~aiordma.OperationTimeout`), and hold no place among their
    connection's ``max_in_flight`` while they wait. (A plain ``def`` method runs one call at
    a time anyway: inline.)

    Raises:
        LocalProtocolError: ``fn`` is not a function, is a plain generator, or takes an
            :class:`RpcStream` without being an ``async def`` (or takes more than one);
            ``idempotent`` is not a bool; ``max_concurrency`` is not a positive int.
    """
    check_bool(idempotent, name="idempotent")
    check_optional_int(max_concurrency, name="max_concurrency", low=1)
    if fn is None:  # @method(idempotent=..., max_concurrency=...)
        return lambda f: _mark(f, idempotent, max_concurrency)
    return _mark(fn, idempotent, max_concurrency)


def _mark(fn: Any, idempotent: bool, max_concurrency: int | None) -> Any:
    if not inspect.isfunction(fn) or inspect.isgeneratorfunction(fn):
        raise LocalProtocolError(f"@method needs an async def or a def, not {fn!r:.80}")
    setattr(fn, _RPC_STREAM, stream_kind(fn))
    setattr(fn, _RPC_IDEMPOTENT, idempotent)
    setattr(fn, _RPC_LIMIT, max_concurrency)
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
