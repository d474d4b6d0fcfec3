"""Connection set-up: ``connect()`` (and what :mod:`.listener`'s ``listen()`` shares with it).

Two transports share one set-up and one port: RDMA (an :class:`Endpoint`: a queue pair, set up
over a TCP connection) and TCP (a :class:`~aiordma._tcp.channel.TcpChannel`: the messages
travel over that TCP connection itself). ``transport="rdma"`` sends the RDMA Hello,
``"tcp"`` a TcpHello; ``"auto"`` (the default) sends the RDMA Hello where this host has a
usable device, and connects again with a TcpHello if the listener refuses it for want of one
(``Reject(category=TRANSPORT)``); a host without a device sends a TcpHello at once. The RDMA
Hello is protocol version 3's, so a listener of that version connects over RDMA as before.

pyverbs does not expose the RDMA-CM event channel's fd, so endpoints are set up over an
asyncio TCP connection (the bootstrap), which then stays open as the liveness channel: the
peer's death closes it, and that fails every pending operation at once.

Set-up, driven by the sans-I/O :mod:`aiordma.protocols.handshake`:

1. client: TCP connect (bounded by ``timeout``); choose the device and GID that carry the
   local address of that connection (RoCE v2), or the first usable one; create the queue
   pair; send Hello (QP number, random PSN, GID, MTU, window);
2. server: on Hello, the same on its side, bring its queue pair to RTS towards the client,
   post its receive slots, send Accept;
3. client: bring its queue pair to RTS, post its receive slots, send Ready; the endpoint is
   returned. The server hands its endpoint to the handler on Ready.

Each side posts its receive slots before the message that lets the peer send: no first SEND
meets an empty receive queue (a receiver-not-ready NAK, retried after the RNR timer).

With a shared secret (``secret=`` on both sides), the server challenges the client before step
2 and creates nothing, and connects no queue pair, until the client's proof matches; the client
checks the server's proof in its Accept before step 3 (:mod:`aiordma.protocols.handshake` has the
details). A listener can also bound its connections per peer address and in total; a client
over a limit gets :class:`ConnectionRejectedError`.

Over TCP (:mod:`aiordma.protocols.handshake` has the messages): the client sends TcpHello (its
receive buffer, slots, ``eager_max``, largest message); the server makes its channel, which
reads the connection from then on, and answers TcpAccept; the client makes its channel and
sends Ready; the server's channel takes the Ready, then the message frames behind it. The
server sends no frame before the Ready, so the client's channel has nothing to miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, overload

from aiordma._args import check_host, check_optional_int, check_port, check_seconds
from aiordma._device.device import Device, list_devices
from aiordma._endpoint.config import BUFFER_READS, Config
from aiordma._endpoint.endpoint import Endpoint
from aiordma._endpoint.qp import QPAddress, QueuePair
from aiordma._endpoint.receive_pool import SharedReceivePool, join_pool, release_pool
from aiordma._endpoint.send_arena import SendSeat, join_send_arena
from aiordma._endpoint.side import SideChannel
from aiordma._errors import (
    AiordmaError,
    AuthenticationError,
    BrokenResourceError,
    ConnectionRejectedError,
    DeviceError,
    LocalProtocolError,
    OperationTimeout,
    RemoteProtocolError,
    from_protocol_error,
)
from aiordma._memory.region import MemoryRegion
from aiordma._reactor.reactor import release_shared, shared_reactor
from aiordma._tcp.channel import TcpChannel
from aiordma.protocols import handshake as hs
from aiordma.protocols.errors import AuthenticationError as ProtocolAuthError
from aiordma.protocols.errors import ProtocolError

__all__ = ["TRANSPORTS", "Channel", "connect"]

log = logging.getLogger("aiordma")

Channel = Endpoint | TcpChannel
"""A connection made by :func:`connect` or handed to a listener's handler."""
Handler = Callable[[Any], Awaitable[None]]
TRANSPORTS = ("auto", "rdma", "tcp")
"""The values of ``transport=``."""

_devices: dict[tuple[str | None, int | None, int | None, str | None], Device] = {}


_listed: tuple[float, list[Any], DeviceError | None] = (-1e9, [], None)
_carried: dict[tuple[str, str | None], bool] = {}  # (ip, device name) -> a GID of it has ip


