"""Collectives over the TCP transport, device-free: groups of 2, 3 and 4 worker processes
(``tests/rxe/collective_worker.py``, the device tests' worker) whose links are TCP channels
over loopback, running every operation, several in flight and subgroups, each
result checked element by element against numpy (``collective_ops.expected``); in one
process, a rank that starts collectives in another order gets the typed error over TCP too,
and the choice of transport (``Group.join(transport=...)``, the rendezvous' rule; "no device"
is said to the set-up itself where a test needs it, as in ``test_tcp_transport.py``).

The workers' piece sizes are small and differ between ranks (over TCP ``slot_bytes`` is the
size of the pieces a rank receives, each in one message), one of them larger than a TCP
channel's ``eager_max``, and the thresholds are low, so the cases' sizes run every algorithm
in many pieces. The same cases run over rxe in ``tests/rxe/test_collectives_set.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aiordma
from aiordma.lowlevel import list_devices
from aiordma.protocols import collectives as proto
from aiordma.services.collectives import CollectiveMismatchError, Group, RendezvousError
from aiordma.services.collectives.launch import free_port

from ..bounds import STEP
from ..rxe.collective_group import Groups, play
from .test_tcp_transport import no_device

GROUPS: dict[int, dict[str, str]] = {
    2: {"loop": "uvloop", "slot_bytes": "1024,300000", "slots": "2", "env": "torchrun",
        "thresholds": '{"allreduce": 2048, "reduce_scatter": 2048, "reduce": 2048}',
        "transport": "tcp"},
    3: {"loop": "asyncio", "slot_bytes": "2048,4096,1024", "slots": "3,1,2", "env": "slurm",
        "thresholds": '{"allreduce": 4096, "broadcast": 512, "allgather": 4096, '
                      '"reduce_scatter": 1024, "reduce": 3000}',
        "transport": "auto"},  # (without a device auto takes TCP; with one, see groups())
    4: {"loop": "uvloop", "slot_bytes": "4096,1024", "slots": "2,1", "env": "torchrun",
        "thresholds": '{"allreduce": 8192, "allgather": 1024, "reduce_scatter": 512, '
                      '"reduce": 512}', "transport": "tcp"},
}
BIG = {"rows": 700, "rest": [3]}  # 2100 items per rank: over every threshold of GROUPS


def _no_device() -> bool:
    try:
        return not list_devices()
    except aiordma.DeviceError:
        return True


@pytest.fixture(scope="module")
def groups() -> Iterator[Groups]:
    specs = GROUPS
    if not _no_device():  # (auto would take RDMA here: ask for TCP)
        specs = {w: {**spec, "transport": "tcp"} for w, spec in GROUPS.items()}
    gs = Groups(None, specs)
    yield gs
    gs.close()


EVERY_OPERATION = [
    {"kind": "allreduce", "op": "sum", "dtype": "float32", "shape": [3000], "seed": 1,
     "out": False, "wrap": None},
    {"kind": "allreduce", "op": "avg", "dtype": "float16", "shape": [61, 33], "seed": 2,
     "out": True, "wrap": "dlpack"},
    {"kind": "allreduce", "op": "bor", "dtype": "uint8", "shape": [5], "seed": 3,
     "out": False, "wrap": "buffer"},
    {"kind": "reduce", "op": "min", "dtype": ">i4", "shape": [5], "root": 3, "seed": 4,
     "out": False, "wrap": None},
    {"kind": "reduce", "op": "avg", "dtype": "float64", "shape": [3000], "root": 1, "seed": 5,
     "out": True, "wrap": "buffer"},
    {"kind": "reduce_scatter", "op": "sum", "dtype": "float32", **BIG, "seed": 6,
     "out": False, "wrap": None},
    {"kind": "reduce_scatter", "op": "bxor", "dtype": "int64", "rows": 2, "rest": [],
     "seed": 7, "out": True, "wrap": "dlpack"},
    {"kind": "alltoall", "dtype": "complex64", **BIG, "seed": 8, "out": True, "wrap": None},
    {"kind": "alltoallv", "dtype": "float64", "rest": [2], "max_rows": 400, "seed": 9,
     "recv": True},
    {"kind": "alltoallv", "dtype": "S3", "rest": [], "max_rows": 0, "seed": 10, "recv": False},
    {"kind": "gather", "root": 1, "shapes": [[3000], [0], [2, 3], []],
     "dtypes": ["float64", "int8", "S3", "bool"], "seed": 11, "out": False},
    {"kind": "scatter", "root": 2, "shapes": [[3000], [], [2, 0], [5]],
     "dtypes": ["int8", "float64", "complex64", ">i4"], "seed": 12, "as_list": True,
     "out": False},
    {"kind": "p2p", "seed": 13, "messages": [[0, 1, 0, [3000], "float64"],
                                             [0, 1, 0, [2], "int8"], [1, 0, 2, [], "S3"]]},
    {"kind": "broadcast", "root": 1, "dtype": "float64", "shape": [3000], "seed": 14},
    {"kind": "allgather", "seed": 15, "out": False, "shapes": [[3000], [2], [], [61, 33]],
     "dtypes": ["float64", "int8", "bool", "complex64"]},
    {"kind": "barrier"},
]
BUCKETS = [{"kind": "allreduce", "op": "sum", "dtype": "float32", "shape": [n], "seed": i,
            "out": False, "wrap": None}
           for i, n in enumerate([5, 3000, 1, 0, 2500, 7, 4000, 64])]
EVERY_ALGORITHM_AT_ONCE = [
    {"kind": "broadcast", "root": 1, "dtype": "float64", "shape": [3000], "seed": 1},
    {"kind": "reduce_scatter", "op": "max", "dtype": "int32", **BIG, "seed": 2, "out": False,
     "wrap": None},
    {"kind": "barrier"},
    {"kind": "alltoall", "dtype": "int8", **BIG, "seed": 3, "out": False, "wrap": None},
    {"kind": "p2p", "seed": 4, "messages": [[1, 0, 1, [3000], "float64"]]},
    {"kind": "gather", "root": 0, "shapes": [[700], [3], [0], [2, 2]],
     "dtypes": ["float64", "int8", "bool", "S3"], "seed": 5, "out": False},
]
BIG_SUM = {"kind": "allreduce", "op": "sum", "dtype": "float64", "shape": [3000], "seed": 1,
           "out": False, "wrap": None}
SUBGROUPS = [
    {"kind": "split", "colors": [0, 1, 0, 1], "keys": [0, 0, 0, 0],
     "cases": [BIG_SUM, {"kind": "barrier"}]},
    {"kind": "inflight", "cases": [
        {"kind": "subgroup", "ranks": [0, 1], "cases": [BIG_SUM]},
        {"kind": "subgroup", "ranks": [2, 1, 0], "cases": [BIG_SUM]},
        BIG_SUM]},
    {"kind": "split", "colors": [None, 2, 2, None], "keys": [0, 1, -1, 0],
     "cases": [{"kind": "p2p", "seed": 3, "messages": [[0, 1, 0, [4], "int8"]]}]},
]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_operation_over_tcp_matches_numpy(groups: Groups, tmp_path: Any,
                                                world: int) -> None:
    play(groups, world, EVERY_OPERATION, str(tmp_path))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_several_in_flight_over_tcp_match_numpy(groups: Groups, tmp_path: Any,
                                                world: int) -> None:
    play(groups, world, [{"kind": "inflight", "cases": BUCKETS},
                         {"kind": "inflight", "cases": EVERY_ALGORITHM_AT_ONCE}], str(tmp_path))


@pytest.mark.parametrize("world", [3, 4])
def test_subgroups_over_tcp_match_numpy(groups: Groups, tmp_path: Any, world: int) -> None:
    play(groups, world, SUBGROUPS, str(tmp_path))


# -- in one process ----------------------------------------------------------------------------


async def form(world: int, transport: str = "tcp", **kwargs: Any) -> list[Group]:
    port = free_port()
    kwargs.setdefault("slot_bytes", 1024)
    return list(await asyncio.wait_for(asyncio.gather(*(
        Group.join(r, world, "127.0.0.1", port, timeout=STEP, transport=transport, **kwargs)
        for r in range(world))), STEP))


@pytest.mark.parametrize("together", [False, True])
async def test_another_order_over_tcp_is_a_typed_error_on_every_rank(together: bool) -> None:
    kinds = ["allreduce", "barrier", "alltoall"]
    orders = [kinds, kinds, ["barrier", "allreduce", "alltoall"]]
    calls = {"allreduce": lambda g: g.allreduce(np.ones(3000)),
             "barrier": lambda g: g.barrier(),
             "alltoall": lambda g: g.alltoall(np.ones(2 * g.world_size))}

    async def rank(g: Group, order: list[str]) -> None:
        if together:
            await asyncio.gather(*(calls[k](g) for k in order))
        else:
            for k in order:
                await calls[k](g)

    gs = await form(3)
    try:
        assert [g.transport for g in gs] == ["tcp"] * 3
        results = await asyncio.wait_for(asyncio.gather(
            *(rank(g, o) for g, o in zip(gs, orders, strict=True)), return_exceptions=True),
            STEP)
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))
    for r, res in enumerate(results):
        assert isinstance(res, CollectiveMismatchError), f"rank {r}: {res!r}"
        if not together:
            assert "allreduce" in str(res) and "barrier" in str(res), f"rank {r}: {res}"


async def test_small_allreduces_over_tcp_run_on_the_links() -> None:
    """A group over TCP links has no step engine (it needs RDMA): its first small allreduce
    finds that out with the other ranks (every rank offers nothing) and every later one runs
    on the links at once, several in flight included."""
    gs = await form(3)
    try:
        xs = [[np.full(n, r + 1.0) for n in (1, 100, 1000)] for r in range(3)]
        for _ in range(2):
            await asyncio.wait_for(asyncio.gather(*(
                asyncio.gather(*(g.allreduce(x) for x in row))
                for g, row in zip(gs, xs, strict=True))), STEP)
        for row in xs:
            for x in row:
                np.testing.assert_array_equal(x, np.full(x.size, 18.0))  # (1+2+3), then x3
        assert all(g._engine.off for g in gs)
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))


@pytest.mark.parametrize("bound", [0, 0.2])
async def test_an_operations_bound_is_a_typed_timeout_that_breaks_the_group(
        bound: float) -> None:
    """An operation's timeout (a timer that cancels its task, _core._run): rank 0's barrier
    with no partner fails with OperationTimeout once the bound is over (0: at once), the
    group breaks, and the other rank hears of it; calls that end within their bound leave
    no cancellation behind for the caller's next await."""
    gs = await form(2)
    try:
        xs = [np.ones(10) for _ in gs]
        for _ in range(3):
            await asyncio.wait_for(asyncio.gather(*(g.allreduce(x, timeout=5) for g, x in
                                                    zip(gs, xs, strict=True))), STEP)
            await asyncio.sleep(0.01)  # (a cancellation left behind would land here)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(aiordma.OperationTimeout, match=f"longer than {float(bound)} s"):
            await asyncio.wait_for(gs[0].barrier(timeout=bound), STEP)
        # (uvloop's timers count whole milliseconds: one may fire up to 1 ms early)
        assert asyncio.get_running_loop().time() - t0 >= bound - 0.002
        assert gs[0].broken
        with pytest.raises(aiordma.BrokenResourceError):  # (the first may find rank 0's part)
            for _ in range(2):
                await asyncio.wait_for(gs[1].barrier(), STEP)
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))


