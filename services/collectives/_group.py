"""The public :class:`Group`: its operations are defined by topic in :mod:`._data_ops`,
:mod:`._reduce_ops` and :mod:`._p2p`, on the machinery of :mod:`._core` (formation, running an
operation, subgroups, lifecycle); failure is :mod:`._fabric`'s, the links :mod:`._links`'.

Which algorithm each collective runs is picked per call by
:func:`aiordma.protocols.collectives.choose` from the array's size and the group's size, the
same way on every rank: :mod:`._rounds` (few rounds, for small arrays), :mod:`._ring`
(bandwidth-optimal, for large ones) and :mod:`._direct` (every block straight to its rank).
"""

from __future__ import annotations

from aiordma.protocols import collectives as proto

from ._arrays import REDUCE_OPS
from ._core import MAX_WORLD
from ._data_ops import DataMovement
from ._mesh import Rendezvous
from ._p2p import PointToPoint
from ._reduce_ops import Reductions
from ._window import Window, Windows

__all__ = ["MAX_WORLD", "REDUCE_OPS", "Group", "Rendezvous", "Thresholds", "Window"]

Thresholds = proto.Thresholds


class Group(DataMovement, Reductions, PointToPoint, Windows):
    """A group of ``world_size`` ranks (processes, usually on several hosts) that run
    collectives over RDMA: :meth:`barrier`, :meth:`broadcast`, :meth:`allgather`,
    :meth:`gather`, :meth:`scatter`, :meth:`alltoall`, :meth:`alltoallv`, :meth:`allreduce`,
    :meth:`reduce` and :meth:`reduce_scatter`, point-to-point :meth:`send` and :meth:`recv`,
    subgroups (:meth:`split`, :meth:`subgroup`), and windows for one-sided algorithms of
    your own (:meth:`window`: put, get, signals, fence). Arrays are numpy arrays, CPU tensors
    through DLPack (a torch tensor works as is) or buffers; ``out=`` where MPI or torch take
    an output.

    Form it with :meth:`from_env` (under torchrun, mpirun, srun, or ``python -m
    aiordma.services.collectives.launch``) or :meth:`join`, and use it as ``async with``.
    Its links are RDMA, or TCP where a rank has no usable device (:attr:`transport`).

    The ordering rule
        Every rank must start a group's collectives in the same order, with matching
        arguments (as with MPI). Several may be in flight at once, on one group and on its
        subgroups: ``await asyncio.gather(*(g.allreduce(b) for b in buckets))`` runs them
        overlapped on the wire. A collective takes its place in the order when it *starts*:
        when the coroutine first runs, which for ``asyncio.gather`` and ``create_task`` is
        the order the tasks were made in. A rank that starts them in another order than the
        others, or with another kind, op, dtype, size or root, raises
        :class:`CollectiveMismatchError` naming both operations, and so do the others (the
        rank that noticed tells them), instead of waiting. ``send``/``recv`` are outside that
        order (matched by source, tag and order of sends).

    Failure
        An operation that fails in any way, or is cancelled, breaks the group and its
        subgroups (every other operation in flight fails with the same error, and the other
        ranks' fail in turn); see :mod:`._fabric`.

    Attributes:
        rank, world_size: this rank and the group's size.
        members: the group's ranks in the group formed by ``join``/``from_env``.
        timeout: the default bound, in seconds, on each operation (``None``: unbounded, only
            peer death ends a wait).
        calls: collectives started so far.
        thresholds: the sizes where each collective's algorithm changes.
    """
