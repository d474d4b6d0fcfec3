"""The server side of connection set-up: :func:`listen` and :class:`Listener` (the steps
are in :mod:`.connect`'s documentation). One port takes both transports: a Hello is set up as
an RDMA endpoint, a TcpHello as a TCP channel, as far as the listener's ``transport`` allows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Self

from aiordma._args import check_host, check_int, check_optional_int, check_port
from aiordma._device.device import Device
from aiordma._endpoint.config import Config
from aiordma._endpoint.connect import (
    Channel,
    Handler,
    _check_config,
    _check_device,
    _check_secret,
    _check_transport,
    _device_for,
    _keepalive,
    _read_event,
    _Resources,
    _tcp_params,
)
from aiordma._endpoint.endpoint import Endpoint
from aiordma._endpoint.side import SideChannel
from aiordma._endpoint.stock import SetupStock
from aiordma._errors import (
    AiordmaError,
    BrokenResourceError,
    ConnectionRejectedError,
    DeviceError,
    LocalProtocolError,
    RemoteProtocolError,
    from_protocol_error,
)
from aiordma._tcp.channel import TcpChannel
from aiordma.protocols import handshake as hs
from aiordma.protocols.errors import AuthenticationError as ProtocolAuthError
from aiordma.protocols.errors import ProtocolError

__all__ = ["Handler", "Listener", "listen"]

log = logging.getLogger("aiordma")


class Listener:
    """Accepts connections and runs ``handler(channel)`` for each, concurrently: an
    :class:`Endpoint` (RDMA) or a :class:`~aiordma._tcp.channel.TcpChannel` (TCP), as the client
    asked and the listener's ``transport`` allows (``channel.transport`` says which).

    Each handler runs in its own task; when it returns (or fails) its endpoint is closed
    gracefully. A connection whose set-up fails (a protocol error, a client that failed the
    shared-secret check) is dropped and logged; the listener keeps serving. A connection over
    a limit is refused with a Reject (the client gets :class:`ConnectionRejectedError`).
    ``aclose()`` stops accepting, cancels running handlers and closes their endpoints;
    ``async with listener:`` does that on exit.

    Attributes:
        host, port: the address actually bound (``port`` is the real one when 0 was asked).
        transport: what it takes: ``"auto"`` (RDMA where this host has a device, and TCP),
            ``"rdma"`` or ``"tcp"``; a client asking for another is refused with
            ``Reject(category=TRANSPORT)``.
        endpoints: the connections currently open (endpoints and TCP channels).
        accepted: connections handed to the handler so far.
        failed_setups: connections whose set-up failed (authentication failures included).
        last_setup_error: why the latest of them failed (a typed error: a protocol error,
            an :class:`~aiordma.AiordmaError`, an ``OSError`` or a ``TimeoutError``), or None.
        rejected: connections refused because a limit was reached, or because they asked for
            a transport this listener does not take.
        stock: the connections' resources it makes ahead (``Config.setup_stock``; its
            ``taken`` and ``missed`` count the set-ups that found one and that did not), or
            None.
        max_connections_per_peer, max_connections: the limits (``None``: unlimited). Each
            counts TCP connections from set-up to close, so half-open set-ups count too.
    """

    def __init__(self, handler: Handler, config: Config, device: str | Device | None,
                 gid_index: int | None, *, secret: bytes | None = None,
                 max_connections_per_peer: int | None = None,
                 max_connections: int | None = None, transport: str = "auto") -> None:
        self._handler = handler
        self.transport = transport
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
        self.endpoints: set[Channel] = set()
        self.host = ""
        self.port = 0
        self._closed = False
        self.accepted = 0
        self.failed_setups = 0
        self.last_setup_error: BaseException | None = None
        self.stock: SetupStock | None = None

    async def _start(self, host: str, port: int, backlog: int) -> None:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: SideChannel(self._made), host, port, backlog=backlog)
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

    def _made(self, side: SideChannel) -> None:
        """A client connected: its set-up (and then its handler) runs in a task of its own."""
        asyncio.get_running_loop().create_task(self._on_connection(side))

    async def _on_connection(self, side: SideChannel) -> None:
        peername = side.get_extra_info("peername")
        peer = str(peername[0]) if peername else "?"
        why = self._limit_reached(peer)
        if why is not None:
            self.rejected += 1
            log.warning("aiordma: refused a connection from %s: %s", peer, why)
            await self._refuse(side, why)
            return
        self._per_peer[peer] += 1
        try:
            await self._serve_connection(side)
        except asyncio.CancelledError:
            # Nobody awaits this task (the listener started it for the connection), so it
            # ends quietly, e.g. when asyncio.run() cancels a program's leftover tasks at exit.
            return
        finally:
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]

    async def _refuse(self, side: SideChannel, why: str) -> None:
        """Read the Hello (bounded), answer Reject(LIMIT), hang up. Nothing is allocated."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        control = hs.ControlConnection(hs.Role.SERVER, secret=self._secret)
        try:
            async with asyncio.timeout(self._config.handshake_timeout):
                try:
                    ev = await _read_event(side, control)
                except ProtocolAuthError:
                    ev = None  # a Hello, but no secret where one is needed (or vice versa)
                if ev is None or isinstance(ev, (hs.Hello, hs.TcpHello)):
                    side.write(control.send(hs.Reject(reason=why,
                                                      category=hs.RejectCategory.LIMIT)))
                    await side.drain()
        except (ProtocolError, OSError, TimeoutError):
            pass
        finally:
            side.abort()
            self._tasks.discard(task)

    async def _serve_connection(self, side: SideChannel) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            with self.stock.setting_up() if self.stock is not None else contextlib.nullcontext():
                ep = await self._accept(side)
        except ConnectionRejectedError as exc:  # the transport asked for: a negotiation's step
            self.rejected += 1
            log.info("aiordma: refused a connection from %s: %s",
                     side.get_extra_info("peername"), exc)
            side.abort()
            self._tasks.discard(task)
            return
        except (AiordmaError, ProtocolError, OSError, TimeoutError) as exc:
            self.failed_setups += 1
            self.last_setup_error = exc.with_traceback(None)  # (no frames kept alive)
            log.warning("aiordma: set-up from %s failed: %s: %s",
                        side.get_extra_info("peername"), type(exc).__name__, exc)
            side.abort()
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

    async def _accept(self, side: SideChannel) -> Channel:
        _keepalive(side, self._config)
        control = hs.ControlConnection(hs.Role.SERVER, secret=self._secret)
        async with asyncio.timeout(self._config.handshake_timeout):
            try:
                ev = await _read_event(side, control)
                if not isinstance(ev, (hs.Hello, hs.TcpHello)):
                    raise BrokenResourceError("the client left before its Hello")
                dev = await self._transport_for(ev, side, control)
                if control.uses_secret:
                    # Nothing is created for the client until its proof matches.
                    side.write(control.send(hs.Challenge()))
                    ev_proof = await _read_event(side, control)
                    if not isinstance(ev_proof, hs.Proof):
                        raise BrokenResourceError("the client left before its proof")
            except ProtocolAuthError as exc:
                with contextlib.suppress(Exception):
                    side.write(control.send(hs.Reject(
                        reason=str(exc)[:1000], category=hs.RejectCategory.AUTHENTICATION)))
                    await asyncio.wait_for(side.drain(), 1.0)
                raise from_protocol_error(exc, "handshake") from exc
            if isinstance(ev, hs.TcpHello):
                ch = self._accept_tcp(side, control, ev)
            else:
                assert dev is not None
                ep = await self._accept_rdma(side, control, ev, dev)
        # Once the Accept is out, the client takes itself to be connected: its Ready gets a
        # bound of its own. (Under one budget for the whole set-up, a listener slowed by a
        # storm of connects dropped clients whose Ready was already on its way: their first
        # call failed with BrokenResourceError, seen in the soak on a busy machine.)
        if isinstance(ev, hs.TcpHello):
            try:
                async with asyncio.timeout(self._config.handshake_timeout):
                    await asyncio.shield(ch._ready)  # type: ignore[arg-type]  # (the server's)
                return ch
            except BaseException:
                ch.abort()
                raise
        try:
            async with asyncio.timeout(self._config.handshake_timeout):
                ready = await _read_event(side, control)
            if not isinstance(ready, hs.Ready):
                raise BrokenResourceError("the client did not confirm the connection")
            ep._established()
            return ep
        except BaseException:
            ep.abort()
            raise

    async def _transport_for(self, hello: hs.Hello | hs.TcpHello, side: SideChannel,
                             control: hs.ControlConnection) -> Device | None:
        """The device for an RDMA Hello (None for a TcpHello), or a Reject if this listener
        does not take the transport asked for (or, for RDMA under ``"auto"``, has no usable
        device: TRANSPORT, the client may come again over TCP; under ``"rdma"`` that is a
        failed set-up, RESOURCES, as it always was).

        Raises:
            ConnectionRejectedError: a TRANSPORT refusal (a negotiation's step).
            DeviceError: ``"rdma"`` and the device cannot be used.
        """
        why = None
        dev = None
        if isinstance(hello, hs.TcpHello):
            if self.transport == "rdma":
                why = "this listener takes RDMA only: connect with transport='rdma' or 'auto'"
        elif self.transport == "tcp":
            why = "this listener takes TCP only: connect with transport='tcp' or 'auto'"
        else:
            try:
                dev = _device_for(side.get_extra_info("sockname")[0], self._device,
                                  self._gid_index)
            except DeviceError as exc:
                if self.transport == "rdma":
                    side.write(control.send(hs.Reject(
                        reason=f"no RDMA resources: {exc}"[:1000],
                        category=hs.RejectCategory.RESOURCES)))
                    await side.drain()
                    raise
                why = (f"this listener has no usable RDMA device ({exc}); it takes TCP: "
                       f"connect with transport='tcp' or 'auto'")
        if why is not None:
            side.write(control.send(hs.Reject(reason=why[:1000],
                                              category=hs.RejectCategory.TRANSPORT)))
            await side.drain()
            raise ConnectionRejectedError(why, reason=why,
                                          category=hs.RejectCategory.TRANSPORT)
        return dev

    async def _accept_rdma(self, side: SideChannel, control: hs.ControlConnection,
                           hello: hs.Hello, dev: Device) -> Endpoint:
        """Create the client's queue pair and endpoint, answer Accept (the Ready is awaited
        by the caller)."""
        pool = hs.server_uses_pool(hello, pool=self._config.receive_pool)
        try:
            res = self.stock.take(dev, pool) if self.stock is not None else None
            if res is None:
                res = _Resources(dev, self._config, pool=pool)
        except DeviceError as exc:
            side.write(control.send(hs.Reject(reason=f"no RDMA resources: {exc}"[:1000],
                                              category=hs.RejectCategory.RESOURCES)))
            await side.drain()
            raise
        try:
            res.connect_qp(hello)
            # The endpoint posts its receive slots before the Accept goes out: the client
            # sends as soon as it has the Accept (its first SEND met an empty receive
            # queue when they were posted on the Ready: a receiver-not-ready NAK, retried
            # after rxe's RNR timer; counted by tests/rxe/test_endpoint.py). It reads the
            # control channel only once the Ready came.
            ep = res.endpoint(control, side, hello, established=False)
        except BaseException:
            res.release()
            raise
        try:
            side.write(control.send(res.params(hs.Accept)))
            await side.drain()
        except BaseException:
            ep.abort()
            raise
        return ep

    def _accept_tcp(self, side: SideChannel, control: hs.ControlConnection,
                    hello: hs.TcpHello) -> TcpChannel:
        """Make the client's channel, which reads the connection from now on (the client's
        Ready first), and answer TcpAccept."""
        if control.trailing_data[0]:
            raise RemoteProtocolError("the client sent more than its TcpHello before the "
                                      "answer")
        ch = TcpChannel(config=self._config, peer=hello, side=side, control=control)
        try:
            side.write(control.send(_tcp_params(hs.TcpAccept, self._config)))
        except BaseException:
            ch.abort()
            raise
        return ch

    async def aclose(self) -> None:
        """Stop accepting; cancel the handlers and close their endpoints. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        if self.stock is not None:
            self.stock.close()
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
        if self.stock is not None:
            self.stock.close()
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
                 max_connections: int | None = None, transport: str = "auto") -> Listener:
    """Listen on ``host:port`` and run ``await handler(channel)`` for every connection: an
    :class:`Endpoint` for a client that connects over RDMA, a
    :class:`~aiordma._tcp.channel.TcpChannel` for one over TCP (``channel.transport``).

    ``port=0`` picks a free port (see :attr:`Listener.port`). Devices and GIDs are chosen per
    connection as :func:`connect` does, unless ``device``/``gid_index`` are given.

    Args:
        transport: ``"auto"`` (default): both, RDMA where this host has a usable device (a
            host without one takes TCP only); ``"rdma"``: RDMA only (a device is required);
            ``"tcp"``: TCP only (no device is opened).
        secret: a shared secret (at least 16 bytes): only clients that prove it (HMAC-SHA256
            challenge-response, see :func:`connect`) get a queue pair; others are refused with
            an authentication Reject and counted in :attr:`Listener.failed_setups`.
        max_connections_per_peer: at most this many connections (in set-up or open) from one
            peer IP address; more are refused (the client gets
            :class:`ConnectionRejectedError`). ``None``: no limit.
        max_connections: at most this many connections in all. ``None``: no limit.

    Raises:
        DeviceError: ``transport="rdma"`` and no usable RDMA device (checked now, not at the
            first connection).
        LocalProtocolError: ``secret`` is not bytes of at least 16 bytes, a limit is < 1, or
            ``transport`` none of ``"auto"``, ``"rdma"``, ``"tcp"``.
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
    kind = _check_transport(transport)
    dev = None
    if kind != "tcp":
        # Open the device now: pyverbs' first import and the device's opening can take
        # seconds on a slow machine, which must not count against the first client's
        # handshake timeout.
        try:
            dev = _device_for(None if host in ("", "0.0.0.0", "::") else host, device,
                              gid_index)
        except DeviceError as exc:
            if kind == "rdma":
                raise
            log.info("aiordma: listening on %s:%s for TCP only: %s", host, port, exc)
    lst = Listener(handler, config, device, gid_index, secret=key,
                   max_connections_per_peer=max_connections_per_peer,
                   max_connections=max_connections, transport=kind)
    await lst._start(host, port, backlog)
    if dev is not None and config.setup_stock:
        lst.stock = SetupStock(config, config.setup_stock, dev)
        lst.stock.fill()
    return lst


