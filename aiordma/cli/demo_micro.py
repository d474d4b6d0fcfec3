"""``aiordma demo microservices``: three replicas of a service, each its own process, behind a
pool (:func:`aiordma.rpc.connect_pool`) under load; one replica is killed (``SIGKILL``)
mid-run and started again.

The service, :class:`Orders`, has an idempotent method (``price``, a read) and one that is not
(``order``, which places an order: running it twice would place two); and the same pair as
streams (``quotes`` yields prices, idempotent; ``bulk_order`` takes an order's lines, not), one
more idempotent stream (``bulk_quote``) and ``whoami`` (which replica answered, and the
caller's metadata). Every call carries a
request id, and each replica appends the id of every call it runs to its *journal* (a file,
one ``os.write`` per call, before the call's work: a call that started has run, even if its
replica is killed before answering). A restarted replica reads its journal back, so asking any
replica (``journal()``) what it ran counts its earlier lives too.

The scenario (:func:`scenario`) runs ``ops`` calls from ``workers`` tasks, half of each
method; after a third of them it kills one replica, and once the pool has ejected it, starts it
again on the same port; the last third of the calls waits until the pool has it back, so the
restarted replica takes its share of them. It returns what every call got and what every journal holds, and
checks what the pool promises: every ``price`` call completes (sent again elsewhere when its
replica died), every ``order`` either completes and ran exactly once, or fails typed
(:class:`~aiordma.rpc.UnknownOutcomeError`) and ran at most once; none ran twice. The demo
prints the outcome, the pool's counters and what the journals say; the device tests
(``tests/rxe/test_rpc_pool.py``) assert it.

The demo (:func:`scenario`, :func:`run_micro_demo`) is shaped as a deployment would be: one of
the three replicas takes TCP only (as on a host without an RDMA device), the other two RDMA,
all behind the one pool; the replicas refuse any call without the demo's token in its metadata
(a server interceptor, :func:`require_token`), the pool's client interceptor
(:func:`send_token`) adds it to every attempt, and one call made without it is refused,
typed; the pool's counters are exported for Prometheus (:mod:`aiordma.cli.demo_metrics`) and
scraped once at the end. It prints what each transport carried.

``python -m aiordma.cli.demo_micro replica --port P --journal PATH --name N`` is one replica
(it prints ``serving orders on HOST:PORT``); ``--transport tcp`` makes it take TCP only, as a
replica on a host without an RDMA device would. With :data:`TOKEN_ENV` set in its environment
(not an argument: ``ps`` shows those) it refuses calls that do not carry that token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvloop

from aiordma.rpc import CallContext, ClientCall, RpcStream, Service, current_call, method

STEP = 60.0  # bound on any one step that waits for another process
TOKEN_ENV = "AIORDMA_DEMO_TOKEN"
"""The environment variable that gives a replica process the token it requires."""
TOKEN_KEY = "token"
"""The metadata key the token travels under."""


def require_token(token: str) -> Any:
    """A server interceptor that refuses a call whose metadata does not carry ``token``
    (under :data:`TOKEN_KEY`) before its method runs: the caller gets a
    :class:`~aiordma.rpc.RemoteError` whose ``type_name`` is ``"PermissionError"``. (Not
    :class:`~aiordma.rpc.Unavailable`: that says "make it again elsewhere", and a pool would;
    a caller without the token is refused everywhere.)"""
    async def check(call: CallContext, proceed: Any) -> Any:
        if call.metadata.get(TOKEN_KEY) != token:
            raise PermissionError(f"{call.method}(): the call carries no valid "
                                  f"{TOKEN_KEY!r} in its metadata")
        return await proceed()

    return check


def send_token(token: str) -> Any:
    """A client interceptor that adds ``token`` to every call's (and, in a pool, every
    attempt's) metadata."""
    async def add(call: ClientCall, proceed: Any) -> Any:
        call.metadata[TOKEN_KEY] = token
        return await proceed()

    return add


