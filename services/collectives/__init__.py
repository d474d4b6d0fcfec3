"""Collectives over RDMA: a group of ranks in separate processes (on one host or many) that
run ``barrier``, ``broadcast``, ``allgather``, ``gather``, ``scatter``, ``alltoall(v)``,
``allreduce``, ``reduce``, ``reduce_scatter`` and point-to-point ``send``/``recv`` of numpy
arrays (or DLPack tensors, or buffers), several at a time and on subgroups, moving the data in
messages (small pieces) or by RDMA WRITE into receive slots registered once per group; or, where
a rank has no RDMA device, over TCP (every piece in a message: ``Group.join(transport=...)``).

.. code-block:: python

    from aiordma.services.collectives import Group

    async with await Group.from_env(timeout=60) as g:  # torchrun / srun / launch set the env
        await g.barrier()
        arr = await g.broadcast(arr, root=0)          # root's array on every rank
        parts = await g.allgather(arr)                # one array per rank, in rank order
        await g.allreduce(arr, op="sum")              # in place; sum prod max min avg band...
        await asyncio.gather(*(g.allreduce(b) for b in buckets))  # several in flight
        half = await g.split(g.rank % 2)              # subgroups, on the same links
        async with await g.window(buf) as win:        # one-sided: your own algorithms
            await win.put(arr, (g.rank + 1) % g.world_size, 0, signal=0)
            await win.wait_signal(0)                  # the left neighbour's data is in buf

Start the processes with torchrun, srun, or the local launcher::

    python -m aiordma.services.collectives.launch -n 4 -- python my_script.py

Formation is described in :mod:`aiordma.services.collectives._mesh`, the choice of algorithm
in :mod:`._group`, running operations and subgroups in :mod:`._core`, failure in
:mod:`._fabric`, the links (receive slots, credits, WRITE then message, filing messages of
operations in flight) in :mod:`._links`, windows (one-sided put, get and signals) in
:mod:`._window`, the algorithms in :mod:`._rounds` (few rounds, small arrays), :mod:`._ring`
(bandwidth-optimal, large ones) and :mod:`._direct` (straight to each rank), the messages, the ordering rule and the schedules in
:mod:`aiordma.protocols.collectives`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._env import LaunchEnvironment, launch_environment
    from ._errors import (
        CollectiveArgumentError,
        CollectiveMismatchError,
        GroupError,
        LaunchEnvironmentError,
        RendezvousError,
    )
    from ._group import REDUCE_OPS, Group, Thresholds
    from ._window import Window

# Imported on first use (PEP 562), so that `python -m aiordma.services.collectives.launch` starts
# without loading numpy, aiordma and pyverbs: the launcher only starts processes.
_WHERE = {
    "LaunchEnvironment": "._env", "launch_environment": "._env",
    "CollectiveArgumentError": "._errors", "CollectiveMismatchError": "._errors",
    "GroupError": "._errors", "LaunchEnvironmentError": "._errors",
    "RendezvousError": "._errors", "Group": "._group", "REDUCE_OPS": "._group",
    "Thresholds": "._group", "Window": "._window",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "REDUCE_OPS",
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "Group",
    "GroupError",
    "LaunchEnvironment",
    "LaunchEnvironmentError",
    "RendezvousError",
    "Thresholds",
    "Window",
    "launch_environment",
]