async def test_engine_calls_that_end_in_their_poll_let_the_loop_run_others() -> None:
    """An engine call whose poll ended it returns without the event loop turning (no timer,
    no await): _run_engine gives the loop a turn at every 32nd call by number (the same
    calls on every rank), so a loop of them does not starve other tasks. Driven here with a
    stand-in call whose future is done at once (the engine itself needs RDMA): 128 calls
    (numbers 1-128), the other task runs at each of the 4 turns meanwhile, and every call's
    result comes back."""
    gs = await form(2)
    try:
        loop = asyncio.get_running_loop()
        ticks = 0
        stop = False

        async def other() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0)

        def begin(engine: Any) -> tuple[asyncio.Future[None], Any]:
            fut = loop.create_future()
            fut.set_result(None)
            return fut, "state"

        ticker = asyncio.ensure_future(other())
        await asyncio.sleep(0)
        start = ticks
        got = [await gs[0]._run_engine("barrier", 5, None, begin,  # type: ignore[arg-type]
                                       lambda engine, fut, state: state)
               for _ in range(128)]
        during = ticks - start
        stop = True
        await ticker
        assert got == ["state"] * 128
        assert 4 <= during <= 5, during
    finally:
        for g in gs:
            g.abort()


async def test_a_recv_of_another_shape_over_tcp_is_typed() -> None:
    g0, g1 = await form(2)
    try:
        await asyncio.wait_for(g0.send(np.arange(6.0), 1, tag=3), STEP)
        with pytest.raises(CollectiveMismatchError, match="shape"):
            await asyncio.wait_for(g1.recv(np.zeros(5), 0, tag=3), STEP)
        with pytest.raises((CollectiveMismatchError, aiordma.BrokenResourceError)):
            await asyncio.wait_for(g0.barrier(), STEP)
    finally:
        await asyncio.gather(g0.aclose(), g1.aclose())


