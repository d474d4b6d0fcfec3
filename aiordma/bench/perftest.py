"""perftest, the C baseline: run a server and client pair on one device, parse the report.

perftest (Debian's ``perftest`` package) prints one result line under a header such as::

     #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec] ...
     64      200          288.72         56742.58      2859.69    3328.91 ...

The parsers are pure (text in, numbers out; tests run them on captured real output). Units
are perftest's: latency in microseconds **one way** (half a round trip, as ``ib_send_lat``
measures it), bandwidth in its ``MB/sec``, which is 2**20 bytes per second (perftest divides
by ``0x100000``), so it is reported here as MiB/s.

:func:`run_pair` starts the server, then the client towards 127.0.0.1 (the TCP exchange of
queue-pair numbers; the traffic itself goes over the device and GID given), retrying the
client while the server is not listening yet. Both are killed at the deadline. With
``across`` (the bench across a :class:`~aiordma.bench.link.Link`) the server runs on the far
host, and the client here connects to that host's address.

perftest times with the CPU's time-stamp counter. In the rxe VM the guest kernel says "Marking
TSC unstable due to TSCs unsynchronized": a process that moves between CPUs mid-run reads
counters that disagree, and perftest then prints nonsense (0.00 MB/sec was seen). So each
process is pinned to one CPU (``cpus``: server, client) with ``taskset``, and every figure is
checked against the wall clock (:func:`check_against_wall_clock`).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aiordma import AiordmaError, OperationTimeout

from .link import RemoteProcess

__all__ = ["Across", "BandwidthReport", "LatencyReport", "PerftestError", "RemoteServer",
           "check_against_wall_clock", "parse_bandwidth", "parse_latency", "pinning", "run_pair"]


class PerftestError(Exception):
    """perftest failed, timed out, or printed no result line; ``output`` holds what it said.
    ``missing`` is True when the tool is not installed (no point in trying again)."""

    def __init__(self, message: str, output: str = "", *, missing: bool = False) -> None:
        super().__init__(message)
        self.output = output
        self.missing = missing


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyReport:
    """One ``ib_*_lat`` result line; times in microseconds, one way."""

    size: int
    iterations: int
    t_min: float
    t_max: float
    t_typical: float
    t_avg: float
    t_stdev: float
    p99: float
    p999: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BandwidthReport:
    """One ``ib_*_bw`` result line; bandwidth in MiB/s (perftest's MB/sec), rate in Mpps."""

    size: int
    iterations: int
    bw_peak: float
    bw_avg: float
    msg_rate: float


_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|-?nan|-?inf"


def _result_line(text: str, header_word: str, columns: int) -> list[float]:
    """The numbers of the first line after the header holding ``header_word``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "#bytes" in line and header_word in line:
            for row in lines[i + 1:]:
                if row.lstrip().startswith("#bytes"):
                    continue
                nums = re.findall(_NUM, row)
                if len(nums) >= columns and not row.lstrip().startswith("-"):
                    return [float(n) for n in nums[:columns]]
                if row.strip().startswith("---"):
                    break
    raise PerftestError(f"no result line under a '{header_word}' header", text)


def parse_latency(text: str) -> LatencyReport:
    """Parse ``ib_send_lat`` (or ``ib_write_lat``...) output.

    Raises:
        PerftestError: no result line.
    """
    v = _result_line(text, "t_typical", 9)
    return LatencyReport(size=int(v[0]), iterations=int(v[1]), t_min=v[2], t_max=v[3],
                         t_typical=v[4], t_avg=v[5], t_stdev=v[6], p99=v[7], p999=v[8])


def parse_bandwidth(text: str) -> BandwidthReport:
    """Parse ``ib_write_bw`` / ``ib_read_bw`` / ``ib_send_bw`` output.

    Raises:
        PerftestError: no result line.
    """
    v = _result_line(text, "BW average", 5)
    return BandwidthReport(size=int(v[0]), iterations=int(v[1]), bw_peak=v[2], bw_avg=v[3],
                           msg_rate=v[4])


def check_against_wall_clock(report: LatencyReport | BandwidthReport, seconds: float) -> None:
    """Refuse a figure that the client's own run time makes impossible.

    A latency run of ``n`` round trips has at least ``n / 2`` of them no shorter than
    ``2 * t_typical``, so ``t_typical <= seconds / n``; a bandwidth run moved
    ``size * iterations`` bytes within ``seconds``, so its average is at least that over
    ``seconds``. (Set-up only adds to ``seconds``, so the bounds are loose but never wrong.)

    Raises:
        PerftestError: the figure contradicts the wall clock (e.g. unsynchronized TSCs).
    """
    if isinstance(report, LatencyReport):
        bound = seconds * 1e6 / report.iterations
        if not 0 < report.t_typical <= bound:
            raise PerftestError(f"t_typical {report.t_typical} us is impossible: "
                                f"{report.iterations} round trips took {seconds:.2f} s")
    else:
        bound = report.size * report.iterations / seconds / (1 << 20)
        if not report.bw_avg >= bound > 0:
            raise PerftestError(f"{report.bw_avg} MiB/s is impossible: {report.iterations} x "
                                f"{report.size} B took at most {seconds:.2f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connect_failed(output: str) -> bool:
    """Whether a client's output says the server was not listening yet."""
    return "Couldn't connect" in output or "Unable to open file descriptor" in output \
        or "Connection refused" in output


def pinning() -> tuple[int, int] | None:
    """CPUs for perftest's server and client: two different ones where there are two and
    ``taskset`` exists (the same one on a single CPU), else None (not pinned)."""
    if shutil.which("taskset") is None:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[0], allowed[-1]) if allowed else None


