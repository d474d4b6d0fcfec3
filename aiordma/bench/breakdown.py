"""Where the time of one 64 B round trip and one RPC call goes, layer by layer.

``python -m aiordma.bench.breakdown [--loop asyncio|uvloop] [--device]``

Without ``--device`` (any machine, no RDMA): figures of the parts that need no device, each
timed alone in this process, as the median of ``--repeat`` runs:

- ``floor``: the asyncio floor of a round trip: two fd wake-ups and two task switches (two
  tasks ping-pong one byte over a socket pair; each side's reader callback resolves the
  future its task awaits, as aiordma's reactor does);
- ``message protocol``: the sans-I/O message protocol's steps for one 64 B message (the
  sender's ``send_data`` and its actions; the receiver's ``on_completion``, its actions and
  ``pop``), in the build endpoints use (compiled, or the Python source);
- ``rpc protocol``: the RPC protocol's four steps for one call (request, its receipt, the
  answer, its receipt);
- ``rpc over channel_pair``: an RPC echo through the whole RPC layer over the in-memory
  channel (no verbs, no fd wake-ups), at 1 call in flight.

With ``--device`` (an RDMA device here, e.g. inside ``python -m harness run``): a 64 B round
trip between this process and an echoing peer process, with the time of the client's parts
measured inside the run: the posting calls (``ibv_post_send``, which on rxe does the packet
work of the message in the kernel), the reactor's wake-ups (reading the event, polling,
feeding the protocol, reposting, re-arming), the client's CPU time (user and system) per
round trip, and the rest (the endpoint's ``send``/``recv``, the event loop, waiting for the
peer). The same for an RPC echo call.

Figures are microseconds (``us``); under the VM's software emulation everything is several
times slower than on hardware, so compare parts with each other, not with other machines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from typing import IO, Any

import uvloop

__all__ = ["floor", "main", "message_protocol_steps", "rpc_over_channel_pair",
           "rpc_protocol_steps"]

PAYLOAD = b"x" * 64
clock = time.perf_counter


def _median(f: Callable[[], float], repeat: int) -> float:
    return statistics.median(f() for _ in range(repeat))


async def _floor(n: int) -> float:
    """Microseconds per round trip of two tasks over a socket pair (see the module)."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
    waiting: dict[socket.socket, asyncio.Future[None]] = {}
    ready: set[socket.socket] = set()  # read before its task waited (the loop ran it first)

    def readable(s: socket.socket) -> None:
        s.recv(64)
        fut = waiting.pop(s, None)
        if fut is None:
            ready.add(s)
        elif not fut.done():
            fut.set_result(None)

    async def wait(s: socket.socket) -> None:
        if s in ready:
            ready.discard(s)
            return
        fut = waiting[s] = loop.create_future()
        await fut

    loop.add_reader(a.fileno(), readable, a)
    loop.add_reader(b.fileno(), readable, b)

    async def echo() -> None:
        while True:
            await wait(b)
            b.send(b"x")

    task = loop.create_task(echo())
    try:
        for _ in range(100):
            a.send(b"x")
            await wait(a)
        t = clock()
        for _ in range(n):
            a.send(b"x")
            await wait(a)
        return (clock() - t) / n * 1e6
    finally:
        task.cancel()
        loop.remove_reader(a.fileno())
        loop.remove_reader(b.fileno())
        a.close()
        b.close()


def floor(loop: str, n: int = 5000) -> float:
    """The asyncio floor of one round trip on ``loop`` (``"asyncio"`` or ``"uvloop"``), us."""
    return _run(loop, _floor(n))


