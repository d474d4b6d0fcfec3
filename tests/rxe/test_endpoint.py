"""Endpoints over a real device: messages, flow control, one-sided operations, lifecycle.

Client and server are two endpoints in this process, on one rxe (or NIC) port, connected
through aiordma's TCP bootstrap; every test runs on asyncio and on uvloop.
Two-process and stateful coverage lives in test_stateful.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import aiordma
from aiordma import (
    BrokenResourceError,
    ClosedResourceError,
    Config,
    LocalProtocolError,
    OperationTimeout,
    RemoteAccessError,
    RemoteBuffer,
)
from aiordma.lowlevel import resource_counts

from ..bounds import STEP, hang_guard, load_factor, scaled

# Its subject is the loop integration: both loops under `--loops one` too (tests/loops.py).
pytestmark = pytest.mark.both_loops

EAGER_MAX = Config().eager_max
EDGES = [0, 1, 1023, 1024, 1025, EAGER_MAX - 1, EAGER_MAX, EAGER_MAX + 1, 65536, 1 << 20]
SIZES = st.one_of(st.sampled_from(EDGES), st.integers(0, 3 * EAGER_MAX),
                  st.integers(0, 4 << 20))


async def echo(ep) -> None:
    """Listener handler: send every message back."""
    while (m := await ep.recv()) is not None:
        await ep.send(m)


@given(size=SIZES, seed=st.integers(0, 2**32 - 1))
@example(size=4 << 20, seed=1).via("4 MiB rendezvous")
@example(size=EAGER_MAX + 1, seed=2).via("first rendezvous size")
async def test_messages_cross_both_ways_byte_for_byte(connected, size: int, seed: int) -> None:
    data = random.Random(seed).randbytes(size)
    c, s = connected.client, connected.server
    sender = asyncio.ensure_future(c.send(data))  # a rendezvous send waits for the read
    got = await asyncio.wait_for(s.recv(), STEP)
    await asyncio.wait_for(sender, STEP)
    assert got == data and isinstance(got, bytearray)
    sender = asyncio.ensure_future(s.send(memoryview(got)))
    back = await asyncio.wait_for(c.recv(), STEP)
    await asyncio.wait_for(sender, STEP)
    assert back == data


async def test_recv_into_keeps_a_message_that_does_not_fit(connected) -> None:
    c, s = connected.client, connected.server
    small, big = bytearray(10), bytearray(2 * EAGER_MAX)
    await c.send(b"x" * 100)
    with pytest.raises(LocalProtocolError, match="stays queued"):
        await asyncio.wait_for(s.recv_into(small), STEP)
    assert await asyncio.wait_for(s.recv_into(big), STEP) == 100
    assert big[:100] == b"x" * 100
    payload = os.urandom(EAGER_MAX + 500)  # rendezvous: read straight into the buffer
    sender = asyncio.ensure_future(c.send(payload))
    n = await asyncio.wait_for(s.recv_into(big), STEP)
    await asyncio.wait_for(sender, STEP)
    assert n == len(payload) and big[:n] == payload
    payload2 = os.urandom(EAGER_MAX + 9)  # same buffer again: its registration is reused
    sender = asyncio.ensure_future(c.send(payload2))
    n = await asyncio.wait_for(s.recv_into(big), STEP)
    await asyncio.wait_for(sender, STEP)
    assert big[:n] == payload2
    assert (s._reg_cache.misses, s._reg_cache.hits) == (1, 1)


async def test_send_from_a_registered_region(connected) -> None:
    """send(LocalSlice): a large slice is read by the peer from the region's own registration
    (nothing registered per message, the region stays open and usable); a small one goes
    eagerly; a region registered without remote access gets a read-only one from expose()."""
    c, s = connected.client, connected.server
    data = bytearray(os.urandom(3 << 20))
    region = c.register(data, remote_read=True)
    for lo, hi in ((100, 100 + 2 * EAGER_MAX), (5, 50), (0, len(data))):
        sender = asyncio.ensure_future(c.send(region[lo:hi]))
        assert await asyncio.wait_for(s.recv(), STEP) == data[lo:hi]
        await asyncio.wait_for(sender, STEP)
    assert not region.closed and not c._rdv_out
    plain = c.register(bytearray(b"y" * (EAGER_MAX + 7)))  # local access only
    sender = asyncio.ensure_future(c.send(plain.whole()))
    assert await asyncio.wait_for(s.recv(), STEP) == b"y" * (EAGER_MAX + 7)
    await asyncio.wait_for(sender, STEP)
    region.close()
    with pytest.raises(aiordma.ClosedResourceError):
        await c.send(region[0:EAGER_MAX + 1])
    await c.send(b"still fine")
    assert await asyncio.wait_for(s.recv(), STEP) == b"still fine"


async def test_many_tasks_sending_at_once_keep_their_order(connected) -> None:
    c, s = connected.client, connected.server
    tasks, per_task = 8, 25

    async def sender(t: int) -> None:
        for i in range(per_task):
            size = 16 if i % 7 else EAGER_MAX + 100  # a rendezvous now and then
            await c.send(bytes([t, i]) + bytes(size))

    senders = [asyncio.ensure_future(sender(t)) for t in range(tasks)]
    last = [-1] * tasks
    for _ in range(tasks * per_task):
        msg = await asyncio.wait_for(s.recv(), STEP)
        t, i = msg[0], msg[1]
        assert i == last[t] + 1, f"task {t}: message {i} after {last[t]}"
        last[t] = i
    await asyncio.wait_for(asyncio.gather(*senders), STEP)
    assert last == [per_task - 1] * tasks


async def test_graceful_close_delivers_everything_then_none(connected) -> None:
    c, s = connected.client, connected.server
    for i in range(10):  # eager sizes: each send returns once posted
        await c.send(bytes([i]) * (i * 800))
    closing = asyncio.ensure_future(c.aclose())
    for i in range(10):
        assert await asyncio.wait_for(s.recv(), STEP) == bytes([i]) * (i * 800)
    assert await asyncio.wait_for(s.recv(), STEP) is None
    await asyncio.wait_for(closing, STEP)
    assert c.closed
    with pytest.raises(ClosedResourceError):
        await c.send(b"late")
    with pytest.raises(BrokenResourceError):
        await s.send(b"to a closed peer")
    await c.aclose()  # idempotent
    c.abort()


async def test_abort_on_one_side_breaks_pending_receive_on_the_other(connected) -> None:
    c, s = connected.client, connected.server
    pending = asyncio.ensure_future(s.recv())
    await asyncio.sleep(0.05)
    c.abort()
    with pytest.raises(BrokenResourceError):  # (the catalogue gives the peer no time bound)
        await asyncio.wait_for(pending, hang_guard())
    with pytest.raises(ClosedResourceError):
        await c.recv()


async def test_local_close_wakes_every_pending_operation(connected) -> None:
    c = connected.client
    mr = c.register(bytearray(64))
    recvs = [asyncio.ensure_future(c.recv()) for _ in range(3)]
    await asyncio.sleep(0.05)
    c.abort()
    for r in recvs:
        with pytest.raises(ClosedResourceError):
            await asyncio.wait_for(r, STEP)
    with pytest.raises(ClosedResourceError):
        await c.write(mr[0:8], RemoteBuffer(address=0, rkey=1, length=8, writable=True))


async def test_one_sided_write_read_and_atomics(connected) -> None:
    c, s = connected.client, connected.server
    region = bytearray(1 << 16)
    exposed = s.register(region)
    desc = exposed.expose(read=True, write=True, atomic=True)
    # descriptors travel as messages (a msgpack-friendly tuple)
    await s.send(msgpack.packb(desc.to_wire()))
    peer = RemoteBuffer.from_wire(msgpack.unpackb(await c.recv()))
    mine = c.register(bytearray(os.urandom(8192)))
    await asyncio.wait_for(c.write(mine[0:4096], peer[0:4096]), STEP)
    assert region[:4096] == mine.view[:4096]
    region[8192:12288] = os.urandom(4096)
    await asyncio.wait_for(c.read(mine[4096:8192], peer[8192:12288]), STEP)
    assert bytes(mine.view[4096:8192]) == region[8192:12288]
    region[64:72] = (41).to_bytes(8, "little")
    assert await c.fetch_add(peer[64:72], 1) == 41
    assert await c.compare_swap(peer[64:72], expected=42, new=7) == 42
    assert int.from_bytes(region[64:72], "little") == 7
    with pytest.raises(LocalProtocolError):
        await c.fetch_add(peer[60:68], 1)  # misaligned: refused before posting
    with pytest.raises(LocalProtocolError):
        peer[0:1 << 17]  # past the descriptor


async def test_posted_writes_with_notify_land_before_their_message(connected) -> None:
    """post_write returns once posted; the notify message reaches the peer only after the
    WRITE's data (many WRITEs on the wire at once, each checked when its message arrives)."""
    c, s = connected.client, connected.server
    n, size = 48, 4096
    region = bytearray(n * size)
    await s.send(msgpack.packb(s.register(region).expose(write=True).to_wire()))
    peer = RemoteBuffer.from_wire(msgpack.unpackb(await c.recv()))
    src = c.register(bytearray(os.urandom(n * size)))
    acks = [await asyncio.wait_for(c.post_write(src[i * size:(i + 1) * size],
                                                peer[i * size:(i + 1) * size],
                                                notify=i.to_bytes(4, "little")), STEP)
            for i in range(n)]
    for i in range(n):
        got = await asyncio.wait_for(s.recv(), STEP)
        assert got is not None and int.from_bytes(got, "little") == i
        assert region[i * size:(i + 1) * size] == src.view[i * size:(i + 1) * size]
    await asyncio.wait_for(asyncio.gather(*acks), STEP)  # every WRITE acknowledged
    assert all(a.done() and a.result() is None for a in acks)
    # without notify: the future alone says when the data is there
    done = await c.post_write(src[0:size], peer[size:2 * size])
    await asyncio.wait_for(done, STEP)
    assert region[size:2 * size] == src.view[0:size]


