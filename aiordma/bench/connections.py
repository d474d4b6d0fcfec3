"""Area (s): many connections to one server in another process (issue 37, item 4).

For each count N of the plan (``conn_counts``), this process opens N endpoints to one server
process (``python -m aiordma.bench.connections --serve``, a fresh one per count and loop),
after one warm-up connection (the first opens the device in this process), at most
``conn_in_flight`` set-ups at a time, then sends one 64 B message on every endpoint at once
and waits for every echo, then closes them all. It records, per N:

* ``setups_per_s``: N over the time from the first ``connect()`` to the last one's return;
* ``setup_server_cpu_ms`` and ``setup_client_cpu_ms``: the CPU time (user + system) the
  server process and this one spent meanwhile, per connection (``/proc/<pid>/stat``,
  ``os.times()``): what a set-up costs each side, which a busy host stretches less than the
  rate;
* ``rss_kib_per_conn`` and ``pin_kib_per_conn``: the server process's growth of ``VmRSS``
  and ``VmPin`` (memory the kernel pinned for its regions) from before the first connection
  to after the echoes, over N (``/proc/<pid>/status``); ``rss_mib``: that RSS growth in all;
  on pools, ``pin_beyond_pool_kib_per_conn``: the pinned growth less the server's pool's
  slots (which the growth includes: see the row of one connection), over N;
* ``server_qps`` and ``server_mrs``: the kernel's count of the server process's queue pairs
  and memory regions with the N connections open (``rdma -j resource show qp|mr``, by pid),
  ``mrs_per_conn`` the latter over N, and ``left_after_close``: how many of those were
  still held by the server 10 s after the last close beyond its count before the first
  connection (0 when everything was released);
* ``echo_ms``: from sending the first 64 B message to the last echo's return;
* ``echo_server_cpu_us`` and ``echo_client_cpu_us``: the CPU time (user + system) the server
  process and this one spent meanwhile, per echo (``/proc/<pid>/stat``, ``os.times()``):
  unlike ``echo_ms``, not stretched by other work on the machine; ``echo_packets``: the
  packets the machine's RDMA ports sent meanwhile (rxe's ``sent_pkts``), per echo.

The kernel's counts need the ``rdma`` command and the right to list (root in the VM); where
they cannot be read the row leaves them out and says so in its ``how``.

* ``rtt_p50_us`` and ``echo_rate_per_s`` (with ``rounds``): with all N open, ``rounds`` 64 B
  round trips one after another on the first connection (their median), then as many
  echoes pipelined on it (:func:`per_op`): what one operation costs beside N - 1 idle
  connections, against the row of N = 1.

The area's rows: the counts of ``conn_counts`` with the default ``Config``, and those of
``conn_pool_counts`` with both ends on receive pools of :data:`POOL_BUFFERS` slots (the
clients' too) and a patient keepalive (:data:`PATIENT`, as 1,000 connections in one VM need).
Above :data:`LISTED` connections the kernel's counts come from its summary of every
process's objects, less the client's own (:func:`own_objects`).

``python -m aiordma.bench.connections -n 32,128,256`` runs the same measurement on its own
and prints one line per N; with ``--pool BUFFERS`` both ends take their receives from shared
receive pools of that many slots (``Config(receive_pool=True, client_pool=True)``), and its line
adds the server's kernel count of shared receive queues; ``--rounds K`` adds the figures on
one connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import uvloop

from .process import announced_process

if TYPE_CHECKING:
    import aiordma

    from .measure import Results
    from .plan import Plan

__all__ = ["ConnectionFigures", "connection_rows", "kernel_objects", "measure_connections",
           "open_files", "row_key", "run_connection_rows", "server_process"]

SERVING = "SERVING"
ECHO = b"\x5a" * 64
LIST_BOUND = 180.0  # seconds for one `rdma resource show` (thousands of objects in the VM)
SETTLE = 10.0  # seconds the server is given to release a closed connection's objects
LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}
LISTED = 512  # above this, the kernel's objects are counted from its summary, not listed
POOL_BUFFERS = 4096  # area (s)'s rows on the pool: each end's pool (1,365 connections)
PATIENT = 10  # those rows' keepalive: 10 s idle, then 10 probes 1 s apart (as 1,000 need)


# -- the server ----------------------------------------------------------------------------

async def _echo(ep: Any) -> None:
    while (msg := await ep.recv()) is not None:
        await ep.send(msg)


def open_files(wanted: int) -> int:
    """Raise this process's limit of open files towards ``wanted`` (up to the hard limit:
    each connection holds its TCP control socket) and return the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


