"""Forming a group's mesh: the rendezvous, a directed link to and from every other rank.

Formation, bounded as a whole by the group's ``timeout``:

1. Rank 0 serves a :class:`Rendezvous` (an :mod:`aiordma.rpc` service) on
   ``MASTER_ADDR:MASTER_PORT``. Every rank starts a listener for its incoming links on a free
   port, on the address that reaches rank 0 (the local address of its rendezvous connection;
   rank 0 uses ``MASTER_ADDR``), and calls ``join(rank, world_size, host, port)``; ranks that
   start before rank 0 retry until it is up. The call returns once all ``world_size`` ranks
   joined: a random group token and every rank's address. A rank joining twice, out of range
   or with another world size fails the rendezvous for everyone (:class:`RendezvousError`).
   The join also says which links the rank takes (its ``transport``): ``"rdma"`` (a rank on
   a host without a usable device raises :class:`~aiordma.UnsupportedOperationError` here),
   ``"tcp"``, or, for ``"auto"``, either where it has a usable device and TCP only where it
   has none. The whole group's links are TCP if any rank takes TCP only, else RDMA
   (:attr:`aiordma.protocols.collectives.Roster.transport`); a rank that insists on RDMA in
   a group where another insists on TCP fails the rendezvous. The answer says which.
2. Each rank connects to every other rank (``aiordma.connect`` with the group's transport,
   all at once) and sends ``Hello(token, rank)``: these are its outgoing links. It accepts
   the other ranks' links (anything else is dropped). Over RDMA, it registers receive slots
   for each and exposes them to that rank alone, and learns the slots of every rank it sends
   to; over TCP, it tells each rank the piece size it takes instead (see :mod:`._links`).
3. Every link's reader starts (:mod:`._links`), then an exchange with every rank (everyone
   is connected: the whole group's call 0); after it rank 0 closes the rendezvous server
   (everyone has their answer by then).

A group of ``world`` ranks thus holds ``2 (world - 1)`` endpoints per rank; the schedules
pick which links a collective uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import socket
from typing import Any, cast

import numpy as np

import aiordma
from aiordma import (
    AiordmaError,
    BrokenResourceError,
    Config,
    DeviceError,
    Endpoint,
    Listener,
    OperationTimeout,
    RemoteBuffer,
    RemoteProtocolError,
    UnsupportedOperationError,
)
from aiordma.lowlevel import Device
from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.rpc import RemoteError, RpcClient, RpcServer, Service, method, serve
from aiordma.rpc import connect as rpc_connect

from ._arrays import mapped
from ._errors import GroupError, RendezvousError
from ._links import Inbound, Link, Outbound, Router, receive_event
from ._plane import CallPlane, GroupLinks, Plane
from ._rounds import exchange

__all__ = ["Mesh", "Rendezvous"]

log = logging.getLogger("aiordma.services.collectives")

_FRAME = 1024  # bytes a TCP link's Inline message takes beyond its piece (well over its header)
_TCP_PIECE_MAX = (1 << 20) - _FRAME  # (proto.decode takes messages of at most 1 MiB)
SLOTS = 2  # by default, receive slots per incoming RDMA link ...
SLOT_BYTES = 1 << 20  # ... of 1 MiB each (docs/reports/2026-11-28-large-pieces.md)
TCP_PIECE = 256 << 10  # and over TCP, the pieces a rank takes


class Rendezvous(Service):
    """Rank 0's meeting point: ``join()`` returns once every rank has joined.

    The bookkeeping is :class:`aiordma.protocols.collectives.Roster`; a refused join fails the whole
    rendezvous, and every waiting ``join()`` raises :class:`RendezvousError`.
    """

    def __init__(self, world_size: int, token: int) -> None:
        self.roster = proto.Roster(world_size)
        self.token = token
        self._done = asyncio.Event()

    def add(self, rank: Any, world_size: Any, host: Any, port: Any, links: Any) -> None:
        try:
            self.roster.add(rank, world_size, host, port, links)
        except proto.RendezvousRefused as exc:
            raise RendezvousError(str(exc)) from None
        finally:
            if self.roster.done:
                self._done.set()

    async def result(self) -> dict[str, Any]:
        await self._done.wait()
        if self.roster.failure is not None:
            raise RendezvousError(self.roster.failure)
        return {"token": self.token, "members": [list(m) for m in self.roster.addresses()],
                "transport": self.roster.transport}

    @method
    async def join(self, rank: int, world_size: int, host: str, port: int,
                   links: str = "rdma") -> dict[str, Any]:
        """Join as ``rank`` listening on ``host:port`` and taking ``links``
        (:data:`~aiordma.protocols.collectives.LINK_CHOICES`); every rank's address and the
        group's transport once complete."""
        self.add(rank, world_size, host, port, links)
        return await self.result()


