"""Raw verbs building blocks under aiordma's friendly API.

For users who want to drive queue pairs themselves: open a :class:`Device`, create a
:class:`CompletionReactor` (a CQ watched by the event loop), queue pairs on it and memory
regions, and await single work requests. The pyverbs objects are reachable as ``.raw`` /
``.cq`` / ``.context`` / ``.pd``.

:func:`verbs_path` says whether new reactors and queue pairs use the compiled fast path or
pyverbs' objects (``AIORDMA_FASTPATH=0`` forces the latter).

:func:`resource_counts` reports the verbs objects, loop registrations and endpoints aiordma
holds open right now (a leak check compares it with a baseline).
"""

from aiordma._device.device import (
    Device,
    DeviceInfo,
    GidInfo,
    PortInfo,
    list_devices,
    no_device_reason,
    open_devices,
    resource_counts,
)
from aiordma._endpoint.qp import QPAddress, QueuePair, connect_pair
from aiordma._memory.region import LocalSlice, MemoryRegion, RemoteBuffer
from aiordma._reactor.reactor import CompletionReactor, resolve_future
from aiordma._verbs.compiled import describe as verbs_path

__all__ = [
    "CompletionReactor",
    "Device",
    "DeviceInfo",
    "GidInfo",
    "LocalSlice",
    "MemoryRegion",
    "PortInfo",
    "QPAddress",
    "QueuePair",
    "RemoteBuffer",
    "connect_pair",
    "list_devices",
    "no_device_reason",
    "open_devices",
    "resolve_future",
    "resource_counts",
    "verbs_path",
]
