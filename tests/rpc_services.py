"""Services the RPC tests serve, over the in-memory pair or the TCP transport's channels on
loopback (tests/unit: the ``over`` fixture picks, see tests/unit/conftest.py) and over a
device (tests/rxe)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiordma.rpc import RpcClient, RpcServer, RpcStream, Service, current_endpoint, method
from aiordma.testing import channel_pair, tcp_pairs

from .bounds import STEP

TAG: contextvars.ContextVar[str] = contextvars.ContextVar("tag", default="untouched")


class Pairs:
    """Which channels the device-free tests' helpers connect: ``"memory"`` (the in-memory pair),
    ``"plain"`` (the same, seen as a plain MessageChannel: :class:`PlainChannel`) or ``"tcp"``
    (the TCP transport over loopback sockets). Set by the ``over`` fixture."""

    kind = "memory"


class PlainChannel:
    """A channel seen only as a :class:`~aiordma.transport.MessageChannel`, without the
    :class:`~aiordma.transport.ReadyChannel` methods: the RPC layer reads it with a task
    (``recv()``), its path for any other channel."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in ("recv_nowait", "call_when_readable"):
            raise AttributeError(name)
        return getattr(self.inner, name)


@contextlib.asynccontextmanager
async def connected(n: int = 1, **options: Any) -> AsyncIterator[list[tuple[Any, Any]]]:
    """``n`` connected (client, server) channel pairs of the kind :class:`Pairs` says;
    ``options`` as :func:`aiordma.testing.channel_pair`'s. The TCP ones are aborted on exit."""
    if Pairs.kind == "memory":
        yield [channel_pair(**options) for _ in range(n)]
        return
    if Pairs.kind == "plain":
        pairs = (channel_pair(**options) for _ in range(n))
        yield [(PlainChannel(a), PlainChannel(b)) for a, b in pairs]
        return
    config = {"max_message": options.get("max_message", 1 << 30),
              "recv_buffer": options.get("recv_buffer", 4 << 20),
              "data_slots": options.get("slots", 64),
              "close_timeout": options.get("close_timeout", 5.0)}
    if "eager_max" in options:
        config["slot_size"] = max(64, options["eager_max"] + 12)
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(tcp_pairs(**config)) for _ in range(n)]


class Calc(Service):
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.finished_slow = 0
        self.inline_tasks: list[asyncio.Task[Any] | None] = []  # current task, per mul() call

    # plain defs: they run inline, as their request is read (no task of their own)
    @method
    def mul(self, a: int, b: int) -> int:
        self.inline_tasks.append(asyncio.current_task())
        TAG.set("set by mul")  # in a copy of the connection's context: nobody else sees it
        return a * b

    @method
    def fail_now(self, text: str) -> None:
        raise KeyError(text)

    @method
    def caller(self) -> int:
        return int(current_endpoint().id)

    @method
    async def tag(self) -> str:
        return TAG.get()

    @method
    async def add(self, a: int, b: int) -> int:
        return a + b

    @method
    async def echo(self, value):  # type: ignore[no-untyped-def]
        return value

    @method
    async def fail(self, text: str) -> None:
        raise ValueError(text)

    @method
    async def sleep(self, seconds: float) -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished_slow += 1
        return "slept"

    async def not_exported(self) -> str:
        return "secret"


class Gauge(Service):
    """Records how many calls run at once, per connection (current_endpoint()), and answers."""

    def __init__(self) -> None:
        self.running: dict[int, int] = {}
        self.peak: dict[int, int] = {}

    @method
    async def hold(self, seconds: float) -> int:
        ep = current_endpoint().id
        self.running[ep] = self.running.get(ep, 0) + 1
        self.peak[ep] = max(self.peak.get(ep, 0), self.running[ep])
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running[ep] -= 1
        return ep

    @method
    async def blob(self, n: int) -> bytes:
        return bytes(n)


