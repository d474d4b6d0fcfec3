"""What a group shares with its subgroups: the mesh of links, the operations running on them,
the order of each group's collectives, and failure.

Failure
    Every wait on a peer is bounded: by the endpoint's peer-death detection (a dead process
    closes its TCP liveness connection; keepalive notices a dead host in seconds), which fails
    the operation with :class:`~aiordma.BrokenResourceError`, and by the group's ``timeout``
    (:class:`~aiordma.OperationTimeout`). An operation that fails in any way, or is cancelled,
    leaves the ranks out of step, so it *breaks the group* (and its subgroups, which share its
    links): every operation still running on this rank fails with the same error, and the
    links close at once, which fails the other ranks' operations in turn, so a failure
    reaches every rank in a few round trips instead of leaving ranks waiting for their
    timeouts. A broken group raises :class:`~aiordma.BrokenResourceError` from then on; form
    a new one.

    Every link has a reader from formation on (:mod:`._links`), so a rank notices a link that
    breaks, or a message it cannot be running, at once, whatever its operations wait on.

    Ranks that disagree (a :class:`CollectiveMismatchError`: another kind of collective in
    the same place of the order, another dtype, size, op or root) tell each other: the rank
    that noticed sends a ``Fault`` with the reason to every rank, and closes its links
    gracefully (bounded), so the ``Fault`` arrives before the links go; a rank that gets one
    fails with a :class:`CollectiveMismatchError` saying what the other rank found, and
    passes it on the same way. So every rank raises the typed error, not only the one that
    noticed (a rank that saw a link break first raises
    :class:`~aiordma.BrokenResourceError` instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Protocol

from aiordma import BrokenResourceError, ClosedResourceError
from aiordma.protocols import collectives as proto

from ._errors import CollectiveMismatchError
from ._errors import fresh as _fresh
from ._links import Link

if TYPE_CHECKING:
    from ._mesh import Mesh
    from ._plane import Plane

__all__ = ["Fabric", "SignalSink"]

log = logging.getLogger("aiordma.services.collectives")
_REPORT_BOUND = 2.0  # seconds: sending the Fault and closing gracefully after a mismatch


class SignalSink(Protocol):
    """A window's signal counters, as the links' reader reaches them (see :mod:`._window`)."""

    def signal(self, counter: int) -> None:
        """One signal for ``counter`` arrived (after the data it announces)."""

    def end(self, exc: BaseException) -> None:
        """The group closed or broke: fail the waiters with ``exc``."""


class Fabric:
    """The shared state of a group and its subgroups on one rank (see the module)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.mesh: Mesh | None = None
        self.plane: Plane | None = None
        self.orders: dict[int, proto.CallOrder] = {}  # group number -> its collectives' order
        self.running: set[asyncio.Task[object]] = set()
        self.failure: BaseException | None = None
        self.closed = False
        # (group number, SIGNAL_CHANNEL, window's call number) -> the window's signal counters
        self.signals: dict[tuple[int, int, int], SignalSink] = {}
        self._closing: asyncio.Task[None] | None = None
        self.engines: list[Any] = []  # each group's and subgroup's EngineSlot (see _engine)
        self.on_engine: dict[int, set[int]] = {}  # group number -> its calls on its engine

    # -- the links' reports (see _links.Router) -------------------------------------------------

    def check(self, event: proto.Piece | proto.Value | proto.Inline, peer: int) -> None:
        if event.channel:
            return  # point-to-point: matched by its own numbering
        order = self.orders.get(event.group)
        if order is None:
            return  # a subgroup this rank has not made yet
        try:
            order.check(event.call, event.op, peer)
        except proto.MismatchError as exc:
            raise CollectiveMismatchError(f"rank {self.rank}: {exc}") from None
        if event.call in self.on_engine.get(event.group, ()):
            raise CollectiveMismatchError(
                f"rank {self.rank}: rank {peer} sent a {proto.KINDS[event.op]} message for "
                f"collective #{event.call} over the links; this rank runs it on its step "
                f"engine: the ranks disagree on its size (more than the engine takes on one "
                f"of them)")

    def signal(self, event: proto.Value) -> None:
        sink = self.signals.get((event.group, event.channel, event.call))
        if sink is not None:  # (else a window closed here: a late signal has no one to wake)
            sink.signal(event.step)

    def fault(self, peer: int, reason: str) -> BaseException:
        message = reason if reason.startswith(f"rank {peer}:") else f"rank {peer}: {reason}"
        self.fail(CollectiveMismatchError(message, reported_by=peer))
        return self.echo() if self.failure is not None else BrokenResourceError(message)

    def failed(self, exc: BaseException, peer: int) -> None:
        if self.closed or self.failure is not None:
            return  # closed here (by either side), or the group already knows
        if not isinstance(exc, CollectiveMismatchError):
            wrapped = BrokenResourceError(f"rank {self.rank}: the link with rank {peer} broke: "
                                          f"{exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        self.fail(exc)

    # -- failure ----------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """Break the group with ``exc`` (the first failure wins): fail every operation running
        on it, and close the links (see the module)."""
        if self.failure is not None or self.closed:
            return
        self.failure = exc
        current = asyncio.current_task()
        for t in list(self.running):
            if t is not current:
                t.cancel()
        if isinstance(exc, CollectiveMismatchError) and self.mesh is not None:
            self._closing = asyncio.get_running_loop().create_task(self._report(str(exc)))
        else:
            self.abort()

    def echo(self) -> BaseException:
        """The failure again, for one more operation that it ended: the same typed error for
        a mismatch or a broken link; for anything else (a timeout, a cancellation or an error
        of another operation), :class:`~aiordma.BrokenResourceError` saying what."""
        failure = self.failure
        assert failure is not None
        if isinstance(failure, (CollectiveMismatchError, BrokenResourceError)):
            return _fresh(failure)
        exc = BrokenResourceError(f"rank {self.rank}: the group broke under this operation: "
                                  f"another one failed ({failure!r})")
        exc.__cause__ = failure
        return exc

    async def _report(self, reason: str) -> None:
        """Tell every rank why the group broke, then close (see the module)."""
        plane = self.plane
        try:
            if plane is not None:
                plane.stop()
                def fault(ep: Link) -> bytes:  # (cut to fit a slot: see _links.eager)
                    cut = reason.encode()[:min(1900, max(0, ep.eager_max - 16))]
                    return proto.encode(proto.Fault(reason=cut.decode(errors="ignore")))

                async with asyncio.timeout(_REPORT_BOUND):
                    await asyncio.gather(*(out.ep.send(fault(out.ep))
                                           for out in plane.outs.values()),
                                         return_exceptions=True)
                    if self.mesh is not None:
                        await self.mesh.aclose()
        except Exception as exc:  # noqa: BLE001  (the group is broken already; report it only)
            log.debug("rank %d: reporting a mismatch: %r", self.rank, exc)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close everything at once: this rank's operations fail with
        :class:`~aiordma.ClosedResourceError` (or the group's failure), the other ranks' with
        :class:`~aiordma.BrokenResourceError`. Idempotent."""
        self._end_windows()
        self._close_engines()
        if self.plane is not None:
            self.plane.stop()
        if self.mesh is not None:
            self.mesh.abort()

    def _close_engines(self) -> None:
        for slot in self.engines:
            slot.close()

    def _end_windows(self) -> None:
        """Wake every window's signal waiters (the group is closing or broke)."""
        exc = self.echo() if self.failure is not None else None
        for sink in list(self.signals.values()):
            sink.end(exc if exc is not None else ClosedResourceError("the group was closed"))

    def end_subgroup_windows(self, group: int) -> None:
        """Wake the signal waiters of subgroup ``group``'s windows: that subgroup was closed
        (its windows' waits end at once, typed, as the whole group's do when it closes)."""
        for key, sink in list(self.signals.items()):
            if key[0] == group:
                sink.end(ClosedResourceError("the subgroup was closed"))

    async def aclose(self) -> None:
        """Close gracefully (see :meth:`~._mesh.Mesh.aclose`); idempotent."""
        if self._closing is not None:
            with contextlib.suppress(Exception):
                await self._closing
        if self.closed:
            return
        self.closed = True
        self._end_windows()
        self._close_engines()
        if self.plane is not None:
            self.plane.stop()
        if self.mesh is not None:
            await self.mesh.aclose()

    def close_now(self) -> None:
        """Close everything at once (``Group.abort()`` of the whole group)."""
        self.closed = self.closed or self.failure is None
        self.abort()