def message_protocol_steps(n: int = 20000) -> float:
    """Microseconds of the message protocol's steps for one 64 B message (see the module)."""
    from aiordma._verbs.compiled import message_protocol
    from aiordma.protocols import messages as m

    cls = message_protocol()
    slot = 8192
    kw: dict[str, Any] = {"slot_size": slot, "send_slots": 64, "data_slots": 64,
                          "ctrl_slots": 8, "peer_slot_size": slot, "peer_data_slots": 64,
                          "peer_ctrl_slots": 8, "peer_max_message": 1 << 30,
                          "max_message": 1 << 30, "recv_budget": 4 << 20, "signal_every": 16,
                          "max_reads": 8}
    sends = [bytearray(slot * 64) for _ in range(2)]
    recvs = [bytearray(slot * 72) for _ in range(2)]
    sides = [cls(send_region=memoryview(sends[i]), recv_region=memoryview(recvs[i]), **kw)
             for i in range(2)]
    posted: list[list[int]] = [[], []]  # each side's posted receive slots, in order

    def carry_out(i: int) -> None:
        """Side ``i``'s actions, as a device would: sends land in the other side's next
        posted receive slot (and complete at once when signaled)."""
        j = 1 - i
        while sides[i].actions:
            for act in sides[i].take_actions():
                if type(act) is m.PostRecv:
                    posted[i].append(act.slot)
                elif type(act) is m.PostSend:
                    s = posted[j].pop(0)
                    recvs[j][s * slot:s * slot + act.length] = (
                        sends[i][act.offset:act.offset + act.length])
                    sides[j].on_completion(s, act.length)
                    if act.signaled:
                        sides[i].on_completion(act.wr_id, 0)
                    carry_out(j)

    carry_out(0)
    carry_out(1)
    a, b = sides
    t = clock()
    for _ in range(n):
        a.send_data(PAYLOAD)
        carry_out(0)
        b.pop()
        carry_out(1)
    return (clock() - t) / n * 1e6


def rpc_protocol_steps(n: int = 20000) -> float:
    """Microseconds of the RPC protocol's four steps for one call with a 64 B argument."""
    from aiordma.protocols import rpc as proto

    client = proto.RpcConnection(proto.Role.CLIENT)
    server = proto.RpcConnection(proto.Role.SERVER)
    t = clock()
    for _ in range(n):
        _, msgs = client.send_request("echo", (PAYLOAD,), {}, 1000)
        for msg in msgs:
            server.receive_message(msg)
        ev: Any = server.next_event()
        for msg in server.send_response(ev.id, ev.args[0]):
            client.receive_message(msg)
        client.next_event()
    return (clock() - t) / n * 1e6


async def _rpc_channel(n: int) -> float:
    from aiordma.rpc import RpcClient, RpcServer, Service, method
    from aiordma.testing import channel_pair

    class Echo(Service):
        @method
        def echo(self, x: Any) -> Any:
            return x

    a, b = channel_pair()
    server = RpcServer(Echo(), max_in_flight=64, grace=1.0)
    serving = asyncio.ensure_future(server.serve_connection(b))
    client = RpcClient(a, 64)
    try:
        for _ in range(100):
            await client.call("echo", PAYLOAD)
        t = clock()
        for _ in range(n):
            await client.call("echo", PAYLOAD)
        return (clock() - t) / n * 1e6
    finally:
        client.abort()
        await server.aclose()
        await asyncio.gather(serving, return_exceptions=True)


def rpc_over_channel_pair(loop: str, n: int = 3000) -> float:
    """Microseconds per RPC echo call over :func:`aiordma.testing.channel_pair`, 1 in flight."""
    return _run(loop, _rpc_channel(n))


def _run(loop: str, coro: Any) -> Any:
    return uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)


# -- on a device -------------------------------------------------------------------------------

