"""The TCP transport on real loopback sockets, device-free: negotiation (``transport=`` on both
sides, a listener that refuses a transport, a version-3 listener, the RDMA Hello unchanged),
the shared secret, a peer that breaks the frames, typed errors for one-sided operations, what
says which transport was chosen (the channel, the client, the server's stats, ``aiordma
stats``, the pool's ReplicaStats), the key-value client's RPC fallback, a collectives group
formed over TCP (and ``transport="rdma"`` refused typed), and a pool of replicas over TCP (balancing, a killed replica ejected and an
idempotent call sent again, a non-idempotent one never twice).

Where a test needs this host to have no RDMA device, it says so to the set-up itself
(monkeypatched device lookup), so the tests mean the same on a host that has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest

import aiordma
from aiordma import (
    AuthenticationError,
    BrokenResourceError,
    Config,
    ConnectionRejectedError,
    DeviceError,
    RemoteProtocolError,
    UnsupportedOperationError,
)
from aiordma._endpoint import connect as connect_module
from aiordma._endpoint import listener as listener_module
from aiordma._endpoint.listener import Listener
from aiordma.cli.demo_micro import Orders
from aiordma.lowlevel import resource_counts
from aiordma.protocols import handshake as hs
from aiordma.protocols import tcp as frames
from aiordma.rpc import UnknownOutcomeError, connect_pool, serve
from aiordma.rpc._stats import format_stats
from aiordma.services import kv
from aiordma.services.echo import Echo

from ..bounds import STEP


def no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host has no RDMA device, as far as connection set-up can tell."""
    def none(*args: Any) -> Any:
        raise DeviceError("no RDMA device (this test says so)")

    monkeypatch.setattr(connect_module, "_device_for", none)
    monkeypatch.setattr(listener_module, "_device_for", none)


async def keep(channel: Any) -> None:
    """A listener's handler that echoes until the end."""
    while (m := await channel.recv()) is not None:
        await channel.send(m)


@contextlib.asynccontextmanager
async def listener(transport: str = "auto", **kw: Any) -> AsyncIterator[Listener]:
    """A listener; one with ``transport="rdma"`` is made without opening a device (listen()
    would refuse it on a host without one), to see what it answers a TcpHello."""
    if transport == "rdma":
        lst = Listener(keep, Config(), None, None, transport="rdma", **kw)
        await lst._start("127.0.0.1", 0, 16)
    else:
        lst = await aiordma.listen(keep, "127.0.0.1", 0, transport=transport, **kw)
    async with lst:
        yield lst


