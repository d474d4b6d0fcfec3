"""The collectives' errors: part of aiordma's exception family.

Peer failures during a collective are aiordma's own :class:`~aiordma.BrokenResourceError`
(a neighbour died or left), :class:`~aiordma.OperationTimeout` (the group's timeout expired)
and :class:`~aiordma.ClosedResourceError` (this process closed the group). The classes here
cover what is specific to groups.
"""

from __future__ import annotations

from aiordma import AiordmaError, BrokenResourceError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "CollectiveArgumentError", "CollectiveMismatchError", "GroupError", "LaunchEnvironmentError",
    "RendezvousError",
]


class GroupError(AiordmaError):
    """Base class of the errors specific to collectives groups."""


class LaunchEnvironmentError(GroupError):
    """The environment does not describe a group: a variable a launcher sets (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``SLURM_PROCID``, ``SLURM_NTASKS``) is
    missing or invalid.

    Attributes:
        missing: names of the variables that are missing (empty if one was invalid instead).
    """

    def __init__(self, message: str, *, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class RendezvousError(GroupError):
    """Rank 0 refused the group: a rank joined twice, a rank is out of range, or ranks
    disagree on the world size. Every rank of the rendezvous gets it, not only the culprit."""


class CollectiveMismatchError(GroupError, RemoteProtocolError):
    """Ranks called different collectives, or the same one with different arguments (op,
    dtype, element count, root, counts, shapes), or started them in a different order; or a
    ``recv`` got a message of another shape or dtype than the array it was given. The group
    is broken afterwards.

    The rank that noticed tells the others, which raise this error too (its message says
    which rank found what).

    Attributes:
        reported_by: the rank whose report this is, or None where this rank noticed it.
    """

    def __init__(self, message: str, *, reported_by: int | None = None) -> None:
        super().__init__(message)
        self.reported_by = reported_by


class CollectiveArgumentError(GroupError, LocalProtocolError):
    """A group or a collective was called with an argument it cannot use (a rank out of range,
    a port that is not one, an unknown op, a dtype the op does not support, a read-only array
    to reduce in place, a root out of range, a negative timeout, an ``out=`` of the wrong
    shape or dtype, counts that do not add up, an object that is not an array, a buffer or
    a DLPack tensor on the CPU). Raised before anything is sent: the group stays usable. A
    ``LocalProtocolError`` (and so a ``ValueError``), as every caller bug in aiordma."""


def fresh(exc: BaseException) -> BaseException:
    """A new exception like ``exc``, for one more waiter to raise (an exception instance is
    raised once: tracebacks and contexts attach to it)."""
    try:
        new = type(exc)(*exc.args)
    except Exception:  # noqa: BLE001  (a type with another signature)
        new = BrokenResourceError(str(exc))
    else:
        new.__dict__.update(getattr(exc, "__dict__", {}))  # (e.g. reported_by)
    new.__cause__ = exc.__cause__
    return new
