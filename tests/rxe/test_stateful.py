"""Hypothesis stateful tests: endpoints driven through random interleavings, checked against a
model, over a real device.

* ``PairMachine``: two endpoints in this process (client and the listener's endpoint).
  Messages both ways (sizes 0..4 MiB across the eager/rendezvous threshold and the MTU),
  received in any interleaving with later sends; RDMA WRITE/READ and atomics on each side's
  exposed region. Every byte and the order are checked against the model.
* ``ProcessMachine``: the same against a listener in a separate process
  (``peer_process.py``), whose region is checked by asking it for its bytes.
* ``ManyClientsMachine``: several clients on one listener, interleaved.

Each runs on the default asyncio loop and on uvloop. Rules run the loop until their step is
done, so background work (rendezvous sends waiting for the reader) progresses in every step.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque
from typing import Any

import msgpack
import pytest
import uvloop
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import aiordma
from aiordma import Config, RemoteBuffer

from ..bounds import STEP
from .peers import peer_process

EAGER_MAX = Config().eager_max
SIZES = st.one_of(
    st.sampled_from([0, 1, 1023, 1024, 1025, EAGER_MAX, EAGER_MAX + 1, 65536, 4 << 20]),
    st.integers(0, 2 * EAGER_MAX),
    st.integers(0, 1 << 20),
)
REGION = 1 << 16
SPANS = st.tuples(st.integers(0, REGION), st.integers(0, 8192)).map(
    lambda t: (min(t[0], REGION), min(t[1], REGION - min(t[0], REGION))))
WORDS = st.integers(0, REGION // 8 - 1).map(lambda w: w * 8)
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
MAX_OUTSTANDING = 40
_device: Any = None


STATS: Counter[str] = Counter()  # rules actually run, checked by each test


def machine_settings() -> settings:
    base = settings()
    return settings(base, max_examples=base.max_examples, stateful_step_count=30, deadline=None)


class _LoopMachine(RuleBasedStateMachine):
    loop_factory: Any = asyncio.new_event_loop

    def __init__(self) -> None:
        super().__init__()
        self.loop = self.loop_factory()
        asyncio.set_event_loop(self.loop)
        self.tasks: list[asyncio.Task[Any]] = []
        self.done = asyncio.Event()  # set at teardown: handlers return, endpoints close

    def run(self, aw: Any) -> Any:
        try:
            return self.loop.run_until_complete(asyncio.wait_for(aw, STEP))
        except TimeoutError:
            print(f"a step took longer than {STEP} s; left behind: {self.diagnose()}")
            raise

    def diagnose(self) -> str:
        """The endpoints' counts and the kernel's view of the queue pairs (printed with a
        step that timed out)."""
        import subprocess

        eps = getattr(self, "ep", None)
        eps = list(eps.values()) if isinstance(eps, dict) else [eps, *getattr(self, "clients", [])]
        out = [f"{ep!r}: {ep.stats()}" for ep in eps if ep is not None]
        try:
            out.append(subprocess.run(["rdma", "-d", "resource", "show", "qp"],
                                      capture_output=True, text=True, timeout=10, check=False).stdout)
        except (OSError, subprocess.SubprocessError) as exc:
            out.append(f"rdma resource show qp: {exc}")
        return "\n".join(out)

    def spawn(self, coro: Any) -> None:
        self.tasks.append(self.loop.create_task(coro))
        self.run(asyncio.sleep(0))  # let it start: sends are queued in rule order

    @invariant()
    def background_work_did_not_fail(self) -> None:
        for t in [t for t in self.tasks if t.done()]:
            t.result()
            self.tasks.remove(t)

    def settle(self) -> None:
        """Wait for every background send."""
        tasks, self.tasks = self.tasks, []

        async def all_done() -> None:
            await asyncio.gather(*tasks)

        self.run(all_done())

    def close_loop(self) -> None:
        pending = [t for t in self.tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()
        asyncio.set_event_loop(None)


class PairMachine(_LoopMachine):
    """Client <-> server endpoints in one process."""

    @initialize()
    def connect(self) -> None:
        self.run(self._connect())
        self.expected: dict[str, deque[bytes]] = {"c2s": deque(), "s2c": deque()}
        self.models = {"c": bytearray(REGION), "s": bytearray(REGION)}

    async def _connect(self) -> None:
        served: asyncio.Queue[Any] = asyncio.Queue()

        async def handler(ep: Any) -> None:
            await served.put(ep)
            await self.done.wait()

        self.listener = await aiordma.listen(handler, "127.0.0.1", 0, device=_device)
        self.ep = {"c": await aiordma.connect("127.0.0.1", self.listener.port, timeout=STEP,
                                              device=_device)}
        self.ep["s"] = await served.get()
        self.regions = {k: bytearray(REGION) for k in "cs"}
        self.mrs = {k: self.ep[k].register(self.regions[k]) for k in "cs"}
        # each side's descriptor of the *other* side's region
        self.remote = {k: self.mrs[o].expose(read=True, write=True, atomic=True)
                       for k, o in (("c", "s"), ("s", "c"))}
        self.scratch = {k: self.ep[k].register(bytearray(2 * 8192)) for k in "cs"}

    @precondition(lambda self: sum(map(len, self.expected.values())) < MAX_OUTSTANDING)
    @rule(way=st.sampled_from(["c2s", "s2c"]), size=SIZES, seed=st.integers(0, 2**32 - 1))
    def send(self, way: str, size: int, seed: int) -> None:
        data = random.Random(seed).randbytes(size)
        self.expected[way].append(data)
        self.spawn(self.ep[way[0]].send(data))

    @precondition(lambda self: any(self.expected.values()))
    @rule(way=st.sampled_from(["c2s", "s2c"]))
    def recv(self, way: str) -> None:
        if not self.expected[way]:
            way = "s2c" if way == "c2s" else "c2s"
        got = self.run(self.ep[way[2]].recv())
        assert got == self.expected[way].popleft()
        STATS["message checked"] += 1

    @rule(side=st.sampled_from("cs"), span=SPANS, seed=st.integers(0, 2**32 - 1))
    def write(self, side: str, span: tuple[int, int], seed: int) -> None:
        off, n = span
        data = random.Random(seed).randbytes(n)
        local = self.scratch[side]
        local.view[:n] = data
        self.run(self.ep[side].write(local[0:n], self.remote[side][off:off + n]))
        other = "s" if side == "c" else "c"
        self.models[other][off:off + n] = data
        assert self.regions[other] == self.models[other]
        STATS["write checked"] += 1

    @rule(side=st.sampled_from("cs"), span=SPANS)
    def read(self, side: str, span: tuple[int, int]) -> None:
        off, n = span
        local = self.scratch[side]
        self.run(self.ep[side].read(local[8192:8192 + n], self.remote[side][off:off + n]))
        other = "s" if side == "c" else "c"
        assert bytes(local.view[8192:8192 + n]) == bytes(self.models[other][off:off + n])
        STATS["read checked"] += 1

    @rule(side=st.sampled_from("cs"), word=WORDS, add=st.integers(0, 2**64 - 1))
    def fetch_add(self, side: str, word: int, add: int) -> None:
        other = "s" if side == "c" else "c"
        model = self.models[other]
        before = int.from_bytes(model[word:word + 8], "little")
        old = self.run(self.ep[side].fetch_add(self.remote[side][word:word + 8], add))
        assert old == before
        model[word:word + 8] = ((before + add) % 2**64).to_bytes(8, "little")
        assert self.regions[other] == model

    @rule(side=st.sampled_from("cs"), word=WORDS, hit=st.booleans(), new=st.integers(0, 2**64 - 1))
    def compare_swap(self, side: str, word: int, hit: bool, new: int) -> None:
        other = "s" if side == "c" else "c"
        model = self.models[other]
        before = int.from_bytes(model[word:word + 8], "little")
        expected = before if hit else (before + 1) % 2**64
        old = self.run(self.ep[side].compare_swap(self.remote[side][word:word + 8],
                                                  expected=expected, new=new))
        assert old == before
        if hit:
            model[word:word + 8] = new.to_bytes(8, "little")
        assert self.regions[other] == model
        STATS["atomic checked"] += 1

    def teardown(self) -> None:
        try:
            if hasattr(self, "ep"):
                for way in ("c2s", "s2c"):
                    while self.expected[way]:
                        assert self.run(self.ep[way[2]].recv()) == self.expected[way].popleft()
                        STATS["message checked"] += 1
                self.settle()
                self.run(self.ep["c"].aclose())
                assert self.run(self.ep["s"].recv()) is None
                self.done.set()
                self.run(self.listener.aclose())
        finally:
            self.close_loop()


class ProcessMachine(_LoopMachine):
    """This process's client against a listener in another process (``peer_process.py``)."""

    port: int = 0

    @initialize()
    def connect(self) -> None:
        self.ep = self.run(aiordma.connect("127.0.0.1", self.port, timeout=STEP, device=_device))
        wire = msgpack.unpackb(self.run(self.ep.recv()))
        self.peer = RemoteBuffer.from_wire(wire)
        self.model = bytearray(REGION)
        self.expected: deque[bytes] = deque()
        self.scratch = self.ep.register(bytearray(2 * 8192))

    @precondition(lambda self: len(self.expected) < MAX_OUTSTANDING)
    @rule(size=SIZES, seed=st.integers(0, 2**32 - 1))
    def send(self, size: int, seed: int) -> None:
        data = b"\x00" + random.Random(seed).randbytes(size)
        self.expected.append(data)
        self.spawn(self.ep.send(data))

    @precondition(lambda self: bool(self.expected))
    @rule()
    def recv(self) -> None:
        if self.expected:
            assert self.run(self.ep.recv()) == self.expected.popleft()
            STATS["message checked"] += 1

    @rule(span=SPANS, seed=st.integers(0, 2**32 - 1))
    def write_then_check_remotely(self, span: tuple[int, int], seed: int) -> None:
        off, n = span
        data = random.Random(seed).randbytes(n)
        self.scratch.view[:n] = data
        self.run(self.ep.write(self.scratch[0:n], self.peer[off:off + n]))
        self.model[off:off + n] = data
        self.check_remote(off, n)

    @rule(span=SPANS)
    def read(self, span: tuple[int, int]) -> None:
        off, n = span
        self.run(self.ep.read(self.scratch[8192:8192 + n], self.peer[off:off + n]))
        assert bytes(self.scratch.view[8192:8192 + n]) == bytes(self.model[off:off + n])

    @rule(word=WORDS, add=st.integers(0, 2**64 - 1))
    def fetch_add(self, word: int, add: int) -> None:
        before = int.from_bytes(self.model[word:word + 8], "little")
        assert self.run(self.ep.fetch_add(self.peer[word:word + 8], add)) == before
        self.model[word:word + 8] = ((before + add) % 2**64).to_bytes(8, "little")
        self.check_remote(word, 8)

    def check_remote(self, off: int, n: int) -> None:
        """Ask the peer for its bytes; earlier echoes come first, in order."""
        self.run(self.ep.send(b"\x01" + off.to_bytes(4, "little") + n.to_bytes(4, "little")))
        self.drain_echoes()
        assert self.run(self.ep.recv()) == self.model[off:off + n]
        STATS["remote bytes checked"] += 1

    def drain_echoes(self) -> None:
        """Receive every echo still expected, each checked, in order."""
        while self.expected:
            assert self.run(self.ep.recv()) == self.expected.popleft()
            STATS["message checked"] += 1

    def teardown(self) -> None:
        try:
            if hasattr(self, "ep"):
                self.drain_echoes()
                self.settle()
                self.run(self.ep.aclose())
        finally:
            self.close_loop()