async def _serve(pool: int = 0, send_slots: int = 0, keepalive: int = 0,
                 stock: int = 0) -> None:
    import aiordma

    open_files(8192)
    kw: dict[str, Any] = {"receive_pool": True, "pool_buffers": pool} if pool else {}
    if send_slots:
        kw["send_slots"] = send_slots
    if stock:
        kw["setup_stock"] = stock
    if keepalive:  # (as patient() in aiordma.bench.peer: idle S s, then S probes 1 s apart)
        kw |= {"keepalive_idle": keepalive, "keepalive_interval": 1,
               "keepalive_probes": keepalive}
    config = aiordma.Config(**kw) if kw else None
    async with await aiordma.listen(_echo, "127.0.0.1", 0, transport="rdma",
                                    backlog=1024, config=config) as listener:
        while listener.stock is not None and len(listener.stock) < stock:
            await asyncio.sleep(0.05)  # (its stock made before the first client)
        print(f"{SERVING} {listener.port}", flush=True)
        await asyncio.Event().wait()  # until terminated


@contextlib.contextmanager
def server_process(loop: str, pool: int = 0, send_slots: int = 0,
                   keepalive: int = 0, stock: int = 0) -> Iterator[tuple[int, int]]:
    """A server process on ``loop`` (its receives from a pool of ``pool`` slots if not 0; its
    endpoints with ``send_slots`` send slots and a keepalive of ``keepalive`` s idle and as
    many probes, if not 0; ``stock`` connections' resources made ahead, made before it
    announces itself): yields its port and pid; terminated on exit."""
    cmd = [sys.executable, "-m", "aiordma.bench.connections", "--serve", "--loop", loop,
           "--pool", str(pool), "--send-slots", str(send_slots), "--keepalive", str(keepalive),
           "--stock", str(stock)]
    with announced_process(cmd, SERVING, timeout=120.0) as (line, proc):
        yield int(line.split()[1]), proc.pid


# -- what the server holds -----------------------------------------------------------------