def _device_list(ttl: float = 10.0) -> list[Any]:
    """``list_devices()``, cached for ``ttl`` seconds (it opens every device), its failure
    too (no pyverbs: ``transport="auto"`` then asks again only after ``ttl``).

    Raises:
        DeviceError: pyverbs is not available.
    """
    global _listed
    now = time.monotonic()
    if now - _listed[0] > ttl:
        _carried.clear()
        try:
            _listed = (now, list_devices(), None)
        except DeviceError as exc:
            _listed = (now, [], exc)
    if _listed[2] is not None:
        raise DeviceError(str(_listed[2]))
    return _listed[1]


def _device_for(local_ip: str | None, device: str | Device | None,
                gid_index: int | None) -> Device:
    """The device and GID carrying ``local_ip`` (RoCE v2), else the first usable one.

    Devices are opened once per process and shared by every endpoint.
    """
    if isinstance(device, Device):
        return device
    devices = _device_list()  # (raises at once, cached, where pyverbs is missing)
    ip = local_ip
    if ip is not None and gid_index is None:
        carried = _carried.get((ip, device))
        if carried is None:  # (once per listing: a set-up's 0.1 ms in the VM)
            carried = _carried[(ip, device)] = any(
                g.ip == ip for d in devices if device in (None, d.name)
                for p in d.ports for g in p.gids)
        if not carried:
            ip = None  # e.g. TCP over 127.0.0.1: no GID carries it; take the default choice
    key = (device, None, gid_index, ip)
    dev = _devices.get(key)
    if dev is None or dev.closed:
        dev = Device(device, gid_index=gid_index, local_ip=ip)
        _devices[key] = dev
    return dev


