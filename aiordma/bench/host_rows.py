"""Area (i), ``aiordma bench --host-cpu``: CPU time per operation on this host, without a
device, beside the asyncio TCP + msgpack baseline over loopback.

On a real NIC the device's work is off the CPU, so what an operation costs a user there is
the processes' CPU time, and that can be measured here, on the host, where Python runs at
full speed. Rows, on each loop:

* ``i.rtt64.*``: a 64 B message round trip, one at a time;
* ``i.rpc1.*`` and ``i.rpc64.*``: an RPC call ``echo(64 B)``, 1 and 64 calls in flight.

Each done by three systems:

* ``aiordma``: over :func:`aiordma.testing.channel_pair` (the in-memory channel, both ends in
  this process): for the calls, ``aiordma.rpc``'s client and server, the layer that runs on an
  endpoint unchanged; for the round trip, ``send``/``recv`` of the channel. What this leaves
  out is aiordma's endpoint, message protocol and verbs calls under the channel;
* ``asyncio TCP``: the baseline (:mod:`~aiordma.bench.tcp_baseline`) with both ends in this
  process, over loopback, the same way as the channel pair;
* ``asyncio TCP, 2 processes``: the same with the server in a process of its own on the same
  loop (its CPU read from ``/proc``, this process's from ``getrusage``; both counted).

The figure is CPU microseconds per operation, user + system, of every process taking part
(:mod:`~aiordma.bench.cputime`), measured over ``plan.cpu_ops`` operations after
``plan.cpu_warmup``; wall time per operation beside it. The ratios: aiordma's CPU per
operation over each TCP row's.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from .cputime import CpuTimes, own_times, per_op, process_times
from .measure import Results, Versus
from .plan import Plan

__all__ = ["HOST_AREA", "host_specs", "run_host_bench", "run_host_rows"]

HOST_AREA = "i"
STEP = 60.0  # bound on connecting
Op = Callable[[], Awaitable[Any]]
Make = Callable[[], Awaitable[dict[str, float]]]

SYSTEMS = {"aiordma": "aiordma", "tcp": "asyncio TCP", "tcp2": "asyncio TCP, 2 processes"}


async def drive(op: Op, *, ops: int, in_flight: int, warmup: int,
                server_pid: int | None = None) -> dict[str, float]:
    """``warmup`` operations, then ``ops`` more by ``in_flight`` tasks, timed: the CPU time of
    this process (and of ``server_pid``'s) per operation, and wall time per operation."""
    for _ in range(warmup):
        await op()
    todo = iter(range(ops))

    async def worker() -> None:
        for _ in todo:
            await op()

    other = process_times(server_pid) if server_pid is not None else CpuTimes(0.0, 0.0)
    mine, t0 = own_times(), time.perf_counter()
    async with asyncio.TaskGroup() as workers:
        for _ in range(in_flight):
            workers.create_task(worker())
    wall, spent = time.perf_counter() - t0, own_times() - mine
    if server_pid is not None:
        spent = spent + (process_times(server_pid) - other)
    return per_op(spent, wall, ops)


async def memory_round_trips(plan: Plan, size: int = 64) -> dict[str, float]:
    """``size`` B round trips over a channel pair, the echoing end a task of this process."""
    from aiordma.testing import channel_pair

    a, b = channel_pair()
    msg = b"x" * size

    async def echo() -> None:
        while (m := await b.recv()) is not None:
            await b.send(m)

    async def op() -> None:
        await a.send(msg)
        reply = await a.recv()
        if reply is None or len(reply) != size:
            raise RuntimeError(f"the echo answered {reply!r:.40}")

    server = asyncio.ensure_future(echo())
    try:
        return await drive(op, ops=plan.cpu_ops, in_flight=1, warmup=plan.cpu_warmup)
    finally:
        await a.aclose()
        await asyncio.wait_for(server, STEP)


async def memory_rpc(plan: Plan, in_flight: int) -> dict[str, float]:
    """``echo(<payload>)`` calls by ``aiordma.rpc`` over a channel pair, ``in_flight`` at once,
    the echo service served in this process."""
    from aiordma.rpc import RpcClient, RpcServer
    from aiordma.services.echo import Echo
    from aiordma.testing import channel_pair

    a, b = channel_pair()
    server = RpcServer(Echo(), max_in_flight=max(in_flight, 1), grace=1.0)
    serving = asyncio.ensure_future(server.serve_connection(b))
    payload = b"x" * plan.rpc_payload
    try:
        async with RpcClient(a, max_in_flight=max(in_flight, 1)) as client:

            async def op() -> None:
                if len(await client.call("echo", payload)) != len(payload):
                    raise RuntimeError("echo returned something else")

            return await drive(op, ops=plan.cpu_ops, in_flight=in_flight,
                               warmup=plan.cpu_warmup)
    finally:
        await asyncio.wait_for(serving, STEP)


@contextlib.asynccontextmanager
async def _tcp_ports(ports: dict[str, int] | None) -> Any:
    """The TCP baselines' ports: ``ports`` (a server process's), else servers in this
    process for the time of the row."""
    if ports is not None:
        yield ports
        return
    from .tcp_baseline import serve_tcp_echo, serve_tcp_frames

    rpc, frames = await serve_tcp_echo(), await serve_tcp_frames()
    try:
        yield {"rpc": rpc.sockets[0].getsockname()[1],
               "frames": frames.sockets[0].getsockname()[1]}
    finally:
        for s in (rpc, frames):
            s.close()
            await s.wait_closed()


async def tcp_round_trips(plan: Plan, size: int = 64, *, ports: dict[str, int] | None = None,
                          server_pid: int | None = None) -> dict[str, float]:
    """``size`` B frames echoed over asyncio TCP streams, one at a time."""
    from .tcp_baseline import TcpFrames

    msg = b"x" * size
    async with _tcp_ports(ports) as where:
        conn = await asyncio.wait_for(TcpFrames.connect("127.0.0.1", where["frames"]), STEP)
        try:

            async def op() -> None:
                if len(await conn.round_trip(msg)) != size:
                    raise RuntimeError("the echo came back short")

            return await drive(op, ops=plan.cpu_ops, in_flight=1, warmup=plan.cpu_warmup,
                               server_pid=server_pid)
        finally:
            await conn.aclose()


async def tcp_rpc(plan: Plan, in_flight: int, *, ports: dict[str, int] | None = None,
                  server_pid: int | None = None) -> dict[str, float]:
    """``echo(<payload>)`` calls over the asyncio TCP + msgpack baseline."""
    from .tcp_baseline import TcpEchoClient

    payload = b"x" * plan.rpc_payload
    async with _tcp_ports(ports) as where:
        client = await asyncio.wait_for(TcpEchoClient.connect("127.0.0.1", where["rpc"]), STEP)
        try:

            async def op() -> None:
                if len(await client.call("echo", payload)) != len(payload):
                    raise RuntimeError("echo returned something else")

            return await drive(op, ops=plan.cpu_ops, in_flight=in_flight,
                               warmup=plan.cpu_warmup, server_pid=server_pid)
        finally:
            await client.aclose()


def host_specs(plan: Plan, loop: str, *, server: tuple[dict[str, int], int] | None = None
               ) -> list[tuple[str, dict[str, Any], Make]]:
    """(key, row metadata, measurement) of area (i) on ``loop``; ``server``: the TCP server
    process's ports and pid, for the two-process rows (left out without it)."""
    specs: list[tuple[str, dict[str, Any], Make]] = []
    counted = f"{plan.cpu_ops} operations after {plan.cpu_warmup}"

    def add(name: str, what: str, rows: dict[str, tuple[str, Make]]) -> None:
        versus = [Versus(metric="cpu_us_per_op", base=f"i.{name}.{who}.{loop}",
                         base_metric="cpu_us_per_op", label=SYSTEMS[who] + " CPU")
                  for who in ("tcp", "tcp2") if who in rows]
        for who, (how, make) in rows.items():
            specs.append((f"i.{name}.{who}.{loop}", {
                "area": HOST_AREA, "what": what, "system": SYSTEMS[who], "loop": loop,
                "how": f"{how}; {counted}", "versus": versus if who == "aiordma" else []},
                make))

    one = "both ends in this process"
    two = "server in another process on the same loop, both processes' CPU"
    rtt: dict[str, tuple[str, Make]] = {
        "aiordma": (f"channel_pair() send/recv, {one}", lambda: memory_round_trips(plan)),
        "tcp": (f"length-prefixed frames over loopback, {one}",
                lambda: tcp_round_trips(plan))}
    if server is not None:
        rtt["tcp2"] = (f"length-prefixed frames over loopback, {two}",
                       lambda: tcp_round_trips(plan, ports=server[0], server_pid=server[1]))
    add("rtt64", "64 B message round trip, CPU per round trip", rtt)
    for n in plan.cpu_in_flight:
        rpc: dict[str, tuple[str, Make]] = {
            "aiordma": (f"aiordma.rpc over channel_pair(), echo({plan.rpc_payload} B), {one}",
                        lambda n=n: memory_rpc(plan, n)),  # type: ignore[misc]
            "tcp": (f"msgpack frames over loopback, echo({plan.rpc_payload} B), {one}",
                    lambda n=n: tcp_rpc(plan, n))}  # type: ignore[misc]
        if server is not None:
            rpc["tcp2"] = (f"msgpack frames over loopback, echo({plan.rpc_payload} B), {two}",
                           lambda n=n: tcp_rpc(plan, n, ports=server[0],  # type: ignore[misc]
                                               server_pid=server[1]))
        add(f"rpc{n}", f"RPC call, {n} in flight, CPU per call", rpc)
    return specs


@contextlib.contextmanager
def tcp_server_process(loop: str, *, timeout: float = 60.0) -> Iterator[tuple[dict[str, int],
                                                                            int]]:
    """The TCP baselines' servers in a process of their own on ``loop``: (ports, pid)."""
    from .process import announced_process

    cmd = [sys.executable, "-m", "aiordma.bench.tcp_baseline", "--loop", loop]
    with announced_process(cmd, "READY", timeout=timeout, env=dict(os.environ)) as (line,
                                                                                    proc):
        ports = {k: int(v) for k, _, v in (w.partition("=") for w in line.split()[1:])}
        yield ports, proc.pid


async def _rows(specs: list[tuple[str, dict[str, Any], Make]], plan: Plan,
                results: Results) -> None:
    from .runner import failure

    for key, meta, make in specs:
        label = f"  [i] {meta['system']} {meta['loop']}: {meta['what']}"
        load = os.getloadavg()[0]
        try:
            async with asyncio.timeout(plan.row_timeout):
                values = await make()
        except Exception as exc:  # noqa: BLE001  # a failed row is reported, the run goes on
            results.fail(key, failure(exc), load=load, **meta)
            print(f"{label}: FAILED ({failure(exc)})", flush=True)
            continue
        results.record(key, values, load=load, **meta)
        print(f"{label}: {values['cpu_us_per_op']:.1f} us CPU ({values['user_us_per_op']:.1f} "
              f"user, {values['system_us_per_op']:.1f} system), {values['us_per_op']:.1f} us "
              f"wall", flush=True)


def run_host_rows(plan: Plan, *, loops: list[str], repeat: int, results: Results) -> None:
    """Every row of area (i) on each loop, ``repeat`` times, into ``results``."""
    from .runner import LOOPS

    for r in range(repeat):
        print(f"repeat {r + 1} of {repeat}:", flush=True)
        for loop in loops:
            with tcp_server_process(loop) as server:
                LOOPS[loop](_rows(host_specs(plan, loop, server=server), plan, results))


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def run_host_bench(*, quick: bool = False, loops: list[str] | None = None, repeat: int = 1,
                   json_path: str | None = None) -> int:
    """``aiordma bench --host-cpu``: area (i) here, no device; print the table and the goals,
    write the JSON. Returns 0 if every row was measured, else 1."""
    import uvloop

    from .report import HOST_GOALS, evaluate_goals, format_table, to_json, write_json

    loops = loops or ["asyncio", "uvloop"]
    plan = Plan.quick() if quick else Plan()
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kernel": platform.release(), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
        "python": platform.python_version(), "uvloop": uvloop.__version__,
        "loadavg_start": list(os.getloadavg())}
    print(f"aiordma bench --host-cpu: CPU per operation on this host, no device; "
          f"{'quick' if quick else 'full'} plan, loops {', '.join(loops)}, {repeat} "
          f"repeat(s)", flush=True)
    results = Results()
    t0 = time.monotonic()
    run_host_rows(plan, loops=loops, repeat=repeat, results=results)
    env["loadavg_end"] = list(os.getloadavg())
    env["seconds"] = round(time.monotonic() - t0, 1)
    goals = evaluate_goals(results, loops, HOST_GOALS)
    header = [
        "",
        (f"aiordma bench --host-cpu: kernel {env['kernel']}, {env['cpus']} CPUs "
         f"({env['cpu_model']}), Python {env['python']}, uvloop {env['uvloop']}, "
         f"{env['date_utc']}"),
        (f"plan: {'quick' if quick else 'full'}; {repeat} repeat(s): figures are the median "
         f"[min..max] of the repeats; ratios are of medians; load average "
         f"{env['loadavg_start'][0]:.2f} at the start, {env['loadavg_end'][0]:.2f} at the end; "
         f"{env['seconds']:.0f} s"),
        ("CPU: user + system time of every process taking part (this one by getrusage; a "
         "server process by /proc, 10 ms ticks)"),
    ]
    for line in format_table(results, header=header, goals=goals).splitlines():
        print(line)
    sys.stdout.flush()
    if json_path:
        settings = {"quick": quick, "areas": HOST_AREA, "loops": loops, "repeat": repeat,
                    "host_cpu": True, "argv": sys.argv}
        write_json(to_json(results, settings=settings, environment=env, goals=goals),
                   json_path)
        print(f"\nJSON: {json_path}")
    return 1 if any(r.failed for r in results.rows.values()) else 0