class _Timed:
    """Wraps a callable, adding the time of each call to ``total`` (and counting calls)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *args: Any) -> Any:
        t = clock()
        try:
            return self.fn(*args)
        finally:
            self.total += clock() - t
            self.calls += 1


async def _device_client(port: int, n: int) -> dict[str, float]:
    import aiordma

    ep = await aiordma.connect("127.0.0.1", port, transport="rdma")
    if not isinstance(ep, aiordma.Endpoint):  # (transport="rdma" returns nothing else)
        raise TypeError(f"an RDMA connection was asked for, not {type(ep).__name__}")
    out: dict[str, float] = {}
    try:
        for _ in range(200):
            await ep.send(PAYLOAD)
            await ep.recv()
        # (private attributes, read by this tool only: the posting call and the wake-up)
        posts = ep._run_actions = _Timed(ep._run_actions)  # type: ignore[method-assign]
        reactor = ep._reactor
        loop = asyncio.get_running_loop()
        loop.remove_reader(reactor._fd)
        wake = _Timed(reactor.completion_queue.wake)
        loop.add_reader(reactor._fd, wake, reactor._handlers, reactor._routes)
        rtts = []
        t0, w0 = os.times(), clock()
        for _ in range(n):
            t = clock()
            await ep.send(PAYLOAD)
            await ep.recv()
            rtts.append(clock() - t)
        t1, wall = os.times(), clock() - w0
        out["round trip p50"] = statistics.median(rtts) * 1e6
        out["client CPU, user"] = (t1.user - t0.user) / n * 1e6
        out["client CPU, system"] = (t1.system - t0.system) / n * 1e6
        out["posting calls (ibv_post_send and reposts)"] = posts.total / n * 1e6
        out["wake-ups (event, poll, protocol, repost, re-arm)"] = wake.total / n * 1e6
        out["wake-ups per round trip"] = wake.calls / n
        out["rest: send/recv, event loop, waiting for the peer"] = (
            wall - posts.total - wake.total) / n * 1e6
        loop.remove_reader(reactor._fd)
        loop.add_reader(reactor._fd, reactor.completion_queue.wake, reactor._handlers,
                        reactor._routes)
    finally:
        await ep.aclose()
    return out


async def _echo_peer(port: int) -> None:
    import aiordma

    async def handler(ep: Any) -> None:
        while (msg := await ep.recv()) is not None:
            await ep.send(msg)

    async with await aiordma.listen(handler, "127.0.0.1", port):
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def device_round_trip(loop: str, n: int = 2000, port: int = 18710) -> dict[str, float]:
    """The 64 B round trip's parts on a device (see the module), against a peer process."""
    peer = subprocess.Popen([sys.executable, "-m", "aiordma.bench.breakdown", "--peer",
                             str(port), "--loop", loop], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        if typing.cast(IO[str], peer.stdout).readline().strip() != "READY":
            raise RuntimeError("the echo peer did not start")
        return _run(loop, _device_client(port, n))
    finally:
        if peer.stdin is not None:
            peer.stdin.close()
        try:
            peer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            peer.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aiordma.bench.breakdown",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--device", action="store_true", help="also a round trip on a device")
    ap.add_argument("--repeat", type=int, default=3, help="runs per host figure (median)")
    ap.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer:
        _run(args.loop, _echo_peer(args.peer))
        return 0
    from aiordma._verbs.compiled import message_protocol

    build = "compiled" if message_protocol().__module__.endswith("_c") else "python"
    rows = [
        (f"floor: two fd wake-ups and two task switches ({args.loop})",
         _median(lambda: floor(args.loop), args.repeat)),
        (f"message protocol, one 64 B message ({build})",
         _median(message_protocol_steps, args.repeat)),
        ("rpc protocol, the four steps of one call", _median(rpc_protocol_steps, args.repeat)),
        (f"rpc echo over channel_pair, 1 in flight ({args.loop})",
         _median(lambda: rpc_over_channel_pair(args.loop), args.repeat)),
    ]
    if args.device:
        for name, value in device_round_trip(args.loop).items():
            rows.append((f"device, 64 B round trip: {name}", value))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        unit = "" if "per round trip" in name else " us"
        print(f"{name:<{width}}  {value:8.2f}{unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