def _keepalive(side: SideChannel, config: Config) -> None:
    """TCP keepalive so a dead host (not just a dead process) is noticed within seconds."""
    idle, interval, count = (config.keepalive_idle, config.keepalive_interval,
                             config.keepalive_probes)
    sock = side.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Resources:
    """What an endpoint needs before the handshake names the peer; released on failure.

    ``pool``: its receives come from the event loop's shared pool if that has room (else it
    has receive slots of its own, as without): a listener's connection whose client offered
    the pool and whose ``Config`` chooses it, or a client's whose ``Config`` chooses it and
    ``client_pool``.

    ``ahead``: made before any client asked (a listener's stock, :mod:`.stock`): the queue
    pair goes to INIT at once (that step needs nothing of the peer's), and a pool's credit
    rules learn of the connection only when :meth:`claim` hands it to a client.
    """

    def __init__(self, device: Device, config: Config, *, pool: bool = False,
                 ahead: bool = False) -> None:
        self.device = device
        self.config = config
        sends = config.send_slots + config.max_onesided + BUFFER_READS + 1  # +1: a window bind
        self.pool: SharedReceivePool | None = None
        self.pool_grant = 0
        found = None
        if pool:  # a pool with room, on one of its reactors (else slots of its own)
            found = join_pool(device, sends, buffers=config.pool_buffers,
                              slot_size=config.slot_size, share=config.data_slots)
        receives = 0 if found is not None else config.data_slots + config.ctrl_slots
        self.entries = sends + receives
        if found is not None:
            self.pool, self.reactor = found
        else:
            self.reactor = shared_reactor(device, self.entries)
        self.qp: QueuePair | None = None
        self.joined = False  # (a pool's credit rules know of it: claim())
        self.slots: MemoryRegion | None = None
        self.seat: SendSeat | None = None  # (on a pool: the send slots are a chunk's)
        try:
            self.qp = QueuePair(device, self.reactor, max_send_wr=sends, max_recv_wr=receives,
                                max_rd_atomic=config.max_rd_atomic,
                                srq=self.pool.srq if self.pool is not None else None)
            if self.pool is not None:
                if not ahead:
                    self.claim()
                # On a pool, no receive slots and no send slots of its own: a seat in a
                # chunk of the pool's send arena (one memory region per 32 connections).
                self.seat = join_send_arena(
                    self.pool.send_arenas, device, slot_size=config.slot_size,
                    reserve=min(config.send_reserve, config.send_slots),
                    shared=config.send_slots)
                self.slots = self.seat.region
            else:
                # The receive slots, then the send slots: one buffer, one registration (a
                # memory region is a kernel object per connection; a registration cost
                # 0.9-3.7 ms of a set-up in the VM).
                nslots = receives + config.send_slots
                self.slots = MemoryRegion(device, bytearray(nslots * config.slot_size))
            if ahead:
                self.to_init()
        except BaseException:
            self.release()
            raise

    def claim(self) -> None:
        """Attach the connection to its pool's credit rules (if on a pool), which grant its
        first credits (the Accept carries them).

        Raises:
            LocalProtocolError: the pool's rules have no room now (release these resources).
        """
        if self.pool is not None and not self.joined:
            assert self.qp is not None
            self.pool_grant = self.pool.join(self.qp.qp_num, _Unset())
            self.joined = True

    def to_init(self) -> None:
        """RESET -> INIT (it needs nothing of the peer's)."""
        assert self.qp is not None
        self.qp.to_init()

    def params(self, cls: type[hs._QPParams]) -> hs._QPParams:
        assert self.qp is not None
        a = self.qp.local_address()
        config, pool = self.config, self.pool
        extra: dict[str, int] = {}
        if pool is not None and pool.rules is not None:  # (an Accept's 1, a Hello's 2)
            extra = {"receive_pool": 2 if cls is hs.Hello else 1, "pool_grant": self.pool_grant}
            data, ctrl = pool.rules.share_max, pool.rules.ctrl_reserve
        else:
            data, ctrl = config.data_slots, config.ctrl_slots
            if cls is hs.Hello and config.receive_pool:
                extra = {"receive_pool": 1}
        return cls(qp_num=a.qp_num, psn=a.psn, gid=a.gid, lid=a.lid, mtu=a.mtu,
                   data_slots=data, ctrl_slots=ctrl, slot_size=config.slot_size,
                   max_rd_atomic=config.max_rd_atomic, max_message=config.max_message,
                   **extra)

    def connect_qp(self, peer: hs._QPParams) -> None:
        assert self.qp is not None
        self.qp.connect(QPAddress(qp_num=peer.qp_num, psn=peer.psn, gid=peer.gid, lid=peer.lid,
                                  mtu=peer.mtu), peer_rd_atomic=peer.max_rd_atomic)

    def endpoint(self, control: hs.ControlConnection, side: SideChannel, peer: hs._QPParams, *,
                 established: bool = True) -> Endpoint:
        """The endpoint, which owns these resources from now on (``abort()`` releases them)
        and posts its receive slots at once."""
        assert self.qp and self.slots
        return Endpoint(device=self.device, config=self.config, control=control, side=side,
                        peer=peer, qp=self.qp, reactor=self.reactor,
                        entries=self.entries, slots=self.slots, established=established,
                        pool=self.pool, pool_grant=self.pool_grant, send_seat=self.seat)

    def release(self) -> None:
        if self.qp is not None:
            self.qp.close()
        if self.seat is not None:  # after its queue pair (it posted nothing yet)
            self.seat.leave()
        elif self.slots is not None:
            self.slots.close()
        if self.pool is not None:  # after its queue pair: nothing of it is in flight
            if self.qp is not None:
                self.pool.leave(self.qp.qp_num, {})
            release_pool(self.pool)
        release_shared(self.reactor, self.entries)


class _Unset:
    """The pool member of a connection being set up (the endpoint replaces it): nothing of
    its arrives before the Accept goes out, and a grant meanwhile waits in the rules."""

    def _pool_completion(self, slot: int, wc: Any) -> None:  # pragma: no cover (no frame)
        raise RuntimeError("a frame before the endpoint exists")

    def _pool_event(self, event: Any) -> None:
        pass



async def _read_event(side: SideChannel, control: hs.ControlConnection) -> hs.Event:
    while True:
        ev = control.next_event()
        if ev is not hs.NEED_DATA:
            assert isinstance(ev, hs.Event)
            return ev
        control.receive_data(await side.read())


def _check_config(config: Any) -> Config:
    """``config``, or the defaults; a ``Config`` is valid once made (it validates itself)."""
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise LocalProtocolError(f"config must be an aiordma.Config, not {config!r:.80}")
    return config