async def raw_hello(port: int, hello: hs.Event) -> hs.Event:
    """Send ``hello`` on a new connection as a client would; the listener's answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        control = hs.ControlConnection(hs.Role.CLIENT)
        writer.write(control.send(hello))
        while (ev := control.next_event()) is hs.NEED_DATA:
            control.receive_data(await asyncio.wait_for(reader.read(65536), STEP))
        assert isinstance(ev, hs.Event)
        return ev
    finally:
        writer.transport.abort()


RDMA_HELLO = hs.Hello(qp_num=1, psn=2, gid=bytes(16), lid=0, mtu=3, data_slots=8, ctrl_slots=3,
                      slot_size=4096, max_rd_atomic=1)


# -- negotiation ---------------------------------------------------------------------------------


async def test_auto_without_a_device_goes_over_tcp_on_both_sides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    no_device(monkeypatch)
    async with listener() as lst:
        assert lst.transport == "auto"
        async with await aiordma.connect("127.0.0.1", lst.port, timeout=STEP) as ch:
            assert isinstance(ch, aiordma.TcpChannel) and ch.transport == "tcp"
            await ch.send(b"over tcp")
            assert await asyncio.wait_for(ch.recv(), STEP) == b"over tcp"
        assert lst.accepted == 1 and lst.failed_setups == 0


async def test_forcing_tcp_works_whatever_the_host_has() -> None:
    async with listener() as lst, await aiordma.connect("127.0.0.1", lst.port, timeout=STEP,
                                                       transport="tcp") as ch:
        assert ch.transport == "tcp"
        await ch.send(bytes(3 << 20))  # past the eager size and a fraction of the buffer
        assert len(await asyncio.wait_for(ch.recv(), STEP)) == 3 << 20


async def test_a_client_of_auto_at_a_tcp_only_listener_ends_up_over_tcp() -> None:
    """With a device here, the client offers RDMA first and is refused (TRANSPORT), then
    connects again over TCP; without one it goes over TCP at once: TCP either way."""
    async with listener("tcp") as lst:
        async with await aiordma.connect("127.0.0.1", lst.port, timeout=STEP) as ch:
            assert ch.transport == "tcp"
        assert lst.accepted == 1 and lst.failed_setups == 0


async def test_an_rdma_hello_at_a_listener_without_rdma_is_refused_as_transport(
        monkeypatch: pytest.MonkeyPatch) -> None:
    no_device(monkeypatch)
    for transport in ("tcp", "auto"):
        async with listener(transport) as lst:
            ev = await raw_hello(lst.port, RDMA_HELLO)
            assert isinstance(ev, hs.Reject) and ev.category == hs.RejectCategory.TRANSPORT
            assert "transport='tcp'" in ev.reason
            assert lst.rejected == 1 and lst.failed_setups == 0


async def test_a_tcp_hello_at_an_rdma_only_listener_is_refused_typed() -> None:
    async with listener("rdma") as lst:
        with pytest.raises(ConnectionRejectedError, match="RDMA only") as info:
            await aiordma.connect("127.0.0.1", lst.port, timeout=STEP, transport="tcp")
        assert info.value.category == hs.RejectCategory.TRANSPORT
        assert lst.rejected == 1


async def test_rdma_forced_without_a_device_is_a_device_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    no_device(monkeypatch)
    async with listener("tcp") as lst:
        with pytest.raises(DeviceError):
            await aiordma.connect("127.0.0.1", lst.port, timeout=STEP, transport="rdma")
    with pytest.raises(DeviceError):
        await aiordma.listen(keep, "127.0.0.1", 0, transport="rdma")


async def test_a_version_3_listener_closing_on_a_tcp_hello_is_a_clear_error() -> None:
    """A listener of protocol version 3 reads a TcpHello as an unknown message and drops the
    connection: the client says so, naming the version."""
    async def v3(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        body = msgpack.unpackb(await reader.readexactly(n))
        assert body["t"] == hs.TcpHello.code  # not a type version 3 knows
        writer.transport.abort()

    server = await asyncio.start_server(v3, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(BrokenResourceError, match="protocol version 3"):
            await aiordma.connect("127.0.0.1", port, timeout=STEP, transport="tcp")
    finally:
        server.close()


def test_the_rdma_hello_is_version_3_byte_for_byte() -> None:
    """What a client offering RDMA sends is protocol version 3's Hello: a version-3 listener
    accepts it, so that peer still connects over RDMA."""
    body = msgpack.unpackb(hs.encode(RDMA_HELLO)[4:])
    assert body.pop("t") == 1 and body.pop("version") == hs.RDMA_VERSION == 3
    assert set(body) == {"qp_num", "psn", "gid", "lid", "mtu", "data_slots", "ctrl_slots",
                         "slot_size", "max_rd_atomic", "max_message", "nonce"}
    assert hs.PROTOCOL_VERSION == 4


# -- the shared secret, a peer that breaks the rules, one-sided operations -----------------------


async def test_the_shared_secret_guards_a_tcp_set_up_too() -> None:
    secret = b"s" * 32
    async with listener("tcp", secret=secret) as lst:
        async with await aiordma.connect("127.0.0.1", lst.port, timeout=STEP, secret=secret,
                                         transport="tcp") as ch:
            await ch.send(b"authenticated")
            assert await asyncio.wait_for(ch.recv(), STEP) == b"authenticated"
        with pytest.raises(AuthenticationError):
            await aiordma.connect("127.0.0.1", lst.port, timeout=STEP, secret=b"x" * 32,
                                  transport="tcp")
        with pytest.raises(AuthenticationError):
            await aiordma.connect("127.0.0.1", lst.port, timeout=STEP, transport="tcp")
        await asyncio.sleep(0.05)
        assert lst.accepted == 1 and lst.failed_setups == 2


async def test_a_peer_that_breaks_the_frames_breaks_the_channel_typed() -> None:
    got: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def handler(ch: Any) -> None:
        try:
            await ch.recv()
        except BaseException as exc:
            got.set_result(exc)
            raise

    async with await aiordma.listen(handler, "127.0.0.1", 0, transport="tcp") as lst:
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        control = hs.ControlConnection(hs.Role.CLIENT)
        writer.write(control.send(hs.TcpHello(recv_buffer=1000, slots=1, eager_max=10,
                                              max_message=1000)))
        while (ev := control.next_event()) is hs.NEED_DATA:
            control.receive_data(await asyncio.wait_for(reader.read(65536), STEP))
        assert isinstance(ev, hs.TcpAccept) and ev.recv_buffer == Config().recv_buffer
        writer.write(control.send(hs.Ready()) + frames.HEADER.pack(9, 0, 0, 0))  # no such kind
        assert isinstance(await asyncio.wait_for(got, STEP), RemoteProtocolError)
        writer.transport.abort()


@pytest.mark.parametrize("operation", ["register", "write", "post_write", "read", "fetch_add",
                                       "compare_swap", "expose"])
async def test_one_sided_operations_over_tcp_raise_a_typed_error_naming_it(
        operation: str) -> None:
    async with aiordma.testing.tcp_pairs() as (a, _b):
        method = getattr(a, operation)
        args: dict[str, Any] = {"register": (bytearray(8),), "write": (None, None),
                                "post_write": (None, None), "read": (None, None),
                                "fetch_add": (None, 1), "compare_swap": (None,),
                                "expose": (None,)}[operation]
        kwargs = {"expected": 0, "new": 1} if operation == "compare_swap" else {}
        with pytest.raises(UnsupportedOperationError, match="over TCP") as info:
            result = method(*args, **kwargs)
            if asyncio.iscoroutine(result):
                await result
        assert (info.value.operation, info.value.transport) == (operation, "tcp")
        await a.send(b"still usable")  # nothing happened to the channel


async def test_tcp_channels_are_counted_and_released() -> None:
    before = resource_counts()["tcp_channels"]
    async with aiordma.testing.tcp_pairs() as (a, b):
        assert resource_counts()["tcp_channels"] == before + 2
        await a.aclose()
        assert b.stats().sent == 0 and a.closed
    assert resource_counts()["tcp_channels"] == before


# -- the choice is visible; services over TCP --------------------------------------------------


async def test_the_server_the_client_and_the_stats_command_say_the_transport() -> None:
    async with await serve(Echo(), "127.0.0.1", 0, transport="tcp") as server, \
            await aiordma.rpc.connect("127.0.0.1", server.port, timeout=STEP) as client:
        assert client.transport == "tcp"
        assert await client.echo(b"x" * 100_000) == b"x" * 100_000  # out of band
        stats = await client.call(aiordma.rpc.STATS_METHOD, timeout=STEP)
        assert stats["transports"] == {"tcp": 1} == server.stats()["transports"]
        assert format_stats(stats, "h:1").splitlines()[0].startswith(
            "h:1: 1 connections (tcp 1), ")


async def test_the_key_value_clients_one_sided_get_falls_back_to_rpc_over_tcp() -> None:
    store = kv.KvStore()
    async with await serve(store, "127.0.0.1", 0, transport="tcp") as server, \
            await kv.connect("127.0.0.1", server.port, timeout=STEP) as client:
        assert client.rpc.transport == "tcp"
        await client.put(b"k", b"value", timeout=STEP)
        assert await client.get(b"k", timeout=STEP) == b"value"  # one_sided=True: the default
        assert await client.get(b"absent", timeout=STEP) is None
        assert client.counters["fallback_no_rdma"] == 2 and client.counters["rpc_get"] == 2
        assert store.counters["table_without_rdma"] == 1 and store.counters["table"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_group_on_a_host_without_rdma_forms_over_tcp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a device, transport="auto" (the default) forms the group over TCP; asking for
    RDMA there is refused typed (the rest: tests/unit/test_collectives_tcp.py)."""
    from aiordma.services.collectives import Group

    no_device(monkeypatch)
    port = _free_port()
    gs = await asyncio.wait_for(asyncio.gather(
        *(Group.join(r, 2, "127.0.0.1", port, timeout=STEP) for r in range(2))), STEP)
    try:
        assert [g.transport for g in gs] == ["tcp", "tcp"]
        xs = [np.arange(3000.0) * (r + 1) for r in range(2)]
        await asyncio.wait_for(asyncio.gather(*(g.allreduce(x) for g, x in zip(gs, xs))),
                               STEP)
        assert all((x == np.arange(3000.0) * 3).all() for x in xs)
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))
    with pytest.raises(UnsupportedOperationError, match="transport='rdma'") as info:
        await Group.join(0, 2, "127.0.0.1", _free_port(), timeout=STEP, transport="rdma")
    assert info.value.transport == "tcp"