class Orders(Service):
    """An order service: ``price`` (idempotent) and ``order`` (not), each ``work`` seconds
    long, journaled by request id (see the module)."""

    def __init__(self, name: str = "orders", journal: str | None = None,
                 pace: float = 0.0) -> None:
        self.name = name
        self.pace = pace  # seconds every call takes on top of its work (a slow replica)
        self.ran: Counter[str] = Counter()  # request id -> times run (all lives, if journaled)
        self.metadata: dict[str, list[dict[str, Any]]] = {}  # request id -> each run's metadata
        self._fd: int | None = None
        if journal is not None:
            with contextlib.suppress(FileNotFoundError), open(journal) as f:
                self.ran.update(line.split()[1] for line in f if line.strip())
            self._fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _ran(self, kind: str, request_id: str) -> None:
        self.ran[request_id] += 1
        self.metadata.setdefault(request_id, []).append(dict(current_call().metadata))
        current_call().answer_metadata["replica"] = self.name
        if self._fd is not None:  # one write of a short line: appended whole, kept at a kill
            os.write(self._fd, f"{kind} {request_id}\n".encode())

    @method(idempotent=True)
    async def price(self, request_id: str, item: str, work: float = 0.0) -> dict[str, Any]:
        """A quote for ``item``: a read, safe to run twice."""
        self._ran("price", request_id)
        await asyncio.sleep(work + self.pace)
        return {"replica": self.name, "price": 100 + len(item)}

    @method
    async def order(self, request_id: str, item: str, work: float = 0.0) -> dict[str, Any]:
        """Places an order: running it twice would place two."""
        self._ran("order", request_id)
        await asyncio.sleep(work + self.pace)
        return {"replica": self.name, "order": request_id}

    @method(idempotent=True)
    async def quotes(self, request_id: str, items: list[str], work: float = 0.0
                     ) -> AsyncIterator[dict[str, Any]]:
        """A quote for each of ``items``, one at a time: a read, safe to run twice."""
        self._ran("quotes", request_id)
        for item in items:
            await asyncio.sleep(work + self.pace)
            yield {"replica": self.name, "item": item, "price": 100 + len(item)}

    @method
    async def bulk_order(self, request_id: str, lines: RpcStream[str]) -> dict[str, Any]:
        """Places one order of the lines the caller sends: running it twice would place
        two."""
        self._ran("bulk_order", request_id)
        got = [line async for line in lines]
        await asyncio.sleep(self.pace)
        return {"replica": self.name, "order": request_id, "lines": len(got)}

    @method(idempotent=True)
    async def bulk_quote(self, request_id: str, items: RpcStream[str]) -> dict[str, Any]:
        """The total price of the items the caller sends: a read."""
        self._ran("bulk_quote", request_id)
        total = 0
        async for item in items:
            total += 100 + len(item)
        return {"replica": self.name, "total": total}

    @method(idempotent=True)
    def whoami(self) -> dict[str, Any]:
        """This replica's name and the caller's metadata (``str`` values as they came,
        ``bytes`` ones as text)."""
        md = {k: v if isinstance(v, str) else v.decode(errors="replace")
              for k, v in current_call().metadata.items()}
        current_call().answer_metadata["replica"] = self.name
        return {"replica": self.name, "metadata": md}

    @method(idempotent=True)
    def journal(self) -> dict[str, int]:
        """Request id -> times this replica (in any of its lives) ran it."""
        return dict(self.ran)


# -- replicas as processes ------------------------------------------------------------------

class ReplicaProcess:
    """One replica's process (``python -m aiordma.cli.demo_micro replica``), which can be
    killed and started again on the same port with the same journal; ``start_timeout``
    bounds each of its starts."""

    def __init__(self, name: str, journal: str, loop: str, host: str = "127.0.0.1",
                 transport: str = "auto", token: str | None = None,
                 start_timeout: float = STEP,
                 popen: Callable[..., Any] = subprocess.Popen) -> None:
        self.name, self.journal, self.loop, self.host = name, journal, loop, host
        self.popen = popen  # what starts it (``subprocess.Popen``'s signature)
        self.transport = transport
        self.token = token  # required of its callers, if not None
        self.start_timeout = start_timeout
        self.port = 0
        self.proc: Any = None  # a subprocess.Popen, or what `popen` made

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def spawn(self) -> None:
        """Start its process (on its port, if it had one: a restart); see :meth:`started`."""
        cmd = [sys.executable, "-m", "aiordma.cli.demo_micro", "replica", "--name", self.name,
               "--journal", self.journal, "--port", str(self.port), "--loop", self.loop,
               "--host", self.host, "--transport", self.transport]
        env = None if self.token is None else {**os.environ, TOKEN_ENV: self.token}
        self.proc = self.popen(cmd, stdout=subprocess.PIPE, text=True, env=env)

    def started(self) -> None:
        """Wait until it serves (its announcement line), at most ``start_timeout``.

        Raises:
            AiordmaError: it said something else, exited, or said nothing in time.
        """
        from aiordma import AiordmaError
        from aiordma.bench.process import _first_line

        if self.proc is None:
            raise AiordmaError(f"replica {self.name} was not started")
        line = _first_line(self.proc, self.start_timeout)
        if not line.startswith("serving orders on "):
            self.stop()
            raise AiordmaError(f"replica {self.name} did not start: it said {line.strip()!r}")
        self.port = int(line.split()[3].rsplit(":", 1)[1])

    def start(self) -> None:
        self.spawn()
        self.started()

    def kill(self) -> float:
        """SIGKILL it (without waiting for it to go: :meth:`reap`); ``time.monotonic()`` just
        before the signal."""
        t = time.monotonic()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
        return t

    def reap(self) -> None:
        """Wait for a killed process to be gone (blocking: the kernel releases its RDMA
        resources meanwhile)."""
        if self.proc is not None:
            self.proc.wait(timeout=STEP)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=STEP)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


