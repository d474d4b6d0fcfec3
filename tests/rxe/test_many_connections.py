"""Many connections to one server in another process (issue 37): bounded by counts, never by
a rate.

Every connection is served (its own 64 B message comes back to it), the server's kernel holds
one queue pair and one memory region per open connection (the receive and send slots share one
registration; the atomics' scratch is registered only by an endpoint that makes an atomic),
plus, where its receives come from a shared receive pool, one shared receive queue and one
memory region per pool; and after the close both processes are back to their counts before
(the kernel's lists, ``rdma resource show``; the open fds; aiordma's own counts for this
process).

The second test holds 1,000 connections to one server whose receives come from one pool (its
CQ entries spread over several reactors: ``join_pool``); both ends' slots are made small so
that both processes fit the VM's 2 GiB (1,000 connections of the default ``Config`` pin
about 1.1 GiB on the client's side and 0.5 GiB of send slots on the server's; with only the
clients' made small, the second loop's run lost 417 of its 1,000 control channels to
keepalive time-outs).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from typing import Any

import pytest

import aiordma
from aiordma.bench.connections import LIST_BOUND, kernel_objects, open_files, server_process

from ..bounds import STEP
from .leaks import back, snapshot

N = 128  # connections open at once
LISTED = 256  # above this, the kernel's objects are counted, not listed (rdma resource show)
IN_FLIGHT = 16  # set-ups at a time
MANY = 1000  # connections on one pool
MANY_BUFFERS = 4096  # its slots: 3 control slots reserved per connection, the rest for data
SMALL = aiordma.Config(receive_pool=True, data_slots=8, ctrl_slots=4, send_slots=8)


def _rdma(*args: str) -> Any:
    rdma = shutil.which("rdma") or "/sbin/rdma"
    done = subprocess.run([rdma, "-j", "resource", "show", *args], capture_output=True,
                          text=True, timeout=LIST_BOUND, check=True)
    return json.loads(done.stdout)


def _totals() -> dict[str, int]:
    """The kernel's count of queue pairs and memory regions on every device (its summary:
    no list of the objects)."""
    rows = _rdma()
    return {k: sum(int(r.get(k, 0)) for r in rows) for k in ("qp", "mr")}


def _srqs(pid: int) -> int:
    return sum(1 for e in _rdma("srq") if e.get("pid") == pid)


async def _served(rdma_device: object, loop: str, n: int, *, pool: int = 0, send_slots: int = 0,
                  config: aiordma.Config | None = None) -> dict[str, int]:
    """``n`` connections to a server process (``pool``: its pool's slots; ``send_slots``: its
    endpoints'), one echo each, every count back after the close; returns the server's
    kernel objects with them open."""
    open_files(n + 256)
    with server_process(loop, pool, send_slots) as (port, pid):
        kw = {"timeout": 4 * STEP, "device": rdma_device, "transport": "rdma",
              "config": config}
        # warm-up: this process opens the device (and the server its first reactor)
        await (await aiordma.connect("127.0.0.1", port, **kw)).aclose()
        async with asyncio.timeout(STEP):  # the server's side of it closed too
            while (before := await snapshot(pid))[0].kernel["qp"]:
                await asyncio.sleep(0.1)
        mine = await snapshot()
        base = await asyncio.to_thread(_totals) if n > LISTED else {}
        gate = asyncio.Semaphore(IN_FLIGHT)
        eps: list[aiordma.Endpoint] = []

        async def one() -> None:
            async with gate:
                eps.append(await aiordma.connect("127.0.0.1", port, **kw))

        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(n):
                    tg.create_task(one())
            assert len(eps) == n

            async def echo(i: int, ep: aiordma.Endpoint) -> None:
                msg = i.to_bytes(4, "little") * 16  # 64 B, this connection's own
                await ep.send(msg)
                assert await asyncio.wait_for(ep.recv(), 4 * STEP) == msg

            async with asyncio.TaskGroup() as tg:
                for i, ep in enumerate(eps):
                    tg.create_task(echo(i, ep))
            if n <= LISTED:
                objects = kernel_objects(pid)
                assert objects is not None
                (server,) = await snapshot(pid)
                held = {k: server.kernel[k] - before[0].kernel[k] for k in ("qp", "mr")}
            else:  # (listing thousands of objects took more than 5 minutes in the VM)
                objects = {"srq": await asyncio.to_thread(_srqs, pid)}
                now = await asyncio.to_thread(_totals)
                held = {k: now[k] - base[k] - n for k in ("qp", "mr")}  # (less the clients')
            assert held["qp"] == n, (held, objects)
            # one region per connection, and one per pool (as many as shared receive queues)
            assert held["mr"] == n + objects["srq"], (held, objects)
        finally:
            await asyncio.gather(*(ep.aclose() for ep in eps), return_exceptions=True)
        await back([*before, *mine], timeout=4 * STEP)
        return objects


async def test_many_connections_are_served_and_released(rdma_device) -> None:
    objects = await _served(rdma_device, "asyncio", N)
    # (AIORDMA_RECEIVE_POOL=1 in the environment puts both ends on the pool: one holds them)
    assert objects["srq"] == (1 if aiordma.Config().receive_pool else 0), objects


@pytest.mark.serial  # (alone: it takes most of the VM's memory and CPU for minutes)
@pytest.mark.timeout(1200)  # about 5 minutes on a busy host (set-up at 6/s); a hang guard
async def test_a_thousand_connections_share_one_pool(rdma_device) -> None:
    objects = await _served(rdma_device, "uvloop", MANY, pool=MANY_BUFFERS,
                            send_slots=SMALL.send_slots, config=SMALL)
    assert objects["srq"] == 1, objects  # one pool, however many CQs its connections use