class Streamer(Service):
    """Streaming methods for the stream tests, over the in-memory pair and (served by
    tests/rxe/peer_process.py) in another process. It counts what its generators produced and
    what its readers read, and records how each generator ended, for the tests to read back
    by a unary call (``stats``)."""

    def __init__(self) -> None:
        self.produced = 0  # items its generators produced (resumed and yielded)
        self.read = 0  # items its methods read from clients
        self.ended: list[str] = []  # how each generator ended: "returned" or the exception

    @method
    def stats(self) -> dict[str, Any]:
        return {"produced": self.produced, "read": self.read, "ended": list(self.ended)}

    @method
    def reset(self) -> None:
        self.produced = self.read = 0
        self.ended.clear()

    @contextlib.contextmanager
    def _watch(self) -> Iterator[None]:
        """Records how the generator it wraps ended (a close arrives as GeneratorExit at its
        yield, a cancel as CancelledError at its await)."""
        try:
            yield
        except BaseException as exc:
            self.ended.append(type(exc).__name__)
            raise
        self.ended.append("returned")

    @method
    async def rows(self, n: int, size: int = 0) -> AsyncIterator[Any]:
        """Items 0, 1, ... (``n`` of them, or for ever if negative); with ``size``, each a
        ``size``-byte pattern of its index."""
        with self._watch():
            i = 0
            while n < 0 or i < n:
                self.produced += 1
                yield i if not size else pattern(i, size)
                i += 1

    @method
    async def slow(self, pause: float) -> AsyncIterator[int]:
        """An item, then ``pause`` seconds, for ever."""
        with self._watch():
            i = 0
            while True:
                self.produced += 1
                yield i
                i += 1
                await asyncio.sleep(pause)

    @method
    async def fail_after(self, k: int, text: str) -> AsyncIterator[int]:
        """``k`` items, then ValueError(text)."""
        with self._watch():
            for i in range(k):
                self.produced += 1
                yield i
            raise ValueError(text)

    @method
    async def upload(self, tag: str, chunks: RpcStream[bytes]) -> dict[str, Any]:
        """Reads every chunk: their count, total size and SHA-256, with ``tag``."""
        digest, count, total = hashlib.sha256(), 0, 0
        async for chunk in chunks:
            self.read += 1
            digest.update(chunk)
            count += 1
            total += len(chunk)
        return {"tag": tag, "count": count, "bytes": total, "sha256": digest.hexdigest()}

    @method
    async def read_some(self, k: int, items: RpcStream[Any]) -> list[Any]:
        """Reads ``k`` items and returns them, leaving the rest unread."""
        got: list[Any] = []
        while len(got) < k:
            try:
                got.append(await anext(items))
            except StopAsyncIteration:
                break
            self.read += 1
        return got

    @method
    async def slow_reader(self, pause: float, items: RpcStream[Any]) -> int:
        """Reads every item, ``pause`` seconds apart; returns how many it read."""
        n = 0
        async for _ in items:
            self.read += 1
            n += 1
            await asyncio.sleep(pause)
        return n

    @method
    async def echo_stream(self, items: RpcStream[Any]) -> AsyncIterator[Any]:
        """Yields every item it reads (bidirectional)."""
        with self._watch():
            async for item in items:
                self.read += 1
                self.produced += 1
                yield item


def pattern(i: int, size: int) -> bytes:
    """``size`` bytes that say ``i``: its 8-byte little-endian form, repeated."""
    return (i.to_bytes(8, "little") * (size // 8 + 1))[:size]


@contextlib.asynccontextmanager
async def served_over_memory(service: Service, *, server_limit: int = 64, client_limit: int = 64,
                 grace: float = 5.0, max_streams: int = 16, stream_window: int = 16,
                 **pair: Any) -> AsyncIterator[tuple[RpcClient, RpcServer]]:
    """A server for ``service`` on one end of a pair (in memory, or TCP: :class:`Pairs`), a
    client on the other."""
    async with connected(**pair) as [(a, b)]:
        server = RpcServer(service, max_in_flight=server_limit, grace=grace,
                           max_streams=max_streams, stream_window=stream_window)
        serving = asyncio.ensure_future(server.serve_connection(b))
        client = RpcClient(a, max_in_flight=client_limit)
        try:
            yield client, server
        finally:
            client.abort()
            await asyncio.wait_for(server.aclose(), STEP)
            await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), STEP)