async def test_pieces_larger_than_a_message_slot_and_a_small_config() -> None:
    """Pieces of 256 KiB (over TCP, the default ``slot_bytes=None``'s) are TCP messages far
    over ``eager_max``; with ``Config.max_message`` of 8 KiB the pieces shrink to fit it."""
    for kwargs in ({"slot_bytes": None},
                   {"slot_bytes": None, "config": aiordma.Config(max_message=8192)}):
        gs = await form(2, **kwargs)
        try:
            sizes = [i.size for g in gs for i in g._fabric.plane.ins.values()]
            assert sizes == ([256 << 10] * 2 if "config" not in kwargs else [7168] * 2), sizes
            xs = [np.arange(200_000, dtype=np.float64) * (r + 1) for r in range(2)]
            await asyncio.wait_for(asyncio.gather(*(g.allreduce(x) for g, x in
                                                    zip(gs, xs, strict=True))), STEP)
            for x in xs:
                np.testing.assert_array_equal(x, np.arange(200_000) * 3.0)
        finally:
            await asyncio.gather(*(g.aclose() for g in gs))


async def test_auto_takes_tcp_without_a_device_and_rdma_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    no_device(monkeypatch)  # (whatever this host has)
    gs = await form(2, transport="auto")
    try:
        assert [g.transport for g in gs] == ["tcp", "tcp"]
        parts = await asyncio.wait_for(asyncio.gather(*(g.allgather(np.array([g.rank]))
                                                        for g in gs)), STEP)
        assert [[int(p[0]) for p in ps] for ps in parts] == [[0, 1], [0, 1]]
    finally:
        await asyncio.gather(*(g.aclose() for g in gs))
    with pytest.raises(aiordma.UnsupportedOperationError, match="transport='rdma'"):
        await Group.join(0, 2, "127.0.0.1", free_port(), timeout=STEP, transport="rdma")
    single = await Group.join(0, 1, "127.0.0.1", free_port(), transport="tcp")
    assert single.transport is None  # (a group of one has no link)
    await single.aclose()