@contextlib.contextmanager
def replicas(n: int, loop: str, directory: str, transports: dict[int, str] | None = None,
             token: str | None = None, timeout: float = STEP,
             popen: Callable[..., Any] = subprocess.Popen) -> Iterator[list[ReplicaProcess]]:
    """``n`` replica processes journaling into ``directory``, each taking the transport
    ``transports`` gives it (default ``"auto"``) and, if ``token`` is given, refusing calls
    without it; stopped on exit. ``timeout`` bounds each one's start (and restart); ``popen``
    starts each (the device tests give a warm start's)."""
    procs = [ReplicaProcess(f"r{i}", os.path.join(directory, f"r{i}.journal"), loop,
                            transport=(transports or {}).get(i, "auto"), token=token,
                            start_timeout=timeout, popen=popen)
             for i in range(n)]
    try:
        for p in procs:  # (started together: a Python start is the slow part in the VM)
            p.spawn()
        for p in procs:
            p.started()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def _serve_replica(name: str, journal: str, host: str, port: int,
                         transport: str = "auto") -> None:
    from aiordma.rpc import serve

    token = os.environ.get(TOKEN_ENV)
    interceptors = [require_token(token)] if token else []
    async with await serve(Orders(name, journal), host, port, transport=transport,
                           interceptors=interceptors) as server:
        print(f"serving orders on {host}:{server.port}", flush=True)
        await asyncio.Event().wait()


# -- the scenario ---------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    """What one scenario run saw."""

    loop: str
    outcomes: dict[str, dict[str, int]]  # method -> {"ok": n, "UnknownOutcomeError": n, ...}
    ok_orders: list[str]  # request ids of orders that completed
    unknown_orders: list[str]  # ... that raised UnknownOutcomeError
    ran: Counter[str]  # request id -> times run, over every replica's journal
    stats: Any  # the pool's PoolStats at the end
    killed: str  # the killed replica's address
    ejected_after: float  # s from the SIGKILL to its ejection
    back_after: float  # s from its restart to the pool's reconnect
    calls_after_restart: int  # calls the restarted replica took after it was back
    elapsed: float
    problems: list[str]  # broken promises (empty: all kept)
    names: dict[str, str] = dataclasses.field(default_factory=dict)  # address -> name
    transports: dict[str, str] = dataclasses.field(default_factory=dict)  # address -> what
    # its process was told to take ("auto", "tcp", ...)
    refused: Exception | None = None  # what the call without the token got (token required)
    refused_at: str = ""  # the replica it was made to
    metrics_url: str = ""  # where the pool's metrics were served, if they were
    metrics: str | None = None  # the one scrape's text (None: not scraped)
    metrics_note: str = ""  # why there are no metrics, if there are none


REFUSED_ID = "order-refused"
"""The request id of the call made without the token (no journal may hold it)."""


def answered(r: Any) -> int:
    """The attempts a replica answered, as the pool counted them (its ``ReplicaStats``):
    sent, less those lost with a connection and those still out."""
    return int(r.calls - r.failures - r.outstanding)


async def _wait_for(cond: Any, what: str, timeout: float = STEP) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not cond():
        if loop.time() - t0 > timeout:
            raise TimeoutError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.005)
    return loop.time() - t0


