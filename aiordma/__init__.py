"""aiordma: asyncio RDMA messaging.

Completion channels are watched as file descriptors by the event loop (standard asyncio or
uvloop, no progress thread); queue pairs, memory regions and one-sided operations are awaited.
Raw building blocks live in :mod:`aiordma.lowlevel`.
"""

from ._connect import Listener, connect, listen
from ._endpoint import Config, Endpoint, EndpointStats
from ._errors import (
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
)
from ._memory import LocalSlice, MemoryRegion, RemoteBuffer
from ._window import Exposure

__version__ = "0.1.0"

__all__ = [
    "AiordmaError",
    "AuthenticationError",
    "BrokenResourceError",
    "BusyResourceError",
    "ClosedResourceError",
    "CompletionError",
    "Config",
    "ConnectionRejectedError",
    "DeviceError",
    "Endpoint",
    "EndpointStats",
    "Exposure",
    "Listener",
    "LocalAccessError",
    "LocalProtocolError",
    "LocalSlice",
    "MemoryRegion",
    "OperationTimeout",
    "PeerUnreachableError",
    "RemoteAccessError",
    "RemoteBuffer",
    "RemoteProtocolError",
    "__version__",
    "connect",
    "listen",
]
