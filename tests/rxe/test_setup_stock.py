"""A listener's stock of connections' resources made ahead (``Config.setup_stock``), counted
by the kernel: bounded by counts, never by a rate or a time.

* a burst of set-ups larger than the stock, from clients in another process: every
  connection served (its own 64 B echo), the stock's whole content taken and the rest made
  as before, the listener's kernel holding exactly one queue pair (and, with slots of its
  own, one memory region) per open connection beyond its stock, and everything back to the
  count before the listener once it and the clients closed;
* a listener closed (``aclose()`` or ``abort()``) with its stock full, or while it is being
  made: every queue pair, region, CQ and fd of it released;
* a set-up cancelled while it holds a queue pair taken from the stock (the listener closed
  while it waits for the client's Ready), and one whose client leaves at that point: the
  taken resources released with it, the rest of the stock at the close.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

import aiordma
from aiordma import Config
from aiordma.protocols import handshake as hs

from ..bounds import STEP
from ..restrack import kernel_counts
from . import warm
from .leaks import back, snapshot
from .peers import _read_line, wait_until

STOCK = 8
BURST = 24  # set-ups, three times the stock
IN_FLIGHT = 16


async def _echo(ep: Any) -> None:
    while (msg := await ep.recv()) is not None:
        await ep.send(msg)


async def _qps_mrs() -> dict[str, int]:
    pid = os.getpid()
    return (await asyncio.to_thread(kernel_counts, [pid], ("qp", "mr")))[pid]


async def _baseline(rdma_device: Any) -> list[Any]:
    """This process's counts before the test, after a listener with a stock of one was made
    and closed on this loop: on uvloop, libuv keeps an fd on ``/dev/null`` from a loop's
    first listening socket until the loop closes (its spare for ``EMFILE``), which is not
    this test's leak."""
    warm_up = await aiordma.listen(_echo, "127.0.0.1", 0, device=rdma_device,
                                   transport="rdma", config=Config(setup_stock=1))
    await _stocked(warm_up, 1)
    await asyncio.wait_for(warm_up.aclose(), STEP)
    return await snapshot()


async def _stocked(listener: aiordma.Listener, n: int) -> None:
    assert listener.stock is not None
    stock = listener.stock
    await wait_until(lambda: len(stock) == n, f"a stock of {n}", timeout=4 * STEP)


