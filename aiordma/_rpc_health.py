"""The RPC server's built-in health method, ``_aiordma.health``: every :class:`RpcServer`
answers it itself, whatever its service (a service's own methods cannot take the name: it is
not a Python identifier). A pool of replicas (:mod:`aiordma._rpc_pool`) calls it when it
connects and then periodically: an answer means the server's event loop runs and reads its
connection; the answer also says which of the service's methods were declared
``@method(idempotent=True)``, so that the pool knows which calls it may send again elsewhere.

It is a plain ``def``: it runs inline as its request is read (no task, no admission), so a
server busy with ``max_in_flight`` long calls still answers it at once, and one whose loop is
stuck does not. A server that is shutting down refuses it like any call
(:class:`~aiordma.rpc.RemoteError` ``ClosedResourceError``), which a pool takes as "eject"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._rpc_service import _RPC_IDEMPOTENT, _RPC_METHOD, Service

__all__ = ["BUILTIN_PREFIX", "HEALTH", "builtin_method", "idempotent_methods"]

BUILTIN_PREFIX = "_aiordma."
"""The name space of methods a server answers itself."""

HEALTH = "_aiordma.health"
"""The health method's name."""


def idempotent_methods(service: Service) -> list[str]:
    """The names of ``service``'s methods declared ``@method(idempotent=True)``, sorted."""
    cls = type(service)
    return sorted(name for name in dir(cls)
                  if getattr(getattr(cls, name, None), _RPC_IDEMPOTENT, False)
                  and getattr(getattr(cls, name, None), _RPC_METHOD, False))


def builtin_method(service: Service, name: str) -> Callable[..., Any] | None:
    """The built-in method called ``name`` of a server serving ``service``, or None."""
    if name != HEALTH:
        return None
    answer = {"status": "serving", "idempotent": idempotent_methods(service)}

    def health() -> dict[str, Any]:
        return answer

    return health
