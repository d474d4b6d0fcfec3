"""Services and interceptors for the tests of call metadata, interceptors, deadline
propagation and server operations (drain, concurrency limits, counters): over the in-memory
pair (tests/unit/test_rpc_meta_over_memory.py, test_rpc_ops_over_memory.py) and, served by
tests/rxe/ops_peer.py, in another process (tests/rxe/test_rpc_ops.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from time import perf_counter
from typing import Any

from aiordma.rpc import (
    CallContext,
    ClientCall,
    RpcClient,
    RpcServer,
    Service,
    current_call,
    ignore_caller_deadline,
    method,
)

from .bounds import STEP
from .rpc_services import connected

LIMIT = 2  # Traced.limited's max_concurrency


class Traced(Service):
    """Methods that report what they saw of their call, and count what ran (read back by
    ``counts``: a test's evidence of what the server did)."""

    def __init__(self) -> None:
        self.downstream: RpcClient | None = None  # relay()'s target
        self.reset()

    @method
    def reset(self) -> None:
        self.ran: dict[str, int] = {}
        self.running = 0  # limited() calls inside the method now
        self.peak = 0  # the most limited() calls inside it at once
        self.order: list[str] = []  # limited()'s tags, in the order the calls started
        self.finished = 0  # hold() calls that ran to the end
        self.hold_cancelled = 0
        self.gate = asyncio.Event()  # what hold(-1) and limited(-1, ...) wait for
        self.intercepted: list[Any] = []  # what a server interceptor saw (ops_peer.py's)

    @method
    def open_gate(self) -> None:
        self.gate.set()

    def _ran(self, name: str) -> None:
        self.ran[name] = self.ran.get(name, 0) + 1

    @method
    def counts(self) -> dict[str, Any]:
        return {"ran": dict(self.ran), "peak": self.peak, "running": self.running,
                "order": list(self.order), "finished": self.finished,
                "hold_cancelled": self.hold_cancelled, "intercepted": list(self.intercepted)}

    @staticmethod
    def _seen(call: CallContext) -> dict[str, Any]:
        """What a method saw of its call; its answer's metadata echoes the ``echo-*`` keys."""
        call.answer_metadata["served-by"] = "traced"
        for k, v in call.metadata.items():
            if k.startswith("echo-"):
                call.answer_metadata[k] = v
        return {"method": call.method, "metadata": dict(call.metadata),
                "remaining": call.time_remaining()}

    @method
    async def whoami(self, *args: Any) -> dict[str, Any]:
        self._ran("whoami")
        return {**self._seen(current_call()), "args": list(args)}

    @method
    def whoami_now(self) -> dict[str, Any]:
        """A plain def: runs inline (without interceptors), metadata and all."""
        self._ran("whoami_now")
        return self._seen(current_call())

    @method
    async def fail_with(self, text: str) -> None:
        self._ran("fail_with")
        current_call().answer_metadata["why"] = text
        raise ValueError(text)

    @method
    async def bad_answer_metadata(self) -> int:
        current_call().answer_metadata["Not A Key"] = "x"
        return 1

    async def _pause(self, seconds: float) -> None:
        """``seconds``, or (negative) until the gate opens."""
        if seconds < 0:
            await self.gate.wait()
        else:
            await asyncio.sleep(seconds)

    @method
    async def hold(self, seconds: float) -> str:
        """Holds ``seconds`` (negative: until the gate opens)."""
        self._ran("hold")
        try:
            await self._pause(seconds)
        except asyncio.CancelledError:
            self.hold_cancelled += 1
            raise
        self.finished += 1
        return "held"

    @method(max_concurrency=LIMIT)
    async def limited(self, seconds: float, tag: str) -> str:
        """Holds as ``hold``; at most LIMIT at once (counted: ``peak``)."""
        self._ran("limited")
        self.order.append(tag)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await self._pause(seconds)
        finally:
            self.running -= 1
        return tag

    @method
    async def relay(self, name: str, *args: Any, inner_timeout: float | None = None,
                    ignore: bool = False, port: int = 0) -> Any:
        """Calls ``name(*args)`` with ``inner_timeout`` on the downstream client (or on a new
        connection to ``port`` of this host, made and closed here): the deadline propagates,
        unless ``ignore``."""
        self._ran("relay")
        if port:
            from aiordma.rpc import connect

            with ignore_caller_deadline():  # (the connection is not the call under test)
                client = await connect("127.0.0.1", port, timeout=STEP)
            self.downstream = client
        assert self.downstream is not None
        try:
            if ignore:
                with ignore_caller_deadline():
                    return await self.downstream.call(name, *args, timeout=inner_timeout)
            return await self.downstream.call(name, *args, timeout=inner_timeout)
        finally:
            if port:
                self.downstream.abort()
                self.downstream = None

    @method
    async def rows(self, n: int) -> AsyncIterator[int]:
        """A stream whose answer's metadata says how many it sent."""
        self._ran("rows")
        call = current_call()
        for i in range(n):
            yield i
        call.answer_metadata["sent"] = str(n)
        call.answer_metadata["saw"] = ",".join(sorted(call.metadata))


# -- interceptors --------------------------------------------------------------------------------


def recording(log: list[Any], name: str) -> Any:
    """An interceptor (either side) that logs its entry and exit, and what it saw."""
    async def interceptor(call: Any, proceed: Any) -> Any:
        log.append((name, "in", call.method, dict(call.metadata), call.deadline is not None))
        try:
            return await proceed()
        finally:
            log.append((name, "out", call.method))
    return interceptor


async def auth(call: CallContext, proceed: Any) -> Any:
    """A server interceptor: a call needs metadata ``token: good`` (else PermissionError, the
    method not run); the method sees ``user`` instead of the token; the answer says so."""
    if call.metadata.get("token") != "good":
        call.answer_metadata["auth"] = "refused"
        raise PermissionError("no valid token")
    del call.metadata["token"]
    call.metadata["user"] = "alice"
    call.answer_metadata["auth"] = "ok"
    return await proceed()


async def timing(call: CallContext, proceed: Any) -> Any:
    """A server interceptor that times the call (its admission included) into the answer's
    metadata."""
    t0 = perf_counter()
    try:
        return await proceed()
    finally:
        call.answer_metadata["server-ms"] = f"{(perf_counter() - t0) * 1000:.3f}"


def with_token(token: str) -> Any:
    """A client interceptor that adds ``token`` to every call's metadata."""
    async def interceptor(call: ClientCall, proceed: Any) -> Any:
        call.metadata["token"] = token
        return await proceed()
    return interceptor


@contextlib.asynccontextmanager
async def served(service: Service, *, interceptors: Sequence[Any] = (),
                 client_interceptors: Sequence[Any] = (), server_limit: int = 64,
                 grace: float = 5.0, clients: int = 1
                 ) -> AsyncIterator[tuple[list[RpcClient], RpcServer]]:
    """A server for ``service`` with ``interceptors``, and ``clients`` clients, each over a
    pair of its own (in memory, or TCP: :class:`~tests.rpc_services.Pairs`)."""
    async with connected(clients) as pairs:
        server = RpcServer(service, max_in_flight=server_limit, grace=grace,
                           interceptors=interceptors)
        serving = [asyncio.ensure_future(server.serve_connection(b)) for _, b in pairs]
        made = [RpcClient(a, max_in_flight=64, interceptors=client_interceptors)
                for a, _ in pairs]
        try:
            yield made, server
        finally:
            for c in made:
                c.abort()
            await asyncio.wait_for(server.aclose(), STEP)
            await asyncio.wait_for(asyncio.gather(*serving, return_exceptions=True), STEP)
