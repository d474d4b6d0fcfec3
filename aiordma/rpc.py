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

The wire protocol is :mod:`protocols.rpc` (sans-I/O): one message per frame, large ``bytes``,
``memoryview`` and numpy values as out-of-band messages, which the endpoint moves by rendezvous
(RDMA READ, no copy) when they exceed its eager size. Many calls share a connection; each runs
in its own task on the server, at most ``max_in_flight`` at once (the client waits for a free
place: backpressure). A call's ``timeout`` travels as its deadline: when it expires the client
raises :class:`~aiordma.OperationTimeout` and sends a cancel, which cancels the server's task.
An exception in a method reaches the caller as :class:`RemoteError` with the remote type name
and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from protocols import rpc as proto
from protocols.errors import ProtocolError

from ._connect import Listener, listen
from ._connect import connect as _connect_endpoint
from ._device import Device
from ._endpoint import Config, Endpoint
from ._errors import (
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    LocalProtocolError,
    OperationTimeout,
    RemoteProtocolError,
)

__all__ = [
    "RemoteError", "RpcClient", "RpcServer", "Service", "connect", "current_endpoint", "method",
    "serve",
]

log = logging.getLogger("aiordma.rpc")
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
_RPC_METHOD = "__aiordma_rpc_method__"
_caller: contextvars.ContextVar[Endpoint] = contextvars.ContextVar("aiordma_rpc_caller")


def current_endpoint() -> Endpoint:
    """The endpoint of the client whose call is running (inside a :func:`method` only).

    Services use it to register memory on the caller's device and to tell callers apart.

    Raises:
        LookupError: not inside a remote call.
    """
    return _caller.get()


