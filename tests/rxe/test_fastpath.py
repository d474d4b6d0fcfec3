"""The compiled verbs fast path against pyverbs' path, on a real device.

The path is chosen per reactor and queue pair when they are created (``AIORDMA_FASTPATH=0``
forces pyverbs' objects), so both run in this process: a differential test drives the same
random operations through a pair on each path and compares everything observable, and the
message layer, the error paths and the lifetimes are run on each. This is where CI tests the
pure-Python path, which machines without the compiled module run.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma import ClosedResourceError, DeviceError, RemoteAccessError
from aiordma.lowlevel import (CompletionReactor, MemoryRegion, QueuePair, RemoteBuffer,
                               connect_pair)
from aiordma.protocols import messages as protocol

from ..bounds import STEP
from .test_pipelining import batch, echoing

# Its subject is the loop integration: both loops under `--loops one` too (tests/loops.py).
pytestmark = pytest.mark.both_loops

PATHS = ("compiled", "python")


def _compiled_expected() -> bool:
    """The set-up built the fast path for the pyverbs in use (its private prefix)."""
    import pyverbs

    from aiordma._verbs.load import private_prefix

    prefix = private_prefix()
    return prefix is not None and str(prefix) in (pyverbs.__file__ or "")


def use_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiordma._verbs.compiled import describe, fastpath

    if path == "python":
        monkeypatch.setenv("AIORDMA_FASTPATH", "0")
        return
    monkeypatch.delenv("AIORDMA_FASTPATH", raising=False)
    if fastpath() is None:
        if _compiled_expected():
            pytest.fail(f"scripts/setup.sh builds the fast path here, but: {describe()}")
        pytest.skip(f"no compiled fast path: {describe()}")


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    use_path(request.param, monkeypatch)
    return str(request.param)


class Loop:
    """A reactor and a connected pair of queue pairs on one path."""

    def __init__(self, device: Any, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
        use_path(path, monkeypatch)
        self.reactor = CompletionReactor(device)
        self.a, self.b = connect_pair(device, self.reactor)
        assert self.reactor.compiled == self.a.compiled == (path == "compiled")

    def close(self) -> None:
        self.reactor.close()


@pytest.fixture
async def loop_on(rdma_device: Any, path: str,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Loop]:
    lo = Loop(rdma_device, path, monkeypatch)  # (on this test's event loop)
    yield lo
    lo.close()


# -- differential: the same operations on both paths, everything observable compared ---------

OPS = st.lists(st.one_of(
    st.tuples(st.just("send"), st.integers(0, 9000)),
    st.tuples(st.just("write"), st.integers(0, 9000)),
    st.tuples(st.just("read"), st.integers(1, 9000)),
    st.tuples(st.just("fetch_add"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("compare_swap"), st.integers(0, 3)),
), min_size=1, max_size=12)


async def run_ops(lo: Loop, device: Any, ops: list[tuple[str, int]], seed: int) -> list[Any]:
    """Carry out ``ops`` on ``lo``; return what a user could observe of each."""
    rnd = random.Random(seed)
    seen: list[Any] = []
    counter = bytearray(8)
    word_mr = MemoryRegion(device, counter, remote_write=True, atomic=True)
    result = MemoryRegion(device, bytearray(8))
    word = word_mr.expose(atomic=True)
    try:
        for op, arg in ops:
            if op == "send":
                data = rnd.randbytes(arg)
                src, dst = MemoryRegion(device, bytearray(data)), MemoryRegion(device, bytearray(arg + 8))
                got = lo.b.recv_future(dst.whole())
                await asyncio.wait_for(lo.a.send(src.whole()), STEP)
                wc = await asyncio.wait_for(got, STEP)
                seen.append((op, wc.status, wc.opcode, wc.byte_len, bytes(dst.view)))
            elif op in ("write", "read"):
                data = rnd.randbytes(arg)
                mine = MemoryRegion(device, bytearray(data) if op == "write" else bytearray(arg))
                theirs = MemoryRegion(device, bytearray(b"\xee" * arg) if op == "write"
                                      else bytearray(data), remote_write=True, remote_read=True)
                remote = theirs.expose(write=True, read=True)
                if op == "write":
                    await asyncio.wait_for(lo.a.write(mine.whole(), remote), STEP)
                else:
                    await asyncio.wait_for(lo.a.read(mine.whole(), remote), STEP)
                seen.append((op, bytes(mine.view), bytes(theirs.view)))
            elif op == "fetch_add":
                old = await asyncio.wait_for(lo.a.fetch_add(result.whole(), word, arg), STEP)
                seen.append((op, old, bytes(counter)))
            else:
                old = await asyncio.wait_for(
                    lo.a.compare_swap(result.whole(), word, arg, arg + 1), STEP)
                seen.append((op, old, bytes(counter)))
    finally:
        word_mr.close()
        result.close()
    return seen


@given(ops=OPS, seed=st.integers(0, 2**32 - 1))
async def test_both_paths_agree_on_every_operation(rdma_device, ops, seed) -> None:
    with pytest.MonkeyPatch.context() as mp:
        compiled = Loop(rdma_device, "compiled", mp)
    with pytest.MonkeyPatch.context() as mp:
        python = Loop(rdma_device, "python", mp)
    try:
        a = await run_ops(compiled, rdma_device, ops, seed)
        b = await run_ops(python, rdma_device, ops, seed)
    finally:
        compiled.close()
        python.close()
    assert a == b
    assert len(a) == len(ops)


# -- each path on its own ----------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [(2000, 0, 100), (64, 1, 20000)],
                         ids=["2000 x 0..100 B", "64 x 1..20000 B, some by rendezvous"])
async def test_a_pipelined_batch_is_echoed_whole(rdma_device, path, pattern) -> None:
    n, lo, hi = pattern
    msgs = batch(n, lo, hi, seed=n)
    async with echoing(rdma_device) as ep:
        assert ep._reactor.compiled == ep._qp.compiled == (path == "compiled")
        await asyncio.wait_for(asyncio.gather(*(ep.send(m) for m in msgs)), STEP)
        got = [await asyncio.wait_for(ep.recv(), STEP) for _ in range(n)]
    assert got == msgs


async def test_a_refused_state_change_is_a_typed_error_and_the_queue_pair_goes_on(
        rdma_device, path) -> None:
    """RTR towards a GID index the port does not have: the kernel refuses it, and each path
    (compiled: one ``ibv_modify_qp``; pyverbs' attribute objects) raises ``DeviceError``
    naming the step, with the call's errno. The queue pair stays in INIT: a good RTR and RTS
    follow, and the pair then carries a message."""
    reactor = CompletionReactor(rdma_device)
    a, b = QueuePair(rdma_device, reactor), QueuePair(rdma_device, reactor)
    try:
        assert a.compiled == b.compiled == (path == "compiled")
        a.to_init()
        remote = b.local_address()
        with pytest.raises(DeviceError, match=r"\(RTR\)") as refused:
            a._verbs.to_rtr(port=rdma_device.port, path_mtu=remote.mtu,
                            dest_qp_num=remote.qp_num, rq_psn=remote.psn, lid=remote.lid,
                            gid=remote.gid, sgid_index=250, max_dest_rd_atomic=1,
                            min_rnr_timer=12)
        assert refused.value.errno
        a.connect(remote)
        b.connect(a.local_address())
        src = MemoryRegion(rdma_device, bytearray(64))
        dst = MemoryRegion(rdma_device, bytearray(64))
        await numbered_message(a, b, src, dst, 7)
        src.close()
        dst.close()
    finally:
        a.close()
        b.close()
        reactor.close()


async def test_sends_of_one_tick_leave_as_one_chain(rdma_device, path) -> None:
    """A writer awaiting ``send()`` in a loop, never suspending while credits last (the
    message rate's sender): the tick's first message is posted before ``send()`` returns, the
    next 63 (the peer's 64 credits) are held and posted at the tick's end by one call (one
    chain: one doorbell); the rest follow as credits come back, and the echo brings all 300
    back whole and in order. Counts the driver's posting calls, on each verbs path."""
    msgs = batch(300, 1, 200, seed=7)
    async with echoing(rdma_device) as ep:
        assert ep._qp.compiled == (path == "compiled")
        calls: list[int] = []  # SENDs per posting call
        run = ep._run_actions

        def counting(actions: list[Any]) -> Any:
            calls.append(sum(type(a) is protocol.PostSend for a in actions))
            return run(actions)

        ep._run_actions = counting
        got: list[bytes] = []

        async def read() -> None:
            for _ in msgs:
                m = await ep.recv()
                assert m is not None
                got.append(bytes(m))

        reader = asyncio.ensure_future(read())
        async with asyncio.timeout(STEP):
            await ep.send(msgs[0])
            assert [c for c in calls if c] == [1]  # the tick's first: posted at once
            for m in msgs[1:64]:
                await ep.send(m)  # (a credit each: no suspension, still this tick)
            assert [c for c in calls if c] == [1]  # held for the tick's end
            await asyncio.sleep(0)
            assert [c for c in calls if c] == [1, 63]  # one call, one chain
            for m in msgs[64:]:
                await ep.send(m)
            await reader
        assert got == msgs


async def test_a_ready_channel_callback_runs_once_a_drain_is_over(rdma_device, path) -> None:
    """``call_when_readable``'s callback, woken by a completion while the reactor drains, runs
    when that drain is over (not inside it), so one call takes every message the drain
    brought, as a woken task would: never more calls than the reactor's drains that found
    completions (its fd wake-ups, and its spin ticks and polls after re-arming that found
    some), and every message arrives, in order."""
    loop = asyncio.get_running_loop()
    msgs = batch(300, 0, 100, seed=3)
    async with echoing(rdma_device) as ep:
        r = ep._reactor
        assert r.compiled == (path == "compiled")
        got: list[bytes] = []
        calls = inside = 0
        done = loop.create_future()

        def on_ready() -> None:
            nonlocal calls, inside
            calls += 1
            inside += r.batch.draining
            while (m := ep.recv_nowait()) is not None:
                got.append(bytes(m))
            if len(got) == len(msgs):
                done.set_result(None)
            elif not ep.call_when_readable(on_ready):
                loop.call_soon(on_ready)  # (something came between: take it)

        assert ep.call_when_readable(on_ready)
        before = r.wakeups + r.poll_finds
        await asyncio.wait_for(asyncio.gather(*(ep.send(m) for m in msgs)), STEP)
        await asyncio.wait_for(done, STEP)
        drains = r.wakeups + r.poll_finds - before
    assert got == msgs
    assert inside == 0
    assert 1 <= calls <= drains


async def test_a_wrong_rkey_fails_typed_and_the_pair_is_broken(loop_on) -> None:
    device = loop_on.reactor.device
    dst = MemoryRegion(device, bytearray(64), remote_write=True)
    src = MemoryRegion(device, bytearray(b"z" * 64))
    good = dst.expose(write=True)
    bad = RemoteBuffer(address=good.address, rkey=good.rkey ^ 0x5A5A00, length=64, writable=True)
    with pytest.raises(RemoteAccessError) as info:
        await asyncio.wait_for(loop_on.a.write(src.whole(), bad), STEP)
    assert info.value.status_name in ("IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR")
    assert bytes(dst.view) == bytes(64)


async def test_a_failing_handler_is_reported_and_the_others_still_run(loop_on) -> None:
    loop = asyncio.get_running_loop()
    reported: list[Any] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx.get("exception")))
    device = loop_on.reactor.device
    dsts = [MemoryRegion(device, bytearray(16)) for _ in range(2)]
    src = MemoryRegion(device, bytearray(b"x" * 16))
    seen: list[int] = []
    done = loop.create_future()

    def bad(_wc: Any) -> None:
        raise ValueError("handler bug")

    def good(wc: Any) -> None:
        seen.append(wc.byte_len)
        done.set_result(None)

    r = loop_on.reactor
    for i, h in enumerate((bad, good)):
        wr_id = r.next_wr_id()
        r.watch(wr_id, h)
        loop_on.b.post_recv(wr_id, dsts[i].address, 16, dsts[i].lkey)
    for _ in range(2):
        await asyncio.wait_for(loop_on.a.send(src.whole()), STEP)
    await asyncio.wait_for(done, STEP)
    assert seen == [16]
    assert len(reported) == 1 and isinstance(reported[0], ValueError)


async def test_a_handler_that_closes_the_reactor_ends_the_drain(loop_on) -> None:
    """Two receives complete in one batch; the first one's handler closes the reactor (the
    CQ is destroyed): nothing touches the CQ after that, the second waiter is failed typed."""
    loop = asyncio.get_running_loop()
    device = loop_on.reactor.device
    r = loop_on.reactor
    dsts = [MemoryRegion(device, bytearray(16)) for _ in range(2)]
    src = MemoryRegion(device, bytearray(b"y" * 16))
    first = r.next_wr_id()
    r.watch(first, lambda _wc: r.close())
    loop_on.b.post_recv(first, dsts[0].address, 16, dsts[0].lkey)
    second = loop_on.b.recv_future(dsts[1].whole())
    for _ in range(2):
        loop_on.a.post_send(r.next_wr_id(), _op("SEND"), src.address, 16, src.lkey, signaled=False)
    with pytest.raises(ClosedResourceError):
        await asyncio.wait_for(second, STEP)
    assert r.closed
    await asyncio.sleep(0)
    assert loop.is_running()


def _op(name: str) -> int:
    from aiordma._endpoint.qp import opcode

    return opcode(name)


@pytest.mark.parametrize("path", ["compiled"], indirect=True)
async def test_a_queue_pair_destroyed_under_the_fast_path_is_refused(loop_on) -> None:
    """pyverbs' close() sets its pointer to NULL; the compiled path reads it on every call
    and refuses a NULL one (EBADF) instead of using freed memory."""
    src = MemoryRegion(loop_on.reactor.device, bytearray(16))
    loop_on.a.raw.close()  # behind QueuePair's back
    with pytest.raises(DeviceError, match="Bad file descriptor"):
        loop_on.a.post_send(1, _op("SEND"), src.address, 16, src.lkey)
    with pytest.raises(DeviceError, match="Bad file descriptor"):
        loop_on.a.post_recv(2, src.address, 16, src.lkey)


async def test_a_queue_pair_is_pyverbs_own_and_its_owners_close_it_first(rdma_device,
                                                                          path) -> None:
    """Either path makes pyverbs' ``QP`` (the compiled one with one ibv_create_qp, none of
    pyverbs' attribute objects): in RESET, the capacities asked for, its number as the kernel
    has it; the completion queue tracks it as pyverbs' own do: pyverbs' CQ closed behind
    the reactor's back destroys the queue pair first (else EBUSY), whose posts the compiled
    path then refuses (pyverbs' own post on a destroyed queue pair reads freed memory), and
    the reactor's and the queue pair's own close() afterwards do nothing."""
    from pyverbs.qp import QP

    reactor = CompletionReactor(rdma_device)
    qp = QueuePair(rdma_device, reactor, max_send_wr=37, max_recv_wr=21, max_inline=64)
    src = MemoryRegion(rdma_device, bytearray(16))
    raw = qp.raw
    try:
        assert type(raw) is QP and qp.compiled == (path == "compiled")
        assert qp.state == 0 and qp.qp_num == raw.qp_num  # (IBV_QPS_RESET)
        _, init = raw.query(0xFFFFF)  # (every attribute)
        assert init.cap.max_send_wr >= 37 and init.cap.max_recv_wr >= 21
        assert init.cap.max_send_sge >= 2 and init.cap.max_inline_data >= 64
        assert init.qp_type == 2  # (IBV_QPT_RC)
        raw.set_log_level(logging.WARNING)  # (pyverbs' logger, as its QP() sets it)
        reactor.completion_queue.raw.close()  # (pyverbs' CQ: its queue pairs go first)
        if path == "compiled":
            with pytest.raises(DeviceError, match="Bad file descriptor"):
                qp.post_recv(1, src.address, 16, src.lkey)
    finally:
        reactor.close()
        src.close()
    assert reactor.closed and qp.closed
    qp.close()


async def test_posting_on_a_closed_queue_pair_is_a_closed_error(loop_on) -> None:
    src = MemoryRegion(loop_on.reactor.device, bytearray(16))
    loop_on.a.close()
    with pytest.raises(ClosedResourceError):
        loop_on.a.post_send(1, _op("SEND"), src.address, 16, src.lkey)
    with pytest.raises(ClosedResourceError):
        loop_on.a.post_slot(0)


async def numbered_message(a: Any, b: Any, src: MemoryRegion, dst: MemoryRegion, i: int) -> None:
    """Send 64 B numbered ``i`` (its first 8 bytes) from ``a`` out of ``src``; check that ``b``
    received them whole into ``dst``."""
    src.view[:8] = i.to_bytes(8, "little")
    got = b.recv_future(dst.whole())
    await asyncio.wait_for(a.send(src.whole()), STEP)
    wc = await asyncio.wait_for(got, STEP)
    assert wc.byte_len == 64 and bytes(dst.view[:8]) == i.to_bytes(8, "little")


async def test_busy_polling_delivers_in_order_and_closes_cleanly(rdma_device, path) -> None:
    """The reactor's busy-poll mode (``busy_poll_us``) on each path: 50 sends in lockstep
    arrive whole and in order, then the reactor closes while a spin tick may be scheduled,
    harmlessly."""
    reactor = CompletionReactor(rdma_device, busy_poll_us=500)
    assert reactor.compiled == (path == "compiled")
    a, b = connect_pair(rdma_device, reactor)
    src = MemoryRegion(rdma_device, bytearray(64))
    dsts = [MemoryRegion(rdma_device, bytearray(64)) for _ in range(50)]
    try:
        for i, dst in enumerate(dsts):
            await numbered_message(a, b, src, dst, i)
        assert reactor.completions >= 100  # a send and a receive each
    finally:
        reactor.close()
    await asyncio.sleep(0.01)  # a spin tick scheduled before the close runs now
    assert reactor.closed


async def test_busy_polling_spins_in_a_conversation_and_sleeps_after_it(rdma_device, path,
                                                                        monkeypatch) -> None:
    """Adaptive busy polling (the default; ``CompletionReactor``'s docstring): 200 messages
    in lockstep are mostly caught by spinning (at most one fd wake-up for two messages, where
    each would wake the reactor without a spin), the spin runs out once they
    stop and the reactor sleeps on its fd again (nothing drained while idle); messages
    spaced wider than ``CADENCE`` spins each wake the reactor, with one wasted spin at most
    per message (its send's and its receive's completions come close together: here both
    are on this reactor); and messages close together are caught by spinning again. (A
    20 ms spin, so that a slow machine's steps stay well inside one, and no giving way to a
    crowded CPU, which the next test covers: beside the suite's other worker the spin gave
    way and the lockstep woke 48 times, in a CI run.)"""
    from aiordma._reactor import reactor as reactor_module
    from aiordma._reactor.reactor import CADENCE

    monkeypatch.setattr(reactor_module, "MIN_SHARE", 0.0)

    spin_us = 20_000.0
    reactor = CompletionReactor(rdma_device, busy_poll_us=spin_us)
    assert reactor.compiled == (path == "compiled")
    a, b = connect_pair(rdma_device, reactor)
    src = MemoryRegion(rdma_device, bytearray(64))
    dst = MemoryRegion(rdma_device, bytearray(64))

    async def one(i: int) -> None:
        await numbered_message(a, b, src, dst, i)

    try:
        w0, f0 = reactor.wakeups, reactor.poll_finds
        for i in range(200):
            await one(i)
        lockstep_wakeups = reactor.wakeups - w0
        assert reactor.poll_finds - f0 >= 100, "the spin caught the lockstep's completions"
        assert lockstep_wakeups <= 100  # (each message would wake it without a spin)
        await asyncio.sleep(4 * spin_us / 1e6)  # the spin runs out (no completion for a spin)
        assert not reactor._spinning and reactor.spins_run_out >= 1
        idle = reactor.poll_finds, reactor.wakeups, reactor.completions
        await asyncio.sleep(0.05)
        assert (reactor.poll_finds, reactor.wakeups, reactor.completions) == idle

        runs_out, w1 = reactor.spins_run_out, reactor.wakeups
        for i in range(5):  # wider apart than CADENCE spins: each one a wake-up
            await asyncio.sleep(2 * CADENCE * spin_us / 1e6)
            await one(1000 + i)
        assert reactor.wakeups - w1 >= 5
        assert reactor.spins_run_out - runs_out <= 5

        f1 = reactor.poll_finds
        for i in range(20):  # close together again: spinning again
            await one(2000 + i)
        assert reactor.poll_finds - f1 >= 10
    finally:
        reactor.close()
    await asyncio.sleep(0.01)  # a spin tick scheduled before the close runs now
    assert reactor.closed


async def test_a_spin_gives_way_on_a_crowded_cpu(rdma_device, path, monkeypatch) -> None:
    """A spin that finds its thread getting less than ``MIN_SHARE`` of the CPU (here a busy
    process pinned to the same CPU takes it whenever the spin yields) gives way: it ends, no
    spin starts for ``CROWDED_PAUSE`` (made a minute here, so that a slow machine's steps stay
    inside it), and the messages still arrive whole and in order."""
    import os
    import subprocess
    import sys

    from aiordma._reactor import reactor as reactor_module

    monkeypatch.setattr(reactor_module, "CROWDED_PAUSE", 60.0)

    mine = os.sched_getaffinity(0)
    cpu = min(mine)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    reactor = CompletionReactor(rdma_device, busy_poll_us=20_000)
    a, b = connect_pair(rdma_device, reactor)
    src = MemoryRegion(rdma_device, bytearray(64))
    dst = MemoryRegion(rdma_device, bytearray(64))
    try:
        os.sched_setaffinity(busy.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        for i in range(100):
            await numbered_message(a, b, src, dst, i)
            if reactor.spins_crowded:
                break
            await asyncio.sleep(0.002)  # (the spin goes on: an empty tick looks at its share)
        assert reactor.spins_crowded >= 1
        assert not reactor._spinning
        assert not reactor._in_cadence(reactor._last_found)  # within the pause: no spin starts
    finally:
        os.sched_setaffinity(0, mine)
        busy.kill()
        busy.wait()
        reactor.close()
    await asyncio.sleep(0.01)


async def test_a_chain_of_sends_arrives_whole_and_in_order(loop_on) -> None:
    """``QueuePair.post_sends`` (one ``ibv_post_send`` for the chain on the compiled path, one
    per SEND on pyverbs'): 16 SENDs of 0..1000 B, every 4th signaled, arrive in order, byte for
    byte, and exactly the signaled ones complete on the sender."""
    lo, device, r = loop_on, loop_on.reactor.device, loop_on.reactor
    sizes = [0, 1, 63, 64, 1000, 7, 512, 999, 1, 2, 3, 4, 100, 200, 300, 1000]
    src = MemoryRegion(device, bytearray(random.Random(3).randbytes(16 * 1024)))
    dsts = [MemoryRegion(device, bytearray(1024)) for _ in sizes]
    got = [lo.b.recv_future(d.whole()) for d in dsts]
    sent: list[asyncio.Future[Any]] = []
    items = []
    for i, n in enumerate(sizes):
        wr_id = r.next_wr_id()
        if i % 4 == 3:
            sent.append(r.expect(wr_id, "send"))
        items.append((wr_id, src.address + i * 1024, n, src.lkey, i % 4 == 3))
    lo.a.post_sends(items)
    wcs = [await asyncio.wait_for(g, STEP) for g in got]
    for i, (wc, n) in enumerate(zip(wcs, sizes, strict=True)):
        assert wc.byte_len == n
        assert bytes(dsts[i].view[:n]) == bytes(src.view[i * 1024:i * 1024 + n])
    for f in sent:
        assert (await asyncio.wait_for(f, STEP)).status == 0
    assert r.pending == 0  # nothing else was expected
