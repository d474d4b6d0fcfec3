"""An endpoint's tunables (:class:`Config`) and its message counts (:class:`EndpointStats`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from aiordma._args import check_int, check_seconds
from aiordma._errors import LocalProtocolError
from aiordma.protocols.framing import HEADER_SIZE

__all__ = ["BUFFER_READS", "POOL_ENV", "Config", "EndpointStats"]

POOL_ENV = "AIORDMA_RECEIVE_POOL"
"""The environment variable that, set to ``1``, makes ``Config.receive_pool`` default to on."""

_U16 = 0xFFFF
STOCK_MAX = 1024
"""The largest ``Config.setup_stock``: each one made ahead holds a queue pair."""
_SLOT_MEMORY = 4 << 30  # bytes of receive (or send) slots an endpoint may have
BUFFER_READS = 8
"""Rendezvous READs into the endpoint's own buffers in flight at once (send-queue entries the
queue pair reserves for them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Tunables of an endpoint (both sides may differ; each tells the other its window).

    A connection over the TCP transport takes ``recv_buffer``, ``data_slots`` (its slots past
    the buffer), ``slot_size`` (its ``eager_max``), ``max_message``, ``close_timeout``,
    ``handshake_timeout`` and the keepalive from it; the rest is RDMA's.

    Attributes:
        data_slots: receive slots for messages (the peer's message window).
        ctrl_slots: receive slots for control frames (acknowledgements, credit returns); at
            least 3.
        slot_size: bytes per receive/send slot, 12-byte frame header included.
        send_slots: pre-registered send slots (messages posted and not yet known complete).
            A connection on a shared receive pool (``receive_pool``) has no send
            slots of its own: it takes ``send_reserve`` slots in a chunk of the pool's *send
            arena* (one memory region per 32 connections, each chunk with ``send_slots``
            more slots that its connections borrow while their own are in flight), and
            ``send_slots`` caps its posts in flight.
        send_reserve: (a connection on a shared receive pool) send slots of its own in the
            pool's send arena, at least 2 (at most ``send_slots`` of them count): messages
            sent one at a time never need more; a stream borrows the chunk's shared slots
            beyond them. Memory per idle connection: ``send_reserve + send_slots / 32``
            slots (48 KiB with the defaults).
        signal_every: request a send completion every N posts.
        recv_buffer: bytes of received messages the endpoint holds for the application
            outside its receive slots (like ``SO_RCVBUF``; each message counts 64 bytes more
            than its size). 0: messages stay in their slots until read.
        max_message: the largest message accepted from the peer, in bytes (the peer learns it
            at set-up, and ``send()`` refuses larger ones before sending anything).
        max_onesided: one-sided operations in flight per endpoint (READs and atomics are
            further bounded by the device's initiator depth). The default, 54, keeps a
            connection's send queue (``send_slots + max_onesided + 9`` entries: 127 with the
            defaults) within the 128 slots rxe rounds it up to: at 64 (137 entries, rounded
            to 256 slots of 256 B) each queue pair mapped 64 KiB of the device's queue memory
            into the process, 31 KiB of a listener's RSS per connection more at 1,000 in the
            VM (docs/reports/2026-11-26-connections-at-scale.md).
        max_rd_atomic: RDMA READs/atomics in flight, each way.
        close_timeout: seconds ``aclose()`` waits for the peer before releasing anyway.
        handshake_timeout: seconds a listener gives a client's set-up once the TCP
            connection exists, up to its Accept; the client's Ready then has as long again.
        keepalive_idle, keepalive_interval, keepalive_probes: TCP keepalive of the connection
            that set the endpoint up and stays open as its liveness channel: a peer host that
            vanishes (no FIN, no RST) is declared dead after about idle + interval x probes
            seconds, and every pending operation fails with :class:`BrokenResourceError`. A
            killed process is noticed at once (its kernel closes the socket). A host holding
            hundreds of connections wants more patience (e.g. 10 s idle, 10 probes): the
            default's probe a second per socket, lost in bursts on a stalled host, broke
            healthy connections at 1,000 on one machine.
        receive_pool: offer and take a *shared receive pool* (see the guide "The shared
            receive pool"): a listener with it takes the receives of every client that offers
            it too from one pool per event loop and device (``pool_buffers`` slots of
            ``slot_size``), granting each connection a share of it (at most ``data_slots``)
            while it sends; a client with it offers to follow such a pool's grants (and,
            with ``client_pool``, takes its own receives from its loop's pool too). Without
            it on both sides (or when the pool is full), a connection has slots of its own.
            Off by default (a listener of before the pool refuses a client that offers it);
            ``AIORDMA_RECEIVE_POOL=1`` in the environment turns the default on.
        client_pool: (a client with ``receive_pool``) take its own receives from its event
            loop's pool on the device too, and its send slots from the pool's send arena, as
            a listener's connections do (the listener follows its pool's grants; a listener
            of before 2026-11-28 refuses such a client): a set-up then registers nothing,
            for a process that holds many connections. One pool pins ``pool_buffers x
            slot_size`` (8 MiB at the defaults) even for one connection, and a round trip on
            a connection with both ends pooled cost 1.37-1.40 ms against 1.05-1.15 ms with
            the listener's alone in the VM (see the guide "The shared receive pool").
            Off by default.
        pool_buffers: slots of the loop's pool (its first pooled connection creates it);
            each connection reserves 3 of them for its control frames.
        setup_stock: (a listener's) connections' resources it makes ahead, while no set-up is
            under way: each a queue pair already in INIT on its share of a completion queue,
            with its receive slots and send slots (its pool's place and a seat in the send
            arena, with ``receive_pool``), so that a burst of that many set-ups skips their
            making; each set-up takes one, and the stock is made up again once the set-ups
            pause. 0 (default): none. Each one made ahead holds a queue pair and, without
            the pool, its slots (1.1 MiB pinned with the defaults; 48 KiB of the arena with
            the pool); ``aclose()`` releases them.
        immediates: accept RDMA WRITEs with immediate data from the peer
            (``Endpoint.post_write(..., imm=k)``), read with ``Endpoint.recv_event()``; one
            arriving on an endpoint without it breaks the connection (the peer broke the
            protocol). RDMA only (a TCP channel has no WRITEs).
    """

    data_slots: int = 64
    ctrl_slots: int = 8
    slot_size: int = 8192
    send_slots: int = 64
    send_reserve: int = 4
    signal_every: int = 16
    recv_buffer: int = 4 << 20
    max_message: int = 1 << 30
    max_onesided: int = 54
    max_rd_atomic: int = 16
    close_timeout: float = 5.0
    handshake_timeout: float = 10.0
    keepalive_idle: int = 1
    keepalive_interval: int = 1
    keepalive_probes: int = 2
    receive_pool: bool = field(default_factory=lambda: os.environ.get(POOL_ENV) == "1")
    client_pool: bool = False
    pool_buffers: int = 1024
    setup_stock: int = 0
    immediates: bool = False

    @property
    def eager_max(self) -> int:
        """Largest message sent eagerly with these slots (the peer's slots may lower it)."""
        return self.slot_size - HEADER_SIZE

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (``Config(...)`` does, so a ``Config`` that exists is valid).

        The upper bounds are what the wire carries (slots and credits are 16-bit,
        ``max_rd_atomic`` 8-bit, ``max_message`` at most 2**62), what Linux accepts for TCP
        keepalive (32767 s, 127 probes), and at most 4 GiB of slot memory each way.

        Raises:
            LocalProtocolError: naming the first unusable field.
        """
        check_int(self.slot_size, name="slot_size", low=64, high=1 << 20)
        check_int(self.data_slots, name="data_slots", low=1, high=_U16)
        check_int(self.ctrl_slots, name="ctrl_slots", low=3, high=_U16)
        check_int(self.send_slots, name="send_slots", low=2, high=_U16)
        check_int(self.send_reserve, name="send_reserve", low=2, high=_U16)
        for name in ("signal_every", "max_onesided"):
            check_int(getattr(self, name), name=name, low=1, high=_U16)
        check_int(self.max_rd_atomic, name="max_rd_atomic", low=1, high=255)
        check_int(self.max_message, name="max_message", low=1, high=1 << 62)
        check_int(self.recv_buffer, name="recv_buffer", low=0, high=1 << 62)
        for name in ("keepalive_idle", "keepalive_interval"):
            check_int(getattr(self, name), name=name, low=1, high=32767)
        check_int(self.keepalive_probes, name="keepalive_probes", low=1, high=127)
        for name in ("close_timeout", "handshake_timeout"):
            check_seconds(getattr(self, name), name=name)
        for name in ("receive_pool", "client_pool", "immediates"):
            if not isinstance(getattr(self, name), bool):
                raise LocalProtocolError(f"{name} must be True or False, not "
                                         f"{getattr(self, name)!r:.40}")
        check_int(self.pool_buffers, name="pool_buffers", low=8, high=1 << 20)
        check_int(self.setup_stock, name="setup_stock", low=0, high=STOCK_MAX)
        if self.pool_buffers * self.slot_size > _SLOT_MEMORY:
            raise LocalProtocolError(f"pool_buffers: a pool of {self.pool_buffers} slots of "
                                     f"{self.slot_size} B exceeds {_SLOT_MEMORY >> 30} GiB")
        for what, slots in (("receive", self.data_slots + self.ctrl_slots),
                            ("send", self.send_slots)):
            if slots * self.slot_size > _SLOT_MEMORY:
                raise LocalProtocolError(f"{slots} {what} slots of {self.slot_size} B exceed "
                                         f"{_SLOT_MEMORY >> 30} GiB")


@dataclass(frozen=True, slots=True)
class EndpointStats:
    """A snapshot of an endpoint's messages (:meth:`Endpoint.stats`).

    Attributes:
        sent: messages posted to the peer.
        queued: messages waiting for a send slot or a credit (their ``send()`` waits).
        received: messages that arrived from the peer.
        delivered: messages handed to the application (``recv()``, ``recv_into()``).
        inbox: messages arrived and not yet delivered.
        inbox_bytes: bytes held for the application, counted against ``Config.recv_buffer``.
        buffered_reads: rendezvous messages the endpoint READ into its own buffer (the others
            went straight into a waiting receiver's buffer).
    """

    sent: int
    queued: int
    received: int
    delivered: int
    inbox: int
    inbox_bytes: int
    buffered_reads: int