@pytest.mark.parametrize("pool", [False, True], ids=["own-slots", "pool"])
async def test_a_burst_larger_than_the_stock_is_served_and_released(rdma_device: Any,
                                                                     pool: bool) -> None:
    before = await _baseline(rdma_device)
    config = Config(setup_stock=STOCK, receive_pool=pool)
    listener = await aiordma.listen(_echo, "127.0.0.1", 0, device=rdma_device,
                                    transport="rdma", config=config)
    proc = None
    try:
        stock = listener.stock
        assert stock is not None
        await _stocked(listener, STOCK)
        base = await _qps_mrs()  # the stock's 8 queue pairs among them
        script = os.path.join(os.path.dirname(__file__), "setup_burst.py")
        proc = warm.popen([sys.executable, script, str(listener.port), str(BURST),
                           str(IN_FLIGHT), *(["pool"] if pool else [])],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        line = await asyncio.to_thread(_read_line, proc, 20 * STEP)
        assert line == f"OPEN {BURST}\n", line
        assert listener.accepted == BURST
        assert stock.taken + stock.missed == BURST, stock
        assert stock.taken >= STOCK, stock  # what was in stock before the burst, at least
        # The stock made up again once the set-ups paused: then the listener holds one
        # queue pair per connection beyond it (and one region each, with slots of its own).
        await _stocked(listener, STOCK)
        held = await _qps_mrs()
        assert held["qp"] - base["qp"] == BURST, (held, base, stock)
        if not pool:
            assert held["mr"] - base["mr"] == BURST, (held, base, stock)
        else:  # the arena's chunks of 32 (the 8 in stock have seats too)
            assert held["mr"] - base["mr"] <= 1, (held, base, stock)
        assert proc.stdin is not None
        proc.stdin.write(b"\n")
        line = await asyncio.to_thread(_read_line, proc, 20 * STEP)
        assert line == "CLOSED\n", line
        await wait_until(lambda: not listener.endpoints, "the endpoints closed", 4 * STEP)
    finally:
        await asyncio.wait_for(listener.aclose(), STEP)
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
    assert len(stock) == 0
    await back(before, timeout=4 * STEP)


@pytest.mark.parametrize("how", ["aclose", "abort", "aclose-while-made"])
async def test_a_listener_closed_with_its_stock_releases_it(rdma_device: Any,
                                                            how: str) -> None:
    before = await _baseline(rdma_device)
    config = Config(setup_stock=16)  # (AIORDMA_RECEIVE_POOL=1: on the pool)
    listener = await aiordma.listen(_echo, "127.0.0.1", 0, device=rdma_device,
                                    transport="rdma", config=config)
    stock = listener.stock
    assert stock is not None
    if how != "aclose-while-made":
        await _stocked(listener, 16)
        held = await _qps_mrs()
        assert held["qp"] - before[0].kernel["qp"] == 16, held
        # one region each (their slots), or the pool's and one chunk of its send arena
        mrs = 2 if config.receive_pool else 16
        assert held["mr"] - before[0].kernel["mr"] == mrs, held
    else:
        await wait_until(lambda: len(stock) >= 1, "the stock's making begun", 4 * STEP)
    if how == "abort":
        listener.abort()
    else:
        await asyncio.wait_for(listener.aclose(), STEP)
    assert len(stock) == 0
    await asyncio.sleep(0)
    await back(before, timeout=4 * STEP)


async def _hello_without_ready(rdma_device: Any, port: int, pool: bool
                               ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that sends a Hello (made-up queue pair: the listener's RTR needs nothing of
    it; ``pool``: offering the receive pool) and reads the Accept, then sends no Ready: the
    listener's set-up waits."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), STEP)
    control = hs.ControlConnection(hs.Role.CLIENT)
    writer.write(control.send(hs.Hello(qp_num=0x1234, psn=1, gid=rdma_device.gid, lid=0,
                                       mtu=rdma_device.active_mtu_enum, data_slots=4,
                                       ctrl_slots=3, slot_size=8192, max_rd_atomic=1,
                                       receive_pool=int(pool))))
    async with asyncio.timeout(STEP):
        while (ev := control.next_event()) is hs.NEED_DATA:
            control.receive_data(await reader.read(65536))
    assert isinstance(ev, hs.Accept), ev
    return reader, writer


@pytest.mark.parametrize("how", ["listener-closed", "client-left"])
async def test_a_setup_cancelled_holding_a_stocked_queue_pair_releases_it(
        rdma_device: Any, how: str) -> None:
    before = await _baseline(rdma_device)
    config = Config(setup_stock=4)  # (AIORDMA_RECEIVE_POOL=1: on the pool)
    listener = await aiordma.listen(_echo, "127.0.0.1", 0, device=rdma_device,
                                    transport="rdma", config=config)
    stock = listener.stock
    assert stock is not None
    writer = None
    try:
        await _stocked(listener, 4)
        base = await _qps_mrs()
        _, writer = await _hello_without_ready(rdma_device, listener.port,
                                               config.receive_pool)
        assert stock.taken == 1 and len(stock) == 3, stock  # (not made up: a set-up waits)
        held = await _qps_mrs()
        assert held == base, (held, base)  # its queue pair is the stock's
        if how == "client-left":
            writer.transport.abort()
            await wait_until(lambda: listener.failed_setups == 1, "the set-up failed",
                             4 * STEP)
            await _stocked(listener, 4)  # made up again once no set-up is under way
            held = await _qps_mrs()
            assert held == base, (held, base)  # the taken one released, one more made
    finally:
        await asyncio.wait_for(listener.aclose(), STEP)  # cancels a waiting set-up
        if writer is not None:
            writer.transport.abort()
    assert listener.accepted == 0
    await back(before, timeout=4 * STEP)