def _check_device(device: Any, gid_index: Any) -> None:
    if device is not None and (not isinstance(device, (str, Device))
                               or (isinstance(device, str) and (not device or "\x00" in device))):
        raise LocalProtocolError(f"device must be a device name or a Device, not {device!r:.80}")
    check_optional_int(gid_index, name="gid_index", low=0)


def _check_secret(secret: bytes | None) -> bytes | None:
    """``secret`` as bytes, or ``None``.

    Raises:
        LocalProtocolError: not bytes-like, or shorter than 16 bytes.
    """
    if secret is None:
        return None
    try:
        raw = bytes(memoryview(secret))
    except TypeError:
        raise LocalProtocolError("secret must be bytes (e.g. secrets.token_bytes(32))") from None
    if len(raw) < hs.MIN_SECRET:
        raise LocalProtocolError(f"secret must have at least {hs.MIN_SECRET} bytes "
                                 f"(e.g. secrets.token_bytes(32)); got {len(raw)}")
    return raw


def _rejected(ev: hs.Reject, where: str) -> AiordmaError:
    """The client's error for the listener's Reject."""
    if ev.category == hs.RejectCategory.AUTHENTICATION:
        return AuthenticationError(f"{where} refused the connection: {ev.reason}",
                                   reason=ev.reason)
    return ConnectionRejectedError(f"{where} refused the connection: {ev.reason}",
                                   reason=ev.reason, category=ev.category)


def _check_transport(transport: Any) -> str:
    """``transport`` checked: one of :data:`TRANSPORTS`.

    Raises:
        LocalProtocolError: anything else.
    """
    if transport not in TRANSPORTS or not isinstance(transport, str):
        raise LocalProtocolError(f"transport must be 'auto', 'rdma' or 'tcp', not "
                                 f"{transport!r:.80}")
    return transport


def _tcp_params(cls: type[hs._TcpParams], config: Config) -> hs._TcpParams:
    """This side's TcpHello or TcpAccept: how it receives (:class:`TcpChannel`'s rules)."""
    return cls(recv_buffer=config.recv_buffer, slots=config.data_slots,
               eager_max=config.eager_max, max_message=config.max_message)


@overload
async def connect(host: str, port: int, *, timeout: float = ..., config: Config | None = ...,
                  device: str | Device | None = ..., gid_index: int | None = ...,
                  secret: bytes | None = ..., transport: Literal["rdma"]) -> Endpoint: ...
@overload
async def connect(host: str, port: int, *, timeout: float = ..., config: Config | None = ...,
                  device: str | Device | None = ..., gid_index: int | None = ...,
                  secret: bytes | None = ..., transport: Literal["tcp"]) -> TcpChannel: ...
@overload
async def connect(host: str, port: int, *, timeout: float = ..., config: Config | None = ...,
                  device: str | Device | None = ..., gid_index: int | None = ...,
                  secret: bytes | None = ..., transport: str = ...) -> Endpoint | TcpChannel: ...
async def connect(host: str, port: int, *, timeout: float = 10.0, config: Config | None = None,
                  device: str | Device | None = None, gid_index: int | None = None,
                  secret: bytes | None = None, transport: str = "auto") -> Endpoint | TcpChannel:
    """Connect to a listener and return an open :class:`Endpoint` (RDMA) or
    :class:`~aiordma._tcp.channel.TcpChannel` (TCP); its ``transport`` says which.

    Args:
        host, port: the listener's TCP address.
        timeout: bound on the whole set-up, TCP connect included.
        config: endpoint tunables (:class:`Config`).
        device, gid_index: override the automatic choice (the RoCE v2 GID of the local address
            that reaches ``host``, else the first ACTIVE port's IPv4 RoCE v2 GID).
        secret: a shared secret (at least 16 bytes) the listener holds too: both sides then
            prove it (HMAC-SHA256 challenge-response) before any queue pair is connected.
            It authenticates set-up only; nothing is encrypted.
        transport: ``"rdma"``: an endpoint, or an error; ``"tcp"``: messages over the TCP
            connection, no device needed (one-sided operations raise
            :class:`~aiordma.UnsupportedOperationError`); ``"auto"`` (default): RDMA where
            this host has a usable device and the listener takes RDMA, else TCP.

    Raises:
        OperationTimeout: the set-up did not finish in ``timeout`` seconds.
        AuthenticationError: the shared-secret check failed, or only one side uses a secret.
        ConnectionRejectedError: the listener refused (a connection limit, no resources, or
            not this transport: ``category`` ``RejectCategory.TRANSPORT``).
        BrokenResourceError: the connection broke during set-up (also: a listener of protocol
            version 3, which takes no TCP connection, closing on a TcpHello).
        RemoteProtocolError: the listener broke the handshake protocol.
        LocalProtocolError: ``secret`` is not bytes of at least 16 bytes, or ``transport``
            none of ``"auto"``, ``"rdma"``, ``"tcp"``.
        DeviceError: ``transport="rdma"`` and no usable RDMA device.
    """
    check_host(host)
    check_port(port)
    check_seconds(timeout)
    config = _check_config(config)
    _check_device(device, gid_index)
    key = _check_secret(secret)
    kind = _check_transport(transport)
    try:
        async with asyncio.timeout(timeout):
            return await _connect(host, port, config, device, gid_index, key, kind)
    except TimeoutError:
        raise OperationTimeout(f"connecting to {host}:{port} took longer than {timeout} s") \
            from None


