"""The far end for tests/rxe/test_rpc_ops.py: an RPC server in its own process.

Run as ``python tests/rxe/ops_peer.py [--loop uvloop] [--auth] [--max-in-flight N]``; it
serves ``tests/rpc_ops_services.py``'s :class:`Traced` and prints ``RPC <port>``. Its server
interceptors: one that records what it saw (``counts()["intercepted"]``: the method and the
metadata's keys) and stamps the answer's metadata with this process's pid, ``timing``, and
with ``--auth`` ``auth`` (a call needs metadata ``token: good``).

Signals drive what a call could not (the service's methods are refused while it drains):
``SIGUSR2`` opens the service's gate (``hold(-1)`` and ``limited(-1, ...)`` return);
``SIGHUP`` starts ``server.drain(60)``, after which the process prints ``DRAINED <counts as
JSON>`` and exits 0. ``SIGUSR1`` dumps its stacks (a stalled start-up).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import signal
import sys
from typing import Any

import uvloop

from aiordma.rpc import CallContext, serve

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.rpc_ops_services import (  # (run as a script: the root is on the path now)
    Traced,
    auth,
    timing,
)

DRAIN_TIMEOUT = 60.0


async def main(with_auth: bool, max_in_flight: int) -> None:
    traced = Traced()

    async def record(call: CallContext, proceed: Any) -> Any:
        traced.intercepted.append([call.method, sorted(call.metadata)])
        call.answer_metadata["server-pid"] = str(os.getpid())
        return await proceed()

    interceptors = [record, timing, *([auth] if with_auth else [])]
    server = await serve(traced, "127.0.0.1", 0, max_in_flight=max_in_flight,
                         interceptors=interceptors)
    drained = asyncio.Event()

    async def drain() -> None:
        await server.drain(DRAIN_TIMEOUT)
        print("DRAINED", json.dumps(traced.counts()), flush=True)
        drained.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR2, lambda: traced.gate.set())
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(drain()))
    print(f"RPC {server.port}", flush=True)
    await drained.wait()


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--auth", action="store_true")
    p.add_argument("--max-in-flight", type=int, default=64)
    a = p.parse_args()
    (uvloop.run if a.loop == "uvloop" else asyncio.run)(main(a.auth, a.max_in_flight))
    sys.exit(0)
