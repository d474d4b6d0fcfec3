"""The key-value service over a device.

* In one process: each GET path (one-sided hit, one-sided "absent", fallbacks for large
  values, long keys and full windows), torn slots made on purpose in the server's table (the
  client must go to the server and still return the right value), and per-connection
  registrations (a departed client's rkey no longer reaches the table).
* ``KvMachine``, a hypothesis stateful test against a dict model with the server in another
  process (``aiordma serve kv``): sequential puts, deletes and GETs by both paths, and bursts of
  several concurrent writers (separate connections) with one-sided readers running alongside.
  Every value a reader gets must be one that was written to that key (or the value before the
  burst): a torn value would be neither.
* The ``aiordma kv`` command against the same served process.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
import uvloop
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

import aiordma
from aiordma.rpc import serve
from aiordma.services import kv

from ..bounds import STEP, hang_guard
from .peers import served_by_cli

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
# A small table, so that overflowing windows, tombstones and BIG entries all occur.
GEOMETRY = {"slots": 64, "slot_size": 128, "window": 4}
INLINE = GEOMETRY["slot_size"] - 24
STATS: Counter[str] = Counter()


async def _client(port: int, device: Any) -> kv.KvClient:
    return await kv.connect("127.0.0.1", port, timeout=STEP, device=device)


async def test_each_get_path(rdma_device: Any) -> None:
    store = kv.KvStore(slots=8, slot_size=128, window=4)
    async with await serve(store, "127.0.0.1", 0, device=rdma_device) as server:  # noqa: SIM117
        async with await _client(server.port, rdma_device) as c:
            assert await c.get(b"nothing") is None
            assert c.counters["one_sided_missing"] == 1
            await c.put(b"k", b"v" * 50)
            assert await c.get(b"k") == b"v" * 50
            assert await c.get("k", one_sided=False) == b"v" * 50  # str keys are UTF-8
            assert c.counters["one_sided_hit"] == 1 and c.counters["rpc_get"] == 1
            for one_sided in (True, False):  # an expired bound is a typed error, either path
                with pytest.raises(aiordma.OperationTimeout):  # (before anything is sent)
                    await c.get(b"k", one_sided=one_sided, timeout=0)
            # A GET cancelled once its READ is posted leaves the READ (unless it ended in its
            # post): its buffer comes back through a fence.
            left = asyncio.ensure_future(c.get(b"k"))
            await asyncio.sleep(0)
            left.cancel()
            try:
                assert await left == b"v" * 50  # (it ended before the cancel)
            except asyncio.CancelledError:
                pass
            # All 16 read buffers (the default) at once: the cancelled READ's came back.
            got = await asyncio.wait_for(asyncio.gather(*(c.get(b"k") for _ in range(16))), STEP)
            assert got == [b"v" * 50] * 16
            big = bytes(range(256)) * 100  # not inline: the slot says BIG
            await c.put(b"big", big)
            assert await c.get(b"big") == big
            assert c.counters["fallback_big"] == 1 and c.counters["one_sided_hit"] == 17
            long_key = b"L" * 200  # longer than a slot: never one-sided, no READ spent
            await c.put(long_key, b"x")
            assert await c.get(long_key) == b"x"
            for i in range(20):  # 8 slots, windows of 4: most of these overflow
                await c.put(f"key{i}", f"value{i}".encode())
            for i in range(20):
                assert await c.get(f"key{i}") == f"value{i}".encode()
            assert c.counters["fallback_unknown"] > 0
            assert await c.delete(b"k") and not await c.delete(b"k")
            assert await c.get(b"k") is None
            stats = await c.stats()
            assert stats["keys"] == 22 and stats["overflow"] > 0
            with pytest.raises(aiordma.LocalProtocolError):  # refused here, nothing sent
                await c.put(b"k", 42)  # type: ignore[arg-type]
            with pytest.raises(aiordma.rpc.RemoteError) as info:  # the server's own check
                await c.rpc.call("put", b"k", 42)
            assert info.value.type_name == "LocalProtocolError"
            assert await c.get(b"key0") == b"value0"  # the connection still serves


async def test_torn_slots_are_never_returned(rdma_device: Any) -> None:
    store = kv.KvStore(slots=8, slot_size=128, window=4)
    async with await serve(store, "127.0.0.1", 0, device=rdma_device) as server:  # noqa: SIM117
        async with await _client(server.port, rdma_device) as c:
            await c.put(b"k", b"good value")
            assert await c.get(b"k") == b"good value"
            slot = store._writer.slot_of(b"k")
            assert slot is not None
            off = slot * store.layout.slot_size
            table = store._table
            table[off] |= 1  # the version odd: a rewrite in progress
            assert await c.get(b"k") == b"good value"
            assert c.counters["fallback_torn"] == 1
            table[off] &= ~1
            value_at = off + 24 + 1
            table[value_at] ^= 0xFF  # a value byte changed under the old checksum
            assert await c.get(b"k") == b"good value"
            assert c.counters["fallback_torn"] == 2
            table[value_at] ^= 0xFF
            assert await c.get(b"k") == b"good value"
            assert c.counters["one_sided_hit"] == 2


async def test_a_departed_clients_rkey_no_longer_reaches_the_table(rdma_device: Any) -> None:
    store = kv.KvStore(slots=8, slot_size=128, window=4)
    async with await serve(store, "127.0.0.1", 0, device=rdma_device) as server:
        first = await _client(server.port, rdma_device)
        await first.put(b"k", b"v")
        assert await first.get(b"k") == b"v"
        stale = first._table
        # Everything registered before `first` leaves, so no new registration can take over
        # its rkey (rxe's rkeys are an index and a random byte: ReDMArk).
        async with await _client(server.port, rdma_device) as second:
            ep = second.rpc.endpoint
            dst = ep.register(bytearray(len(stale)))
            await ep.read(dst.whole(), stale)  # the stale descriptor works while first is here
            assert (await second.rpc.call("table"))["table"] == list(second._table.to_wire())
            assert store.counters["table"] == 2  # one registration per connection, not per ask
            await first.aclose()
            with pytest.raises(aiordma.RemoteAccessError):
                async with asyncio.timeout(STEP):
                    while True:  # until the server has closed first's connection
                        await ep.read(dst.whole(), stale)
                        await asyncio.sleep(0.05)
            assert second.rpc.endpoint.broken  # that endpoint only
        async with await _client(server.port, rdma_device) as third:  # the server still serves
            assert await third.get(b"k") == b"v"


# -- the stateful test against a server in another process ------------------------------------

_names = [f"k{i}".encode() for i in range(10)]
NAMES = st.sampled_from(_names)
PAYLOADS = st.one_of(st.binary(max_size=INLINE - 12), st.binary(max_size=INLINE - 12),
                     st.integers(INLINE, 3000).map(lambda n: b"B" * n),
                     st.just(b"R" * 20_000))  # rendezvous-sized (8 KiB eager slots)
WRITES = st.lists(st.tuples(st.integers(0, 2), NAMES, PAYLOADS), min_size=1, max_size=12)
_examples = itertools.count()
_port = 0
_device: Any = None


class KvMachine(RuleBasedStateMachine):
    loop_factory: Any = asyncio.new_event_loop

    def __init__(self) -> None:
        super().__init__()
        self.loop = self.loop_factory()
        asyncio.set_event_loop(self.loop)
        self.prefix = f"e{next(_examples)}/".encode()  # the server outlives examples
        self.model: dict[bytes, bytes] = {}
        self.serial = itertools.count()
        self.writers: list[kv.KvClient] = []
        self.readers: list[kv.KvClient] = []

    def run(self, aw: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(aw, STEP))

    def key(self, name: bytes) -> bytes:
        return self.prefix + name

    def value(self, payload: bytes) -> bytes:
        return next(self.serial).to_bytes(4, "big") + self.prefix + payload  # unique

    @initialize()
    def connect(self) -> None:
        async def five() -> list[kv.KvClient]:
            return [await _client(_port, _device) for _ in range(5)]

        clients = self.run(five())
        self.writers, self.readers = clients[:3], clients[3:]

    @rule(name=NAMES, payload=PAYLOADS)
    def put(self, name: bytes, payload: bytes) -> None:
        value = self.value(payload)
        self.run(self.writers[0].put(self.key(name), value))
        self.model[self.key(name)] = value

    @rule(name=NAMES)
    def delete(self, name: bytes) -> None:
        key = self.key(name)
        assert self.run(self.writers[1].delete(key)) == (key in self.model)
        self.model.pop(key, None)

    @rule(name=NAMES, one_sided=st.booleans())
    def get(self, name: bytes, one_sided: bool) -> None:
        key = self.key(name)
        assert self.run(self.readers[0].get(key, one_sided=one_sided)) == self.model.get(key)
        STATS["get checked"] += 1

    @rule(writes=WRITES)
    def burst(self, writes: list[tuple[int, bytes, bytes]]) -> None:
        """Writers on three connections at once, readers reading one-sided meanwhile."""
        plan: list[list[tuple[bytes, bytes]]] = [[], [], []]
        for w, name, payload in writes:
            plan[w].append((self.key(name), self.value(payload)))
        allowed = {k: {v} for k, v in self.model.items()}
        for ops in plan:
            for k, v in ops:
                allowed.setdefault(k, set()).add(v)
        keys = sorted(allowed)
        before = dict(self.model)
        done = asyncio.Event()

        async def write(client: kv.KvClient, ops: list[tuple[bytes, bytes]]) -> None:
            for k, v in ops:
                await client.put(k, v)

        async def read(client: kv.KvClient, start: int) -> int:
            n = 0
            while not done.is_set() or n < 4:
                k = keys[(start + n) % len(keys)]
                got = await client.get(k)
                if got is None:
                    assert k not in before, f"{k!r} vanished during a burst of puts"
                else:
                    assert got in allowed[k], f"GET {k!r} returned a value never written"
                n += 1
            return n

        async def go() -> int:
            readers = [asyncio.ensure_future(read(c, i)) for i, c in enumerate(self.readers)]
            try:
                await asyncio.gather(*(write(c, ops)
                                       for c, ops in zip(self.writers, plan, strict=True)))
            finally:
                done.set()
            return sum(await asyncio.gather(*readers))

        STATS["burst reads checked"] += self.run(go())
        # Each writer's own puts are ordered; the last one to arrive wins.
        for k in {k for ops in plan for k, _ in ops}:
            final = self.run(self.writers[0].get(k, one_sided=False))
            lasts = {[v for kk, v in ops if kk == k][-1] for ops in plan
                     if any(kk == k for kk, _ in ops)}
            assert final in lasts
            self.model[k] = final
        STATS["bursts"] += 1

    def teardown(self) -> None:
        try:
            if self.writers:  # leave the shared server's small table reusable (tombstones)
                for k in list(self.model):
                    self.run(self.writers[0].delete(k))
            for c in self.writers + self.readers:
                for what, n in c.counters.items():
                    STATS[what] += n
                self.run(c.aclose())
        finally:
            self.loop.close()
            asyncio.set_event_loop(None)


@pytest.fixture(scope="module")
def kv_port(rdma_device: Any) -> Any:
    options = [f"--{k.replace('_', '-')}={v}" for k, v in GEOMETRY.items()]
    # a client's set-up may take longer than the default 10 s in a busy VM (ci46b, load 8-10)
    options.append(f"--handshake-timeout={hang_guard(10.0):.1f}")
    with served_by_cli("kv", *options) as port:
        yield port


@pytest.mark.parametrize("loop", LOOPS)
def test_concurrent_writers_and_one_sided_readers(kv_port: int, rdma_device: Any,
                                                  loop: str) -> None:
    global _port, _device
    _port, _device = kv_port, rdma_device
    cls = type(f"KvMachine_{loop}", (KvMachine,), {"loop_factory": staticmethod(LOOPS[loop])})
    STATS.clear()
    base = settings()
    run_state_machine_as_test(cls, settings=settings(
        base, max_examples=base.max_examples, stateful_step_count=12, deadline=None))
    print(f"{cls.__name__}: {dict(STATS)}")
    for what in ("get checked", "burst reads checked", "one_sided_hit", "fallback_big"):
        assert STATS[what] > 0, f"no {what!r}: {dict(STATS)}"


def test_the_kv_command(kv_port: int) -> None:
    # Each invocation starts Python, which costs seconds in the VM, so each command runs once,
    # under one of the two loops in turn (both loops run every store path in
    # test_concurrent_writers_and_one_sided_readers; this test is the command's own: its
    # arguments, output, exit status and each loop's option). Its --timeout (default 10 s, for
    # the connection and each call) is the default scaled by the load: at load 8-10 (ci46b) a
    # connection took longer than 10 s in the VM.
    def kv_cli(loop: str, *args: str, stdin: bytes | None = None
               ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "aiordma", "kv", *args, "--port",
                               str(kv_port), "--loop", loop,
                               "--timeout", f"{hang_guard(10.0):.1f}"], input=stdin,
                              capture_output=True, timeout=hang_guard(), check=False)

    assert kv_cli("asyncio", "put", "cli-key", "-", stdin=bytes(range(256))).returncode == 0
    assert kv_cli("uvloop", "get", "cli-key", "--raw").stdout == bytes(range(256))  # one-sided
    got = kv_cli("asyncio", "get", "cli-key", "--rpc")
    assert (got.returncode, got.stdout) == (0, bytes(range(256)) + b"\n")
    assert kv_cli("uvloop", "delete", "cli-key").returncode == 0
    missing = kv_cli("asyncio", "get", "cli-key")
    assert missing.returncode == 1 and b"no key" in missing.stderr
