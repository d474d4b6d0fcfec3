"""What the message protocol asks its driver to do, and what it hands to receivers.

The vocabulary of :class:`aiordma.protocols.messages.MessageProtocol`'s output, in a module of
its own so that every build of the protocol (the Python source, and the same source compiled
by ``scripts/build_fastpath.py``) emits the same classes and the driver tells them apart with
``type(a) is PostSend``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "EMPTY",
    "READING",
    "READY",
    "UNREAD",
    "Immediate",
    "Incoming",
    "PoolReturn",
    "PoolWant",
    "PostRecv",
    "PostSend",
    "SendDone",
    "SendDropped",
    "SendPosted",
    "StartRead",
]

# -- actions (slotted, not frozen: one is built per post, and frozen ones cost 3x) -------------


@dataclass(slots=True)
class PostSend:
    """Post the frame at ``send_region[offset:offset + length]`` as a SEND."""

    wr_id: int  # low 32 bits (see messages.send_wr_id)
    offset: int
    length: int
    signaled: bool


@dataclass(slots=True)
class PostRecv:
    """(Re)post receive slot ``slot`` (work-request id ``slot``)."""

    slot: int


@dataclass(slots=True)
class StartRead:
    """RDMA-READ ``message`` (``size`` bytes at ``address``/``rkey``) into a new buffer the
    endpoint owns; then call :meth:`MessageProtocol.read_done` with that buffer."""

    message: Incoming


@dataclass(slots=True)
class SendPosted:
    """The queued eager message ``ticket`` is posted: its caller's buffer is free."""

    ticket: int


@dataclass(slots=True)
class SendDone:
    """The peer has read rendezvous message ``token``: its memory may be released."""

    token: int


@dataclass(slots=True)
class SendDropped:
    """Queued message ``ticket`` (or rendezvous ``token``) will never be sent: the peer closed."""

    ticket: int
    rendezvous: bool


@dataclass(slots=True)
class PoolWant:
    """Receive pool: the peer asks for ``frames`` more data credits (the pool's rules decide:
    :meth:`aiordma.protocols.receive_pool.ReceivePool.on_want`)."""

    frames: int


@dataclass(slots=True)
class PoolReturn:
    """Receive pool: the peer gave ``credits`` data credits back
    (:meth:`aiordma.protocols.receive_pool.ReceivePool.on_return`)."""

    credits: int


class Incoming:
    """A message in the inbox that is not simply a buffered ``bytearray``.

    An eager message still in its receive slot (``slot >= 0``, bytes at
    ``recv_region[offset:offset + size]``), or a rendezvous message (``token``, ``size``
    bytes at ``address``/``rkey``): unread and in its slot, being read into a buffer
    (``reading``), or read (``payload``).
    """

    __slots__ = ("address", "index", "offset", "payload", "reading", "rendezvous", "rkey",
                 "size", "slot", "token")

    def __init__(self, index: int, slot: int, size: int, *, offset: int = 0,
                 rendezvous: bool = False, address: int = 0, rkey: int = 0,
                 token: int = 0) -> None:
        self.index = index  # 1 for the first message the peer sent
        self.slot = slot  # -1 once the slot is released
        self.size = size
        self.offset = offset
        self.rendezvous = rendezvous
        self.address, self.rkey, self.token = address, rkey, token
        self.payload: Any = None
        self.reading = False

    def __repr__(self) -> str:
        what = "rendezvous" if self.rendezvous else "eager"
        return f"<Incoming #{self.index} {what} {self.size} B slot {self.slot}>"


class Immediate:
    """An RDMA WRITE with immediate data that the peer sent (it took one of this side's
    receive slots and a data credit, as a message does, and carries no frame): its 32-bit
    ``value`` and ``nbytes``, the WRITE's length. In the inbox among the messages, in the
    order the peer posted them; ``slot`` is the receive slot it holds (-1 once released)."""

    __slots__ = ("index", "nbytes", "slot", "value")

    def __init__(self, index: int, value: int, nbytes: int, slot: int = -1) -> None:
        self.index = index  # 1 for the first message the peer sent (immediates count too)
        self.value = value
        self.nbytes = nbytes
        self.slot = slot

    def __repr__(self) -> str:
        return f"Immediate(value={self.value:#x}, nbytes={self.nbytes})"


# What the head of the inbox is (MessageProtocol.head)
EMPTY, READY, UNREAD, READING = "empty", "ready", "unread", "reading"