async def _open(host: str, port: int, config: Config) -> SideChannel:
    try:
        _, side = await asyncio.get_running_loop().create_connection(SideChannel, host, port)
    except OSError as exc:
        raise BrokenResourceError(f"cannot reach {host}:{port}: {exc}") from exc
    _keepalive(side, config)
    return side


_ahead: dict[tuple[str, str | None, int | None], tuple[float, Device]] = {}


async def _device_ahead(host: str, port: int, device: str | Device | None,
                        gid_index: int | None, ttl: float = 10.0) -> None:
    """Open the device this connection will use before its TCP connect, so that the
    listener's set-up bound (its ``handshake_timeout``) does not count this process opening
    it: the first connection of a process opens it, seconds on a slow or busy machine, and a
    listener dropped such clients (``TimeoutError`` on its side, "closed the connection
    during set-up" on theirs). The source address is the kernel's route to ``host`` (a UDP
    socket's connect sends nothing). Where it cannot be told, or no device opens, nothing
    happens here: the choice after the connect decides, and raises, as it always did.
    Done once per host and choice while the device it opened stays open, for the device
    list's ``ttl`` (the probe and the choice cost a set-up 0.8 ms of CPU in the VM)."""
    if isinstance(device, Device):
        return
    key = (host, device, gid_index)
    seen = _ahead.get(key)
    if seen is not None and time.monotonic() - seen[0] < ttl and not seen[1].closed:
        return
    try:
        try:  # an address needs no resolver (the loop's runs in a thread: ms in the VM)
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_NUMERICHOST)
        except socket.gaierror:  # a name
            infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                                 type=socket.SOCK_STREAM)
        if not infos:
            return
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            local = probe.getsockname()[0]
        if len(_ahead) >= 1024:  # (a client of that many hosts: start again)
            _ahead.clear()
        _ahead[key] = (time.monotonic(), _device_for(local, device, gid_index))
    except (OSError, DeviceError):
        pass


async def _connect(host: str, port: int, config: Config, device: str | Device | None,
                   gid_index: int | None, secret: bytes | None,
                   transport: str) -> Endpoint | TcpChannel:
    where = f"{host}:{port}"
    if transport != "tcp":
        await _device_ahead(host, port, device, gid_index)
    side = await _open(host, port, config)
    if transport != "tcp":
        try:
            dev = _device_for(side.get_extra_info("sockname")[0], device, gid_index)
        except DeviceError as exc:
            if transport == "rdma":
                side.abort()
                raise
            log.debug("aiordma: connecting to %s over TCP: %s", where, exc)
        else:
            try:
                return await _connect_rdma(side, config, dev, secret, where)
            except ConnectionRejectedError as exc:
                if transport == "rdma" or exc.category != hs.RejectCategory.TRANSPORT:
                    raise
                log.debug("aiordma: %s takes no RDMA: connecting again over TCP", where)
            side = await _open(host, port, config)
    return await _connect_tcp(side, config, secret, where)