# -- a pool of replicas over TCP ----------------------------------------------------------------

FAST = {"health_interval": 0.05, "health_timeout": 1.0, "reconnect_base": 0.02,
        "reconnect_cap": 0.1, "wait_for_replica": 3.0, "seed": 7}


@contextlib.asynccontextmanager
async def replicas(n: int) -> AsyncIterator[list[tuple[Orders, Any]]]:
    services = [Orders(f"r{i}") for i in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(
            await serve(s, "127.0.0.1", 0, transport="tcp")) for s in services]
        yield list(zip(services, servers, strict=True))


async def test_a_pool_over_tcp_balances_ejects_and_retries_only_idempotent_calls() -> None:
    async with replicas(3) as reps:
        addresses = [f"127.0.0.1:{server.port}" for _, server in reps]
        async with await connect_pool(addresses, timeout=STEP, transport="tcp",
                                      **FAST) as pool:
            stats = pool.stats()
            assert [r.transport for r in stats.replicas] == ["tcp"] * 3
            assert all(r.state == "UP" for r in stats.replicas)
            got = await asyncio.gather(*(pool.price(f"p{i}", "tea", 0.01, timeout=STEP)
                                         for i in range(30)))
            assert {g["replica"] for g in got} == {"r0", "r1", "r2"}  # every replica took some
            # one replica dies with calls in flight on it
            victim_service, victim = next((s, v) for s, v in reps
                                          if f"127.0.0.1:{v.port}" == addresses[0])
            prices = [asyncio.ensure_future(pool.price(f"q{i}", "tea", 0.2, timeout=STEP))
                      for i in range(12)]
            orders = [asyncio.ensure_future(pool.order(f"o{i}", "tea", 0.2, timeout=STEP))
                      for i in range(12)]
            await asyncio.sleep(0.1)
            victim.abort()
            priced = await asyncio.gather(*prices)
            assert all(p["replica"] != victim_service.name for p in priced)  # sent again
            outcomes = await asyncio.gather(*orders, return_exceptions=True)
            for i, out in enumerate(outcomes):
                ran = sum(s.ran[f"o{i}"] for s, _ in reps)
                if isinstance(out, UnknownOutcomeError):
                    assert ran <= 1  # never sent twice
                else:
                    assert not isinstance(out, BaseException) and ran == 1
            assert any(isinstance(o, UnknownOutcomeError) for o in outcomes)
            assert pool.stats().ejections >= 1
            gone = next(r for r in pool.stats().replicas if r.address == addresses[0])
            assert gone.state != "UP" and gone.transport is None  # ejected: no connection