class ManyClientsMachine(_LoopMachine):
    """Several clients on one echo listener, their messages interleaved."""

    @initialize(n=st.integers(2, 5))
    def connect(self, n: int) -> None:
        async def echo(ep: Any) -> None:
            while (m := await ep.recv()) is not None:
                await ep.send(m)

        async def setup() -> None:
            self.listener = await aiordma.listen(echo, "127.0.0.1", 0, device=_device)
            self.clients = [await aiordma.connect("127.0.0.1", self.listener.port, timeout=STEP,
                                                  device=_device) for _ in range(n)]

        self.run(setup())
        self.expected: list[deque[bytes]] = [deque() for _ in range(n)]

    @precondition(lambda self: sum(map(len, self.expected)) < MAX_OUTSTANDING)
    @rule(k=st.integers(0, 4), size=SIZES, seed=st.integers(0, 2**32 - 1))
    def send(self, k: int, size: int, seed: int) -> None:
        k %= len(self.clients)
        data = bytes([k]) + random.Random(seed).randbytes(size)
        self.expected[k].append(data)
        self.spawn(self.clients[k].send(data))

    @precondition(lambda self: any(self.expected))
    @rule(k=st.integers(0, 4))
    def recv(self, k: int) -> None:
        k %= len(self.clients)
        if not self.expected[k]:
            k = next(i for i, q in enumerate(self.expected) if q)
        if self.expected[k]:
            assert self.run(self.clients[k].recv()) == self.expected[k].popleft()
            STATS["message checked"] += 1

    def teardown(self) -> None:
        try:
            if hasattr(self, "clients"):
                for k, c in enumerate(self.clients):
                    while self.expected[k]:
                        assert self.run(c.recv()) == self.expected[k].popleft()
                self.settle()
                for c in self.clients:
                    self.run(c.aclose())
                assert self.listener.accepted == len(self.clients)
                self.run(self.listener.aclose())
        finally:
            self.close_loop()