@pytest.mark.parametrize("how", ["write", "post_write"])
async def test_wrong_rkey_breaks_only_that_endpoint(rdma_device, how: str) -> None:
    """A forged rkey fails the WRITE typed (post_write: its future) and breaks that endpoint
    alone; another connection keeps serving."""
    kw = {"timeout": STEP, "device": rdma_device}
    async with await aiordma.listen(echo, "127.0.0.1", 0, device=rdma_device) as listener:
        victim = await aiordma.connect("127.0.0.1", listener.port, **kw)
        bystander = await aiordma.connect("127.0.0.1", listener.port, **kw)
        mine = victim.register(bytearray(64))
        target = bystander.register(bytearray(64)).expose(write=True)
        forged = RemoteBuffer(address=target.address, rkey=target.rkey ^ 0x00FF00, length=64,
                              writable=True)
        with pytest.raises(RemoteAccessError):
            if how == "write":
                await asyncio.wait_for(victim.write(mine[0:64], forged), STEP)
            else:
                done = await asyncio.wait_for(victim.post_write(mine[0:64], forged), STEP)
                await asyncio.wait_for(done, STEP)
        assert victim.broken
        with pytest.raises(BrokenResourceError):
            await victim.send(b"after")
        if how == "post_write":
            with pytest.raises(LocalProtocolError):  # checked before anything is posted
                await bystander.post_write(mine[0:64], target[0:32])
        await bystander.send(b"still serving")
        assert await asyncio.wait_for(bystander.recv(), STEP) == b"still serving"
        victim.abort()
        await bystander.aclose()