class _Server(Protocol):
    """perftest's server process, here or on host 2 (what :func:`run_pair` needs of it)."""

    def poll(self) -> int | None: ...

    def wait(self, timeout: float) -> int: ...  # raises subprocess.TimeoutExpired

    def kill(self) -> None: ...


class _LocalServer:
    def __init__(self, argv: list[str]) -> None:
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float) -> int:
        return self._proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


class RemoteServer:
    """perftest's server on the far host of a :class:`~aiordma.bench.link.Link`, as
    :func:`run_pair` needs it (a wait that runs out raises ``subprocess.TimeoutExpired``, a
    host that is gone :class:`PerftestError`); killed with its process group."""

    def __init__(self, proc: RemoteProcess) -> None:
        self._proc = proc

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float) -> int:
        try:
            return self._proc.wait(timeout)
        except OperationTimeout:
            raise subprocess.TimeoutExpired(self._proc.argv, timeout) from None
        except AiordmaError as exc:  # the far host is gone
            raise PerftestError(f"perftest's server on host 2: {exc}") from exc

    def kill(self) -> None:
        self._proc.kill()


@dataclass(frozen=True, slots=True, kw_only=True)
class Across:
    """Where perftest's server runs when it is not here: on the far host of a link, its
    client connecting to ``address`` (that host's link address)."""

    address: str
    device: str
    gid_index: int
    #: starts the server's command there (:class:`RemoteServer` over the link's
    #: :meth:`~aiordma.bench.link.Link.start`; a test puts its own here)
    start: Callable[[list[str]], _Server]


def run_pair(tool: str, args: list[str], *, device: str, gid_index: int,
             timeout: float = 120.0, cpus: tuple[int, int] | None = None,
             across: Across | None = None) -> tuple[str, float]:
    """Run ``tool`` as server and client on ``device`` (GID ``gid_index``); the client's output
    and how long the client ran (seconds, wall clock).

    Args:
        tool: ``ib_send_lat``, ``ib_write_bw``, ...
        args: the test's options, e.g. ``["-s", "64", "-n", "1000", "-e"]``.
        timeout: seconds for the whole pair; both are killed then.
        cpus: pin the server to ``cpus[0]`` and the client to ``cpus[1]`` (see above); not
            with ``across``.
        across: run the server there (host 2, on its device and GID), and the client here
            towards its address.

    Raises:
        PerftestError: the tool is missing, failed, or did not finish in time.
    """
    if shutil.which(tool) is None:
        raise PerftestError(f"{tool} is not installed (Debian package perftest)", missing=True)
    port = _free_port()
    common = ["-F", "-p", str(port), *args]
    client_argv = [tool, "-d", device, "-x", str(gid_index), *common]
    deadline = time.monotonic() + timeout
    server: _Server
    if across is None:
        pin_server, pin_client = ([["taskset", "-c", str(c)] for c in cpus] if cpus
                                  else [[], []])
        server = _LocalServer([*pin_server, *client_argv])
        client_argv = [*pin_client, *client_argv, "127.0.0.1"]
    else:
        try:
            server = across.start([tool, "-d", across.device, "-x", str(across.gid_index),
                                   *common])
        except AiordmaError as exc:  # host 2's agent did not answer
            raise PerftestError(f"{tool}'s server on host 2 did not start: {exc}") from exc
        client_argv = [*client_argv, across.address]
    client_out = ""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PerftestError(f"{tool} did not finish within {timeout:.0f} s", client_out)
            started = time.monotonic()
            try:
                client = subprocess.run(client_argv, capture_output=True, text=True,
                                        timeout=left, check=False)
            except subprocess.TimeoutExpired as exc:
                out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) \
                    else (exc.stdout or "")
                raise PerftestError(f"{tool} did not finish within {timeout:.0f} s",
                                    out) from None
            client_out = client.stdout + client.stderr
            seconds = time.monotonic() - started
            if client.returncode == 0:
                break
            if _connect_failed(client_out) and server.poll() is None:
                time.sleep(0.2)  # the server is not listening yet
                continue
            raise PerftestError(f"{tool} client exited with status {client.returncode}",
                                client_out)
        try:
            server.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise PerftestError(f"{tool} server did not finish within {timeout:.0f} s",
                                client_out) from None
        return client_out, seconds
    finally:
        server.kill()