def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _cpu_s(pid: int) -> float:
    """The user + system CPU time of ``pid`` so far (``/proc/<pid>/stat``), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _packets_sent() -> int | None:
    """Packets every RDMA port of this machine sent so far (rxe's ``sent_pkts`` counter: both
    ends of every connection here, acknowledgements included), or None where not counted."""
    total, found = 0, False
    for path in glob.glob("/sys/class/infiniband/*/ports/*/hw_counters/sent_pkts"):
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            total += int(f.read())
            found = True
    return total if found else None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _rdma_listing(*args: str) -> list[Any] | None:
    """``rdma -j resource show [args]``'s JSON list, or None where it cannot be read (no
    ``rdma`` command, no right, a failure, not a list)."""
    rdma = shutil.which("rdma") or next(
        (p for p in ("/usr/sbin/rdma", "/sbin/rdma") if os.path.exists(p)), None)
    if rdma is None:
        return None
    try:
        done = subprocess.run([rdma, "-j", "resource", "show", *args], capture_output=True,
                              text=True, timeout=LIST_BOUND, check=False)
        rows = json.loads(done.stdout or "[]") if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        rows = None
    return rows if isinstance(rows, list) else None


def kernel_objects(pid: int) -> dict[str, int] | None:
    """The kernel's count of ``pid``'s queue pairs and memory regions (``rdma -j resource
    show``), or None where they cannot be listed (no ``rdma`` command, no right)."""
    out = {}
    for kind in ("qp", "mr", "srq"):
        entries = _rdma_listing(kind)
        if entries is None:
            return None
        out[kind] = sum(1 for e in entries if isinstance(e, dict) and e.get("pid") == pid)
    return out


def kernel_totals() -> dict[str, int] | None:
    """The kernel's count of queue pairs, memory regions and shared receive queues on every
    device, every process's (``rdma -j resource show``: its summary, no list of the objects,
    which took minutes with thousands of them in the VM), or None where it cannot be read."""
    rows = _rdma_listing()
    if rows is None:
        return None
    return {k: sum(int(r.get(k, 0)) for r in rows if isinstance(r, dict))
            for k in ("qp", "mr", "srq")}


def own_objects(eps: list[aiordma.Endpoint]) -> dict[str, int]:
    """The kernel objects these endpoints (all of this process's) hold, by their own account:
    a queue pair each; a memory region each for its own slots, or, on its loop's receive
    pool, one per chunk of the pool's send arena and one per pool with its shared receive
    queue."""
    pools = {id(ep._pool) for ep in eps if ep._pool is not None}
    return {"qp": len(eps), "mr": len({id(ep._slots) for ep in eps}) + len(pools),
            "srq": len(pools)}


async def per_op(ep: aiordma.Endpoint, rounds: int) -> tuple[float, float]:
    """``rounds`` 64 B round trips one after another on ``ep`` (to an echoing peer), then as
    many pipelined (every send issued at once, the echoes read meanwhile): the round trip's
    median in microseconds, and the pipelined echoes per second."""
    lat = []
    for _ in range(rounds):
        t = time.perf_counter()
        await ep.send(ECHO)
        if await ep.recv() != ECHO:
            raise RuntimeError("the echo came back different")
        lat.append(time.perf_counter() - t)
    lat.sort()

    async def receive() -> None:
        for _ in range(rounds):
            if await ep.recv() != ECHO:
                raise RuntimeError("the echo came back different")

    t = time.perf_counter()
    reading = asyncio.ensure_future(receive())
    await asyncio.gather(*(ep.send(ECHO) for _ in range(rounds)))
    await reading
    return lat[len(lat) // 2] * 1e6, rounds / (time.perf_counter() - t)


# -- the client ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ConnectionFigures:
    """One measurement of N connections (see the module documentation)."""

    n: int
    setup_s: float
    rss_kib: int  # the server's growth
    pin_kib: int
    echo_s: float
    objects: dict[str, int] | None  # the server's, N open
    left: int | None  # the server's objects beyond its baseline after the close
    server_cpu_s: float | None = None  # the server's CPU time during the echoes
    client_cpu_s: float | None = None  # this process's
    packets: int | None = None  # the RDMA packets sent meanwhile (both ends)
    setup_server_cpu_s: float | None = None  # the server's CPU time during the set-ups
    setup_client_cpu_s: float | None = None  # this process's
    rtt_us: float | None = None  # per_op() on the first connection, all N open
    rate: float | None = None
    pool_kib: float = 0.0  # the server's pool's slots (0: no pool)

    def values(self) -> dict[str, float]:
        v = {"setups_per_s": self.n / self.setup_s, "rss_kib_per_conn": self.rss_kib / self.n,
             "pin_kib_per_conn": self.pin_kib / self.n, "echo_ms": self.echo_s * 1e3,
             "rss_mib": self.rss_kib / 1024}
        if self.pool_kib:
            v["pin_beyond_pool_kib_per_conn"] = (self.pin_kib - self.pool_kib) / self.n
        if self.server_cpu_s is not None and self.client_cpu_s is not None:
            v |= {"echo_server_cpu_us": self.server_cpu_s / self.n * 1e6,
                  "echo_client_cpu_us": self.client_cpu_s / self.n * 1e6}
        if self.setup_server_cpu_s is not None and self.setup_client_cpu_s is not None:
            v |= {"setup_server_cpu_ms": self.setup_server_cpu_s / self.n * 1e3,
                  "setup_client_cpu_ms": self.setup_client_cpu_s / self.n * 1e3}
        if self.packets is not None:
            v["echo_packets"] = self.packets / self.n
        if self.rtt_us is not None and self.rate is not None:
            v |= {"rtt_p50_us": self.rtt_us, "echo_rate_per_s": self.rate}
        if self.objects is not None and self.left is not None:
            v |= {"server_qps": self.objects["qp"], "server_mrs": self.objects["mr"],
                  "mrs_per_conn": self.objects["mr"] / self.n, "left_after_close": self.left}
        return v


async def measure_connections(port: int, pid: int, n: int, *, in_flight: int = 16,
                              config: aiordma.Config | None = None,
                              timeout: float = 60.0, pause: float = 0.0,
                              rounds: int = 0) -> ConnectionFigures:
    """Open ``n`` endpoints to the server at ``port`` (process ``pid``), echo 64 B on each,
    then, if ``rounds``, :func:`per_op` on the first with all ``n`` open; close them; every
    wait bounded (``timeout`` per set-up and for the echoes). ``pause``: seconds left to the
    server between the warm-up connection and the burst (a server with a stock makes it up
    again then). Above :data:`LISTED` connections the kernel's objects are counted from its
    summary of every process's, less this process's own (:func:`own_objects`).

    Raises:
        AiordmaError: a set-up or an echo failed (every endpoint opened is closed first).
    """
    import aiordma

    open_files(n + 256)
    # Warm-up: the process's first connection opens the device (pyverbs' import and the
    # device's opening: seconds in the VM), which is no connection's set-up.
    await (await aiordma.connect("127.0.0.1", port, transport="rdma", config=config,
                                 timeout=timeout)).aclose()
    await asyncio.sleep(pause)
    listed = n <= LISTED
    base = kernel_objects(pid) if listed else kernel_totals()
    rss0, pin0 = _status_kib(pid, "VmRSS"), _status_kib(pid, "VmPin")
    gate = asyncio.Semaphore(in_flight)
    eps: list[aiordma.Endpoint] = []

    async def one() -> None:
        async with gate:
            eps.append(await aiordma.connect("127.0.0.1", port, transport="rdma",
                                             config=config, timeout=timeout))

    try:
        scpu0, ccpu0, t0 = _cpu_s(pid), _own_cpu_s(), time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for _ in range(n):
                tg.create_task(one())
        setup = time.perf_counter() - t0
        setup_cpu = _cpu_s(pid) - scpu0, _own_cpu_s() - ccpu0

        async def echo(ep: aiordma.Endpoint) -> None:
            await ep.send(ECHO)
            if await ep.recv() != ECHO:
                raise aiordma.AiordmaError("the echo came back different")

        pkts0 = _packets_sent()
        cpu0, own0, t0 = _cpu_s(pid), _own_cpu_s(), time.perf_counter()
        async with asyncio.timeout(timeout), asyncio.TaskGroup() as tg:
            for ep in eps:
                tg.create_task(echo(ep))
        echo_s = time.perf_counter() - t0
        server_cpu, client_cpu = _cpu_s(pid) - cpu0, _own_cpu_s() - own0
        pkts1 = _packets_sent()
        packets = pkts1 - pkts0 if pkts0 is not None and pkts1 is not None else None
        rss, pin = _status_kib(pid, "VmRSS") - rss0, _status_kib(pid, "VmPin") - pin0
        if listed:
            held = kernel_objects(pid)
        else:
            totals, mine = kernel_totals(), own_objects(eps)
            held = (None if totals is None or base is None else
                    {k: totals[k] - base[k] - mine[k] for k in totals})
        rtt = rate = None
        if rounds:
            async with asyncio.timeout(timeout):
                rtt, rate = await per_op(eps[0], rounds)
    finally:
        await asyncio.gather(*(ep.aclose() for ep in eps), return_exceptions=True)
    left = None
    if base is not None:  # (unlisted: both processes' objects back to the count before)
        deadline = time.monotonic() + SETTLE
        while True:
            now = (kernel_objects(pid) if listed else kernel_totals()) or base
            left = sum(max(0, now[k] - base[k]) for k in base)
            if left == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    return ConnectionFigures(n=n, setup_s=setup, rss_kib=rss, pin_kib=pin, echo_s=echo_s,
                             objects=held, left=left, server_cpu_s=server_cpu,
                             client_cpu_s=client_cpu, packets=packets,
                             setup_server_cpu_s=setup_cpu[0], setup_client_cpu_s=setup_cpu[1],
                             rtt_us=rtt, rate=rate)


# -- as an area of ``aiordma bench`` --------------------------------------------------------

def row_key(n: int, pool: bool, loop: str) -> str:
    """The key of area (s)'s row of ``n`` connections (``pool``: both ends on pools)."""
    return f"s.{'pool.' if pool else ''}conns{n}.aiordma.{loop}"


def connection_rows(plan: Plan) -> list[tuple[int, bool]]:
    """Area (s)'s rows in ``plan``: ``(n, pool)`` each."""
    return [(n, False) for n in plan.conn_counts] + [(n, True) for n in plan.conn_pool_counts]


def run_connection_rows(plan: Plan, *, loops: list[str], results: Results) -> None:
    """One repeat of area (s): each count of ``plan.conn_counts`` on each loop, against a
    server process of that loop (a failed row is recorded, and the run goes on)."""
    from .hostload import host_load
    from .measure import failure

    for loop in loops:
        for n, pool in connection_rows(plan):
            key = row_key(n, pool, loop)
            meta = _meta(n, loop, plan, pool)
            load = (host_load() or os.getloadavg())[0]
            try:
                figs = _measured(loop, n, plan.conn_in_flight, plan.row_timeout,
                                 pool=POOL_BUFFERS if pool else 0,
                                 keepalive=PATIENT if pool else 0, rounds=plan.conn_rounds)
            except Exception as exc:  # noqa: BLE001  # reported; the run goes on
                results.fail(key, failure(exc), load=load, **meta)
                print(f"  [s] aiordma {loop}{' pool' if pool else ''}, {n} connections: "
                      f"FAILED ({failure(exc)})", flush=True)
                continue
            if figs.objects is None:
                meta["how"] += "; the kernel's counts could not be read here"
            results.record(key, figs.values(), load=load, **meta)
            print(f"  [s] aiordma {loop}{' pool' if pool else ''}: {describe(figs)}",
                  flush=True)


def _measured(loop: str, n: int, in_flight: int, bound: float,
              pool: int = 0, client_slots: int = 0, stock: int = 0, keepalive: int = 0,
              rounds: int = 0) -> ConnectionFigures:
    """``n`` connections on ``loop`` to a server process of its own (a fresh one per count:
    its RSS growth is then not memory an earlier count freed and this one reused); with
    ``pool``, both ends on receive pools of that many slots (the clients' too); the
    clients' endpoints with ``client_slots`` data and send slots each if not 0 (so that many
    connections fit one machine's memory: the server's are the ``Config``'s defaults); the
    server with a stock of ``stock`` (``Config.setup_stock``), made before its first client
    and again in a 1 s pause after the warm-up connection, if not 0; both ends with a
    keepalive of ``keepalive`` s idle and as many probes 1 s apart if not 0; ``rounds``:
    :func:`per_op` on the first connection with all open."""
    async def bounded() -> ConnectionFigures:
        import aiordma

        kw: dict[str, Any] = ({"data_slots": client_slots, "send_slots": client_slots,
                               "ctrl_slots": 4} if client_slots else {})
        if pool:
            kw |= {"receive_pool": True, "client_pool": True, "pool_buffers": pool}
        if keepalive:
            kw |= {"keepalive_idle": keepalive, "keepalive_interval": 1,
                   "keepalive_probes": keepalive}
        config = aiordma.Config(**kw) if kw else None
        async with asyncio.timeout(bound):
            figs = await measure_connections(port, pid, n, in_flight=in_flight, config=config,
                                             pause=1.0 if stock else 0.0, rounds=rounds)
        # (the server's pool: pool slots of its Config's default size, see _serve)
        return replace(figs, pool_kib=pool * aiordma.Config().slot_size / 1024)

    with server_process(loop, pool, keepalive=keepalive, stock=stock) as (port, pid):
        return LOOPS[loop](bounded())


def _meta(n: int, loop: str, plan: Plan, pool: bool = False) -> dict[str, Any]:
    how = (f"{plan.conn_in_flight} set-ups in flight, one 64 B echo on each, then "
           f"{plan.conn_rounds} round trips and {plan.conn_rounds} pipelined echoes on one "
           f"with all open; the server's RSS/pinned growth, its kernel objects")
    if pool:
        how = (f"both ends on receive pools of {POOL_BUFFERS} slots, keepalive {PATIENT} s "
               f"idle and {PATIENT} probes; " + how)
    return {"area": "s", "what": f"{n} connections to one server{' (pool)' if pool else ''}",
            "system": "aiordma", "loop": loop, "how": how}


def describe(f: ConnectionFigures) -> str:
    """One line of figures."""
    v = f.values()
    srqs = (f", {f.objects['srq']} SRQs" if f.objects is not None and f.objects.get("srq")
            else "")
    kernel = (f"; server holds {f.objects['qp']} QPs, {f.objects['mr']} MRs{srqs}; "
              f"{f.left} left after close" if f.objects is not None else
              "; kernel counts unavailable")
    cpu = (f" (CPU per echo: server {v['echo_server_cpu_us']:.0f} us, client "
           f"{v['echo_client_cpu_us']:.0f} us" + (f", {v['echo_packets']:.1f} packets"
                                                   if "echo_packets" in v else "") + ")"
           if "echo_server_cpu_us" in v else "")
    setup_cpu = (f" (CPU per set-up: server {v['setup_server_cpu_ms']:.1f} ms, client "
                 f"{v['setup_client_cpu_ms']:.1f} ms)" if "setup_server_cpu_ms" in v else "")
    one = (f"; on one of them: round trip p50 {v['rtt_p50_us']:.0f} us, "
           f"{v['echo_rate_per_s']:.0f} pipelined echoes/s" if "rtt_p50_us" in v else "")
    return (f"{f.n} connections: set-up {f.setup_s:.2f} s ({v['setups_per_s']:.1f}/s)"
            f"{setup_cpu}; "
            f"server RSS +{v['rss_kib_per_conn']:.0f} KiB/conn, pinned "
            f"+{v['pin_kib_per_conn']:.0f} KiB/conn; one echo on each {f.echo_s * 1e3:.0f} ms"
            + cpu + one + kernel)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.bench.connections",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--serve", action="store_true", help="be the server (prints its port)")
    p.add_argument("--loop", choices=list(LOOPS), default="uvloop")
    p.add_argument("-n", default="32,128,256", help="connection counts, comma-separated")
    p.add_argument("--in-flight", type=int, default=16, help="set-ups at a time")
    p.add_argument("--pool", type=int, default=0, metavar="BUFFERS",
                   help="the server's receives from a shared pool of BUFFERS slots (0: none)")
    p.add_argument("--send-slots", type=int, default=0, metavar="N",
                   help="(--serve) the server's endpoints with N send slots (0: default)")
    p.add_argument("--client-slots", type=int, default=0, metavar="N",
                   help="the clients' endpoints with N data and N send slots (0: defaults)")
    p.add_argument("--stock", type=int, default=0, metavar="N",
                   help="the server makes N connections' resources ahead "
                        "(Config.setup_stock; 0: none)")
    p.add_argument("--rounds", type=int, default=0, metavar="K",
                   help="with all N open: K round trips, then K pipelined echoes, on one")
    p.add_argument("--keepalive", type=int, default=0, metavar="S",
                   help="both ends' endpoints (or, with --serve, the server's) with a TCP "
                        "keepalive of S s idle, "
                        "then S probes 1 s apart (0: the Config's default)")
    args = p.parse_args(argv)
    if args.serve:
        with contextlib.suppress(KeyboardInterrupt):
            LOOPS[args.loop](_serve(args.pool, args.send_slots, args.keepalive, args.stock))
        return 0
    counts = [int(x) for x in args.n.split(",") if x]
    pool = f"a receive pool of {args.pool}" if args.pool else "no receive pool"
    slots = f", clients with {args.client_slots} slots" if args.client_slots else ""
    slots += f", a server stock of {args.stock}" if args.stock else ""
    print(f"{len(counts)} measurement(s) on {args.loop}, {args.in_flight} set-ups in flight, "
          f"{pool}{slots}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for n in counts:
        print(describe(_measured(args.loop, n, args.in_flight, 600.0, args.pool,
                                 args.client_slots, args.stock, args.keepalive,
                                 args.rounds)), flush=True)
        print(f"  load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
