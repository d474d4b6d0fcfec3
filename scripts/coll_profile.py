"""Time then profile N allreduces of SIZE bytes (float32) per rank; rank r writes
OUT/prof-<size>-<world>-<r>.txt. Wake-ups and completions from the loop's shared reactors."""
import asyncio, cProfile, io, os, pstats, sys, time
import numpy as np


def counters() -> tuple[int, int]:
    try:
        from aiordma._reactor import reactor as R
    except ImportError:
        return 0, 0
    rs = [r for d in R._shared.get(asyncio.get_running_loop(), {}).values() for r in d]
    return sum(r.wakeups for r in rs), sum(r.completions for r in rs)


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
        for _ in range(n):
            a.fill(1)
            t0 = time.perf_counter()
            await g.allreduce(a)
            times.append(time.perf_counter() - t0)
            assert a[0] == g.world_size
        w1, c1 = counters()
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
              f"per call {(w1 - w0) / n:.2f} wake-ups, {(c1 - c0) / n:.2f} completions",
              file=s)
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        with open(os.path.join(out, f"prof-{nbytes}-{g.world_size}-{g.rank}.txt"), "w") as f:
            f.write(s.getvalue())

if __name__ == "__main__":
    import uvloop
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
