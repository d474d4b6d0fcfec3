"""Where one allreduce's time goes, per rank: ``python -m aiordma.services.collectives.launch
-n N -- python scripts/coll_profile.py BYTES CALLS OUTDIR`` (in the VM: under
``python -m harness run``). Each rank times CALLS in-place float32 allreduces of BYTES after 5
warm-up ones (median, min, max; the process's CPU time per call, which a loaded host inflates
less than the wall time; and the wake-ups and work completions per call from the loop's
shared completion reactors), then CALLS more counting the links' posts (``Endpoint.send`` and
``post_write`` calls, those with a ``notify`` message and those with ``imm``: the work
requests the links post per call, a notice being a SEND of its own; the protocol's own
CREDIT frames are not counted), then CALLS more under cProfile, and writes all to
``OUTDIR/prof-<bytes>-<world>-<rank>.txt`` (by internal time, then cumulative). It uses only
the public API, so one copy serves several checkouts (``scripts/coll_ab.py`` runs this one)."""

from __future__ import annotations

import asyncio
import contextvars
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np


def counters() -> tuple[int, int]:
    """(wake-ups, completions) of this loop's shared reactors so far."""
    from aiordma._reactor import reactor

    loop = asyncio.get_running_loop()
    rs = [r for per in reactor._shared.get(loop, {}).values() for r in per]
    return sum(r.wakeups for r in rs), sum(r.completions for r in rs)


async def count_posts(g: object, a: np.ndarray, n: int) -> dict[str, float]:
    """Per call: the links' ``send`` and ``post_write`` calls, by kind (patched for this)."""
    from aiordma import Endpoint

    counts = {"send": 0, "write": 0, "notify": 0, "imm": 0}
    send, post_write = Endpoint.send, Endpoint.post_write
    in_write = contextvars.ContextVar("in_write", default=False)  # (its notice: not a send)

    async def counted_send(self: Endpoint, data: object) -> None:
        counts["send"] += not in_write.get()
        await send(self, data)

    async def counted_write(self: Endpoint, src: object, dst: object, **kw: object) -> object:
        counts["write"] += 1
        counts["notify"] += kw.get("notify") is not None
        counts["imm"] += kw.get("imm") is not None
        token = in_write.set(True)
        try:
            return await post_write(self, src, dst, **kw)  # type: ignore[arg-type]
        finally:
            in_write.reset(token)

    Endpoint.send, Endpoint.post_write = counted_send, counted_write  # type: ignore[method-assign]
    try:
        for _ in range(n):
            a.fill(1)
            await g.allreduce(a)  # type: ignore[attr-defined]
    finally:
        Endpoint.send, Endpoint.post_write = send, post_write  # type: ignore[method-assign]
    return {k: v / n for k, v in counts.items()}


async def main(nbytes: int, n: int, out: str) -> None:
    from aiordma.services.collectives import Group

    async with await Group.from_env(timeout=120) as g:
        a = np.ones(nbytes // 4, np.float32)
        for _ in range(5):
            a.fill(1)
            await g.allreduce(a)
        times = []
        await g.barrier()
        w0, c0 = counters()
        cpu0 = time.process_time()
        for _ in range(n):
            a.fill(1)
            t0 = time.perf_counter()
            await g.allreduce(a)
            times.append(time.perf_counter() - t0)
            if a[0] != g.world_size:
                raise ValueError(f"allreduce gave {a[0]}, not {g.world_size}")
        cpu = (time.process_time() - cpu0) / n
        w1, c1 = counters()
        await g.barrier()
        posts = await count_posts(g, a, n)
        await g.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            a.fill(1)
            await g.allreduce(a)
        prof.disable()
        await g.barrier()
        s = io.StringIO()
        times.sort()
        print(f"rank {g.rank}/{g.world_size}: {n} allreduces of {nbytes} B: median "
              f"{times[n // 2] * 1e3:.3f} ms [{times[0] * 1e3:.3f}..{times[-1] * 1e3:.3f}]; "
              f"per call {cpu * 1e3:.3f} ms CPU, {(w1 - w0) / n:.2f} wake-ups, {(c1 - c0) / n:.2f} completions; "
              f"links' posts per call: {posts['send']:.2f} send, {posts['write']:.2f} post_write "
              f"({posts['notify']:.2f} with notify, {posts['imm']:.2f} with imm): "
              f"{posts['send'] + posts['write'] + posts['notify']:.2f} work requests",
              file=s)
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        Path(out, f"prof-{nbytes}-{g.world_size}-{g.rank}.txt").write_text(s.getvalue())


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