@pytest.mark.parametrize(("after", "error"), [
    (b"\x00\x00\x00\x02\x91\x91", RemoteProtocolError),  # garbage where the Ready goes
    (b"\x00\x00\x00", RemoteProtocolError),  # the stream ends inside a message
    (b"", BrokenResourceError),  # the client leaves at a message boundary
])
async def test_a_client_that_does_not_confirm_a_tcp_set_up_fails_it_typed(
        after: bytes, error: type[Exception]) -> None:
    async with listener("tcp") as lst:
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        writer.write(hs.encode(hs.TcpHello(recv_buffer=1000, slots=1, eager_max=10,
                                           max_message=1000)) + after)
        writer.write_eof()
        with contextlib.suppress(ConnectionError):
            while await asyncio.wait_for(reader.read(65536), STEP):
                pass
        writer.transport.abort()
        for _ in range(int(STEP / 0.01)):
            if lst.failed_setups:
                break
            await asyncio.sleep(0.01)
        assert lst.failed_setups == 1 and lst.accepted == 0
        assert type(lst.last_setup_error) is error, lst.last_setup_error


async def test_a_cancelled_queued_send_lets_the_next_one_go_and_complete() -> None:
    """A held message is out (the reader reads nothing), a second large one waits behind it,
    a small one behind that: cancelling the second frees the small one into a slot, and its
    send completes at once, with nothing read."""
    async with aiordma.testing.tcp_pairs(recv_buffer=0, data_slots=2, slot_size=112) as (a, b):
        eager = a.eager_max  # 100
        held = asyncio.ensure_future(a.send(bytes(2 * eager)))  # in a slot: waits for a read
        queued = asyncio.ensure_future(a.send(bytes(2 * eager)))  # only one held at a time
        small = asyncio.ensure_future(a.send(b"small"))  # behind it, in order
        await asyncio.sleep(0.1)
        assert not (held.done() or queued.done() or small.done())
        queued.cancel()
        await asyncio.wait_for(small, STEP)  # went into the second slot: done
        assert not held.done()
        assert await asyncio.wait_for(b.recv(), STEP) == bytes(2 * eager)
        await asyncio.wait_for(held, STEP)  # taken: done
        assert await asyncio.wait_for(b.recv(), STEP) == b"small"  # the cancelled one: never
        assert b.stats().received == 2 and a.stats().sent == 2