def _run(machine: type[_LoopMachine], loop: str, expect: tuple[str, ...], **attrs: Any) -> None:
    cls = type(f"{machine.__name__}_{loop}", (machine,),
               {"loop_factory": staticmethod(LOOPS[loop]), **attrs})
    STATS.clear()
    run_state_machine_as_test(cls, settings=machine_settings())
    print(f"{cls.__name__}: {dict(STATS)}")
    for what in expect:  # the machine really exercised what it claims to check
        assert STATS[what] > 0, f"no {what!r} step ran: {dict(STATS)}"


@pytest.fixture
def device(rdma_device: Any) -> Any:
    global _device
    _device = rdma_device
    yield rdma_device
    _device = None


@pytest.mark.parametrize("loop", LOOPS)
def test_pair_in_one_process(device: Any, loop: str) -> None:
    _run(PairMachine, loop, ("message checked", "write checked", "read checked",
                             "atomic checked"))


@pytest.mark.parametrize("loop", LOOPS)
def test_several_clients_on_one_listener(device: Any, loop: str) -> None:
    _run(ManyClientsMachine, loop, ("message checked",))


@pytest.fixture
def peer_port(device: Any, request: pytest.FixtureRequest) -> Any:
    with peer_process(request.node.callspec.params["loop"]) as port:
        yield port


@pytest.mark.parametrize("loop", LOOPS)
def test_against_a_peer_in_another_process(peer_port: int, loop: str) -> None:
    _run(ProcessMachine, loop, ("message checked", "remote bytes checked"), port=peer_port)
