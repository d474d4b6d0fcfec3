"""What every message channel says of its life (an RDMA :class:`~aiordma.Endpoint` and a
:class:`~aiordma.TcpChannel` alike): closed, broken, its state, and a close that runs once.

Both keep the message protocol's lifecycle (``_proto.state``), the error that broke them
(``_error``), the event set when the closing exchange is over (``_peer_close``) and their own
``_graceful_close()``; this mixin holds what they do the same with them."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Self

from aiordma.protocols.messages import Lifecycle

__all__ = ["ChannelLife"]


class ChannelLife:
    """The lifecycle half of the :class:`~aiordma.transport.MessageChannel` contract."""

    if TYPE_CHECKING:
        _proto: Any
        _error: BaseException | None
        _peer_close: asyncio.Event
        _close_task: asyncio.Task[None] | None
        _loop: asyncio.AbstractEventLoop

        async def _graceful_close(self) -> None: ...

    @property
    def closed(self) -> bool:
        """This side closed (and released) it."""
        return self._proto.state is Lifecycle.RELEASED

    @property
    def broken(self) -> bool:
        """The peer, the network or the device broke it."""
        return self._error is not None

    @property
    def state(self) -> str:
        """The lifecycle state's name (``aiordma.protocols.messages.Lifecycle``): ``OPEN``,
        ``CLOSING``, ``CLOSE_SENT``, ``PEER_CLOSED``, ``CLOSED``, ``BROKEN`` or ``RELEASED``."""
        return self._proto.state.name

    async def _wait_gone(self) -> BaseException | None:
        """Return once it is no longer usable: the peer broke it (then its error is returned),
        or it was closed (by either side: None). For aiordma's own services that must notice a
        link breaking while they wait on others (the collectives' group)."""
        await self._peer_close.wait()
        return self._error

    async def aclose(self) -> None:
        """Close gracefully: send what is queued, wait until the peer has read every message
        that waits for it (rendezvous messages included), tell the peer how many messages were
        sent, wait up to ``Config.close_timeout`` in all for the peer to confirm it received
        them, then release everything (always, even if the graceful part fails). Idempotent;
        concurrent callers share one close."""
        if self._close_task is None:
            self._close_task = self._loop.create_task(self._graceful_close())
        await asyncio.shield(self._close_task)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