async def test_an_rdma_only_listener_without_its_device_refuses_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``transport="rdma"``: a device that cannot be used is a failed set-up (RESOURCES), not
    an invitation to come again over TCP."""
    no_device(monkeypatch)
    async with listener("rdma") as lst:
        ev = await raw_hello(lst.port, RDMA_HELLO)
        assert isinstance(ev, hs.Reject) and ev.category == hs.RejectCategory.RESOURCES
        for _ in range(int(STEP / 0.01)):
            if lst.failed_setups:
                break
            await asyncio.sleep(0.01)
        assert lst.failed_setups == 1 and lst.rejected == 0
        assert isinstance(lst.last_setup_error, DeviceError)


@pytest.mark.parametrize("transport", ["auto", "rdma", "tcp"])
async def test_the_device_is_opened_before_the_tcp_connect(monkeypatch, transport: str) -> None:  # type: ignore[no-untyped-def]
    """A connection's device is chosen (and opened) from the route to the host before the TCP
    connect, so the listener's set-up bound does not count the opening; a device that cannot
    be had there changes nothing (the choice after the connect decides, as before). Over
    ``transport="tcp"`` no device is looked for."""
    calls: list[tuple[str, ...]] = []

    def device_for(ip: str | None, device: Any, gid_index: Any) -> Any:
        calls.append(("device", str(ip)))
        raise DeviceError("no RDMA device here (the test says so)")

    real_open = connect_module._open

    async def open_(host: str, port: int, config: Config) -> Any:
        calls.append(("tcp", host))
        return await real_open(host, port, config)

    monkeypatch.setattr(connect_module, "_device_for", device_for)
    monkeypatch.setattr(connect_module, "_open", open_)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(BrokenResourceError, match="cannot reach"):
        await aiordma.connect("127.0.0.1", port, timeout=10, transport=transport)
    assert calls == ([] if transport == "tcp" else [("device", "127.0.0.1")]) + [
        ("tcp", "127.0.0.1")]
