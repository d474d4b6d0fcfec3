"""aiordma: asyncio RDMA messaging.

Completion channels are watched as file descriptors by the event loop (standard asyncio or
uvloop, no progress thread); queue pairs, memory regions and one-sided operations are awaited.
Where a side has no RDMA device, connections carry their messages over TCP instead
(:class:`TcpChannel`; ``transport=`` of :func:`connect` and :func:`listen`). Raw building
blocks live in :mod:`aiordma.lowlevel`; the RPC layer is :mod:`aiordma.rpc`; the
sans-I/O wire protocols are :mod:`aiordma.protocols`, the services :mod:`aiordma.services`.

The names below are loaded on first use, so ``import aiordma.protocols`` (sans-I/O, no asyncio,
no pyverbs) does not pull in the event-loop half of the library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "Listener": "_endpoint.listener", "connect": "_endpoint.connect",
    "listen": "_endpoint.listener",
    "Config": "_endpoint.config", "Endpoint": "_endpoint.endpoint",
    "EndpointStats": "_endpoint.config", "Immediate": "protocols.messages",
    "LocalSlice": "_memory.region", "MemoryRegion": "_memory.region",
    "RemoteBuffer": "_memory.region", "Exposure": "_memory.window",
    "TcpChannel": "_tcp.channel",
    **{name: "_errors" for name in (
        "AiordmaError", "AuthenticationError", "BrokenResourceError", "BusyResourceError",
        "ClosedResourceError", "CompletionError", "ConnectionRejectedError", "DeviceError",
        "LocalAccessError", "LocalProtocolError", "OperationTimeout", "PeerUnreachableError",
        "RemoteAccessError", "RemoteProtocolError", "UnsupportedOperationError")},
}

__all__ = [
    "AiordmaError", "AuthenticationError", "BrokenResourceError", "BusyResourceError",
    "ClosedResourceError", "CompletionError", "Config", "ConnectionRejectedError", "DeviceError",
    "Endpoint", "EndpointStats", "Exposure", "Immediate", "Listener", "LocalAccessError",
    "LocalProtocolError", "LocalSlice", "MemoryRegion", "OperationTimeout", "PeerUnreachableError", "RemoteAccessError",
    "RemoteBuffer", "RemoteProtocolError", "TcpChannel", "UnsupportedOperationError",
    "__version__", "connect", "listen",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'aiordma' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


if TYPE_CHECKING:
    from aiordma._endpoint.config import Config, EndpointStats
    from aiordma._endpoint.connect import connect
    from aiordma._endpoint.endpoint import Endpoint
    from aiordma._endpoint.listener import Listener, listen
    from aiordma._errors import (
        AiordmaError,
        AuthenticationError,
        BrokenResourceError,
        BusyResourceError,
        ClosedResourceError,
        CompletionError,
        ConnectionRejectedError,
        DeviceError,
        LocalAccessError,
        LocalProtocolError,
        OperationTimeout,
        PeerUnreachableError,
        RemoteAccessError,
        RemoteProtocolError,
        UnsupportedOperationError,
    )
    from aiordma._memory.region import LocalSlice, MemoryRegion, RemoteBuffer
    from aiordma._memory.window import Exposure
    from aiordma._tcp.channel import TcpChannel
    from aiordma.protocols.messages import Immediate