def _resolve(host: str) -> str:
    """An IPv4 address for ``host`` (RoCE v2 GIDs carry IPv4 addresses here)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise GroupError(f"cannot resolve MASTER_ADDR {host!r}: {exc}") from exc
    return str(infos[0][4][0])


def _is_local(ip: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


class Mesh:
    """The connections of one rank: its listener, the rendezvous (while forming), an outgoing
    and an incoming endpoint per other rank, and the :class:`Plane` over them."""

    def __init__(self, rank: int, world: int, timeout: float | None) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.plane: Plane | None = None
        self.transport: str | None = None  # the links': "rdma" or "tcp" (once rank 0 said)
        self.outgoing: dict[int, Link] = {}
        self.incoming: dict[int, Link] = {}
        self._listener: Listener | None = None
        self._server: RpcServer | None = None
        self._client: RpcClient | None = None
        self._arrivals: dict[int, asyncio.Future[Link]] = {}
        self._token: asyncio.Future[int] | None = None
        self._released = asyncio.Event()  # ends the listener's handlers

    async def form(self, master_addr: str, master_port: int, host: str | None,
                   device: str | Device | None, config: Config | None, slots: int,
                   slot_bytes: int | None, router: Router, formation: int,
                   transport: str = "auto") -> Plane:
        """Form the mesh (steps 1-3 of the module documentation); ``router`` gets the
        links' reports from then on, ``formation`` is the formation's call number, and
        ``transport`` what this rank asks for (``"auto"``, ``"rdma"`` or ``"tcp"``)."""
        master_ip = _resolve(master_addr)
        links_config = dataclasses.replace(config or Config(), immediates=True)  # (see _links)
        loop = asyncio.get_running_loop()
        self._arrivals = {p: loop.create_future() for p in range(self.world) if p != self.rank}
        self._token = loop.create_future()
        if self.rank == 0:
            token = secrets.randbits(63)
            rendezvous = Rendezvous(self.world, token)
            bind = master_ip if _is_local(master_ip) else "0.0.0.0"
            try:
                self._server = await serve(rendezvous, bind, master_port, device=device,
                                           config=config)
            except OSError as exc:
                raise GroupError(f"rank 0 cannot serve the rendezvous on {bind}:{master_port}: "
                                 f"{exc}") from exc
            host = host or master_ip
            self._listener, links = await self._listen(bind, device, links_config, transport)
            rendezvous.add(0, self.world, host, self._listener.port, links)
            info = await rendezvous.result()
        else:
            self._client = client = await self._reach_master(master_ip, master_port, device,
                                                             config)
            host = host or cast(Link, client.endpoint).local_address[0]
            self._listener, links = await self._listen(host, device, links_config, transport)
            try:
                info = await client.call("join", self.rank, self.world, host,
                                         self._listener.port, links)
            except RemoteError as exc:
                if exc.type_name == "RendezvousError":
                    raise RendezvousError(exc.message) from None
                raise
            await client.aclose()
            self._client = None
        try:
            members = proto.validate_members(info["members"], self.world)
            token = int(info["token"])
            kind = info["transport"]
            if kind not in ("rdma", "tcp") or {kind, links} == {"rdma", "tcp"}:
                raise ValueError(f"links over {kind!r:.20} for a rank that takes {links}")
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            raise RemoteProtocolError(f"bad rendezvous answer: {exc}") from exc
        self.transport = kind
        self._token.set_result(token)

        async def link_to(peer: int) -> None:
            rhost, rport = members[peer]
            # Bounded by the formation's timeout around all of this.
            ep: Link
            if kind == "tcp":
                ep = await aiordma.connect(rhost, rport, timeout=1e9, config=config,
                                           transport="tcp")
            else:
                ep = await aiordma.connect(rhost, rport, timeout=1e9, device=device,
                                           config=config, transport="rdma")
            self.outgoing[peer] = ep
            await ep.send(proto.encode(proto.Hello(version=proto.PROTOCOL_VERSION, token=token,
                                                   rank=self.rank, world=self.world)))

        await asyncio.gather(*(link_to(p) for p in self._arrivals))
        for p, fut in self._arrivals.items():
            self.incoming[p] = await fut
        if kind == "tcp":
            self.plane = plane = await self._exchange_pieces(slot_bytes or TCP_PIECE)
        else:
            self.plane = plane = await self._exchange_slots(slots, slot_bytes or SLOT_BYTES)
        plane.start(router)  # from here on, every link has its reader (see _links)
        work = plane.lease()
        view = CallPlane(GroupLinks(plane, range(self.world), self.rank), work, plane)
        tag = proto.Tag(group=0, channel=0, call=formation, op=proto.kind_code("formation"))
        await exchange(view, tag, None)  # everyone is connected
        plane.give_back(work)
        if self._server is not None:
            await self._server.aclose()
            self._server = None
        return self.plane

    async def _listen(self, host: str, device: str | Device | None, config: Config | None,
                      transport: str) -> tuple[Listener, str]:
        """The listener for the other ranks' links, and which links this rank takes
        (:data:`~aiordma.protocols.collectives.LINK_CHOICES`): ``"tcp"`` for TCP, and for
        ``"auto"`` on a host without a usable device; ``"rdma"`` for RDMA; ``"either"`` for
        ``"auto"`` with a device (the listener then takes both: the rendezvous decides).

        Raises:
            UnsupportedOperationError: ``transport="rdma"`` and this host has no usable RDMA
                device.
        """
        if transport != "tcp":
            try:  # (a listener for RDMA checks the device now: the probe)
                probe = await aiordma.listen(self._accept, host, 0, device=device,
                                             config=config, transport="rdma")
            except DeviceError as exc:
                if transport == "rdma":
                    raise UnsupportedOperationError(
                        f"rank {self.rank}: transport='rdma' and this host has no usable RDMA "
                        f"device ({exc}); join with transport='auto' or 'tcp' for TCP links",
                        operation="collectives", transport="tcp") from exc
                log.info("rank %d: no usable RDMA device (%s): this rank takes TCP links",
                         self.rank, exc)
            else:
                if transport == "rdma":
                    return probe, "rdma"
                probe.abort()
                return await aiordma.listen(self._accept, host, 0, device=device,
                                            config=config, transport="auto"), "either"
        return await aiordma.listen(self._accept, host, 0, config=config,
                                    transport="tcp"), "tcp"

    async def _reach_master(self, ip: str, port: int, device: str | Device | None,
                            config: Config | None) -> RpcClient:
        """Connect to rank 0's rendezvous, retrying while it is not up yet."""
        delay = 0.05
        while True:
            try:
                return await rpc_connect(ip, port, device=device, config=config)
            except (BrokenResourceError, OperationTimeout) as exc:
                log.debug("rank %d: rendezvous %s:%d not reachable yet: %s", self.rank, ip,
                          port, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _accept(self, ep: Link) -> None:
        """Listener handler: another rank's outgoing link, if it says the right Hello."""
        assert self._token is not None
        try:
            async with asyncio.timeout(self.timeout):
                data = await ep.recv()
                ev = proto.decode(data) if data is not None else None
                token = await asyncio.shield(self._token)  # may still be on its way here
        except (AiordmaError, ProtocolError, TimeoutError, asyncio.CancelledError) as exc:
            log.warning("rank %d: dropped a connection from %s: %r", self.rank,
                        ep.peer_address, exc)
            return
        ok = (isinstance(ev, proto.Hello) and ev.version == proto.PROTOCOL_VERSION
              and ev.token == token and ev.world == self.world
              and ep.transport == self.transport)
        fut = self._arrivals.get(ev.rank) if ok and isinstance(ev, proto.Hello) else None
        if fut is None or fut.done():
            log.warning("rank %d: dropped a connection from %s: %r", self.rank,
                        ep.peer_address, ev)
            return
        fut.set_result(ep)
        await self._released.wait()  # the listener closes the endpoint when this returns

    async def _exchange_slots(self, slots: int, slot_bytes: int) -> Plane:
        """Expose receive slots on every incoming link; learn every outgoing link's."""
        ins: dict[int, Inbound] = {}
        for p, ep in self.incoming.items():
            buf = mapped(slots * (slot_bytes + proto.NOTE_BYTES))  # (see _links)
            mr = ep.register(buf, remote_write=True)
            desc = mr.expose(write=True)
            await ep.send(proto.encode(proto.Slots(descriptor=desc.to_wire(), count=slots,
                                                   size=slot_bytes)))
            ins[p] = Inbound(ep=ep, peer=p, slots=buf, count=slots, size=slot_bytes)
        outs: dict[int, Outbound] = {}
        for p, ep in self.outgoing.items():
            ev = await receive_event(ep, p)
            if not isinstance(ev, proto.Slots) or ev.count < 1 or ev.size < 64:
                raise RemoteProtocolError(f"rank {p} sent {ev!r:.200}, not its receive slots")
            remote = RemoteBuffer.from_wire(ev.descriptor)
            if remote.length < ev.count * (ev.size + proto.NOTE_BYTES) or not remote.writable:
                raise RemoteProtocolError(f"receive slots {remote} do not hold {ev.count} x "
                                          f"{ev.size} B (and their notes' room) writable")
            outs[p] = Outbound(ep=ep, peer=p, remote=remote, count=ev.count, size=ev.size,
                               inline_max=max(0, ep.eager_max - 64))
        devices = {ep.device for ep in self.outgoing.values() if isinstance(ep, Endpoint)}
        if len(devices) != 1:
            raise GroupError("this rank's links to the others ended up on different RDMA "
                             "devices; pass device= to choose one")
        device = next(iter(devices))
        return Plane(rank=self.rank, world=self.world, device=device, outs=outs, ins=ins)

    async def _exchange_pieces(self, slot_bytes: int) -> Plane:
        """TCP links: tell every incoming link the piece size this rank takes (its
        ``slot_bytes``, at most what one message carries) in a ``Slots`` of no slot; learn
        every outgoing link's (see :mod:`._links`, "Links over TCP")."""
        ins: dict[int, Inbound] = {}
        for p, ep in self.incoming.items():
            size = min(slot_bytes, _TCP_PIECE_MAX, ep.config.max_message - _FRAME) // 64 * 64
            if size < 64:
                raise GroupError(f"Config.max_message={ep.config.max_message} leaves no room "
                                 f"for a collectives piece over TCP: use at least 2048")
            await ep.send(proto.encode(proto.Slots(descriptor=(0, 0, 0, 0), count=0,
                                                   size=size)))
            ins[p] = Inbound(ep=ep, peer=p, slots=np.empty(0, np.uint8), count=0, size=size)
        outs: dict[int, Outbound] = {}
        for p, ep in self.outgoing.items():
            ev = await receive_event(ep, p)
            if not (isinstance(ev, proto.Slots) and ev.count == 0
                    and 64 <= ev.size <= _TCP_PIECE_MAX):
                raise RemoteProtocolError(f"rank {p} sent {ev!r:.200}, not its piece size")
            if ev.size + _FRAME > ep.peer_max_message:
                raise GroupError(f"rank {p} takes {ev.size} B pieces but messages of at most "
                                 f"{ep.peer_max_message} B (Config.max_message)")
            outs[p] = Outbound(ep=ep, peer=p, remote=None, count=0, size=ev.size,
                               inline_max=ev.size)
        return Plane(rank=self.rank, world=self.world, device=None, outs=outs, ins=ins)

    # -- lifecycle -----------------------------------------------------------------------------

    def _endpoints(self) -> list[Link]:
        return [*self.outgoing.values(), *self.incoming.values()]

    async def aclose(self) -> None:
        """Close every link gracefully (messages in flight are delivered), then release the
        rest; bounded by the endpoints' ``Config.close_timeout``."""
        try:
            await asyncio.gather(*(ep.aclose() for ep in self._endpoints()),
                                 return_exceptions=True)
        finally:
            self._release()
            if self._listener is not None:
                await self._listener.aclose()
            if self._server is not None:
                await self._server.aclose()

    def abort(self) -> None:
        """Close everything at once; the other ranks' collectives fail with
        :class:`~aiordma.BrokenResourceError`. Idempotent."""
        for ep in self._endpoints():
            ep.abort()
        self._release()
        if self._listener is not None:
            self._listener.abort()
        if self._server is not None and self._server.listener is not None:
            self._server.listener.abort()
        if self._client is not None:
            self._client.endpoint.abort()
        for fut in (*self._arrivals.values(), self._token):
            if fut is not None and not fut.done():
                fut.cancel()

    def _release(self) -> None:
        if self.plane is not None:
            self.plane.close()
        self._released.set()

    async def abort_quietly(self) -> None:
        """Formation failed: release everything. Rank 0 first gives the other ranks a moment
        to collect the rendezvous' answer (a refusal reaches everyone that way), bounded."""
        server = self._server
        if server is not None and server.listener is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    while server.listener.endpoints:
                        await asyncio.sleep(0.02)
        self.abort()
        with contextlib.suppress(Exception):
            if self._listener is not None:
                await self._listener.aclose()
            if server is not None:
                await server.aclose()
