"""Stream calls through a pool: :class:`PoolStreamCall`, what :meth:`RpcPool.stream
<aiordma.rpc.RpcPool.stream>` and :meth:`RpcPool.stream_call <aiordma.rpc.RpcPool.stream_call>`
return.

A stream picks one replica when it starts (by its key, or the least loaded, as a call does) and
stays on it: it is an :class:`~aiordma.rpc.StreamCall` on that replica's connection. What a
pool adds is what happens when that replica fails it:

* refused (the server drains: :class:`~aiordma.rpc.Unavailable`, before anything was granted
  or sent), the stream starts again on another replica, whatever its method, as a refused
  call does;
* broken (the connection ended), a stream of a method its server declared idempotent starts
  again on another replica, but only while *untouched*: no item of it reached the caller
  (``async for``, ``anext``) and, for :meth:`~aiordma.rpc.RpcPool.stream_call`, the caller
  sent it no item (a :meth:`~PoolStreamCall.send_eof` alone is sent again). Otherwise it fails
  with :class:`~aiordma.rpc.UnknownOutcomeError`: the items already seen or sent cannot be
  taken back, and the method may or may not have run to its end.

Every start again takes a token of the pool's retry budget and counts against its
``max_attempts``; the stream's ``timeout`` bounds all of its attempts. The pool's interceptors
run around the opening of each attempt (``ClientCall.stream`` is True; ``proceed()`` returns
once the request is out). A method's own error (:class:`~aiordma.rpc.RemoteError`) and the
deadline (:class:`~aiordma.OperationTimeout`) are the stream's, never a reason to go elsewhere.
"""

from __future__ import annotations

import asyncio
import typing
from typing import TYPE_CHECKING, Any, Self

from aiordma._errors import (
    AiordmaError,
    BrokenResourceError,
    ClosedResourceError,
    LocalProtocolError,
)
from aiordma.rpc._context import ClientCall, run_chain
from aiordma.rpc._replica import NoReplicaError, Replica, UnknownOutcomeError
from aiordma.rpc._service import Unavailable
from aiordma.rpc._stream import StreamCall

if TYPE_CHECKING:
    from aiordma.rpc._client import RpcClient
    from aiordma.rpc._pool import RpcPool

__all__ = ["PoolStreamCall"]

_FAILED = (Unavailable, BrokenResourceError, ClosedResourceError)
"""What an attempt may fail with that could send the stream elsewhere (see the module)."""


