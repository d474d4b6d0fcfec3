"""Connection set-up: ``connect()``, ``listen()`` and :class:`Listener`.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Self

from aiordma._args import check_host, check_int, check_optional_int, check_port, check_seconds
from aiordma._device.device import Device, list_devices
from aiordma._endpoint.endpoint import BUFFER_READS, Config, Endpoint
from aiordma._endpoint.qp import QPAddress, QueuePair
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
from aiordma.protocols import handshake as hs
from aiordma.protocols.errors import AuthenticationError as ProtocolAuthError
from aiordma.protocols.errors import ProtocolError

__all__ = ["Listener", "connect", "listen"]

log = logging.getLogger("aiordma")

Handler = Callable[[Endpoint], Awaitable[None]]

_devices: dict[tuple[str | None, int | None, int | None, str | None], Device] = {}


_listed: tuple[float, list[Any]] = (0.0, [])


def _device_list(ttl: float = 10.0) -> list[Any]:
    """``list_devices()``, cached for ``ttl`` seconds (it opens every device)."""
    global _listed
    now = time.monotonic()
    if now - _listed[0] > ttl:
        _listed = (now, list_devices())
    return _listed[1]


def _device_for(local_ip: str | None, device: str | Device | None,
                gid_index: int | None) -> Device:
    """The device and GID carrying ``local_ip`` (RoCE v2), else the first usable one.

    Devices are opened once per process and shared by every endpoint.
    """
    if isinstance(device, Device):
        return device
    ip = local_ip
    if ip is not None and gid_index is None:
        carried = any(g.ip == ip for d in _device_list() if device in (None, d.name)
                      for p in d.ports for g in p.gids)
        if not carried:
            ip = None  # e.g. TCP over 127.0.0.1: no GID carries it; take the default choice
    key = (device, None, gid_index, ip)
    dev = _devices.get(key)
    if dev is None or dev.closed:
        dev = Device(device, gid_index=gid_index, local_ip=ip)
        _devices[key] = dev
    return dev


def _keepalive(writer: asyncio.StreamWriter, config: Config) -> None:
    """TCP keepalive so a dead host (not just a dead process) is noticed within seconds."""
    idle, interval, count = (config.keepalive_idle, config.keepalive_interval,
                             config.keepalive_probes)
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Resources:
    """What an endpoint needs before the handshake names the peer; released on failure."""

    def __init__(self, device: Device, config: Config) -> None:
        self.device = device
        self.config = config
        sends = config.send_slots + config.max_onesided + BUFFER_READS + 1  # +1: a window bind
        self.entries = sends + config.data_slots + config.ctrl_slots
        self.reactor = shared_reactor(device, self.entries)
        self.qp: QueuePair | None = None
        self.recv_mr: MemoryRegion | None = None
        self.send_mr: MemoryRegion | None = None
        try:
            self.qp = QueuePair(device, self.reactor,
                                max_send_wr=sends,
                                max_recv_wr=config.data_slots + config.ctrl_slots,
                                max_rd_atomic=config.max_rd_atomic)
            nslots = config.data_slots + config.ctrl_slots
            self.recv_mr = MemoryRegion(device, bytearray(nslots * config.slot_size))
            self.send_mr = MemoryRegion(device, bytearray(config.send_slots * config.slot_size))
        except BaseException:
            self.release()
            raise

    def params(self, cls: type[hs._QPParams]) -> hs._QPParams:
        assert self.qp is not None
        a = self.qp.local_address()
        return cls(qp_num=a.qp_num, psn=a.psn, gid=a.gid, lid=a.lid, mtu=a.mtu,
                   data_slots=self.config.data_slots, ctrl_slots=self.config.ctrl_slots,
                   slot_size=self.config.slot_size, max_rd_atomic=self.config.max_rd_atomic,
                   max_message=self.config.max_message)

    def connect_qp(self, peer: hs._QPParams) -> None:
        assert self.qp is not None
        self.qp.connect(QPAddress(qp_num=peer.qp_num, psn=peer.psn, gid=peer.gid, lid=peer.lid,
                                  mtu=peer.mtu), peer_rd_atomic=peer.max_rd_atomic)

    def endpoint(self, control: hs.ControlConnection, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, peer: hs._QPParams, *,
                 established: bool = True) -> Endpoint:
        """The endpoint, which owns these resources from now on (``abort()`` releases them)
        and posts its receive slots at once."""
        assert self.qp and self.recv_mr and self.send_mr
        return Endpoint(device=self.device, config=self.config, control=control, reader=reader,
                        writer=writer, peer=peer, qp=self.qp, reactor=self.reactor,
                        entries=self.entries, recv_mr=self.recv_mr, send_mr=self.send_mr,
                        established=established)

    def release(self) -> None:
        for r in (self.qp, self.recv_mr, self.send_mr):
            if r is not None:
                r.close()
        release_shared(self.reactor, self.entries)


async def _read_event(reader: asyncio.StreamReader, control: hs.ControlConnection) -> hs.Event:
    while True:
        ev = control.next_event()
        if ev is not hs.NEED_DATA:
            assert isinstance(ev, hs.Event)
            return ev
        data = await reader.read(65536)
        control.receive_data(data)


def _check_config(config: Any) -> Config:
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise LocalProtocolError(f"config must be an aiordma.Config, not {config!r:.80}")
    config.validate()
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


async def connect(host: str, port: int, *, timeout: float = 10.0, config: Config | None = None,
                  device: str | Device | None = None, gid_index: int | None = None,
                  secret: bytes | None = None) -> Endpoint:
    """Connect to a listener and return an open :class:`Endpoint`.

    Args:
        host, port: the listener's TCP address.
        timeout: bound on the whole set-up, TCP connect included.
        config: endpoint tunables (:class:`Config`).
        device, gid_index: override the automatic choice (the RoCE v2 GID of the local address
            that reaches ``host``, else the first ACTIVE port's IPv4 RoCE v2 GID).
        secret: a shared secret (at least 16 bytes) the listener holds too: both sides then
            prove it (HMAC-SHA256 challenge-response) before any queue pair is connected.
            It authenticates set-up only; nothing is encrypted.

    Raises:
        OperationTimeout: the set-up did not finish in ``timeout`` seconds.
        AuthenticationError: the shared-secret check failed, or only one side uses a secret.
        ConnectionRejectedError: the listener refused (a connection limit, no resources).
        BrokenResourceError: the connection broke during set-up.
        RemoteProtocolError: the listener broke the handshake protocol.
        LocalProtocolError: ``secret`` is not bytes of at least 16 bytes.
        DeviceError: no usable RDMA device.
    """
    check_host(host)
    check_port(port)
    check_seconds(timeout)
    config = _check_config(config)
    _check_device(device, gid_index)
    key = _check_secret(secret)
    try:
        async with asyncio.timeout(timeout):
            return await _connect(host, port, config, device, gid_index, key)
    except TimeoutError:
        raise OperationTimeout(f"connecting to {host}:{port} took longer than {timeout} s") \
            from None


async def _connect(host: str, port: int, config: Config, device: str | Device | None,
                   gid_index: int | None, secret: bytes | None) -> Endpoint:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        raise BrokenResourceError(f"cannot reach {host}:{port}: {exc}") from exc
    res: _Resources | None = None
    try:
        _keepalive(writer, config)
        dev = _device_for(writer.get_extra_info("sockname")[0], device, gid_index)
        res = _Resources(dev, config)  # the queue pair stays in RESET until the Accept checks
        control = hs.ControlConnection(hs.Role.CLIENT, secret=secret)
        writer.write(control.send(res.params(hs.Hello)))
        ev = await _read_event(reader, control)
        if isinstance(ev, hs.Challenge):
            writer.write(control.send(hs.Proof()))
            try:
                ev = await _read_event(reader, control)
            except ProtocolAuthError as exc:  # the listener's proof does not match
                with contextlib.suppress(Exception):
                    writer.write(control.send(hs.Reject(
                        reason=str(exc)[:1000], category=hs.RejectCategory.AUTHENTICATION)))
                    await asyncio.wait_for(writer.drain(), 1.0)
                raise
        if isinstance(ev, hs.Reject):
            raise _rejected(ev, f"{host}:{port}")
        if isinstance(ev, hs.ConnectionClosed):
            raise BrokenResourceError(f"{host}:{port} closed the connection during set-up")
        if not isinstance(ev, hs.Accept):  # (the handshake's table allows nothing else here)
            raise RemoteProtocolError(f"{host}:{port} answered {type(ev).__name__}, not Accept")
        res.connect_qp(ev)
        ready = control.send(hs.Ready())
        # The receive slots are posted before the Ready goes out: the server may send as soon
        # as it has it (posted after, the server's first SEND could meet an empty receive
        # queue: a receiver-not-ready NAK and a retry after rxe's RNR timer).
        ep = res.endpoint(control, reader, writer, ev)
        res = None
        try:
            writer.write(ready)
            await writer.drain()
        except BaseException:
            ep.abort()
            raise
        return ep
    except ProtocolError as exc:
        raise from_protocol_error(exc, "handshake") from exc
    except (ConnectionError, OSError) as exc:
        raise BrokenResourceError(f"connection to {host}:{port} failed: {exc}") from exc
    finally:
        if res is not None:
            res.release()
            writer.transport.abort()


class Listener:
    """Accepts connections and runs ``handler(endpoint)`` for each, concurrently.

    Each handler runs in its own task; when it returns (or fails) its endpoint is closed
    gracefully. A connection whose set-up fails (a protocol error, a client that failed the
    shared-secret check) is dropped and logged; the listener keeps serving. A connection over
    a limit is refused with a Reject (the client gets :class:`ConnectionRejectedError`).
    ``aclose()`` stops accepting, cancels running handlers and closes their endpoints;
    ``async with listener:`` does that on exit.

    Attributes:
        host, port: the address actually bound (``port`` is the real one when 0 was asked).
        endpoints: the endpoints currently open.
        accepted: connections handed to the handler so far.
        failed_setups: connections whose set-up failed (authentication failures included).
        last_setup_error: why the latest of them failed (a typed error: a protocol error,
            an :class:`~aiordma.AiordmaError`, an ``OSError`` or a ``TimeoutError``), or None.
        rejected: connections refused because a limit was reached.
        max_connections_per_peer, max_connections: the limits (``None``: unlimited). Each
            counts TCP connections from set-up to close, so half-open set-ups count too.
    """

    def __init__(self, handler: Handler, config: Config, device: str | Device | None,
                 gid_index: int | None, *, secret: bytes | None = None,
                 max_connections_per_peer: int | None = None,
                 max_connections: int | None = None) -> None:
        self._handler = handler
        self._config = config
        self._device = device
        self._gid_index = gid_index
        self._secret = secret  # never shown in repr or logs
        self.max_connections_per_peer = max_connections_per_peer
        self.max_connections = max_connections
        self._per_peer: Counter[str] = Counter()  # peer address -> connections now
        self.rejected = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.endpoints: set[Endpoint] = set()
        self.host = ""
        self.port = 0
        self._closed = False
        self.accepted = 0
        self.failed_setups = 0
        self.last_setup_error: BaseException | None = None

    async def _start(self, host: str, port: int, backlog: int) -> None:
        self._server = await asyncio.start_server(self._on_connection, host, port,
                                                  backlog=backlog)
        sock = self._server.sockets[0].getsockname()
        self.host, self.port = sock[0], sock[1]

    def _limit_reached(self, peer: str) -> str | None:
        """Why a new connection from ``peer`` is over a limit, or ``None``."""
        per_peer, total = self.max_connections_per_peer, self.max_connections
        if per_peer is not None and self._per_peer[peer] >= per_peer:
            return f"too many connections from {peer} (this listener allows {per_peer})"
        if total is not None and sum(self._per_peer.values()) >= total:
            return f"too many connections (this listener allows {total})"
        return None

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if peername else "?"
        why = self._limit_reached(peer)
        if why is not None:
            self.rejected += 1
            log.warning("aiordma: refused a connection from %s: %s", peer, why)
            await self._refuse(reader, writer, why)
            return
        self._per_peer[peer] += 1
        try:
            await self._serve_connection(reader, writer)
        except asyncio.CancelledError:
            # Nobody awaits this task (asyncio's server started it), so it ends quietly: a task
            # that ends cancelled makes Python 3.11's streams log a spurious "Exception in
            # callback" (its done callback calls task.exception()), e.g. when asyncio.run()
            # cancels a program's leftover tasks at exit.
            return
        finally:
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      why: str) -> None:
        """Read the Hello (bounded), answer Reject(LIMIT), hang up. Nothing is allocated."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        control = hs.ControlConnection(hs.Role.SERVER, secret=self._secret)
        try:
            async with asyncio.timeout(self._config.handshake_timeout):
                try:
                    ev = await _read_event(reader, control)
                except ProtocolAuthError:
                    ev = None  # a Hello, but no secret where one is needed (or vice versa)
                if ev is None or isinstance(ev, hs.Hello):
                    writer.write(control.send(hs.Reject(reason=why,
                                                        category=hs.RejectCategory.LIMIT)))
                    await writer.drain()
        except (ProtocolError, OSError, TimeoutError):
            pass
        finally:
            writer.transport.abort()
            self._tasks.discard(task)

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            ep = await self._accept(reader, writer)
        except (AiordmaError, ProtocolError, OSError, TimeoutError) as exc:
            self.failed_setups += 1
            self.last_setup_error = exc.with_traceback(None)  # (no frames kept alive)
            log.warning("aiordma: set-up from %s failed: %s: %s",
                        writer.get_extra_info("peername"), type(exc).__name__, exc)
            writer.transport.abort()
            self._tasks.discard(task)
            return
        self.accepted += 1
        self.endpoints.add(ep)
        try:
            await self._handler(ep)
        except (AiordmaError, OSError) as exc:
            log.info("aiordma: handler for %s ended: %r", ep.peer_address, exc)
        except asyncio.CancelledError:
            ep.abort()
            if self._closed:
                return  # the listener is closing: this task ends quietly, not as "cancelled"
            raise
        except Exception:
            log.exception("aiordma: handler for %s failed", ep.peer_address)
        finally:
            self._tasks.discard(task)
            try:
                await ep.aclose()
            finally:
                self.endpoints.discard(ep)

    async def _accept(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> Endpoint:
        _keepalive(writer, self._config)
        control = hs.ControlConnection(hs.Role.SERVER, secret=self._secret)
        async with asyncio.timeout(self._config.handshake_timeout):
            try:
                ev = await _read_event(reader, control)
                if not isinstance(ev, hs.Hello):
                    raise BrokenResourceError("the client left before its Hello")
                if control.uses_secret:
                    # Nothing is created for the client until its proof matches.
                    writer.write(control.send(hs.Challenge()))
                    ev_proof = await _read_event(reader, control)
                    if not isinstance(ev_proof, hs.Proof):
                        raise BrokenResourceError("the client left before its proof")
            except ProtocolAuthError as exc:
                with contextlib.suppress(Exception):
                    writer.write(control.send(hs.Reject(
                        reason=str(exc)[:1000], category=hs.RejectCategory.AUTHENTICATION)))
                    await asyncio.wait_for(writer.drain(), 1.0)
                raise from_protocol_error(exc, "handshake") from exc
            try:
                dev = _device_for(writer.get_extra_info("sockname")[0], self._device,
                                  self._gid_index)
                res = _Resources(dev, self._config)
            except DeviceError as exc:
                writer.write(control.send(hs.Reject(reason=f"no RDMA resources: {exc}"[:1000],
                                                    category=hs.RejectCategory.RESOURCES)))
                await writer.drain()
                raise
            try:
                res.connect_qp(ev)
                # The endpoint posts its receive slots before the Accept goes out: the client
                # sends as soon as it has the Accept (its first SEND met an empty receive
                # queue when they were posted on the Ready: a receiver-not-ready NAK, retried
                # after rxe's RNR timer; counted by tests/rxe/test_endpoint.py). It reads the
                # control channel only once the Ready came.
                ep = res.endpoint(control, reader, writer, ev, established=False)
            except BaseException:
                res.release()
                raise
            try:
                writer.write(control.send(res.params(hs.Accept)))
                await writer.drain()
            except BaseException:
                ep.abort()
                raise
        # Once the Accept is out, the client takes itself to be connected: its Ready gets a
        # bound of its own. (Under one budget for the whole set-up, a listener slowed by a
        # storm of connects dropped clients whose Ready was already on its way: their first
        # call failed with BrokenResourceError, seen in the soak on a busy machine.)
        try:
            async with asyncio.timeout(self._config.handshake_timeout):
                ready = await _read_event(reader, control)
            if not isinstance(ready, hs.Ready):
                raise BrokenResourceError("the client did not confirm the connection")
            ep._established()
            return ep
        except BaseException:
            ep.abort()
            raise

    async def aclose(self) -> None:
        """Stop accepting; cancel the handlers and close their endpoints. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for ep in list(self.endpoints):
            ep.abort()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def abort(self) -> None:
        """Stop accepting and abort every endpoint now."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for ep in list(self.endpoints):
            ep.abort()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<Listener {self.host}:{self.port} {len(self.endpoints)} endpoints>"


async def listen(handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                 config: Config | None = None, device: str | Device | None = None,
                 gid_index: int | None = None, backlog: int = 128,
                 secret: bytes | None = None, max_connections_per_peer: int | None = None,
                 max_connections: int | None = None) -> Listener:
    """Listen on ``host:port`` and run ``await handler(endpoint)`` for every connection.

    ``port=0`` picks a free port (see :attr:`Listener.port`). Devices and GIDs are chosen per
    connection as :func:`connect` does, unless ``device``/``gid_index`` are given.

    Args:
        secret: a shared secret (at least 16 bytes): only clients that prove it (HMAC-SHA256
            challenge-response, see :func:`connect`) get a queue pair; others are refused with
            an authentication Reject and counted in :attr:`Listener.failed_setups`.
        max_connections_per_peer: at most this many connections (in set-up or open) from one
            peer IP address; more are refused (the client gets
            :class:`ConnectionRejectedError`). ``None``: no limit.
        max_connections: at most this many connections in all. ``None``: no limit.

    Raises:
        DeviceError: no usable RDMA device (checked now, not at the first connection).
        LocalProtocolError: ``secret`` is not bytes of at least 16 bytes, or a limit is < 1.
    """
    if not callable(handler):
        raise LocalProtocolError(f"handler must be an async function, not {handler!r:.80}")
    check_host(host, empty_ok=True)
    check_port(port, zero_ok=True)
    check_int(backlog, name="backlog", low=1)
    config = _check_config(config)
    _check_device(device, gid_index)
    key = _check_secret(secret)
    check_optional_int(max_connections_per_peer, name="max_connections_per_peer")
    check_optional_int(max_connections, name="max_connections")
    # Open the device now: pyverbs' first import and the device's opening can take seconds on
    # a slow machine, which must not count against the first client's handshake timeout.
    _device_for(None if host in ("", "0.0.0.0", "::") else host, device, gid_index)
    lst = Listener(handler, config, device, gid_index, secret=key,
                   max_connections_per_peer=max_connections_per_peer,
                   max_connections=max_connections)
    await lst._start(host, port, backlog)
    return lst


