"""What the bench needs of a link between two hosts to run its rows across it.

Areas (a)-(g) can run across a wire: the peer processes and perftest's servers on the far
host, the clients here, and each row proven to have crossed the link by counters on both
hosts (on one rxe device, rxe loops the traffic back inside the driver, so a row that never
left the device must fail rather than pass as an across-the-wire figure). The bench itself
reaches no other host and boots nothing: :func:`aiordma.bench.run_bench` is handed a
:class:`Link`. The repository's developer harness has one, across two VMs joined by a
private link (``harness/bench/wire.py``, ``python -m harness bench``); it is not installed.

Each row declares what it moves at least (:class:`Payload`); the link's
:meth:`Link.crossed` checks the counters against it and raises :class:`NotCrossed` when they
moved less.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, Self

from aiordma import AiordmaError

__all__ = ["End", "Link", "NotCrossed", "Payload", "RemoteProcess"]


@dataclass(frozen=True, slots=True)
class Payload:
    """What a row moves at least, in payload bytes, from this host (``sent``) and to it
    (``received``); ``roce``: by RDMA (False for the TCP baseline). A lower bound: warm-up,
    headers, acknowledgements and set-up only add to it."""

    sent: int
    received: int
    roce: bool = True


class NotCrossed(AiordmaError):
    """A row's traffic did not show on the link: it did not cross the wire (e.g. both ends
    were on one device)."""


class End(Protocol):
    """One host's end of the link: the RDMA port and GID carrying ``address``, and the
    network interface under it."""

    @property
    def address(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def gid_index(self) -> int: ...

    @property
    def netdev(self) -> str: ...


class RemoteProcess(Protocol):
    """A process started on the far host (:meth:`Link.start`). Leaving the ``with`` block
    (or :meth:`kill`) kills it and its process group."""

    @property
    def argv(self) -> list[str]: ...

    @property
    def stderr(self) -> str: ...

    def poll(self) -> int | None:
        """Its exit status if it has exited, else None."""

    def wait(self, timeout: float) -> int:
        """Its exit status.

        Raises:
            OperationTimeout: still running after ``timeout`` seconds.
            AiordmaError: the far host is gone.
        """

    def expect(self, prefix: str, timeout: float) -> str:
        """Its stdout's first line that starts with ``prefix``.

        Raises:
            AiordmaError: it exited first, said nothing within ``timeout``, or the host is
                gone.
        """

    def kill(self) -> None:
        """Kill it and its process group."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class Link(Protocol):
    """This host (:attr:`here`, the clients) and the far one (:attr:`there`, the servers)."""

    @property
    def here(self) -> End: ...

    @property
    def there(self) -> End: ...

    def start(self, argv: list[str]) -> RemoteProcess:
        """Start ``argv`` on the far host (paths as here: both hosts see the same files).

        Raises:
            AiordmaError: the far host does not answer.
        """

    def snapshot(self) -> Any:
        """Both hosts' counters now (for :meth:`crossed`)."""

    def crossed(self, before: Any, payload: Payload, *, mtu: int) -> str:
        """Whether a row that moved ``payload`` since ``before`` (a :meth:`snapshot`) crossed
        the link; the proof in words.

        Raises:
            NotCrossed: the counters moved less than the payload needs.
        """

    def lossy(self, percent: float) -> AbstractContextManager[None]:
        """Frames lost with probability ``percent`` % on both ends for the block (nothing at
        0), and removed after, also when the block fails."""

    def describe(self) -> str:
        """Both ends in words (the report's header)."""
