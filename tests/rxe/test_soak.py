"""Soak: hundreds of endpoints and RPCs with random cancellations, timeouts and aborts, then
no leaked queue pair, CQ, MR, PD, context, completion channel, fd reader, endpoint, fd or task,
and nothing logged as an error (``unexpected``: e.g. a future whose exception nobody took).

Leaks are counted three ways, for this process and for the server process (``leaks.py``): by
the kernel (its list of each process's verbs objects, ``rdma resource show``), by the process
(its open fds in ``/proc/<pid>/fd``, its asyncio tasks), and by aiordma's own counters
(:func:`aiordma.lowlevel.resource_counts`); each must be back to its baseline. The first
test runs against ``aiordma serve echo`` in another process (which must still serve at the end);
the second serves in this process, so the server side's counts are this process's too. Both run
on the default asyncio loop and on uvloop.

Each soak is bounded by counts (endpoints opened, in waves), never by time: it asserts that
everything was correct and clean, and that every kind of fault in the mix happened, not how much
got done, so a slow or busy machine takes longer instead of failing. Time bounds only guard
against hangs (each wave, the settling of the counts, and pytest's global timeout). Scale:
``AIORDMA_SOAK_SCALE`` (default 1) multiplies the endpoint counts; ``AIORDMA_SOAK_SEED``
replays a run's choices (the seed is printed). The numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from aiordma import AiordmaError, OperationTimeout
from aiordma.rpc import connect as rpc_connect
from aiordma.rpc import serve
from aiordma.services.echo import Echo

from ..bounds import STEP, hang_guard
from . import leaks
from .peers import LOOPS, run_on, server_process

SCALE = float(os.environ.get("AIORDMA_SOAK_SCALE", "1"))
SETTLE = 20.0  # bound on counts returning to their baseline after the last close
EAGER_MAX = 8000  # payloads above the eager limit (8180 B by default) go by rendezvous


@dataclass
class Tally:
    endpoints: int = 0
    connects_cancelled: int = 0
    calls_ok: int = 0
    calls_cancelled: int = 0
    cancelled_after_done: int = 0
    timeouts: int = 0
    timeouts_beaten: int = 0  # answered within a tiny bound anyway
    rendezvous: int = 0
    aborted_mid_call: int = 0
    failed_typed: dict[str, int] = field(default_factory=dict)
    waves: int = 0

    def typed(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.failed_typed[name] = self.failed_typed.get(name, 0) + 1


async def _session(port: int, rng: random.Random, tally: Tally, rpcs_max: int) -> None:
    """One client endpoint's life: maybe a cancelled connect; random calls, cancellations,
    tiny timeouts and rendezvous payloads; maybe an abort under a call; aclose or abort."""
    if rng.random() < 0.05:  # cancel the connect at a random point of the set-up
        task = asyncio.ensure_future(rpc_connect("127.0.0.1", port, timeout=STEP))
        await asyncio.sleep(rng.uniform(0, 0.03))
        task.cancel()
        try:
            client = await task
        except asyncio.CancelledError:
            tally.connects_cancelled += 1
            return
    else:
        client = await rpc_connect("127.0.0.1", port, timeout=STEP)
    tally.endpoints += 1
    try:
        for _ in range(rng.randint(1, rpcs_max)):
            big = rng.random() < 0.08
            payload = rng.randbytes(rng.randint(EAGER_MAX + 200, 40_000) if big
                                    else rng.randint(0, 300))
            tally.rendezvous += big
            roll = rng.random()
            if roll < 0.15:  # a caller cancelled at a random moment
                task = asyncio.ensure_future(client.echo(payload))
                await asyncio.sleep(rng.uniform(0, 0.01))
                task.cancel()
                try:
                    await task
                    tally.cancelled_after_done += 1
                except asyncio.CancelledError:
                    tally.calls_cancelled += 1
            elif roll < 0.30:  # a bound too tight to meet, most of the time
                try:
                    got = await client.call("echo", payload, timeout=rng.uniform(0.0001, 0.01))
                    assert bytes(got) == payload
                    tally.timeouts_beaten += 1
                except OperationTimeout:
                    tally.timeouts += 1
            else:
                got = await client.call("echo", payload, timeout=STEP)
                assert bytes(got) == payload
                tally.calls_ok += 1
        if rng.random() < 0.1:  # abort under a call in flight: it fails typed
            task = asyncio.ensure_future(client.echo(rng.randbytes(rng.randint(0, 20_000))))
            await asyncio.sleep(rng.uniform(0, 0.005))
            client.abort()
            try:
                await asyncio.wait_for(task, STEP)
            except AiordmaError as exc:  # ClosedResourceError, or Broken if it lost a race
                tally.typed(exc)
            tally.aborted_mid_call += 1
    finally:
        if rng.random() < 0.5:
            await asyncio.wait_for(client.aclose(), STEP)
        else:
            client.abort()


async def _soak(port: int, *, target: int, wave: int, rpcs_max: int, seed: int) -> Tally:
    """Waves of ``wave`` client sessions until ``target`` endpoints were opened (or their
    connects cancelled)."""
    rng = random.Random(seed)
    tally = Tally()
    while tally.endpoints + tally.connects_cancelled < target:
        sessions = [_session(port, random.Random(rng.getrandbits(64)), tally, rpcs_max)
                    for _ in range(wave)]
        # Every call in a wave is bounded; a wave that does not end is a hang.
        await asyncio.wait_for(asyncio.gather(*sessions), STEP * 3)
        tally.waves += 1
    return tally


async def _tasks_settled(own: set[asyncio.Task[Any]]) -> None:
    """Wait (bounded) until only ``own`` tasks run; then assert it."""
    deadline = time.monotonic() + SETTLE
    while asyncio.all_tasks() - own and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = asyncio.all_tasks() - own
    assert not left, f"tasks left: {left}"


def _report(what: str, tally: Tally, seconds: float, seed: int) -> None:
    print(f"\n[soak] {what}: seed {seed}, scale {SCALE}, {seconds:.1f} s, {tally.waves} waves: "
          f"{tally.endpoints} endpoints opened and closed, {tally.connects_cancelled} connects "
          f"cancelled; RPCs: {tally.calls_ok} ok, {tally.calls_cancelled} cancelled "
          f"(+{tally.cancelled_after_done} done before the cancel), {tally.timeouts} timed out "
          f"(+{tally.timeouts_beaten} beat the bound), {tally.rendezvous} rendezvous payloads; "
          f"{tally.aborted_mid_call} aborts under a call ({tally.failed_typed})", flush=True)


def _the_mix_ran(tally: Tally, target: int) -> None:
    """Every kind of fault the soak mixes in happened (docs/faults.md's row lists them), and the
    count that bounds it was reached."""
    assert tally.endpoints + tally.connects_cancelled >= target
    missing = [what for what, n in [
        ("a call answered", tally.calls_ok), ("a cancelled connect", tally.connects_cancelled),
        ("a cancelled call", tally.calls_cancelled), ("a timed-out call", tally.timeouts),
        ("a rendezvous payload", tally.rendezvous), ("an abort under a call",
                                                     tally.aborted_mid_call)] if not n]
    assert not missing, f"the mix did not run: no {missing}"


def _seed() -> int:
    env = os.environ.get("AIORDMA_SOAK_SEED")
    return int(env) if env else random.SystemRandom().getrandbits(32)


@pytest.mark.parametrize("loop", LOOPS)
def test_soak_against_a_server_process(rdma_device: Any, unexpected: Any, loop: str) -> None:
    seed = _seed()
    target = int(320 * SCALE)
    # Waves of 40 set-ups at once: in a loaded VM some took longer than the server's default
    # 10 s set-up bound (its "TimeoutError" warnings, the client's "closed the connection
    # during set-up", 2026-11-26, load 5-8); the soak is about leaks, not set-up speed.
    handshake = f"{hang_guard(10.0):.0f}"
    with server_process("echo", "--loop", loop, "--handshake-timeout", handshake) as (port,
                                                                                       server):

        async def main() -> tuple[Tally, float]:
            own = {t for t in asyncio.all_tasks()}
            # Warm-up: the device and the device list are opened once per process.
            async with await rpc_connect("127.0.0.1", port, timeout=STEP) as c:
                assert await asyncio.wait_for(c.ping(), STEP) == "pong"
            await asyncio.sleep(0.5)
            baseline = await leaks.snapshot(os.getpid(), server)
            t0 = time.monotonic()
            tally = await _soak(port, target=target, wave=40, rpcs_max=6, seed=seed)
            took = time.monotonic() - t0
            after = await leaks.back(baseline, SETTLE)
            await _tasks_settled(own)
            print(f"\n[soak] before: {'; '.join(map(str, baseline))}\n[soak] after: "
                  f"{'; '.join(map(str, after))}", flush=True)
            async with await rpc_connect("127.0.0.1", port, timeout=STEP) as c:
                assert await asyncio.wait_for(c.ping(), STEP) == "pong"  # still serving
                print(f"\n[soak] server stats {await asyncio.wait_for(c.stats(), STEP)}",
                      flush=True)
            return tally, took

        tally, took = run_on(loop, main())
    _report(f"client endpoints ({loop}) against `aiordma serve echo --loop {loop}`", tally,
            took, seed)
    _the_mix_ran(tally, target)


@pytest.mark.parametrize("loop", LOOPS)
def test_soak_with_the_server_in_process(rdma_device: Any, unexpected: Any, loop: str) -> None:
    seed = _seed()
    target = int(150 * SCALE)

    async def main() -> tuple[Tally, float]:
        own = {t for t in asyncio.all_tasks()}
        async with await serve(Echo(), "127.0.0.1", 0) as server:
            async with await rpc_connect("127.0.0.1", server.port, timeout=STEP) as c:
                assert await asyncio.wait_for(c.ping(), STEP) == "pong"
            await asyncio.sleep(0.5)
            own |= asyncio.all_tasks()  # the server's accept machinery
            baseline = await leaks.snapshot(os.getpid())
            t0 = time.monotonic()
            tally = await _soak(server.port, target=target, wave=30, rpcs_max=4, seed=seed)
            took = time.monotonic() - t0
            # Both sides' endpoints, QPs, MRs and CQs count here: all must be back.
            after = await leaks.back(baseline, SETTLE)
            await _tasks_settled(own)
            print(f"\n[soak] before: {baseline[0]}\n[soak] after: {after[0]}", flush=True)
        return tally, took

    tally, took = run_on(loop, main())
    _report(f"client and server endpoints in one process ({loop})", tally, took, seed)
    _the_mix_ran(tally, target)