class RemoteError(AiordmaError):
    """The remote method raised. ``type_name`` and ``message`` describe the remote exception."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


def method(fn: F) -> F:
    """Mark an ``async def`` of a :class:`Service` subclass as callable remotely."""
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"@method needs an async def, not {fn!r}")
    setattr(fn, _RPC_METHOD, True)
    return fn  # type: ignore[return-value]  # iscoroutinefunction narrows F away


class Service:
    """Base class of services: only methods marked with :func:`method` can be called."""

    def _rpc_lookup(self, name: str) -> Callable[..., Awaitable[Any]] | None:
        fn = getattr(type(self), name, None)
        if fn is None or not getattr(fn, _RPC_METHOD, False):
            return None
        bound: Callable[..., Awaitable[Any]] = getattr(self, name)
        return bound


def _protocol_error(exc: ProtocolError) -> AiordmaError:
    from protocols.errors import LocalProtocolError as PLocal

    cls = LocalProtocolError if isinstance(exc, PLocal) else RemoteProtocolError
    err = cls(f"rpc: {exc}")
    err.__cause__ = exc
    return err


def _forget(tasks: dict[int, Any], call_id: int, _task: object) -> None:
    tasks.pop(call_id, None)


async def _send_all(ep: Endpoint, lock: asyncio.Lock, msgs: list[Any]) -> None:
    """Send a frame and its buffers as one contiguous group (other tasks wait)."""
    async with lock:
        for m in msgs:
            await ep.send(m)


class RpcServer:
    """Serves one :class:`Service` on a listener; ``aclose()`` finishes in-flight calls
    (bounded by ``grace``) before closing. Use as ``async with``."""

    def __init__(self, service: Service, *, max_in_flight: int, grace: float) -> None:
        self.service = service
        self.max_in_flight = max_in_flight
        self.grace = grace
        self.listener: Listener | None = None
        self.calls = 0
        self.cancelled = 0
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def port(self) -> int:
        assert self.listener is not None
        return self.listener.port

    async def _handle(self, ep: Endpoint) -> None:
        conn = proto.RpcConnection(proto.Role.SERVER, max_in_flight=self.max_in_flight)
        _caller.set(ep)  # copied into every call's task: current_endpoint()
        lock = asyncio.Lock()
        tasks: dict[int, asyncio.Task[None]] = {}
        try:
            while (msg := await ep.recv()) is not None:
                try:
                    conn.receive_message(msg)
                    while (ev := conn.next_event()) is not proto.NEED_DATA:
                        if isinstance(ev, proto.Request):
                            t = asyncio.ensure_future(self._run(ep, conn, lock, ev))
                            tasks[ev.id] = t
                            self._running.add(t)
                            t.add_done_callback(self._running.discard)
                            t.add_done_callback(functools.partial(_forget, tasks, ev.id))
                        elif isinstance(ev, proto.Cancel) and ev.id in tasks:
                            tasks[ev.id].cancel()
                except ProtocolError as exc:
                    log.warning("aiordma.rpc: %s broke the protocol: %s", ep.peer_address, exc)
                    return
        finally:
            if tasks:  # the client left: its calls have nobody to answer to
                for t in list(tasks.values()):
                    t.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _run(self, ep: Endpoint, conn: proto.RpcConnection, lock: asyncio.Lock,
                   req: proto.Request) -> None:
        self.calls += 1
        fn = self.service._rpc_lookup(req.method)
        try:
            if fn is None:
                raise AttributeError(f"no RPC method {req.method!r}")
            if req.deadline_ms is not None:
                async with asyncio.timeout(req.deadline_ms / 1000):
                    result = await fn(*req.args, **req.kwargs)
            else:
                result = await fn(*req.args, **req.kwargs)
            msgs = conn.send_response(req.id, result)
        except asyncio.CancelledError:
            self.cancelled += 1
            msgs = conn.send_error(req.id, "CancelledError", "the call was cancelled")
        except Exception as exc:  # the method's failure is the caller's answer
            try:
                msgs = conn.send_error(req.id, type(exc).__name__, str(exc)[:4000])
            except ProtocolError:
                msgs = conn.send_error(req.id, type(exc).__name__, "(unprintable)")
        with contextlib.suppress(AiordmaError):
            await _send_all(ep, lock, msgs)

    async def aclose(self) -> None:
        """Stop accepting, let running calls finish for up to ``grace`` seconds, then close."""
        if self._closing:
            return
        self._closing = True
        if self.listener is not None and self.listener._server is not None:
            self.listener._server.close()  # no new connections
        if self._running:
            await asyncio.wait(set(self._running), timeout=self.grace)
        if self.listener is not None:
            await self.listener.aclose()

    async def __aenter__(self) -> RpcServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def serve(service: Service, host: str = "127.0.0.1", port: int = 0, *,
                max_in_flight: int = 64, grace: float = 5.0, config: Config | None = None,
                device: str | Device | None = None) -> RpcServer:
    """Serve ``service`` on ``host:port`` (``port=0``: a free one, see ``server.port``)."""
    server = RpcServer(service, max_in_flight=max_in_flight, grace=grace)
    server.listener = await listen(server._handle, host, port, config=config, device=device)
    return server


class RpcClient:
    """A connection to an :class:`RpcServer`. ``await client.call("name", *args)`` or
    ``await client.name(*args)``. Use as ``async with``; ``aclose()`` fails pending calls."""

    def __init__(self, ep: Endpoint, max_in_flight: int) -> None:
        self.endpoint = ep
        self._conn = proto.RpcConnection(proto.Role.CLIENT, peer_max_in_flight=max_in_flight)
        self._lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._reader = asyncio.ensure_future(self._read())

    async def call(self, name: str, *args: Any, timeout: float | None = None,
                   **kwargs: Any) -> Any:
        """Call ``name`` remotely; its result, or :class:`RemoteError`.

        Raises:
            OperationTimeout: ``timeout`` expired (the server's task is cancelled).
            RemoteError: the method raised (``type_name``, ``message``).
            BrokenResourceError / ClosedResourceError: the connection broke or was closed.
        """
        deadline = None if timeout is None else max(0, int(timeout * 1000))
        async with self._slots:  # backpressure: at most max_in_flight calls outstanding
            if self._reader.done():
                raise BrokenResourceError("the RPC connection is closed")
            try:
                call_id, msgs = self._conn.send_request(name, tuple(args), kwargs, deadline)
            except ProtocolError as exc:
                raise _protocol_error(exc) from exc
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiting[call_id] = fut
            await _send_all(self.endpoint, self._lock, msgs)
            try:
                if timeout is None:
                    return await fut
                async with asyncio.timeout(timeout):
                    return await asyncio.shield(fut)
            except TimeoutError:
                with contextlib.suppress(AiordmaError, ProtocolError):
                    await _send_all(self.endpoint, self._lock, self._conn.send_cancel(call_id))
                raise OperationTimeout(f"{name}() took longer than {timeout} s") from None
            finally:
                if not fut.done():
                    fut.cancel()

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name.startswith("_"):
            raise AttributeError(name)

        async def proxy(*args: Any, **kwargs: Any) -> Any:
            return await self.call(name, *args, **kwargs)

        return proxy

    async def _read(self) -> None:
        exc: BaseException = ClosedResourceError("the RPC client was closed")
        try:
            while (msg := await self.endpoint.recv()) is not None:
                self._conn.receive_message(msg)
                while (ev := self._conn.next_event()) is not proto.NEED_DATA:
                    fut = self._waiting.pop(ev.id, None)  # type: ignore[union-attr]
                    if fut is None or fut.done():
                        continue
                    if isinstance(ev, proto.Response):
                        fut.set_result(ev.result)
                    elif isinstance(ev, proto.Error):
                        fut.set_exception(RemoteError(ev.type, ev.message))
            exc = BrokenResourceError("the server closed the connection")
        except ProtocolError as e:
            exc = _protocol_error(e)
            self.endpoint.abort()
        except AiordmaError as e:
            exc = e
        finally:
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(exc)
            self._waiting.clear()

    async def aclose(self) -> None:
        await self.endpoint.aclose()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def connect(host: str, port: int, *, timeout: float = 10.0, max_in_flight: int = 64,
                  config: Config | None = None,
                  device: str | Device | None = None) -> RpcClient:
    """Connect to an :func:`serve`\\ d service."""
    ep = await _connect_endpoint(host, port, timeout=timeout, config=config, device=device)
    return RpcClient(ep, max_in_flight)
