"""``aiordma demo``: a key-value server and its clients over RDMA, with a mixed workload.

The server is ``aiordma serve kv`` in its own process; this process runs ``clients``
connections with ``tasks`` workers each. After loading ``keys`` keys it runs ``ops``
operations, each drawn from a mix of one-sided GETs (an RDMA READ of the server's table,
validated), GETs by RPC and PUTs by RPC, and prints operations per second and latency
percentiles per kind. Every value read is checked: values carry their key, a version and a
pattern derived from both, so a torn or misplaced value would be counted as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator

import uvloop

from aiordma.bench.process import announced

KINDS = ("one-sided GET", "RPC GET", "PUT")
STEP = 30.0  # bound on any one operation


def make_value(key: bytes, version: int, size: int) -> bytes:
    head = b"%s:%d:" % (key, version)
    pattern = hashlib.blake2b(head, digest_size=16).digest()
    body = (pattern * (size // 16 + 1))[:max(0, size - len(head))]
    return head + body


def value_ok(key: bytes, value: bytes) -> bool:
    try:
        k, version, _ = value.split(b":", 2)
        return k == key and value == make_value(key, int(version), len(value))
    except ValueError:
        return False


class Progress:
    """A one-line progress bar on a terminal; a line every 25 % otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.tty = sys.stdout.isatty()
        self._shown = -1
        self._t0 = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self.done += n
        pct = 100 * self.done // self.total
        step = 2 if self.tty else 25
        if pct // step != self._shown // step or self.done == self.total:
            self._shown = pct
            rate = self.done / max(1e-9, time.perf_counter() - self._t0)
            bar = "#" * (pct // 4) + "." * (25 - pct // 4)
            line = f"  {self.label:<8} [{bar}] {pct:3d}% {self.done}/{self.total} {rate:7.0f}/s"
            print("\r" + line if self.tty else line, end="" if self.tty else "\n", flush=True)
            if self.tty and self.done == self.total:
                print()


@contextlib.contextmanager
def kv_server(timeout: float = 60.0) -> Iterator[int]:
    """``aiordma serve kv`` in another process; its port."""
    cmd = [sys.executable, "-m", "aiordma", "serve", "kv", "--port", "0"]
    with announced(cmd, "serving kv on ", timeout=timeout) as line:
        yield int(line.split()[3].rsplit(":", 1)[1])


def _pct(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


async def workload(port: int, *, clients: int, tasks: int, keys: int, ops: int,
                   mix: tuple[float, float, float], seed: int) -> dict[str, object]:
    from aiordma.services import kv

    rng = random.Random(seed)
    names = [b"key-%06d" % i for i in range(keys)]
    sizes = {k: rng.randrange(16, 400) for k in names}
    versions = Counter[bytes]()
    conns = [await kv.connect("127.0.0.1", port, timeout=60) for _ in range(clients)]
    lat: dict[str, list[float]] = {k: [] for k in KINDS}
    errors = Counter[str]()
    try:
        load = Progress("load", keys)

        async def loader(c: kv.KvClient, part: list[bytes]) -> None:
            for k in part:
                await c.put(k, make_value(k, 0, sizes[k]), timeout=STEP)
                load.advance()

        await asyncio.gather(*(loader(c, names[i::clients]) for i, c in enumerate(conns)))
        bar = Progress("mixed", ops)
        plan = rng.choices(range(3), weights=mix, k=ops)
        targets = [rng.choice(names) for _ in range(ops)]
        cursor = iter(range(ops))

        async def worker(c: kv.KvClient) -> None:
            for i in cursor:  # shared: workers take the next operation
                kind, k = KINDS[plan[i]], targets[i]
                t0 = time.perf_counter()
                if kind == "PUT":
                    versions[k] += 1
                    await c.put(k, make_value(k, versions[k], sizes[k]), timeout=STEP)
                else:
                    got = await c.get(k, one_sided=kind == "one-sided GET", timeout=STEP)
                    if got is None or not value_ok(k, got):
                        errors[kind] += 1
                lat[kind].append(time.perf_counter() - t0)
                bar.advance()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns for _ in range(tasks)))
        elapsed = time.perf_counter() - t0
        paths: Counter[str] = Counter()
        for c in conns:
            paths.update(c.counters)
        server = await conns[0].stats()
    finally:
        for c in conns:
            await c.aclose()
    return {"lat": lat, "elapsed": elapsed, "errors": errors, "paths": paths, "server": server}


def run_kv_demo(*, clients: int = 4, tasks: int = 4, keys: int = 500, ops: int = 4000,
                loop: str = "uvloop", mix: tuple[float, float, float] = (0.5, 0.25, 0.25),
                seed: int = 1) -> int:
    from aiordma.lowlevel import list_devices

    from .devices import print_devices as _print_devices

    _print_devices(list_devices())
    print(f"\nkey-value store: `aiordma serve kv` in another process; {clients} client "
          f"connections x {tasks} tasks here ({loop}); {keys} keys of 16-399 B; {ops} "
          f"operations, {mix[0]:.0%} one-sided GET / {mix[1]:.0%} RPC GET / {mix[2]:.0%} PUT")
    runner = uvloop.run if loop == "uvloop" else asyncio.run
    with kv_server() as port:
        r = runner(workload(port, clients=clients, tasks=tasks, keys=keys, ops=ops, mix=mix,
                            seed=seed))
    lat: dict[str, list[float]] = r["lat"]  # type: ignore[assignment]
    elapsed: float = r["elapsed"]  # type: ignore[assignment]
    errors: Counter[str] = r["errors"]  # type: ignore[assignment]
    paths: Counter[str] = r["paths"]  # type: ignore[assignment]
    server: dict[str, int] = r["server"]  # type: ignore[assignment]
    total = sum(len(v) for v in lat.values())
    print(f"\n  {'operation':<14} {'count':>6} {'ops/s':>8} {'p50 us':>8} {'p90 us':>8} "
          f"{'p99 us':>8} {'bad':>4}")
    for kind in KINDS:
        v = sorted(lat[kind])
        if not v:
            continue
        print(f"  {kind:<14} {len(v):6d} {len(v) / elapsed:8.0f} {_pct(v, .5) * 1e6:8.0f} "
              f"{_pct(v, .9) * 1e6:8.0f} {_pct(v, .99) * 1e6:8.0f} {errors[kind]:4d}")
    print(f"  {'all':<14} {total:6d} {total / elapsed:8.0f}   ({elapsed:.2f} s, "
          f"{clients * tasks} operations in flight)")
    fallbacks = {k.removeprefix("fallback_"): n for k, n in paths.items()
                 if k.startswith("fallback_")}
    print(f"  one-sided GETs answered from the READ alone: {paths['one_sided_hit']}; sent to "
          f"RPC: {sum(fallbacks.values())} {fallbacks or ''}")
    print(f"  the server's CPU saw {server.get('get', 0)} GETs and {server.get('put', 0)} PUTs "
          f"(loading included); values failing validation: {sum(errors.values())}")
    return 1 if errors else 0