async def _run(procs: list[ReplicaProcess], *, loop_name: str, ops: int, workers: int,
               work: float, victim: int, quiet: bool, token: str | None = None,
               metrics: bool = False) -> Outcome:
    """The scenario on running replicas (see the module). With ``token``, the pool sends it
    (:func:`send_token`) and one call is made without it, to the first TCP-only replica (or
    the last one); with ``metrics``, the pool's counters are served and scraped once."""
    from aiordma.rpc import RpcClient, UnknownOutcomeError, connect, connect_pool

    from .demo_metrics import PoolEndpoint

    outcomes: dict[str, Counter[str]] = {"price": Counter(), "order": Counter()}
    ok_orders: list[str] = []
    unknown_orders: list[str] = []
    done = 0
    killed = procs[victim]
    interceptors = [send_token(token)] if token else []
    pool = await connect_pool([p.address for p in procs], timeout=STEP, health_interval=0.5,
                              health_timeout=5.0, connect_timeout=10.0, reconnect_cap=1.0,
                              wait_for_replica=STEP, interceptors=interceptors)
    loop = asyncio.get_running_loop()
    t_start = loop.time()
    endpoint: PoolEndpoint | str | None = None
    scraped: str | None = None
    try:
        if metrics:
            endpoint = PoolEndpoint.start(pool)
            if not quiet:
                print(f"  metrics: {endpoint.url}" if isinstance(endpoint, PoolEndpoint)
                      else f"  {endpoint}")
        def replica_of(addr: str) -> Any:
            return next(r for r in pool.stats().replicas if r.address == addr)

        cursor = iter(range(ops))
        back = asyncio.Event()  # the killed replica is back: the last third may start

        async def worker() -> None:
            nonlocal done
            for i in cursor:
                if i >= ops - ops // 3:
                    await back.wait()
                kind = "price" if i % 2 == 0 else "order"
                rid = f"{kind}-{i}"
                try:
                    await pool.call(kind, rid, f"item-{i % 7}", work, timeout=STEP)
                    outcomes[kind]["ok"] += 1
                    if kind == "order":
                        ok_orders.append(rid)
                except UnknownOutcomeError:
                    outcomes[kind]["UnknownOutcomeError"] += 1
                    if kind == "order":
                        unknown_orders.append(rid)
                except Exception as exc:  # noqa: BLE001  # counted: a broken promise
                    outcomes[kind][type(exc).__name__] += 1
                done += 1

        load = [asyncio.ensure_future(worker()) for _ in range(workers)]
        try:
            await _wait_for(lambda: done >= ops // 3, "a third of the calls")
            t_kill = killed.kill()
            if not quiet:
                print(f"  {done} calls done: SIGKILL {killed.name} ({killed.address})")
            await _wait_for(lambda: replica_of(killed.address).state != "UP", "the ejection")
            ejected_after = time.monotonic() - t_kill
            if not quiet:
                print(f"  ejected {ejected_after * 1000:.0f} ms after the kill; restarting it")
            await asyncio.to_thread(killed.reap)
            await asyncio.to_thread(killed.start)
            t_restart = loop.time()
            await _wait_for(lambda: replica_of(killed.address).reconnects >= 1, "the reconnect")
            back_after = loop.time() - t_restart
            calls_back = replica_of(killed.address).calls
            back.set()
            if not quiet:
                print(f"  {killed.name} back {back_after * 1000:.0f} ms after its restart "
                      f"({done} calls done)")
            await asyncio.wait_for(asyncio.gather(*load), STEP * 5)
        finally:
            for t in load:
                t.cancel()
        elapsed = loop.time() - t_start
        calls_after = replica_of(killed.address).calls - calls_back
        stats = pool.stats()
        if isinstance(endpoint, PoolEndpoint):
            scraped = await endpoint.scrape(STEP)
    finally:
        try:
            if isinstance(endpoint, PoolEndpoint):
                await endpoint.close()
        finally:
            await pool.aclose()
    refused: Exception | None = None
    refused_at = ""
    if token:  # one call without the token: refused before its method runs
        target = next((p for p in procs if p.transport == "tcp"), procs[-1])
        refused_at = target.address
        async with await connect("127.0.0.1", target.port, timeout=STEP) as bare:
            try:
                await bare.call("order", REFUSED_ID, "item-0", timeout=STEP)
            except Exception as exc:  # noqa: BLE001  # what it got is the outcome (checked)
                refused = exc
    ran: Counter[str] = Counter()
    for p in procs:  # what each replica ran, read back by a call (its journal: all its lives)
        client: RpcClient = await connect("127.0.0.1", p.port, timeout=STEP,
                                          interceptors=interceptors)
        async with client:
            ran.update(await client.call("journal", timeout=STEP))
    out = Outcome(loop=loop_name, outcomes={k: dict(v) for k, v in outcomes.items()},
                  ok_orders=ok_orders, unknown_orders=unknown_orders, ran=ran, stats=stats,
                  killed=killed.address, ejected_after=ejected_after, back_after=back_after,
                  calls_after_restart=calls_after, elapsed=elapsed, problems=[],
                  names={p.address: p.name for p in procs},
                  transports={p.address: p.transport for p in procs}, refused=refused,
                  refused_at=refused_at,
                  metrics_url=endpoint.url if isinstance(endpoint, PoolEndpoint) else "",
                  metrics=scraped,
                  metrics_note=endpoint if isinstance(endpoint, str) else "")
    out.problems = check(out, ops)
    return out


def check(out: Outcome, ops: int) -> list[str]:
    """The pool's promises, against what the calls got and what the replicas ran."""
    problems = []
    prices = (ops + 1) // 2
    if out.outcomes["price"] != {"ok": prices}:
        problems.append(f"idempotent calls lost: {out.outcomes['price']} of {prices}")
    orders = out.outcomes["order"]
    if set(orders) - {"ok", "UnknownOutcomeError"}:
        problems.append(f"orders failed other than typed: {orders}")
    twice = sorted(rid for rid, n in out.ran.items() if rid.startswith("order-") and n > 1)
    if twice:
        problems.append(f"orders run more than once: {twice[:10]}")
    not_once = [rid for rid in out.ok_orders if out.ran[rid] != 1]
    if not_once:
        problems.append(f"completed orders not run exactly once: {not_once[:10]}")
    never = [i for i in range(0, ops, 2) if out.ran[f"price-{i}"] < 1]
    if never:
        problems.append(f"completed prices that no replica ran: {never[:10]}")
    if out.stats.ejections < 1 or out.stats.reconnects < 1:
        problems.append(f"no ejection or reconnect counted: {out.stats}")
    for r in out.stats.replicas:
        if out.transports.get(r.address) == "tcp" and r.transport != "tcp":
            problems.append(f"{r.address} takes TCP only, yet the pool reached it over "
                            f"{r.transport}")
        if answered(r) < 1:
            problems.append(f"{r.address} ({r.transport}) answered no call")
    if out.refused_at:
        from aiordma.rpc import RemoteError

        if not (isinstance(out.refused, RemoteError)
                and out.refused.type_name == "PermissionError"):
            problems.append(f"the call without the token was not refused with "
                            f"PermissionError: it got {out.refused!r}")
        if out.ran[REFUSED_ID]:
            problems.append("the call without the token ran")
    if out.metrics is not None:
        from .demo_metrics import METRICS_NAME

        line = f'aiordma_rpc_pool_calls_total{{pool="{METRICS_NAME}"}} {float(out.stats.calls)}'
        if line not in out.metrics.splitlines():
            problems.append(f"the scrape has no {line!r}")
    return problems


TCP_REPLICA = 2
"""Which of the demo's three replicas takes TCP only (the others: RDMA, where there is a
device). The one killed is another (``victim``), so the TCP one serves the whole run."""


def scenario(*, loop: str = "uvloop", ops: int = 600, workers: int = 12, work: float = 0.02,
             victim: int = 1, quiet: bool = True) -> Outcome:
    """Three replica processes (one TCP only, all requiring a token), the load, the kill and
    the restart, the refused call and the metrics scrape (see the module); the replicas run
    ``loop`` too."""
    runner = uvloop.run if loop == "uvloop" else asyncio.run
    token = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory(prefix="aiordma-micro-") as d, \
            replicas(3, loop, d, transports={TCP_REPLICA: "tcp"}, token=token) as procs:
        return runner(_run(procs, loop_name=loop, ops=ops, workers=workers, work=work,
                           victim=victim, quiet=quiet, token=token, metrics=True))


def run_micro_demo(*, ops: int = 600, workers: int = 12, loop: str = "uvloop") -> int:
    from aiordma.lowlevel import list_devices

    from .demo_metrics import print_scrape
    from .devices import print_devices as _print_devices

    _print_devices(list_devices())
    print(f"\nmicroservices: 3 replicas of an order service, each its own process, r"
          f"{TCP_REPLICA} taking TCP only (as a host without a device), the others RDMA; each "
          f"refuses calls without a token in their metadata; a pool (aiordma.rpc.connect_pool) "
          f"here ({loop}) whose interceptor adds the token, {workers} tasks, {ops} calls: half "
          f"price() (idempotent), half order() (not); one replica killed (SIGKILL) after a "
          f"third, then started again; the pool's counters served for Prometheus")
    out = scenario(loop=loop, ops=ops, workers=workers, quiet=False)
    s = out.stats
    print(f"\n  {'method':<8} {'calls':>6}  outcome")
    for kind, got in out.outcomes.items():
        print(f"  {kind:<8} {sum(got.values()):6d}  "
              + ", ".join(f"{name} {n}" for name, n in sorted(got.items())))
    print(f"  ({out.elapsed:.2f} s)\n\n  pool: calls {s.calls}, retries {s.retries} (budget "
          f"refused {s.retries_refused}), unknown outcomes {s.unknown_outcomes}, ejections "
          f"{s.ejections}, reconnects {s.reconnects}, connect failures {s.connect_failures}")
    print(f"  {'replica':<19} {'transport':<9} {'state':<6} {'sent':>5} {'answered':>8} "
          f"{'failed':>6} {'ejected':>7} {'back':>4} {'connect failures':>16}")
    for r in sorted(s.replicas, key=lambda r: out.names.get(r.address, r.address)):
        name = f"{out.names.get(r.address, '?')} {r.address}"
        print(f"  {name:<19} {r.transport or '-':<9} {r.state:<6} {r.calls:5d} "
              f"{answered(r):8d} {r.failures:6d} {r.ejections:7d} {r.reconnects:4d} "
              f"{r.connect_failures:16d}")
    carried: dict[str, list[int]] = {}
    for r in s.replicas:
        carried.setdefault(r.transport or "none", []).append(answered(r))
    print("  carried: " + "; ".join(
        f"{t} {sum(n)} calls answered by {len(n)} replica{'s' if len(n) > 1 else ''}"
        for t, n in sorted(carried.items())))
    over = next((r.transport for r in s.replicas if r.address == out.refused_at), None)
    print(f"\n  a call without the token, to {out.names.get(out.refused_at)} "
          f"{out.refused_at} (over {over}): refused, {type(out.refused).__name__}: "
          f"{out.refused}; ran: {out.ran[REFUSED_ID]} times")
    print_scrape(out.metrics_url, out.metrics, out.metrics_note)
    ran_unknown = sum(1 for rid in out.unknown_orders if out.ran[rid])
    print(f"\n  the journals: {sum(1 for r in out.ran if r.startswith('order-'))} orders ran, "
          f"none twice: {max((n for r, n in out.ran.items() if r.startswith('order-')), default=0) <= 1}; "
          f"of the {len(out.unknown_orders)} that failed typed, {ran_unknown} had run before "
          f"the kill and {len(out.unknown_orders) - ran_unknown} had not")
    print(f"  ejected {out.ejected_after * 1000:.0f} ms after the kill; back "
          f"{out.back_after * 1000:.0f} ms after the restart, then took "
          f"{out.calls_after_restart} calls")
    for p in out.problems:
        print(f"  PROBLEM: {p}")
    print("  every promise kept" if not out.problems else "  promises broken")
    return 1 if out.problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.cli.demo_micro")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("replica", help="serve one replica of the order service")
    r.add_argument("--name", default="orders")
    r.add_argument("--journal", required=True)
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=0)
    r.add_argument("--loop", choices=["asyncio", "uvloop"], default="uvloop")
    r.add_argument("--transport", choices=["auto", "rdma", "tcp"], default="auto",
                   help="which clients it takes (tcp: as a host without a device)")
    a = p.parse_args(argv)
    (uvloop.run if a.loop == "uvloop" else asyncio.run)(
        _serve_replica(a.name, a.journal, a.host, a.port, a.transport))
    return 0


if __name__ == "__main__":
    sys.exit(main())
