"""Collectives over RDMA: a group of ranks in separate processes (on one host or many) that
run ``barrier``, ``broadcast``, ``allgather`` and ring ``allreduce`` of numpy arrays, moving
the data by RDMA WRITE.

.. code-block:: python

    from services.collectives import Group

    async with await Group.from_env(timeout=60) as g:  # torchrun / srun / launch set the env
        await g.barrier()
        arr = await g.broadcast(arr, root=0)          # root's array on every rank
        parts = await g.allgather(arr)                # one array per rank, in rank order
        await g.allreduce(arr, op="sum")              # in place; "sum", "prod", "max", "min"

Start the processes with torchrun, srun, or the local launcher::

    python -m services.collectives.launch -n 4 -- python my_script.py

Formation and failure handling are described in :mod:`services.collectives._group`, the data
plane (receive slots, credits, the ring algorithms) in :mod:`services.collectives._ring`, the
messages and schedules in :mod:`protocols.collectives`.
"""

from ._env import LaunchEnvironment, launch_environment
from ._errors import (
    CollectiveArgumentError,
    CollectiveMismatchError,
    GroupError,
    LaunchEnvironmentError,
    RendezvousError,
)
from ._group import Group
from ._ring import REDUCE_OPS

__all__ = [
    "REDUCE_OPS",
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "Group",
    "GroupError",
    "LaunchEnvironment",
    "LaunchEnvironmentError",
    "RendezvousError",
    "launch_environment",
]
