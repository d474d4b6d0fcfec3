"""Messages per RPC call at 1, 16 and 64 calls in flight, on a real device.

Starts ``aiordma serve echo`` in another process, makes 1,024 calls of ``echo(64 B)`` at each
concurrency and prints the request and answer messages per call, from the client endpoint's
``stats()``, and the client reactor's fd wake-ups per call. Without batching both message
figures would be 1.00. ``uvloop`` as the argument runs both ends on uvloop (default asyncio).
Run where a device is, e.g. in the VM::

    .venv/bin/python -m harness run -- .venv/bin/python scripts/rpc_messages_per_call.py
"""

from __future__ import annotations

import asyncio
import sys
import time

CALLS = 1024
STEP = 120.0  # a bound on each concurrency's calls


async def main(loop: str) -> None:
    from aiordma import Endpoint
    from aiordma.rpc import connect

    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiordma", "serve", "echo", "--loop", loop,
        stdout=asyncio.subprocess.PIPE)
    try:
        if server.stdout is None:
            raise RuntimeError("no pipe from the server")
        line = (await asyncio.wait_for(server.stdout.readline(), STEP)).decode()
        # "serving echo on HOST:PORT (Ctrl-C stops)"
        port = int(line.split()[3].rsplit(":", 1)[1])
        client = await connect("127.0.0.1", port)
        ep = client.endpoint
        try:
            if not isinstance(ep, Endpoint):
                raise TypeError("an RDMA client has an Endpoint")
            reactor = ep._reactor
            for n in (1, 16, 64):
                before, woke = ep.stats(), reactor.wakeups

                async def worker(k: int) -> None:
                    for _ in range(k):
                        await client.call("echo", b"x" * 64)

                t = time.perf_counter()
                await asyncio.wait_for(asyncio.gather(*(worker(CALLS // n) for _ in range(n))),
                                       STEP)
                elapsed = time.perf_counter() - t
                after = ep.stats()
                sent, got = after.sent - before.sent, after.received - before.received
                print(f"{n:3d} in flight: {CALLS / elapsed:7.0f} calls/s; request messages "
                      f"{sent / CALLS:.3f} per call, answer messages {got / CALLS:.3f} per call, "
                      f"fd wake-ups {(reactor.wakeups - woke) / CALLS:.3f} per call", flush=True)
        finally:
            await client.aclose()
    finally:
        server.kill()
        await server.wait()


if __name__ == "__main__":
    loop = sys.argv[1] if len(sys.argv) > 1 else "asyncio"
    if loop == "uvloop":
        import uvloop

        uvloop.run(main(loop))
    else:
        asyncio.run(main(loop))