async def test_a_bad_transport_is_a_typed_argument_error() -> None:
    with pytest.raises(aiordma.LocalProtocolError, match="transport"):
        await Group.join(0, 2, "127.0.0.1", free_port(), transport="udp")


def test_the_rendezvous_rule() -> None:
    """TCP for the whole group if any rank takes TCP only; a rank insisting on RDMA beside
    one insisting on TCP fails the rendezvous (every waiting rank hears of it)."""
    for links, want in ((["either", "either"], "rdma"), (["rdma", "either"], "rdma"),
                        (["either", "tcp"], "tcp"), (["tcp", "tcp"], "tcp")):
        roster = proto.Roster(2)
        for r, c in enumerate(links):
            roster.add(r, 2, "10.0.0.1", 1000 + r, c)
        assert roster.transport == want, links
    old = proto.Roster(2)  # a rank of before the TCP links sends none: RDMA
    old.add(0, 2, "10.0.0.1", 1000)
    old.add(1, 2, "10.0.0.1", 1001, "either")
    assert old.transport == "rdma"
    roster = proto.Roster(3)
    roster.add(0, 3, "10.0.0.1", 1000, "rdma")
    roster.add(1, 3, "10.0.0.1", 1001, "either")
    with pytest.raises(proto.RendezvousRefused, match="rank 0 takes rdma.*rank 2 tcp"):
        roster.add(2, 3, "10.0.0.1", 1002, "tcp")
    assert roster.failure is not None
    with pytest.raises(proto.RendezvousRefused, match="links"):
        proto.Roster(1).add(0, 1, "10.0.0.1", 1000, "udp")
    assert issubclass(RendezvousError, aiordma.AiordmaError)
