"""The transport seam: what the RPC layer and the services need of a connection.

:class:`MessageChannel` is a small structural protocol: ordered, reliable messages both ways,
a graceful close and an abort. :class:`aiordma.Endpoint` implements it over RDMA, the TCP
transport's channel (``aiordma.connect(..., transport="tcp")``) over TCP, and
:func:`aiordma.testing.channel_pair` in memory, all with the same semantics, so the RPC layer
and the services run unchanged over any of them, and are tested without a device. A channel
says which it is in ``transport`` (``"rdma"``, ``"tcp"``, ``"memory"``). The contract both keep is written
down as executable checks in :mod:`aiordma.testing` (``CONTRACT``), run against both.

The contract, in words:

* ``send(data)`` takes any contiguous bytes-like object (empty included); messages arrive in
  order, whole, once. A message up to ``eager_max`` bytes is copied at once (``send`` may
  return before the peer reads it); a larger one is held until the peer has taken it into its
  receive buffer or a receiver. ``send`` waits while the peer's receive buffer and slots are
  full (backpressure); a cancelled ``send`` that had not gone yet sends nothing.
* ``send_nowait(data)`` sends an eager message now if nothing is queued before it and there is
  room, and returns ``True``; else it sends nothing and returns ``False``.
* ``recv()`` returns the next message as a new ``bytearray``, or ``None`` once the peer closed
  gracefully and every message it sent was delivered. ``recv_into(buffer)`` copies the next
  message into ``buffer`` and returns its size (``-1`` at the end); a message larger than
  ``buffer`` stays queued and :class:`~aiordma.LocalProtocolError` is raised. A cancelled
  receive loses no message.
* ``aclose()`` flushes what was sent, tells the peer and releases everything (bounded);
  ``abort()`` releases at once. Both are idempotent. Afterwards every operation on this side
  raises :class:`~aiordma.ClosedResourceError`; the peer's ``send`` raises
  :class:`~aiordma.BrokenResourceError`; the peer's ``recv`` delivers what arrived, then
  returns ``None`` (graceful close) or raises ``BrokenResourceError`` (abort, peer death).
* Bad arguments raise :class:`~aiordma.LocalProtocolError` and send nothing: not a
  contiguous bytes-like object, or larger than ``peer_max_message``.

:class:`ReadyChannel` adds a receive path without a waiting task, which the RPC layer uses
where a channel offers it (all three above do; any other channel is read with ``recv()``):

* ``recv_nowait()`` returns the next message, as ``recv()`` would, if it can be taken at once;
  else ``None`` (nothing arrived, or what is next needs ``recv()``: the end, a failure, a
  message still to be read).
* ``call_when_readable(callback)`` returns ``False`` if something is there for ``recv()`` or
  ``recv_nowait()`` already (a message, the end, a failure, or the channel is closed), and
  arranges nothing; else ``True``, and ``callback()`` is called once when something may have
  changed for receivers: a message arrived (from the transport's wake-up, never inside a
  ``send``; on an RDMA endpoint once the completion queue's drain is over, so one call
  finds every message that drain brought), or the channel ended (possibly inside the call that ended it, e.g. ``abort()``).
  It may find nothing new: it then asks again. Use one receiving path at a time: while a
  callback is armed, nobody else receives. (A wrapper whose ``recv()`` does more than its
  inner channel's must not pass these two on: it is then read with ``recv()``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["MessageChannel", "ReadyChannel"]


@runtime_checkable
class MessageChannel(Protocol):
    """One end of a message connection (see the module documentation for the contract)."""

    peer_address: Any
    transport: str
    """What carries the messages: ``"rdma"``, ``"tcp"``, ``"memory"`` (or a channel's own)."""

    @property
    def eager_max(self) -> int:
        """The largest message ``send`` copies at once (larger ones wait for the reader)."""
        ...

    @property
    def peer_max_message(self) -> int:
        """The largest message the peer accepts."""
        ...

    @property
    def closed(self) -> bool:
        """This side closed (and released) the channel."""
        ...

    @property
    def broken(self) -> bool:
        """The peer or the transport broke the channel."""
        ...

    async def send(self, data: Any) -> None: ...

    def send_nowait(self, data: Any) -> bool: ...

    async def recv(self) -> bytearray | None: ...

    async def recv_into(self, buffer: Any) -> int: ...

    async def aclose(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class ReadyChannel(MessageChannel, Protocol):
    """A :class:`MessageChannel` that can also be read without a waiting task (see the module
    documentation): the RPC layer's client and server take each message from the channel's
    wake-up then, without a task switch in between."""

    def recv_nowait(self) -> bytearray | None: ...

    def call_when_readable(self, callback: Callable[[], object]) -> bool: ...