async def test_several_clients_on_one_listener(rdma_device) -> None:
    kw = {"timeout": STEP, "device": rdma_device}
    async with await aiordma.listen(echo, "127.0.0.1", 0, device=rdma_device) as listener:
        async def client(k: int) -> None:
            async with await aiordma.connect("127.0.0.1", listener.port, **kw) as ep:
                for i in range(10):
                    msg = bytes([k, i]) * (1 + 300 * i)
                    await ep.send(msg)
                    assert await asyncio.wait_for(ep.recv(), STEP) == msg

        await asyncio.wait_for(asyncio.gather(*(client(k) for k in range(6))), 4 * STEP)
        assert listener.accepted == 6


def _rnr_naks(device) -> int | None:
    """Receiver-not-ready NAKs the device's port sent and received so far (rxe's counters;
    None where the driver has no such counters)."""
    base = f"/sys/class/infiniband/{device.name}/ports/{device.port}/hw_counters/"
    try:
        return sum(int(open(base + name).read()) for name in ("rcvd_rnr_err", "send_rnr_err"))
    except OSError:
        return None


async def test_the_first_message_each_way_meets_posted_receives(rdma_device) -> None:
    """Each side posts its receive slots before the handshake message that lets the peer send
    (the server before its Accept, the client before its Ready), so a message sent the moment
    the endpoint exists is never NAKed receiver-not-ready (which rxe retries after its RNR
    timer: milliseconds on a first message). Counted by the port's RNR counters around 16
    connections whose client and server both send at once: with the server's slots posted on
    the Ready, each connection's first SEND was NAKed (one NAK each way per connection; the
    bound leaves room for other processes' traffic on the port)."""
    if _rnr_naks(rdma_device) is None:
        pytest.skip(f"{rdma_device.name} has no RNR counters (rxe's hw_counters)")
    kw = {"timeout": STEP, "device": rdma_device}
    n = 16

    async def greet(ep) -> None:  # the server sends first, the moment it has the endpoint
        await ep.send(b"hello")
        await echo(ep)

    async with await aiordma.listen(greet, "127.0.0.1", 0, device=rdma_device) as listener:
        async def client(k: int) -> None:
            async with await aiordma.connect("127.0.0.1", listener.port, **kw) as ep:
                await ep.send(bytes([k]))  # the client too, the moment connect returns
                assert await asyncio.wait_for(ep.recv(), STEP) == b"hello"
                assert await asyncio.wait_for(ep.recv(), STEP) == bytes([k])

        before = _rnr_naks(rdma_device)
        for k in range(n):  # one at a time: each connection's first messages alone
            await asyncio.wait_for(client(k), STEP)
        naks = _rnr_naks(rdma_device) - before
    assert naks < n // 2, f"{naks} receiver-not-ready NAKs over {n} new connections"