async def _connect_rdma(side: SideChannel, config: Config, dev: Device, secret: bytes | None,
                        where: str) -> Endpoint:
    """The RDMA set-up on a new connection (closed if it fails)."""
    res: _Resources | None = None
    handed = False  # the endpoint owns the connection (its abort() closes it)
    try:
        res = _Resources(dev, config, pool=config.receive_pool and config.client_pool)
        control = hs.ControlConnection(hs.Role.CLIENT, secret=secret)
        side.write(control.send(res.params(hs.Hello)))
        # RESET -> INIT needs nothing of the listener's: done while the Hello travels and
        # the listener makes its side, not after its Accept came.
        res.to_init()
        ev = await _answer(side, control)
        if isinstance(ev, hs.Reject):
            raise _rejected(ev, where)
        if isinstance(ev, hs.ConnectionClosed):
            raise BrokenResourceError(f"{where} closed the connection during set-up")
        if not isinstance(ev, hs.Accept):  # (the handshake's table allows nothing else here)
            raise RemoteProtocolError(f"{where} answered {type(ev).__name__}, not Accept")
        res.connect_qp(ev)
        ready = control.send(hs.Ready())
        # The receive slots are posted before the Ready goes out: the server may send as soon
        # as it has it (posted after, the server's first SEND could meet an empty receive
        # queue: a receiver-not-ready NAK and a retry after rxe's RNR timer).
        ep = res.endpoint(control, side, ev)
        res, handed = None, True
        try:
            side.write(ready)
            await side.drain()
        except BaseException:
            ep.abort()
            raise
        return ep
    except ProtocolError as exc:
        raise from_protocol_error(exc, "handshake") from exc
    except (ConnectionError, OSError) as exc:
        raise BrokenResourceError(f"connection to {where} failed: {exc}") from exc
    finally:
        if res is not None:
            res.release()
        if not handed:
            side.abort()


async def _connect_tcp(side: SideChannel, config: Config, secret: bytes | None,
                       where: str) -> TcpChannel:
    """The TCP set-up on a new connection (closed if it fails)."""
    ch: TcpChannel | None = None
    try:
        control = hs.ControlConnection(hs.Role.CLIENT, secret=secret)
        side.write(control.send(_tcp_params(hs.TcpHello, config)))
        ev = await _answer(side, control)
        if isinstance(ev, hs.Reject):
            raise _rejected(ev, where)
        if isinstance(ev, hs.ConnectionClosed):
            raise BrokenResourceError(f"{where} closed the connection during set-up{_OLD}")
        if not isinstance(ev, hs.TcpAccept):  # (the table allows nothing else here)
            raise RemoteProtocolError(f"{where} answered {type(ev).__name__}, not TcpAccept")
        if control.trailing_data[0]:
            raise RemoteProtocolError(f"{where} sent message frames before the Ready")
        # The channel reads the connection from now on; then the Ready lets the server send.
        ch = TcpChannel(config=config, peer=ev, side=side)
        side.write(control.send(hs.Ready()))
        return ch
    except ProtocolError as exc:
        raise from_protocol_error(exc, "handshake") from exc
    except (ConnectionError, OSError) as exc:
        raise BrokenResourceError(f"connection to {where} failed: {exc}{_OLD}") from exc
    except BaseException:
        if ch is not None:
            ch.abort()
        raise
    finally:
        if ch is None:
            side.abort()


_OLD = " (a listener of protocol version 3, before the TCP transport, takes none)"


async def _answer(side: SideChannel, control: hs.ControlConnection) -> hs.Event:
    """The listener's answer to a Hello or TcpHello, after the challenge-response if the
    listener asks for one (the client's proof goes out; a proof of the listener's that does
    not match is refused with an authentication Reject and raised)."""
    ev = await _read_event(side, control)
    if isinstance(ev, hs.Challenge):
        side.write(control.send(hs.Proof()))
        try:
            ev = await _read_event(side, control)
        except ProtocolAuthError as exc:  # the listener's proof does not match
            with contextlib.suppress(Exception):
                side.write(control.send(hs.Reject(
                    reason=str(exc)[:1000], category=hs.RejectCategory.AUTHENTICATION)))
                await asyncio.wait_for(side.drain(), 1.0)
            raise
    return ev
