"""Across two hosts: host 1 (this process) against processes on host 2, over a real link.

Run only on host 1 of ``python -m harness run --hosts 2`` (``scripts/two-host-tests.sh``); elsewhere
every test here skips with that reason. Each test starts its server on host 2 (through the
agent: ``two_hosts.on_host2``), runs its client here on one loop and the server on the same
one, checks every byte, and then checks that the bytes crossed the wire: eth0's byte counters
on both hosts and rxe0's packet counters grew by at least the payload
(``two_hosts.assert_crossed``).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from typing import Any

import msgpack
import pytest

import aiordma
from aiordma import Config, RemoteBuffer
from aiordma.bench.process import announced
from aiordma.services import kv
from harness.remote import RemoteProcess, host_addresses

from ..bounds import STEP, hang_guard
from .peers import LOOPS, run_on
from .two_hosts import (
    AIORDMA,
    PEER,
    START,
    assert_crossed,
    netem_on_host2,
    on_host2,
    rxe_counters,
    snapshot,
)

pytestmark = [pytest.mark.two_hosts, pytest.mark.usefixtures("host2_up")]

EAGER_MAX = Config().eager_max
RECV_BUFFER = Config().recv_buffer
#: One of each size class: empty; one RoCE packet and just past it (rxe's MTU is 1024); the
#: largest eager message (one receive slot) and the first rendezvous one (the receiver
#: RDMA-READs it); 64 KiB and 1 MiB; and twice the receiver's whole buffer (the message waits
#: for the reader, then is READ straight in).
SIZES = [0, 1, 1023, 1024, 1025, EAGER_MAX, EAGER_MAX + 1, 65536, 1 << 20, 2 * RECV_BUFFER]
REGION = 1 << 16  # the peer process's exposed region
#: The liveness channel's keepalive in the tests that move megabytes: idle 10 s, then 10 probes
#: 1 s apart, on both sides. With the default (about 3 s) an 8 MiB rendezvous READ failed once
#: ("control channel: Connection timed out") in a run on a loaded machine: a 1-vCPU host busy
#: with rxe's packet work answered no TCP keepalive probe for 3 s. These tests are about bytes
#: crossing, not about that bound.
KEEPALIVE = 10
PATIENT = Config(keepalive_idle=KEEPALIVE, keepalive_interval=1, keepalive_probes=KEEPALIVE)


def echoed(rng: random.Random, size: int) -> bytes:
    """``size`` random bytes that the peer process echoes: its tag byte (the first) is 0."""
    return b"\x00" + rng.randbytes(size - 1) if size else b""


def _report(what: str, moved: Any) -> None:
    print(f"\n{what}: host 1's eth0 {moved.tx_bytes} B out, {moved.rx_bytes} B in; rxe0 "
          f"{moved.sent_pkts} packets sent, {moved.rcvd_pkts} received", file=sys.stderr)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.timeout(hang_guard(300))  # (the suite's 300 s, scaled by the load as below)
def test_messages_of_every_size_class_cross_the_wire(rdma_device: Any, loop: str) -> None:
    """Every size class echoed, then a batch of mixed sizes in order. Each wait's hang guard
    is scaled by the machine's load (tests/bounds.py): at load 14-20 an 8 MiB message took
    more than the plain 60 s to come back, and arrived whole."""
    _, h2 = host_addresses()
    with on_host2([sys.executable, PEER, "--host", h2, "--loop", loop,
                   "--keepalive", str(KEEPALIVE)], "PORT ") as line:
        port = int(line.split()[1])

        async def main() -> tuple[int, int]:
            rng = random.Random(f"sizes-{loop}")
            async with await aiordma.connect(h2, port, timeout=STEP, config=PATIENT) as ep:
                await asyncio.wait_for(ep.recv(), STEP)  # the peer's region descriptor first
                before = await asyncio.to_thread(snapshot)
                counters = rxe_counters()
                moved = 0
                for size in SIZES:
                    data = echoed(rng, size)
                    sender = asyncio.ensure_future(ep.send(data))
                    got = await asyncio.wait_for(ep.recv(), hang_guard())
                    await asyncio.wait_for(sender, hang_guard())
                    assert got == data, f"{size} B came back different"
                    moved += size
                # A batch of mixed sizes, all sent before the first is read: back in order.
                batch = mixed_batch(rng, 200)
                await echo_in_order(ep, batch)
                moved += sum(map(len, batch))
                here = await asyncio.to_thread(assert_crossed, before, sent=moved,
                                               received=moved)
                _report(f"{moved} B each way ({loop})", here)
                print("rxe0 counters that moved:", {k: v - counters[k] for k, v in
                                                    rxe_counters().items() if v != counters[k]},
                      file=sys.stderr)
                return moved, here.tx_bytes

        moved, _ = run_on(loop, main())
        assert moved > 2 * RECV_BUFFER


@pytest.mark.parametrize("loop", LOOPS)
def test_rdma_write_read_and_atomics_cross_the_wire(rdma_device: Any, loop: str) -> None:
    _, h2 = host_addresses()
    with on_host2([sys.executable, PEER, "--host", h2, "--loop", loop,
                   "--keepalive", str(KEEPALIVE)], "PORT ") as line:
        port = int(line.split()[1])

        async def peer_view(ep: aiordma.Endpoint, off: int, n: int) -> bytes:
            """Host 2's own view of its region: it sends ``region[off:off + n]``."""
            await ep.send(b"\x01" + off.to_bytes(4, "little") + n.to_bytes(4, "little"))
            got = await asyncio.wait_for(ep.recv(), STEP)
            assert got is not None, "host 2 closed"
            return bytes(got)

        async def main() -> None:
            rng = random.Random(f"onesided-{loop}")
            async with await aiordma.connect(h2, port, timeout=STEP, config=PATIENT) as ep:
                remote = RemoteBuffer.from_wire(
                    msgpack.unpackb(await asyncio.wait_for(ep.recv(), STEP)))
                out, back = bytearray(REGION), bytearray(REGION)
                mine, theirs = ep.register(out), ep.register(back)
                before = await asyncio.to_thread(snapshot)
                data = rng.randbytes(REGION)
                out[:] = data
                await asyncio.wait_for(ep.write(mine[0:REGION], remote[0:REGION]), STEP)
                assert await peer_view(ep, 0, REGION) == data  # in host 2's memory
                await asyncio.wait_for(ep.read(theirs[0:REGION], remote[0:REGION]), STEP)
                assert bytes(back) == data
                # Atomics on host 2's memory, 8-byte aligned, 64-bit little-endian.
                out[0:8] = (5).to_bytes(8, "little")
                await asyncio.wait_for(ep.write(mine[0:8], remote[64:72]), STEP)
                assert await asyncio.wait_for(ep.fetch_add(remote[64:72], 7), STEP) == 5
                big = (1 << 63) + 1
                assert await asyncio.wait_for(
                    ep.compare_swap(remote[64:72], expected=12, new=big), STEP) == 12
                assert await asyncio.wait_for(  # a swap whose comparison fails changes nothing
                    ep.compare_swap(remote[64:72], expected=0, new=1), STEP) == big
                assert await peer_view(ep, 64, 8) == big.to_bytes(8, "little")
                # WRITE, host 2's view of it, READ: each REGION bytes.
                here = await asyncio.to_thread(assert_crossed, before, sent=REGION,
                                               received=2 * REGION)
                _report(f"one-sided ({loop})", here)

        run_on(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_rpc_calls_cross_the_wire(rdma_device: Any, loop: str) -> None:
    _, h2 = host_addresses()
    argv = [AIORDMA, "serve", "echo", "--host", h2, "--port", "0", "--loop", loop]
    with on_host2(argv, "serving echo on ") as line:
        port = int(line.split()[3].rsplit(":", 1)[1])

        async def main() -> None:
            rng = random.Random(f"rpc-{loop}")
            values: list[Any] = [
                None, 1, -(1 << 40), "text", b"", rng.randbytes(100),
                rng.randbytes(2 * EAGER_MAX), rng.randbytes(1 << 20),  # large: moved by RDMA
                {"nested": [1, rng.randbytes(5000), {"k": rng.randbytes(300_000)}]},
            ]
            async with await aiordma.rpc.connect(h2, port, timeout=STEP) as client:
                before = await asyncio.to_thread(snapshot)
                for v in values:
                    assert await client.call("echo", v, timeout=STEP) == v
                many = [rng.randbytes(rng.choice([10, 3000, 20000])) for _ in range(64)]
                got = await asyncio.gather(*(client.call("echo", m, timeout=STEP) for m in many))
                assert got == many  # 64 in flight at once, each its own answer
                payload = (1 << 20) + 300_000 + 5000 + 2 * EAGER_MAX + sum(map(len, many))
                here = await asyncio.to_thread(assert_crossed, before, sent=payload,
                                               received=payload)
                _report(f"RPC ({loop})", here)
                assert (await client.call("stats", timeout=STEP))["calls"] == len(values) + 64

        run_on(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_key_value_store_across_the_wire(rdma_device: Any, loop: str) -> None:
    _, h2 = host_addresses()
    # The commands' set-up bounds (10 s by default, each end) x the load factor: at host load
    # 12 the CLI's connect to host 2 outlasted 10 s (ci44a), on the server's side as well.
    patient = f"{hang_guard(10.0):.0f}"
    argv = [AIORDMA, "serve", "kv", "--host", h2, "--port", "0", "--loop", loop,
            "--handshake-timeout", patient]
    with on_host2(argv, "serving kv on ") as line:
        port = int(line.split()[3].rsplit(":", 1)[1])

        async def main() -> None:
            rng = random.Random(f"kv-{loop}")
            # Small values live in the table (one-sided GETs); 2000 B and 100 KB ones do not.
            items = {f"key-{i}".encode(): rng.randbytes(rng.choice([0, 1, 50, 400, 2000,
                                                                    100_000]))
                     for i in range(60)}
            async with await kv.connect(h2, port, timeout=STEP) as client:
                before = await asyncio.to_thread(snapshot)
                for k, v in items.items():
                    await client.put(k, v, timeout=STEP)
                for k, v in items.items():
                    assert await client.get(k, timeout=STEP) == v, k
                    assert await client.get(k, one_sided=False, timeout=STEP) == v, k
                assert client.counters["one_sided_hit"] > 0
                gone = list(items)[::2]
                for k in gone:
                    assert await client.delete(k, timeout=STEP)
                for k, v in items.items():
                    assert await client.get(k, timeout=STEP) == (None if k in gone else v), k
                payload = sum(map(len, items.values()))  # each value got back twice at least
                here = await asyncio.to_thread(assert_crossed, before, sent=payload,
                                               received=2 * payload)
                _report(f"key-value ({loop}): {dict(client.counters)}", here)

        run_on(loop, main())
        # The commands of docs/guides/two-machines.md, as written there but for the address
        # and the set-up bound (the guide says when to give more).
        put = subprocess.run([AIORDMA, "kv", "put", "greeting", "hello", "--host", h2,
                              "--port", str(port), "--timeout", patient], capture_output=True,
                             text=True, timeout=4 * STEP, check=False)
        assert put.returncode == 0, put.stderr
        get = subprocess.run([AIORDMA, "kv", "get", "greeting", "--host", h2, "--port",
                              str(port), "--timeout", patient], capture_output=True, text=True,
                             timeout=4 * STEP, check=False)
        assert (get.returncode, get.stdout) == (0, "hello\n"), get.stderr


#: What netem does to what leaves host 2, and the counter that shows it did: packets dropped,
#: or sent ahead (netem's counts). Reordering: every packet is delayed 10 ms but every 200th,
#: which is sent at once, ahead of those still in the delay (``reorder 100% gap 200``: exactly
#: 1 in 200, not a chance). Not ``reorder 5% 25%``, as before: with a correlation, the guest's
#: kernel (Debian's 6.1) draws each packet's number as 0.75 x a fresh one + 0.25 x the last,
#: which falls under 5 % for about 0.2 % of packets, not 5 % (netem counted 1 of 513 sent
#: ahead, three times in one boot; 5 % without a correlation: 21 and 31 of 513). A burst of
#: 500 datagrams then often had none sent ahead: the runs in which the reordering could not be
#: shown. In one run of 1 in 500, 200 and 100, every message came through (25, 29 and 44 s;
#: rxe0's ``completer_retry_err`` 7, 15 and 26: rxe asks again for a READ's responses from
#: the first one missing); in an earlier try of 1 in 20, rxe timed out a transfer. (A
#: jittered delay, 20 +- 10 ms, reorders nearly every packet of a burst: a 1 MiB READ then
#: moved less than 1 MiB a minute. RoCE expects a network that keeps order.)
REORDER_GAP = 200
DISTURBANCES = [
    ("asyncio", "loss 1%"),
    ("uvloop", "loss 1%"),
    ("asyncio", "loss 5%"),
    ("uvloop", f"delay 10ms reorder 100% gap {REORDER_GAP}"),
]
#: Bursts of 500 numbered UDP datagrams sent at most to show the reordering (2 or 3 of each
#: are sent ahead).
BURSTS = 3
DATAGRAMS = 500


@pytest.mark.timer_bound
@pytest.mark.parametrize(("loop", "netem"), DISTURBANCES)
def test_messages_arrive_intact_and_in_order_through_loss_delay_and_reordering(
        rdma_device: Any, loop: str, netem: str) -> None:
    """netem drops, delays or reorders what leaves host 2 (its echoes, READ responses and
    acknowledgements of host 1's packets): rxe retransmits and puts packets back in order,
    and every message (every size class up to 1 MiB, then a batch of mixed sizes sent before
    the first is read; at 5 % loss up to 64 KiB, and a smaller batch) still arrives whole, in
    order; a one-sided WRITE and READ of 64 KiB too."""
    _, h2 = host_addresses()
    with netem_on_host2(*netem.split()) as counts:
        if "reorder" in netem:
            # First, the reordering happens: numbered UDP datagrams from host 2, sent back to
            # back through this netem, arrive here out of their order. The one sent ahead in a
            # burst overtakes those sent in the 10 ms before it; a sender that stalled for
            # longer (the VM's one vCPU busy elsewhere) leaves none to overtake, so up to
            # BURSTS bursts are sent until one shows it.
            for burst in range(1, BURSTS + 1):
                arrived, late = udp_inversions_from_host2(DATAGRAMS)
                print(f"burst {burst}: {late} of {arrived} datagrams from host 2 (of "
                      f"{DATAGRAMS} sent) arrived after a later one", file=sys.stderr)
                if late:
                    break
            assert arrived > DATAGRAMS // 2 and late > 0
        with on_host2([sys.executable, PEER, "--host", h2, "--loop", loop,
                       "--keepalive", str(KEEPALIVE)], "PORT ") as line:
            port = int(line.split()[1])

            async def main() -> None:
                rng = random.Random(f"netem-{loop}-{netem}")
                async with await aiordma.connect(h2, port, timeout=STEP, config=PATIENT) as ep:
                    remote = RemoteBuffer.from_wire(
                        msgpack.unpackb(await asyncio.wait_for(ep.recv(), STEP)))
                    counters = rxe_counters()
                    t0 = time.monotonic()
                    # Up to 1 MiB; at 5 % loss up to 64 KiB, and a batch of 50 instead of 200: a
                    # rendezvous READ that loses a packet is read again from there, so the cost
                    # grows with the square of its size (2.5 MB each way took 75-93 s on a
                    # loaded machine, and rxe0 received 10 packets per one of payload).
                    sizes = [s for s in SIZES[:-1] if s <= 65536 or netem != "loss 5%"]
                    for size in sizes:
                        data = echoed(rng, size)
                        sender = asyncio.ensure_future(ep.send(data))
                        got = await asyncio.wait_for(ep.recv(), STEP)
                        assert got == data, f"{size} B"  # catalogue
                        await asyncio.wait_for(sender, STEP)
                    n = 200 if netem == "loss 1%" else 50
                    batch = mixed_batch(rng, n)
                    await echo_in_order(ep, batch)
                    out, back = bytearray(rng.randbytes(REGION)), bytearray(REGION)
                    mine, theirs = ep.register(out), ep.register(back)
                    await asyncio.wait_for(ep.write(mine[0:REGION], remote[0:REGION]), STEP)
                    await asyncio.wait_for(ep.read(theirs[0:REGION], remote[0:REGION]), STEP)
                    assert back == out
                    moved = {k: v - counters[k] for k, v in rxe_counters().items()
                             if v != counters[k]}
                    print(f"\n{netem} ({loop}): {sum(sizes) + sum(map(len, batch))} B each "
                          f"way and 64 KiB written and read back in "
                          f"{time.monotonic() - t0:.1f} s; rxe0 counters that moved: {moved}",
                          file=sys.stderr)

            run_on(loop, main())
    print(f"netem on host 2 dropped {counts.dropped} packets and sent {counts.requeues} ahead",
          file=sys.stderr)
    if "loss" in netem:
        assert counts.dropped > 0  # the loss happened: what arrived intact was retransmitted
    else:  # every REORDER_GAP-th packet was sent ahead: the datagrams' and rxe's among them
        assert counts.requeues >= DATAGRAMS // REORDER_GAP


def mixed_batch(rng: random.Random, n: int) -> list[bytes]:
    """``n`` echo-checkable messages of mixed sizes: eager, at and past the eager limit."""
    return [echoed(rng, rng.choice([1, 100, EAGER_MAX, EAGER_MAX + 1, 20000]))
            for _ in range(n)]


async def echo_in_order(ep: Any, batch: list[bytes]) -> None:
    """Send every message of ``batch`` before reading the first echo: each comes back whole,
    in order (every wait bounded by ``STEP`` scaled by the load: :func:`hang_guard`)."""
    async def send_all() -> None:
        for m in batch:
            await ep.send(m)

    sender = asyncio.ensure_future(send_all())
    for i, m in enumerate(batch):
        assert await asyncio.wait_for(ep.recv(), hang_guard()) == m, f"message {i}"
    await asyncio.wait_for(sender, hang_guard())


SO_RCVBUFFORCE = 33  # (Linux; the socket module does not name it)


def udp_inversions_from_host2(n: int) -> tuple[int, int]:
    """Host 2 sends ``n`` numbered datagrams to host 1 back to back: ``(how many arrived, how
    many of them after one with a higher number)``."""
    import socket

    h1, _ = host_addresses()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)  # (root: past rmem_max)
        sock.bind((h1, 0))
        port = sock.getsockname()[1]
        code = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for i in range({n}): s.sendto(i.to_bytes(4, 'big'), ({h1!r}, {port}))")
        with RemoteProcess([sys.executable, "-c", code]) as proc:
            assert proc.wait(START) == 0, proc.stderr
            sock.settimeout(5.0)  # the last ones are 10 ms behind: 5 s, none is coming
            seen: list[int] = []
            while len(seen) < n:
                try:
                    seen.append(int.from_bytes(sock.recv(4), "big"))
                except TimeoutError:
                    break
    highest, inversions = -1, 0
    for i in seen:
        inversions += i < highest
        highest = max(highest, i)
    return len(seen), inversions


def test_the_wire_check_fails_for_traffic_that_stays_on_host_1(rdma_device: Any) -> None:
    """The check above can fail: a peer on host 1 itself, reached at host 1's own link
    address, is served by rxe0's loopback inside the driver; 1 MiB each way then moves no
    byte on eth0, and ``assert_crossed`` says so."""
    h1, _ = host_addresses()
    with announced([sys.executable, PEER, "--host", h1], "PORT ", timeout=4 * STEP) as line:
        port = int(line.split()[1])

        async def main() -> None:
            async with await aiordma.connect(h1, port, timeout=STEP) as ep:
                await asyncio.wait_for(ep.recv(), STEP)
                before = await asyncio.to_thread(snapshot)
                data = echoed(random.Random(1), 1 << 20)
                sender = asyncio.ensure_future(ep.send(data))
                assert await asyncio.wait_for(ep.recv(), STEP) == data
                await asyncio.wait_for(sender, STEP)
                with pytest.raises(AssertionError, match="sent, but eth0 counted"):
                    await asyncio.to_thread(assert_crossed, before, sent=len(data),
                                            received=len(data))

        run_on("asyncio", main())
