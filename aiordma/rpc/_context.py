"""A call as the code around it sees it: the server's :class:`CallContext`
(:func:`current_call`), the :class:`ClientCall` that client interceptors see, the interceptor
chain both sides run, and deadline propagation (a call made while serving one inherits what is
left of its deadline unless :func:`ignore_caller_deadline` says not to).

Interceptors are async middleware, as aiohttp's are: ``async def interceptor(call, proceed)``
gets the call and an async ``proceed()`` that runs the rest of the chain (the next interceptor,
and at the end the call itself) and returns its result. An interceptor may look at or change
the call before it proceeds (its metadata above all), time ``proceed()``, change or replace
what it returns, or raise instead of proceeding: it rejects the call. The first interceptor of
the list is the outermost.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiordma._errors import LocalProtocolError, from_protocol_error
from aiordma.protocols import rpc as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.protocols.rpc import _meta as _rpc_meta

__all__ = ["CallContext", "ClientCall", "ClientInterceptor", "ServerInterceptor",
           "call_deadline", "check_interceptors", "check_metadata", "current_call", "ignore_caller_deadline",
           "inherited_deadline", "run_chain"]

_current: contextvars.ContextVar[CallContext] = contextvars.ContextVar("aiordma_rpc_call")
_inherit: contextvars.ContextVar[bool] = contextvars.ContextVar("aiordma_rpc_inherit",
                                                               default=True)


class CallContext:
    """The call being served, as its method and the server's interceptors see it:
    :func:`current_call` inside a method, the first argument of a server interceptor.

    Attributes:
        deadline: when the caller's deadline passes, in the event loop's time
            (``loop.time()``), or None: the caller set no timeout. Calls this method makes to
            other services inherit it (see :func:`ignore_caller_deadline`).
    """

    # (made for every call: three stores; the rest is read from the request when asked)
    __slots__ = ("_answer_metadata", "_metadata", "_ran", "_req", "deadline")
    _metadata: dict[str, str | bytes]  # (set on first use, for a call that brought none)
    _ran: bool  # (set when an interceptor chain runs: False until it proceeds to the method)

    def __init__(self, req: proto.Request) -> None:
        self._req = req
        self.deadline: float | None = None  # (set by the server when the call has one)
        self._answer_metadata: dict[str, str | bytes] | None = None

    @property
    def method(self) -> str:
        """The method's name."""
        return self._req.method

    @property
    def args(self) -> tuple[Any, ...]:
        """The positional arguments."""
        return self._req.args

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments."""
        return self._req.kwargs

    @property
    def stream(self) -> bool:
        """Whether this is a stream call (an interceptor then sees its opening and its end:
        ``proceed()`` returns when the method's stream is over)."""
        return self._req.stream

    @property
    def metadata(self) -> dict[str, str | bytes]:
        """The caller's metadata (empty if it sent none). A dict: an interceptor may add or
        remove entries before the method sees them (e.g. the identity a token proved)."""
        md = self._req.metadata
        if md is None:
            try:
                md = self._metadata
            except AttributeError:
                md = self._metadata = {}
        return md

    @property
    def answer_metadata(self) -> dict[str, str | bytes]:
        """Metadata to send back with the answer, a result or an error: set entries in it
        (``current_call().answer_metadata["k"] = "v"``). Checked when the answer is sent: bad
        metadata fails the call with ``LocalProtocolError`` and is not sent."""
        md = self._answer_metadata
        if md is None:
            md = self._answer_metadata = {}
        return md

    def time_remaining(self) -> float | None:
        """Seconds until the caller's deadline (negative once it passed), or None."""
        if self.deadline is None:
            return None
        return self.deadline - asyncio.get_running_loop().time()

    def __repr__(self) -> str:
        return f"<CallContext {self.method}() deadline={self.deadline}>"


def current_call() -> CallContext:
    """The call being served (inside a :func:`~aiordma.rpc.method` and the tasks it starts;
    in a server interceptor too): its method's name, arguments, metadata and deadline, and
    the metadata of its answer.

    Raises:
        LookupError: not inside a remote call.
    """
    return _current.get()


@contextlib.contextmanager
def ignore_caller_deadline() -> Iterator[None]:
    """Calls made inside this block do not inherit the deadline of the call being served;
    each has only its own ``timeout``. For work that must outlive the caller's patience, e.g.
    a write-behind or an audit record started by a method::

        with ignore_caller_deadline():
            await audit.call("record", entry, timeout=30)

    Outside a served call it changes nothing."""
    token = _inherit.set(False)
    try:
        yield
    finally:
        _inherit.reset(token)


def call_deadline(timeout: float | None) -> tuple[float | None, float | None]:
    """A call's deadline in loop time (its own ``timeout`` from now, or the deadline it
    inherits if that is earlier, or None) and the timeout its messages name (None once the
    deadline is the inherited one). ``timeout`` is already checked."""
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    ctx = _current.get(None)  # (a call made by a method inherits its deadline)
    if ctx is None or ctx.deadline is None:  # (the common case: no call to inherit from)
        return deadline, timeout
    inherited = inherited_deadline()
    if inherited is not None and (deadline is None or inherited < deadline):
        return inherited, None  # (the messages say the deadline was inherited)
    return deadline, timeout


def inherited_deadline() -> float | None:
    """The deadline (loop time) a call made now inherits: the served call's, or None (not
    inside a served call, the call has none, or :func:`ignore_caller_deadline`)."""
    ctx = _current.get(None)
    if ctx is None or ctx.deadline is None or not _inherit.get():
        return None
    return ctx.deadline


class ClientCall:
    """A call as client interceptors see it (their first argument).

    Attributes:
        method: the method's name.
        args, kwargs: the arguments (an interceptor may replace them before it proceeds).
        metadata: the metadata that will be sent (a dict: add, change or remove entries
            before proceeding; checked when the request is built).
        deadline: when the call gives up, in the event loop's time, or None: its ``timeout``
            or the inherited deadline, whichever comes first (an interceptor may set an
            earlier one).
        stream: whether this is a stream call (an interceptor then sees only its opening:
            ``proceed()`` returns once the request is out, with None).
        answer_metadata: the answer's metadata, once ``proceed()`` returned or raised
            :class:`~aiordma.rpc.RemoteError` (None before; empty if the server sent none).
        replica: for a call through a pool (:func:`~aiordma.rpc.connect_pool`), the replica
            this attempt goes to, ``"host:port"``; None for a call on an
            :class:`~aiordma.rpc.RpcClient`.
        attempt: which attempt of the call this is, from 1 (a pool runs the interceptors
            again for each replica a call is sent to; an ``RpcClient`` call has one).
    """

    __slots__ = ("answer_metadata", "args", "attempt", "deadline", "kwargs", "metadata",
                 "method", "replica", "stream")

    def __init__(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 metadata: dict[str, str | bytes], deadline: float | None,
                 stream: bool, replica: str | None = None, attempt: int = 1) -> None:
        self.method = method
        self.args = args
        self.kwargs = kwargs
        self.metadata = metadata
        self.deadline = deadline
        self.stream = stream
        self.replica = replica
        self.attempt = attempt
        self.answer_metadata: dict[str, str | bytes] | None = None

    def time_remaining(self) -> float | None:
        """Seconds until the call's deadline (negative once it passed), or None."""
        if self.deadline is None:
            return None
        return self.deadline - asyncio.get_running_loop().time()

    def __repr__(self) -> str:
        return f"<ClientCall {self.method}() deadline={self.deadline}>"


Proceed = Callable[[], Awaitable[Any]]
ServerInterceptor = Callable[[CallContext, Proceed], Awaitable[Any]]
"""``async def interceptor(call: CallContext, proceed) -> result``."""
ClientInterceptor = Callable[[ClientCall, Proceed], Awaitable[Any]]
"""``async def interceptor(call: ClientCall, proceed) -> result``."""


def check_metadata(metadata: Any) -> dict[str, str | bytes] | None:
    """A call's ``metadata`` argument, checked and copied (None for none or empty).

    Raises:
        LocalProtocolError: not a mapping of valid keys to ``str`` or ``bytes`` values within
            the limits (see :mod:`aiordma.protocols.rpc._meta`).
    """
    if metadata is None:
        return None
    try:
        return _rpc_meta.check(metadata) or None
    except ProtocolError as exc:
        raise from_protocol_error(exc, "rpc") from exc


def check_interceptors(interceptors: Any) -> tuple[Any, ...]:
    """``interceptors`` as a tuple, each one checked to be callable.

    Raises:
        LocalProtocolError: not a list or tuple of callables.
    """
    if not isinstance(interceptors, (list, tuple)):
        raise LocalProtocolError(f"interceptors is a list of async callables, not "
                                 f"{interceptors!r:.80}")
    for i in interceptors:
        if not callable(i):
            raise LocalProtocolError(f"an interceptor is an async callable (call, proceed), "
                                     f"not {i!r:.80}")
    return tuple(interceptors)


async def run_chain(interceptors: tuple[Any, ...], call: Any, last: Proceed) -> Any:
    """Run ``interceptors`` around ``last`` (the call itself) and return what the outermost
    returns. On the server (``call`` a :class:`CallContext`) ``last`` runs at most once: a
    second ``proceed()`` raises :class:`LocalProtocolError`; on the client each ``proceed()``
    makes the call again (a retry)."""
    n = len(interceptors)
    server = type(call) is CallContext

    def proceed_from(i: int) -> Awaitable[Any]:
        if i < n:
            return interceptors[i](call, lambda: proceed_from(i + 1))  # type: ignore[no-any-return]
        if server:
            if call._ran:
                raise LocalProtocolError(f"{call.method}(): a server interceptor proceeded "
                                         f"twice (a method runs at most once per call)")
            call._ran = True
        return last()

    if server:
        call._ran = False
    return await proceed_from(0)
