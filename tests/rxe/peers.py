"""Device-test helpers: connected endpoint pairs in this process, ``peer_process.py`` (a
listener in another process) for two-process tests, raw queue pairs for crafted frames, and a
bounded wait."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack

import aiordma
from aiordma import Config, RemoteBuffer
from aiordma.lowlevel import MemoryRegion

from ..bounds import STEP, hang_guard
from . import warm


@contextlib.contextmanager
def peer_process(loop: str = "asyncio", die_after: int | None = None) -> Iterator[int]:
    """Run the peer; yield its port; kill it on exit."""
    script = os.path.join(os.path.dirname(__file__), "peer_process.py")
    args = [sys.executable, script, "--loop", loop]
    if die_after is not None:
        args += ["--die-after", str(die_after)]
    proc = warm.popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "" if it died first: no hang
        assert line.startswith("PORT "), f"peer process said {line!r}"
        yield int(line.split()[1])
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextlib.contextmanager
def served_by_cli(service: str, *options: str, timeout: float | None = None) -> Iterator[int]:
    """Run ``aiordma serve SERVICE OPTIONS`` in another process; yield its port; stop it on
    exit. Waits at most ``timeout`` for the "serving" line (default: a hang guard scaled by
    the load, as a Python process's start is what a busy VM slows most)."""
    with server_process(service, *options, timeout=timeout) as (port, _pid):
        yield port


@contextlib.contextmanager
def server_process(service: str, *options: str, timeout: float | None = None
                   ) -> Iterator[tuple[int, int]]:
    """:func:`served_by_cli`, yielding ``(port, pid)`` (the pid: for the kernel's counts of
    the server's resources)."""
    from aiordma.bench.process import announced_process

    args = [sys.executable, "-m", "aiordma", "serve", service, "--port", "0", *options]
    bound = hang_guard() if timeout is None else timeout
    with announced_process(args, f"serving {service} on ", timeout=bound,
                           popen=warm.popen) as (line, proc):
        yield int(line.split()[3].rsplit(":", 1)[1]), proc.pid


# -- for the fault catalogue (tests/rxe/test_faults_*.py) -------------------------------------


class KillablePeer:
    """A running ``peer_process.py``: its ports and pid, and a SIGKILL that says when it was
    sent."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, rpc_port: int | None) -> None:
        self.proc = proc
        self.port = port
        self.rpc_port = rpc_port
        self.pid = proc.pid

    def kill(self) -> float:
        """SIGKILL the process now; return ``time.monotonic()`` just before the signal."""
        import time

        t = time.monotonic()
        self.proc.kill()
        return t


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """One line of ``proc``'s output, bounded (no hang if it never says anything): read a byte
    at a time from the unbuffered pipe, so that a line that came with the one before is not
    left in a buffer that ``select`` does not see (a buffered ``readline()`` took both
    announcement lines when they arrived together, and the wait for the second then timed
    out: the "stall between PORT and RPC", seen on a busy host)."""
    import selectors

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    line = bytearray()
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            if not sel.select(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the peer process said {bytes(line)!r}, not a whole line, "
                                   f"within {timeout} s")
            byte = os.read(fd, 1)
            if not byte:  # it ended
                break
            line += byte
    return line.decode()


def _start_announced(args: list[str], want: int,
                     timeout: float) -> tuple[subprocess.Popen[bytes], list[str]]:
    """Start ``args`` and read its first ``want`` lines, each bounded by ``timeout``. A
    start-up that stalls has its stacks dumped (peer_process.py registers faulthandler on
    SIGUSR1; its stderr goes to the test's output) and is started once more: the start is not
    what the tests check. (The stalls seen between the two lines were this reader's: see
    :func:`_read_line`; one seen before the first line has no known cause.)"""
    for attempt in (1, 2):
        proc = warm.popen(args, stdout=subprocess.PIPE, bufsize=0)
        lines: list[str] = []
        try:
            while len(lines) < want:
                lines.append(_read_line(proc, timeout))
            return proc, lines
        except TimeoutError:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            proc.kill()
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
            print(f"peer_process.py said {len(lines)} of {want} lines within {timeout} s "
                  f"(attempt {attempt}); its stacks are above", file=sys.stderr)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def killable_peer(loop: str = "asyncio", *, rpc: bool = False, call: int | None = None,
                  recv_buffer: int | None = None, stream_window: int | None = None,
                  timeout: float = 120.0) -> Iterator[KillablePeer]:
    """Run ``peer_process.py`` (a listener, ``rpc=True``: also an RPC server; ``call=PORT``: an
    RPC client calling ``hold`` on PORT instead; ``recv_buffer``: its listener's
    ``Config.recv_buffer``; ``stream_window``: its RPC server's); yield it once it announced
    itself (for a caller: once its call is sent); kill it on exit. Start-up is bounded by
    ``timeout``."""
    script = os.path.join(os.path.dirname(__file__), "peer_process.py")
    args = [sys.executable, script, "--loop", loop]
    if rpc:
        args.append("--rpc")
    if call is not None:
        args += ["--call", str(call)]
    if recv_buffer is not None:
        args += ["--recv-buffer", str(recv_buffer)]
    if stream_window is not None:
        args += ["--stream-window", str(stream_window)]
    want = 2 if rpc and call is None else 1  # "PORT" (and "RPC"), or "CALLING"
    proc, lines = _start_announced(args, want, timeout)
    try:
        line = lines[0]
        if call is not None:
            assert line.startswith("CALLING"), f"the caller process said {line!r}"
            yield KillablePeer(proc, call, None)
            return
        assert line.startswith("PORT "), f"peer process said {line!r}"
        port, rpc_port = int(line.split()[1]), None
        if rpc:
            line = lines[1]
            assert line.startswith("RPC "), f"peer process said {line!r}"
            rpc_port = int(line.split()[1])
        yield KillablePeer(proc, port, rpc_port)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


class RawConnection:
    """A queue pair connected to a live listener through the real handshake, then driven by
    hand: a misbehaving peer that posts whatever bytes a test crafts (see
    :func:`raw_connect`). ``close()`` releases everything (queue pair, CQ, memory, TCP)."""

    def __init__(self, reactor: Any, qp: Any, mr: Any, reader: Any, writer: Any) -> None:
        self.reactor, self.qp, self.mr = reactor, qp, mr
        self.reader, self.writer = reader, writer
        self.tcp_port: int = writer.get_extra_info("sockname")[1]

    async def post(self, data: bytes, timeout: float = STEP) -> None:
        """SEND ``data`` as one message (at most 64 KiB); returns once it completed.

        Raises:
            CompletionError: the peer refused it (e.g. longer than its receive slot).
        """
        import asyncio

        self.mr.view[:len(data)] = data
        await asyncio.wait_for(self.qp.send(self.mr[0:len(data)]), timeout)

    async def closed_by_peer(self, timeout: float = STEP) -> bool:
        """Read the TCP connection until the peer closes (EOF or reset); False on timeout."""
        import asyncio

        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:  # (first: it is an OSError too)
            return False
        except (ConnectionError, OSError):
            pass
        return True

    def close(self) -> None:
        self.qp.close()
        self.mr.close()
        self.reactor.close()
        self.writer.transport.abort()


async def raw_connect(device: Any, port: int, *, timeout: float = STEP) -> RawConnection:
    """Set up a queue pair to the listener at ``port`` as :func:`aiordma.connect` would (Hello,
    Accept, Ready over TCP), but return the bare queue pair: nothing is posted, no frames are
    built, no credits are kept. A window of 4 data and 3 control slots of 8 KiB is announced (and posted,
    so the listener's sends do not meet an empty receive queue)."""
    import asyncio

    from aiordma.lowlevel import CompletionReactor, MemoryRegion, QPAddress, QueuePair
    from aiordma.protocols import handshake as hs

    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    reactor = CompletionReactor(device)
    qp = QueuePair(device, reactor, max_send_wr=16, max_recv_wr=16)
    mr = MemoryRegion(device, bytearray(1 << 17))
    conn = RawConnection(reactor, qp, mr, reader, writer)
    try:
        control = hs.ControlConnection(hs.Role.CLIENT)
        a = qp.local_address()
        writer.write(control.send(hs.Hello(qp_num=a.qp_num, psn=a.psn, gid=a.gid, lid=a.lid,
                                           mtu=a.mtu, data_slots=4, ctrl_slots=3,
                                           slot_size=8192, max_rd_atomic=1)))
        async with asyncio.timeout(timeout):
            while (ev := control.next_event()) is hs.NEED_DATA:
                control.receive_data(await reader.read(65536))
        assert isinstance(ev, hs.Accept), f"the listener answered {ev!r}"
        qp.connect(QPAddress(qp_num=ev.qp_num, psn=ev.psn, gid=ev.gid, lid=ev.lid, mtu=ev.mtu))
        for i in range(7):
            qp.post_recv(1000 + i, mr.address + (1 << 16) + i * 8192, 8192, mr.lkey)
        writer.write(control.send(hs.Ready()))
        await asyncio.wait_for(writer.drain(), timeout)
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.asynccontextmanager
async def in_thread(cm: contextlib.AbstractContextManager[Any]) -> Any:
    """Enter a blocking context manager (e.g. :func:`killable_peer`, which waits for the
    process's first line) from a thread, so the event loop keeps running meanwhile (a server
    on this loop may be what the process connects to)."""
    import asyncio

    value = await asyncio.to_thread(cm.__enter__)
    try:
        yield value
    finally:
        cm.__exit__(None, None, None)


def run_on(loop: str, main: Any) -> Any:
    """Run the coroutine ``main`` to completion on a new loop of that name ("asyncio" or
    "uvloop"), as ``asyncio.run`` does: for the tests that run their own loop."""
    import asyncio

    import uvloop

    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


LOOPS = ["asyncio", "uvloop"]


async def wait_until(cond: Any, what: str, timeout: float = STEP) -> None:
    """Poll ``cond()`` every millisecond until it is true; AssertionError after ``timeout``."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.001)


# -- a connected pair in this process ------------------------------------------------------


class Serving:
    """A listener for tests that hands every accepted endpoint to the test (:meth:`pair`,
    :meth:`accepted`). Its handler holds the endpoint open until the listener closes
    (``handler="hold"``), echoes every message (``"echo"``), or reads and drops them
    (``"drain"``). The one connected-pair builder of the device tests."""

    def __init__(self, device: Any, handler: str = "hold") -> None:
        self.device = device
        self.mode = handler
        self.served: asyncio.Queue[aiordma.Endpoint] = asyncio.Queue()
        self.done = asyncio.Event()
        self.listener: Any = None

    async def _handle(self, ep: aiordma.Endpoint) -> None:
        await self.served.put(ep)
        if self.mode == "echo":
            while (msg := await ep.recv()) is not None:
                await ep.send(msg)
        elif self.mode == "drain":
            while await ep.recv() is not None:
                pass
        else:
            await self.done.wait()  # the listener closes the endpoint when this returns

    @property
    def port(self) -> int:
        return int(self.listener.port)

    async def accepted(self) -> aiordma.Endpoint:
        """The server-side endpoint of the next client."""
        return await asyncio.wait_for(self.served.get(), STEP)

    async def pair(self, config: Config | None = None
                   ) -> tuple[aiordma.Endpoint, aiordma.Endpoint]:
        """Connect a client; (client, its server-side endpoint)."""
        client = await aiordma.connect("127.0.0.1", self.port, timeout=STEP,
                                       device=self.device, config=config)
        return client, await self.accepted()


@contextlib.asynccontextmanager
async def serving(device: Any, *, handler: str = "hold", **listen: Any
                  ) -> AsyncIterator[Serving]:
    """A :class:`Serving` listener (``listen`` goes to :func:`aiordma.listen`), closed on
    exit (its endpoints with it)."""
    srv = Serving(device, handler)
    srv.listener = await aiordma.listen(srv._handle, "127.0.0.1", 0, device=device, **listen)
    try:
        yield srv
    finally:
        srv.done.set()
        await asyncio.wait_for(srv.listener.aclose(), STEP)


@contextlib.asynccontextmanager
async def endpoints(device: Any, config: Config | None = None
                    ) -> AsyncIterator[tuple[aiordma.Endpoint, aiordma.Endpoint]]:
    """(client, server): a connected pair in this process; both aborted on exit."""
    async with serving(device, config=config) as srv:
        client, server = await srv.pair(config)
        try:
            yield client, server
        finally:
            client.abort()
            server.abort()


async def exposed(owner: aiordma.Endpoint, peer: aiordma.Endpoint, data: bytes
                  ) -> tuple[MemoryRegion, RemoteBuffer]:
    """A region of ``owner`` holding ``data``, and the descriptor as ``peer`` received it."""
    mr = owner.register(bytearray(data))
    await asyncio.wait_for(owner.send(msgpack.packb(mr.expose(read=True, write=True,
                                                              atomic=True).to_wire())), STEP)
    return mr, RemoteBuffer.from_wire(msgpack.unpackb(await asyncio.wait_for(peer.recv(), STEP)))