async def test_a_connection_closed_the_moment_it_opens_closes_at_once(rdma_device) -> None:
    """A client that closes right after ``connect()`` writes its Close behind its Ready, so the
    server reads both at once: the Close must not stay unread in the control connection's
    buffer (it did: every such close took the whole ``close_timeout``, until the client gave
    up and aborted, and the server's handler saw the end only then: 10.03 s here on asyncio;
    uvloop's writes happened to part the two)."""
    # a graceful close is answered at once; one that waited for its timeout would take it
    # whole: the timeout is x the load factor (tests/bounds.py), so its half stays the cut
    config = Config(close_timeout=10.0 * load_factor())
    kw = {"timeout": STEP, "device": rdma_device, "config": config}
    ends: list[object] = []

    async def handler(ep) -> None:
        ends.append(await ep.recv())

    async with await aiordma.listen(handler, "127.0.0.1", 0, device=rdma_device,
                                    config=config) as listener:
        for _ in range(3):
            ep = await aiordma.connect("127.0.0.1", listener.port, **kw)
            t0 = time.monotonic()
            async with asyncio.timeout(STEP):  # (no task: wait_for's would let the server
                await ep.aclose()              # read the Ready before the Close is written)
            took = time.monotonic() - t0
            assert took < config.close_timeout / 2, f"aclose() took {took:.2f} s"
        deadline = time.monotonic() + STEP
        while len(ends) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert ends == [None, None, None]


async def test_connect_failures_are_typed_and_bounded(rdma_device) -> None:
    kw = {"device": rdma_device}
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(OperationTimeout):
        await aiordma.connect("127.0.0.1", port, timeout=1.0, **kw)
    bound = scaled(5.0)  # the 1 s timeout kept, not a hang: 5 s x the load factor
    assert time.monotonic() - t0 < bound.seconds, bound.describe()
    silent.close()
    await silent.wait_closed()
    with pytest.raises(BrokenResourceError):
        await aiordma.connect("127.0.0.1", port, timeout=5.0, **kw)


async def test_endpoints_come_and_go_without_leaks(rdma_device) -> None:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    kw = {"timeout": STEP, "device": rdma_device}

    async def one_round(listener) -> None:
        async with await aiordma.connect("127.0.0.1", listener.port, **kw) as ep:
            await ep.send(b"ping")
            assert await asyncio.wait_for(ep.recv(), STEP) == b"ping"

    start = resource_counts()
    async with await aiordma.listen(echo, "127.0.0.1", 0, device=rdma_device) as listener:
        await one_round(listener)  # warm-up: the shared reactor, lazily imported modules
        await asyncio.sleep(0.1)

        before_fds, before = fds(), resource_counts()
        before_tasks = len(asyncio.all_tasks())
        for _ in range(15):
            await one_round(listener)
        await asyncio.sleep(0.2)  # let the server side finish closing
        assert not listener.endpoints
        assert fds() <= before_fds
        after = resource_counts()
        for kind in ("qps", "mrs", "endpoints", "fd_readers"):
            assert after[kind] <= before[kind], (kind, before, after)
        assert len(asyncio.all_tasks()) <= before_tasks
    # the last endpoint's close closed the shared CQ and its channel
    end = resource_counts()
    assert (end["cqs"], end["completion_channels"]) == (start["cqs"],
                                                        start["completion_channels"])

