"""Live resource counts: how many verbs objects and loop registrations aiordma holds now.

Counted when a resource is created and when it is closed (once: every ``close()`` is
idempotent), never on the data path: the numbers a leak check compares against a baseline
(``aiordma.lowlevel.resource_counts``).
"""

from __future__ import annotations

__all__ = ["RESOURCE_KINDS", "count_resource", "resource_counts"]

RESOURCE_KINDS = ("contexts", "pds", "completion_channels", "cqs", "qps", "mrs", "endpoints",
                  "fd_readers")
_live: dict[str, int] = dict.fromkeys(RESOURCE_KINDS, 0)


def resource_counts() -> dict[str, int]:
    """How many of aiordma's resources are open in this process right now.

    Counted when a resource is created and when it is closed (once: ``close()`` is
    idempotent), never on the data path. Keys:

    * ``contexts``, ``pds``: verbs contexts and protection domains (one each per open
      :class:`Device`);
    * ``completion_channels``, ``cqs``: one each per open ``CompletionReactor``;
    * ``qps``: open ``QueuePair`` objects; ``mrs``: registered ``MemoryRegion`` objects;
    * ``endpoints``: :class:`~aiordma.Endpoint` objects not yet closed (``abort()``/
      ``aclose()`` release them);
    * ``fd_readers``: file descriptors aiordma registered with an event loop
      (``loop.add_reader``): completion channels, and the device watches.

    Returns:
        A new dict; compare two snapshots to find a leak.
    """
    return dict(_live)


def count_resource(kind: str, delta: int) -> None:
    """Adjust a live count (creation: +1, close: -1). Private to aiordma's modules."""
    _live[kind] += delta
