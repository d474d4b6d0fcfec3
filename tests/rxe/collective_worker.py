"""One rank of a collectives group, driven by a test over stdin/stdout.

Started with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
or srun's (``SLURM_PROCID``, ``SLURM_NTASKS`` + ``MASTER_*``), it forms the group with
``Group.from_env()`` and prints ``READY <rank> <world>``. Then each stdin line is a JSON
command, answered with one line: ``OK <json>`` or ``ERR <json>``: the exception's ``type`` and
``message``, whether it is an ``aiordma.BrokenResourceError`` (``broken``) and whether the
group is broken now (``group_broken``).

Commands:
    ``{"cases": [...], "out": DIR}``: run the cases in order (see ``collective_cases``) and
        save this rank's results to ``DIR/rank<r>.npz`` (``c<i>`` or ``c<i>_<j>`` for lists).
    ``{"ops": [...], "out": DIR}``: the same for ``collective_ops``' cases (every operation,
        several in flight, subgroups), saved under their paths.
    ``{"window": case}``: run ``window_ops``' case (checked here); answers what it counted.
    ``{"barrier": SECONDS}``: rank 0 sleeps SECONDS first; answers enter/exit wall times.
    ``{"quick": N}``: N rounds of small calls as services/collectives/_quick.py takes them
        (an in-place allreduce, a broadcast into an array, an allgather (also of blocks of
        another size on every rank), a reduce-scatter and an alltoall into ``out=``, a
        barrier), beside a task that counts the event
        loop's turns; answers the wrong results, the engine's call count moved, how many
        calls took the general engine path, and the longest run of calls the other task did
        not run between.
    ``{"loop": N}``: allreduce N float32 elements over and over; prints ``STARTED`` after the
        first, and answers (with ERR) once one fails.
    ``{"exit": true}``: close the group and exit.

``--script`` instead runs a fixed check and exits 0 (for launcher tests).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse
import asyncio
import json
import os
import sys
import traceback
from typing import Any

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import aiordma
from aiordma.services.collectives import Group, Thresholds

try:
    import collective_ops
    import window_ops
    from collective_cases import dtype_of, make_input
except ImportError:  # imported as tests.rxe.collective_worker
    from . import collective_ops, window_ops
    from .collective_cases import dtype_of, make_input


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run_case(g: Group, case: dict[str, Any]) -> Any:
    kind = case["kind"]
    if kind == "barrier":
        await g.barrier()
        return np.zeros(0)
    arr = make_input(case, g.rank)
    if kind == "allreduce":
        flags = (arr.flags.c_contiguous, arr.flags.f_contiguous)
        out = await g.allreduce(arr, case["op"])
        assert out is arr, "allreduce must return its argument"
        assert (arr.flags.c_contiguous, arr.flags.f_contiguous) == flags
        return arr
    if kind == "broadcast":
        root = case["root"]
        if g.rank == root:
            out = await g.broadcast(arr, root=root)
            assert out is arr
            return out
        if case.get("fill"):
            target = np.zeros(arr.shape, dtype_of(case["dtype"]))
            out = await g.broadcast(target, root=root)
            assert out is target, "broadcast must fill the array it was given"
            return out
        return await g.broadcast(None, root=root)
    if kind == "allgather":
        return await g.allgather(arr)
    raise ValueError(kind)


async def quick_calls(g: Group, n: int) -> dict[str, Any]:
    """The ``quick`` command (see the module)."""
    general = 0
    run_engine = g._run_engine

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal general
        general += 1
        return run_engine(*args, **kwargs)

    ticks, stop = 0, False

    async def other() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    w, r = g.world_size, g.rank
    m = 4 * w  # (a block of 4 per rank)
    base = np.arange(m, dtype=np.float32)
    x = base + 100 * r
    arr, got, work = np.empty(m, np.float32), np.empty(m, np.float32), np.empty(m, np.float32)
    block, rows = np.empty(4, np.float32), np.empty((w, m), np.float32)
    want = {"allreduce": np.full(m, w * (w + 1) / 2, np.float32),
            "broadcast": base,
            "allgather": np.concatenate([base + 100 * q for q in range(w)]),
            "allgather_out": np.concatenate([base + 100 * q for q in range(w)]),
            "reduce_scatter": w * base[4 * r:4 * r + 4] + 100 * sum(range(w)),
            "alltoall": np.concatenate([base[4 * r:4 * r + 4] + 100 * q for q in range(w)]),
            # (every rank a block of its own size: the quick end leaves the call open, and
            # the general end parses the blocks: _core.GroupCore._engine_rest)
            "allgather_mixed": np.concatenate([np.arange(q + 1, dtype=np.float32) + 100 * q
                                               for q in range(w)])}
    mixed = np.arange(r + 1, dtype=np.float32) + 100 * r

    async def call(kind: str) -> Any:
        if kind == "allreduce":
            arr.fill(r + 1)
            return await g.allreduce(arr)
        if kind == "broadcast":
            return await g.broadcast(x if r == 0 else got, root=0)
        if kind == "allgather":
            return np.concatenate(await g.allgather(x))
        if kind == "allgather_out":
            rows.fill(-1)
            filled = await g.allgather(x, out=rows)
            return filled.ravel() if filled is rows else None
        if kind == "allgather_mixed":
            return np.concatenate(await g.allgather(mixed))
        if kind == "reduce_scatter":
            return await g.reduce_scatter(x, out=block)
        if kind == "alltoall":
            return await g.alltoall(x, out=work)
        return await g.barrier()

    await g.allreduce(arr)  # (the engine forms)
    # (barriers first so that some mixed allgathers, the 7th kind, fall on the calls that
    # give the event loop a turn: number + 1 a multiple of 32, _quick.UNYIELDED)
    for _ in range(-(g._order.started + 7) % 8):
        await g.barrier()
    engine = g._engine.engine
    before = engine.runner.calls
    g._run_engine = counted  # type: ignore[method-assign]
    ticker = asyncio.ensure_future(other())
    wrong, longest, run, seen = [], 0, 0, ticks
    kinds = [*want, "barrier"]
    try:
        for i in range(n * len(kinds)):
            kind = kinds[i % len(kinds)]
            result = await call(kind)
            if kind in want and not np.array_equal(result, want[kind]):
                wrong.append(f"{kind}: {result} != {want[kind]}")
            run = 0 if ticks != seen else run + 1
            seen = ticks
            longest = max(longest, run)
    finally:
        stop = True
        await ticker
        del g._run_engine
    return {"wrong": wrong[:5], "engine_calls": engine.runner.calls - before,
            "calls": n * len(kinds), "general": general, "longest": longest}


async def serve(g: Group) -> None:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        cmd = json.loads(line)
        try:
            if "exit" in cmd:
                await g.aclose()
                say("OK {}")
                return
            if "barrier" in cmd:
                if g.rank == 0:
                    await asyncio.sleep(cmd["barrier"])
                enter = time.time()
                await g.barrier()
                say("OK " + json.dumps({"enter": enter, "exit": time.time()}))
                continue
            if "quick" in cmd:
                say("OK " + json.dumps(await quick_calls(g, cmd["quick"])))
                continue
            if "loop" in cmd:
                arr = np.ones(cmd["loop"], np.float32)
                n = 0
                while True:
                    await g.allreduce(arr)
                    n += 1
                    if n == 1:
                        say("STARTED")
            if "window" in cmd:  # window_ops' case (test_collectives_window.py)
                say("OK " + json.dumps(await window_ops.run(g, cmd["window"])))
                continue
            if "ops" in cmd:  # collective_ops' cases (test_collectives_set.py)
                got: dict[str, Any] = {}
                for i, case in enumerate(cmd["ops"]):
                    got.update(await collective_ops.run(g, case, str(i)))
                np.savez(os.path.join(cmd["out"], f"rank{g.rank}.npz"), **got)
                say("OK {}")
                continue
            results = {}
            t0 = time.perf_counter()
            for i, case in enumerate(cmd["cases"]):
                out = await run_case(g, case)
                if isinstance(out, list):
                    results.update({f"c{i}_{j}": a for j, a in enumerate(out)})
                else:
                    results[f"c{i}"] = out
            elapsed = time.perf_counter() - t0
            np.savez(os.path.join(cmd["out"], f"rank{g.rank}.npz"), **results)
            say("OK " + json.dumps({"seconds": elapsed}))
        except Exception as exc:  # noqa: BLE001  (every failure is the test's answer)
            say("ERR " + json.dumps({
                "type": type(exc).__name__, "message": str(exc)[:500],
                "broken": isinstance(exc, aiordma.BrokenResourceError),
                "group_broken": g.broken}))
            traceback.print_exc()
            if g.broken:
                return


async def script_check() -> None:
    """A fixed sequence with self-checks (run by the launcher test)."""
    import faulthandler

    # Hang guards, not speed limits: on a host loaded to ~9 runnable tasks per 2 cores, four
    # ranks starting under mpirun took longer than 60 s to form, and a link's set-up step longer
    # than the default 10 s handshake_timeout (the test failed so, 2026-11-25). The launcher
    # test allows the whole run 240 s.
    faulthandler.dump_traceback_later(200, exit=True)  # a hang shows where it is, then fails
    async with await Group.from_env(timeout=150,
                                    config=aiordma.Config(handshake_timeout=60)) as g:
        n = g.world_size
        await g.barrier()
        arr = np.arange(10, dtype=np.int64) * (g.rank + 1)
        await g.allreduce(arr)
        np.testing.assert_array_equal(arr, np.arange(10) * (n * (n + 1) // 2))
        parts = await g.allgather(np.array([g.rank]))
        assert [int(p[0]) for p in parts] == list(range(n))
        got = await g.broadcast(np.array([42.5]) if g.rank == n - 1 else None, root=n - 1)
        assert float(got[0]) == 42.5
        say(f"CHECKED {g.rank} {n}")


async def main(a: argparse.Namespace) -> None:
    if a.script:
        await script_check()
        return
    rank_var = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    idx = int(rank_var)
    slot_bytes = [int(x) for x in a.slot_bytes.split(",")]
    slots = [int(x) for x in a.slots.split(",")]
    t_imported = time.perf_counter()
    g = await Group.from_env(timeout=a.timeout, device=a.device,
                             slot_bytes=slot_bytes[idx % len(slot_bytes)],
                             slots=slots[idx % len(slots)],
                             thresholds=Thresholds(**json.loads(a.thresholds)),
                             transport=a.transport)
    t_formed = time.perf_counter()
    print(f"rank {g.rank}: imports {t_imported - T_START:.1f} s, formation "
          f"{t_formed - t_imported:.1f} s", file=sys.stderr, flush=True)
    say(f"READY {g.rank} {g.world_size}")
    try:
        await serve(g)
    finally:
        g.abort()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--device", default=None)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--slot-bytes", default="262144")
    p.add_argument("--slots", default="4")
    p.add_argument("--thresholds", default="{}", help="JSON: Thresholds' fields")
    p.add_argument("--transport", choices=["auto", "rdma", "tcp"], default="auto")
    p.add_argument("--script", action="store_true")
    args = p.parse_args()
    (uvloop.run if args.loop == "uvloop" else asyncio.run)(main(args))
