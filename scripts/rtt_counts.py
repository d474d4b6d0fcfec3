"""Load-independent cost of one small operation over RDMA: system calls, user-space
instructions, completions, wake-ups and posts per operation (issue 33).

Usage (where an RDMA device is, e.g. in the test VM):

    python scripts/rtt_counts.py [--loop asyncio|uvloop] [--what rtt,rpc1,rpc64]
                                 [--calls N1 N2] [--callgrind]
    python scripts/rtt_counts.py --perftest [--calls N1 N2] [--callgrind]  # ib_send_lat -e

Operations, each a client process against the bench's peer process
(``python -m aiordma.bench.peer``, on the same loop, run untraced):

- ``rtt``: bench area (a)'s client, a 64 B ``send`` then ``recv`` on an endpoint;
- ``rpc1``, ``rpc64``: an RPC echo of 64 B (the peer's echo service), 1 or 64 calls in flight.

Per operation, for the client process alone:

- **system calls by kind** (``strace -f``): those between two marker calls around the timed
  loop, divided by its count. A verbs command that is a ``write`` to the uverbs fd is told
  apart by its command number (``write:post_send``: rxe's doorbell); a ``read`` of 8 bytes is
  ``ibv_get_cq_event``'s; the ``ioctl`` is taken to be ``ibv_req_notify_cq`` (rdma-core 59
  issues it as one; strace's count is not decoded further);
- with ``--callgrind``, **instructions** (``valgrind --tool=callgrind``, user space only):
  ``(Ir(N2) - Ir(N1)) / (N2 - N1)`` of two runs that differ only in the count, as
  ``scripts/rpc_icount.py``; from the same two runs, **calls of the verbs functions** (rxe's
  ``post_send``/``post_recv``/``poll_cq``, ``ibv_cmd_req_notify_cq``, ``ibv_get_cq_event``, ``ibv_ack_cq_events``) per operation;
- **wake-ups and completions** (the completion reactors' counters), from an untraced run.

``--callgrind`` is off by default: in the test VM (software emulation) on a host at load
average 8-14, one client run of 32 round trips under callgrind did not finish in 15 minutes
(2026-11-26); it needs a quiet host or a machine with a device. The system-call counts ran in
minutes. ``clock_gettime`` counts are the VM's: under software emulation the guest's clock
source can lose its vDSO, and then every clock read is a system call.

``--perftest`` does the same (system calls, instructions, verbs calls) for perftest's
``ib_send_lat -e -s 64`` client, one iteration being one round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

PAYLOAD = b"x" * 64
WARMUP = 50
MARK = 4_000_017  # getpgid() of this (no such process) brackets the timed loop in strace
CMD_NAMES = {23: "write:req_notify_cq", 28: "write:post_send", 29: "write:post_recv",
             21: "write:poll_cq"}  # IB_USER_VERBS_CMD_* (rdma/ib_user_verbs.h)
VERBS_FUNCS = ("rxe_post_send", "rxe_post_recv", "rxe_poll_cq", "ibv_cmd_req_notify_cq",
               "ibv_get_cq_event", "ibv_ack_cq_events", "epoll_wait")


# -- the client (one process, run under the tools) ----------------------------------------------

def _reactors() -> list[Any]:
    from aiordma._reactor import reactor

    loop = asyncio.get_running_loop()
    return [r for per in reactor._shared.get(loop, {}).values() for r in per]


def _counters() -> tuple[int, int]:
    rs = _reactors()
    return sum(r.wakeups for r in rs), sum(r.completions for r in rs)


def _mark() -> None:
    try:
        os.getpgid(MARK)
    except ProcessLookupError:
        pass


async def _timed(body: Any, calls: int) -> dict[str, float]:
    _mark()
    w0, c0 = _counters()
    cpu0 = time.process_time()
    await body(calls)
    cpu1 = time.process_time()
    w1, c1 = _counters()
    _mark()
    return {"wakeups": (w1 - w0) / calls, "completions": (c1 - c0) / calls,
            "cpu_us": (cpu1 - cpu0) / calls * 1e6}


async def _client(what: str, ports: dict[str, int], calls: int) -> dict[str, float]:
    import msgpack

    import aiordma
    from aiordma import rpc

    if what == "rtt":
        async with await aiordma.connect("127.0.0.1", ports["endpoint"], timeout=1800,
                                         transport="rdma") as ep:
            await ep.send(msgpack.packb(["echo", WARMUP + calls]))

            async def rtt(n: int) -> None:
                for _ in range(n):
                    await ep.send(PAYLOAD)
                    reply = await ep.recv()
                    if reply is None or len(reply) != len(PAYLOAD):
                        raise RuntimeError("the peer answered something else")

            await rtt(WARMUP)
            return await _timed(rtt, calls)
    in_flight = 64 if what == "rpc64" else 1
    async with await rpc.connect("127.0.0.1", ports["echo"], timeout=1800,
                                 max_in_flight=in_flight) as client:

        async def worker(n: int) -> None:
            for _ in range(n):
                if len(await client.call("echo", PAYLOAD)) != len(PAYLOAD):
                    raise RuntimeError("echo returned something else")

        async def echo(n: int) -> None:
            await asyncio.gather(*(worker(n // in_flight) for _ in range(in_flight)))

        await echo(WARMUP * in_flight)
        return await _timed(echo, calls)


def _run_client(args: argparse.Namespace) -> None:
    ports = json.loads(args.ports)
    print(json.dumps(_run_loop(args.loop, _client(args.client, ports, args.run))), flush=True)


async def _serve() -> None:
    """The far end: bench area (a)'s echo peer and the echo service, with a set-up bound
    long enough for a client under valgrind; prints ``READY <json ports>``."""
    import signal

    import aiordma
    from aiordma import Config
    from aiordma.bench.peer import serve_connection
    from aiordma.rpc import serve
    from aiordma.services.echo import Echo

    config = Config(handshake_timeout=1800.0)
    async with await aiordma.listen(serve_connection, "127.0.0.1", 0, config=config,
                                    transport="rdma") as listener, \
            await serve(Echo(), "127.0.0.1", 0, config=config) as echo:
        print("READY " + json.dumps({"endpoint": listener.port, "echo": echo.port}), flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()


def _run_loop(loop: str, coro: Any) -> Any:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


# -- the tools ----------------------------------------------------------------------------------

def _strace_counts(path: str, marked: bool) -> collections.Counter[str]:
    """System calls by kind in an ``strace -f -xx`` log (between the marks if ``marked``)."""
    counts: collections.Counter[str] = collections.Counter()
    inside = not marked
    call = re.compile(r"^(?:\d+ +)?(?:<\.\.\. )?(\w+)\((.*)")
    with open(path) as f:
        for line in f:
            if f"getpgid({MARK})" in line:
                inside = not inside
                continue
            m = call.match(line)
            if m is None or "resumed>" in line:
                continue
            name, rest = m.groups()
            if not inside:
                continue
            if name == "write":
                cmd = re.match(r'\d+, "((?:\\x[0-9a-f]{2}){4})', rest)
                if cmd:
                    num = int.from_bytes(bytes(int(h, 16) for h in
                                               re.findall(r"\\x([0-9a-f]{2})", cmd.group(1))),
                                         "little")
                    name = CMD_NAMES.get(num, f"write:cmd{num}") if num < 64 else "write"
            elif name == "read" and re.search(r", 8\) += ", rest):
                name = "read:cq_event"  # (a completion event is 8 bytes)
            counts[name] += 1
    return counts


def _strace(cmd: list[str], marked: bool = True) -> tuple[collections.Counter[str], str]:
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "strace.log")
        out = subprocess.run(["strace", "-f", "-qq", "-xx", "-s", "8", "-o", log, *cmd],
                             check=True, capture_output=True, text=True, timeout=1200)
        return _strace_counts(log, marked), out.stdout


def _callgrind(cmd: list[str]) -> tuple[int, collections.Counter[str]]:
    """Total Ir and calls of :data:`VERBS_FUNCS` of one run under callgrind (its output kept
    in ``$RTT_COUNTS_KEEP`` if set, for ``callgrind_annotate``)."""
    keep = os.environ.get("RTT_COUNTS_KEEP")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(keep or tmp, f"cg.{os.getpid()}.{time.monotonic_ns()}.out")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd],
                       check=True, capture_output=True, timeout=3600,
                       env={**os.environ, "PYTHONHASHSEED": "0"})
        names: dict[str, str] = {}
        calls: collections.Counter[str] = collections.Counter()
        total = 0
        cfn = None
        with open(out) as f:
            for line in f:
                if line.startswith("summary:"):
                    total = int(line.split()[1])
                elif line.startswith(("cfn=", "fn=")):
                    m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line.strip())
                    if m:
                        if m.group(2):
                            names[m.group(1)] = m.group(2)
                        cfn = names.get(m.group(1)) if line.startswith("cfn=") else None
                elif line.startswith("calls=") and cfn is not None:
                    for f_name in VERBS_FUNCS:
                        if cfn == f_name or cfn.startswith(f_name + "'"):
                            calls[f_name] += int(line.split("=")[1].split()[0])
                    cfn = None
        return total, calls


def _per_op(a: collections.Counter[str], b: collections.Counter[str], n: int) -> dict[str, float]:
    return {k: (b[k] - a[k]) / n for k in sorted(set(a) | set(b)) if b[k] != a[k]}


def _measure(label: str, cmd_for: Any, args: argparse.Namespace, marked: bool) -> None:
    n1, n2 = args.calls
    print(f"## {label}", flush=True)
    counts, out = _strace(cmd_for(n2), marked)
    if marked:
        syscalls = {k: v / n2 for k, v in sorted(counts.items())}
    else:
        first, _ = _strace(cmd_for(n1), marked)
        syscalls = _per_op(first, counts, n2 - n1)
    print("system calls per op: " + json.dumps({k: round(v, 3) for k, v in syscalls.items()}),
          f"(total {sum(syscalls.values()):.2f})", flush=True)
    if out.strip():
        print("counters per op (under strace): " + out.strip().splitlines()[-1], flush=True)
    if args.callgrind:
        ir1, c1 = _callgrind(cmd_for(n1))
        ir2, c2 = _callgrind(cmd_for(n2))
        print(f"instructions per op: {(ir2 - ir1) / (n2 - n1):,.0f}", flush=True)
        print("verbs calls per op: " + json.dumps({k: round(v, 3) for k, v in
                                                   _per_op(c1, c2, n2 - n1).items()}), flush=True)


def _perftest(args: argparse.Namespace) -> None:
    n1, n2 = args.calls
    print("## ib_send_lat -e -s 64 (client)", flush=True)
    runs: dict[str, Any] = {}
    for tool in ("strace", "callgrind"):
        if tool == "callgrind" and not args.callgrind:
            continue
        for n in (n1, n2):
            port = 18600 + len(runs)
            srv = subprocess.Popen(["ib_send_lat", "-d", args.device, "-x", "1", "-e", "-s",
                                    "64", "-n", str(n), "-p", str(port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2)
            client = ["ib_send_lat", "-d", args.device, "-x", "1", "-e", "-s", "64", "-n",
                      str(n), "-p", str(port), "127.0.0.1"]
            try:
                runs[f"{tool}{n}"] = (_strace(client, False)[0] if tool == "strace"
                                      else _callgrind(client))
            finally:
                srv.wait(timeout=120)
    print("system calls per op: " + json.dumps({k: round(v, 3) for k, v in _per_op(
        runs[f"strace{n1}"], runs[f"strace{n2}"], n2 - n1).items()}), flush=True)
    if args.callgrind:
        (ir1, c1), (ir2, c2) = runs[f"callgrind{n1}"], runs[f"callgrind{n2}"]
        print(f"instructions per op: {(ir2 - ir1) / (n2 - n1):,.0f}", flush=True)
        print("verbs calls per op: " + json.dumps({k: round(v, 3) for k, v in
                                                   _per_op(c1, c2, n2 - n1).items()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--what", default="rtt,rpc1,rpc64")
    ap.add_argument("--calls", type=int, nargs=2, default=(128, 640), metavar=("N1", "N2"))
    ap.add_argument("--callgrind", action="store_true",
                    help="also instructions and verbs calls per op (slow: see the docstring)")
    ap.add_argument("--perftest", action="store_true")
    ap.add_argument("--device", default="rxe0")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--run", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        _run_client(args)
        return
    if shutil.which("strace") is None:
        raise SystemExit("strace is needed")
    if args.perftest:
        _perftest(args)
        return
    if args.serve:
        _run_loop(args.loop, _serve())
        return
    from aiordma.bench.process import announced

    fast = os.environ.get("AIORDMA_FASTPATH", "1")
    with announced([sys.executable, __file__, "--serve", "--loop", args.loop], "READY",
                   timeout=300) as line:
        port_map = json.loads(line.split(" ", 1)[1])
        for what in args.what.split(","):
            def cmd_for(n: int, what: str = what) -> list[str]:
                return [sys.executable, __file__, "--client", what, "--loop", args.loop,
                        "--ports", json.dumps(port_map), "--run", str(n)]

            plain = subprocess.run(cmd_for(args.calls[1]), check=True, capture_output=True,
                                   text=True, timeout=1200).stdout.strip().splitlines()[-1]
            print(f"# {what}, {args.loop}, AIORDMA_FASTPATH={fast}", flush=True)
            print("counters per op: " + plain, flush=True)
            _measure(what, cmd_for, args, marked=True)


if __name__ == "__main__":
    main()