class PoolStreamCall:
    """A stream call through a pool, used as a :class:`~aiordma.rpc.StreamCall` is:
    ``async for item in call``, :meth:`send`, :meth:`send_eof`, :meth:`result`,
    :attr:`answer_metadata`, :meth:`aclose`, ``async with``. It starts (picks its replica and
    sends its request) at the first of these; see the module for when it starts again on
    another replica.

    Every operation raises what :class:`~aiordma.rpc.StreamCall`'s raises, and also
    :class:`~aiordma.rpc.UnknownOutcomeError` (its replica broke and it could not start again
    elsewhere), :class:`~aiordma.rpc.NoReplicaError` (no replica was UP to start it) and
    :class:`~aiordma.rpc.Unavailable` (every replica it went to refused it).
    """

    def __init__(self, pool: RpcPool, name: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any], timeout: float | None, window: int,
                 metadata: dict[str, str | bytes] | None, key: Any, sends: bool) -> None:
        # (the arguments were checked by the pool)
        self._pool = pool
        self._name, self._args, self._kwargs = name, args, kwargs
        self._timeout, self._window, self._sends = timeout, window, sends
        self._metadata, self._key_arg = metadata, key
        self._inner: StreamCall | None = None
        self._replica: Replica | None = None
        self._client: RpcClient | None = None
        self._opening: asyncio.Future[None] | None = None
        self._closed = False
        self._received = self._sent = self._eof = False
        self._attempts = 0
        self._failed: set[RpcClient] = set()
        self._refused: Unavailable | None = None
        self._maybe_ran = False
        # set when it starts (pool._begin)
        self._deadline: float | None = None
        self._msg_timeout: float | None = None
        self._md: dict[str, str | bytes] | None = None
        self._key: bytes | None = None

    @property
    def replica(self) -> str | None:
        """The replica the stream runs on, ``"host:port"`` (None before it started)."""
        return None if self._replica is None else self._replica.name

    # -- the API (StreamCall's)

    async def __aenter__(self) -> Self:
        await self._started()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        """The server's next item (see :meth:`StreamCall.__anext__
        <aiordma.rpc.StreamCall.__anext__>`)."""
        inner = await self._started()
        while True:
            try:
                item = await inner.__anext__()
            except _FAILED as exc:
                if not self._may_go_elsewhere(exc):
                    raise
                inner = await self._restart()
                continue
            except (StopAsyncIteration, AiordmaError):
                self._pool._notify()  # (its place is free: calls waiting for one look again)
                raise
            self._received = True
            return item

    async def send(self, item: Any) -> None:
        """Send ``item`` to the server's method (see :meth:`StreamCall.send
        <aiordma.rpc.StreamCall.send>`)."""
        inner = await self._started()
        while True:
            try:
                await inner.send(item)
            except _FAILED as exc:
                if not self._may_go_elsewhere(exc):
                    raise
                inner = await self._restart()
                continue
            self._sent = True
            return

    async def send_eof(self) -> None:
        """No more items come (see :meth:`StreamCall.send_eof
        <aiordma.rpc.StreamCall.send_eof>`); sent again if the stream starts again."""
        inner = await self._started()
        self._eof = True
        try:
            await inner.send_eof()
        except _FAILED as exc:
            if not self._may_go_elsewhere(exc):
                raise
            await self._restart()  # (which sends the EOF)

    async def result(self) -> Any:
        """The method's answer, once the call ended (see :meth:`StreamCall.result
        <aiordma.rpc.StreamCall.result>`)."""
        async for _ in self:
            pass
        return await typing.cast(StreamCall, self._inner).result()  # (iterating started it)

    @property
    def answer_metadata(self) -> dict[str, str | bytes]:
        """The metadata of the answer (of the attempt that ended), once the call ended."""
        return {} if self._inner is None else self._inner.answer_metadata

    async def aclose(self) -> None:
        """End the call (see :meth:`StreamCall.aclose <aiordma.rpc.StreamCall.aclose>`).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._inner is not None:
            await self._inner.aclose()
        self._pool._notify()

    # -- internals

    async def _started(self) -> StreamCall:
        """Start the stream (once; a concurrent first operation waits for it); its current
        attempt."""
        if self._opening is None:
            loop = asyncio.get_running_loop()
            opening = self._opening = loop.create_future()
            try:
                if self._closed:
                    raise ClosedResourceError(f"{self._name}(): the call was closed")
                self._deadline, self._msg_timeout, self._md, self._key = self._pool._begin(
                    self._name, self._timeout, self._metadata, self._key_arg)
                await self._start()
            except BaseException as exc:
                self._closed = True
                opening.set_exception(ClosedResourceError(
                    f"{self._name}(): the call did not start: {exc!r:.200}"))
                opening.exception()  # (retrieved: only concurrent openers see it)
                raise
            opening.set_result(None)
        elif not self._opening.done():
            await self._opening
        elif self._opening.exception() is not None:
            raise self._opening.exception()  # type: ignore[misc]
        return typing.cast(StreamCall, self._inner)  # (started)

    async def _start(self) -> StreamCall:
        """Pick a replica and open the stream there, until an attempt opens or may not go
        elsewhere; the open attempt."""
        pool = self._pool
        while True:
            try:
                replica, client = await pool._pick(self._failed, self._deadline, self._name,
                                                   self._msg_timeout, self._key)
            except NoReplicaError as exc:
                err = pool._nowhere(exc, self._name, self._attempts, self._refused,
                                    self._maybe_ran, self._replica)
                if err is exc:
                    raise
                raise err from exc
            self._attempts += 1
            replica.calls += 1
            self._replica, self._client = replica, client
            try:
                return await self._open_on(replica, client)
            except _FAILED as exc:
                if not self._may_go_elsewhere(exc):
                    raise

    async def _restart(self) -> StreamCall:
        """The current attempt failed and may go elsewhere: start again (sending the EOF
        again if the caller had sent it)."""
        if self._inner is not None:
            await self._inner.aclose()  # (its connection is gone: returns at once)
        inner = await self._start()
        if self._eof:
            await inner.send_eof()
        return inner

    async def _open_on(self, replica: Replica, client: RpcClient) -> StreamCall:
        """Open the stream on ``client`` (the connection to ``replica``), through the pool's
        interceptors and then the client's own; the opened call."""
        interceptors = self._pool.interceptors
        loop = asyncio.get_running_loop()
        self._inner = None

        async def open_as(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                          metadata: dict[str, str | bytes] | None,
                          deadline: float | None) -> None:
            if self._inner is not None:
                raise LocalProtocolError(f"{self._name}(): a stream call is opened once (an "
                                         f"interceptor proceeded twice)")
            left = None if deadline is None else max(0.0, deadline - loop.time())
            self._inner = client._stream_call(name, args, kwargs, left, self._window,
                                              metadata, self._sends)
            await self._inner._open()

        if not interceptors:
            await open_as(self._name, self._args, self._kwargs, self._md, self._deadline)
        else:
            call = ClientCall(self._name, self._args, self._kwargs, dict(self._md or {}),
                              self._deadline, True, replica.name, self._attempts)
            await run_chain(interceptors, call, lambda: open_as(
                call.method, call.args, call.kwargs, call.metadata, call.deadline))
        return typing.cast(StreamCall, self._inner)  # (the chain proceeded, or raised)

    def _may_go_elsewhere(self, exc: BaseException) -> bool:
        """The current attempt failed with ``exc``: True if the stream may start again on
        another replica (what it needs is recorded), False if ``exc`` is the caller's as it
        is (the caller closed the stream, an interceptor's own error, a refusal that cannot
        be retried).

        Raises:
            UnknownOutcomeError: its replica broke and it may not start again elsewhere.
            ClosedResourceError: the pool was closed.
        """
        pool, replica, client = self._pool, self._replica, self._client
        if self._closed or replica is None or client is None:
            return False
        refused = isinstance(exc, Unavailable)
        if refused:
            replica.poke.set()  # its health check says at once whether it drains
        elif isinstance(exc, (NoReplicaError, UnknownOutcomeError)) or not pool._broke(
                replica, client, exc):  # type: ignore[arg-type]
            return False
        untouched = not self._received and not self._sent
        loop = asyncio.get_running_loop()
        if (untouched and (refused or self._name in replica.idempotent)
                and pool._may_retry(self._attempts, self._deadline, loop)):
            self._failed.add(client)
            if refused:
                self._refused = exc  # type: ignore[assignment]
            else:
                self._maybe_ran = True
            return True
        if refused:
            return False
        pool._unknown += 1
        why = ("not declared idempotent" if self._name not in replica.idempotent
               else "an item had reached the caller" if self._received
               else "an item had been sent" if self._sent
               else f"not retried after {self._attempts} attempt(s)")
        raise UnknownOutcomeError(
            f"{self._name}(): the connection to {replica.name} broke during the stream; it may "
            f"or may not have run ({why})", method=self._name, address=replica.name,
            attempts=self._attempts) from exc
