"""Built-in methods: what every :class:`~aiordma.rpc.RpcServer` answers besides its service's
methods, in a name space of their own (names that start with :data:`PREFIX`, which a
service's method, a Python identifier, cannot have).

A built-in is a function of the server (and the call's arguments), registered here with
:func:`builtin`; the server binds it to itself on first use and runs it like a method (a plain
``def`` inline, an ``async def`` in a task), interceptors and counters included. Built-ins
are answered while the server drains (operators watch the drain through them); the service's
methods are refused then. Adding one is one function here, like :func:`health`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from aiordma.rpc._service import _RPC_IDEMPOTENT, _RPC_METHOD

__all__ = ["HEALTH", "PREFIX", "STATS", "builtin", "idempotent_methods", "lookup", "names"]

PREFIX = "aiordma."
"""The reserved name space of built-in methods."""

STATS = "aiordma.stats"
"""The built-in that answers :meth:`~aiordma.rpc.RpcServer.stats` (``aiordma stats``)."""

HEALTH = "aiordma.health"
"""The built-in a pool of replicas (:mod:`aiordma.rpc._pool`) checks a server with."""

F = TypeVar("F", bound=Callable[..., Any])
_BUILTINS: dict[str, Callable[..., Any]] = {}


def builtin(name: str) -> Callable[[F], F]:
    """Register ``fn(server, *args, **kwargs)`` as the built-in method ``name`` (which starts
    with :data:`PREFIX`)."""
    if not name.startswith(PREFIX) or name in _BUILTINS:
        raise ValueError(f"a built-in's name starts with {PREFIX!r} and is new: {name!r}")

    def register(fn: F) -> F:
        _BUILTINS[name] = fn
        return fn
    return register


def lookup(name: str, server: Any) -> Callable[..., Any] | None:
    """Built-in ``name`` bound to ``server``, or None if there is none of that name."""
    fn = _BUILTINS.get(name)
    if fn is None:
        return None
    return functools.partial(fn, server)  # (inspect sees through it: async def or not)


def names() -> tuple[str, ...]:
    """The built-ins' names."""
    return tuple(_BUILTINS)


@builtin(STATS)
def stats(server: Any) -> dict[str, Any]:
    """The server's counters: :meth:`~aiordma.rpc.RpcServer.stats`."""
    result: dict[str, Any] = server.stats()
    return result


def idempotent_methods(service: Any) -> list[str]:
    """The names of ``service``'s methods declared ``@method(idempotent=True)``, sorted."""
    cls = type(service)
    return sorted(name for name in dir(cls)
                  if getattr(getattr(cls, name, None), _RPC_IDEMPOTENT, False)
                  and getattr(getattr(cls, name, None), _RPC_METHOD, False))


@builtin(HEALTH)
def health(server: Any) -> dict[str, Any]:
    """Whether the server takes calls, and which of its service's methods are idempotent:
    ``{"status": "serving" | "draining", "idempotent": [names]}``. A pool of replicas calls
    it when it connects and then periodically: an answer means the server's event loop runs
    and reads its connection (a plain ``def``: it runs inline as its request is read, no task
    and no admission, so a server busy with ``max_in_flight`` long calls still answers it at
    once, and one whose loop is stuck does not); ``"draining"`` (see
    :meth:`~aiordma.rpc.RpcServer.drain`) tells the pool to stop sending calls there and to
    let those it sent finish."""
    return {"status": "draining" if server.draining else "serving",
            "idempotent": idempotent_methods(server.service)}
