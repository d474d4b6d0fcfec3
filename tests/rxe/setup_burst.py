"""A burst of clients in a process of their own, for tests/rxe/test_setup_stock.py.

    python setup_burst.py PORT N IN_FLIGHT [pool]

Opens N endpoints to the listener on 127.0.0.1:PORT (IN_FLIGHT set-ups at a time; ``pool``:
clients that offer the listener's receive pool), sends one 64 B message of its own on each
and checks its echo, prints ``OPEN N``; then, at a line on stdin (or its end), closes them
all and prints ``CLOSED``. Every wait is bounded; a failure is printed and exits 1.
"""

from __future__ import annotations

import asyncio
import sys

import aiordma

STEP = 60.0


async def main(port: int, n: int, in_flight: int, pool: bool) -> None:
    config = aiordma.Config(receive_pool=True) if pool else aiordma.Config(receive_pool=False)
    gate = asyncio.Semaphore(in_flight)
    eps: list[aiordma.Endpoint] = []

    async def one() -> None:
        async with gate:
            eps.append(await aiordma.connect("127.0.0.1", port, transport="rdma",
                                             config=config, timeout=4 * STEP))

    async def echo(i: int, ep: aiordma.Endpoint) -> None:
        msg = i.to_bytes(4, "little") * 16
        await ep.send(msg)
        got = await asyncio.wait_for(ep.recv(), 4 * STEP)
        assert got == msg, (i, got)

    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(n):
                tg.create_task(one())
        async with asyncio.TaskGroup() as tg:
            for i, ep in enumerate(eps):
                tg.create_task(echo(i, ep))
        print(f"OPEN {len(eps)}", flush=True)
        await asyncio.wait_for(asyncio.to_thread(sys.stdin.readline), 20 * STEP)
    finally:
        await asyncio.gather(*(ep.aclose() for ep in eps), return_exceptions=True)
    print("CLOSED", flush=True)


if __name__ == "__main__":
    try:
        asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                         "pool" in sys.argv[4:]))
    except BaseException as exc:  # noqa: BLE001  # (said, for the test's message)
        print(f"FAILED {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
