"""Live resource counts: how many verbs objects and loop registrations aiordma holds now.

Counted when a resource is created and when it is closed (once: every ``close()`` is
idempotent), or, for a region or queue pair dropped without closing, when the garbage collector
takes it (pyverbs destroys the verbs object then); never on the data path: the numbers a leak
check compares against a baseline (``aiordma.lowlevel.resource_counts``).
"""

from __future__ import annotations

import weakref

__all__ = ["RESOURCE_KINDS", "Share", "count_resource", "resource_counts"]

RESOURCE_KINDS = ("contexts", "pds", "completion_channels", "cqs", "qps", "mrs", "endpoints",
                  "fd_readers", "tcp_channels")
_live: dict[str, int] = dict.fromkeys(RESOURCE_KINDS, 0)


def resource_counts() -> dict[str, int]:
    """How many of aiordma's resources are open in this process right now.

    Counted when a resource is created and when it is closed (once: ``close()`` is
    idempotent) or, for a region or queue pair dropped unclosed, garbage-collected; never on
    the data path. Keys:

    * ``contexts``, ``pds``: verbs contexts and protection domains (one each per open
      :class:`Device`);
    * ``completion_channels``, ``cqs``: one each per open ``CompletionReactor``;
    * ``qps``: open ``QueuePair`` objects; ``mrs``: registered ``MemoryRegion`` objects;
    * ``endpoints``: :class:`~aiordma.Endpoint` objects not yet closed (``abort()``/
      ``aclose()`` release them);
    * ``fd_readers``: file descriptors aiordma registered with an event loop
      (``loop.add_reader``): completion channels, and the device watches;
    * ``tcp_channels``: connections over the TCP transport not yet closed.

    Returns:
        A new dict; compare two snapshots to find a leak.
    """
    return dict(_live)


def count_resource(kind: str, delta: int) -> None:
    """Adjust a live count (creation: +1, close: -1). Private to aiordma's modules."""
    _live[kind] += delta


def _give_back(kind: str, cell: list[int]) -> None:
    count_resource(kind, -cell[0])
    cell[0] = 0


class Share:
    """What one object adds to a live count: given back by its ``close()``, or by the garbage
    collector if the object is dropped without closing (pyverbs then destroys the verbs object
    it held, so the count follows what exists; the kernel's own list agrees)."""

    __slots__ = ("_cell", "_kind")

    def __init__(self, owner: object, kind: str, n: int = 1) -> None:
        self._kind = kind
        self._cell = [0]  # the finalizer holds this, not the owner (or it would never run)
        fin = weakref.finalize(owner, _give_back, kind, self._cell)
        fin.atexit = False  # nothing to give back when the interpreter ends
        self.add(n)

    def add(self, n: int = 1) -> None:
        self._cell[0] += n
        count_resource(self._kind, n)

    def give_back(self, n: int = 1) -> None:
        self._cell[0] -= n
        count_resource(self._kind, -n)
