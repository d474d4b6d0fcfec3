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
client while the server is not listening yet. Both are killed at the deadline.

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
from dataclasses import dataclass

__all__ = ["BandwidthReport", "LatencyReport", "PerftestError", "check_against_wall_clock",
           "parse_bandwidth", "parse_latency", "pinning", "run_pair"]


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


def run_pair(tool: str, args: list[str], *, device: str, gid_index: int,
             timeout: float = 120.0, cpus: tuple[int, int] | None = None) -> tuple[str, float]:
    """Run ``tool`` as server and client on ``device`` (GID ``gid_index``); the client's output
    and how long the client ran (seconds, wall clock).

    Args:
        tool: ``ib_send_lat``, ``ib_write_bw``, ...
        args: the test's options, e.g. ``["-s", "64", "-n", "1000", "-e"]``.
        timeout: seconds for the whole pair; both are killed then.
        cpus: pin the server to ``cpus[0]`` and the client to ``cpus[1]`` (see above).

    Raises:
        PerftestError: the tool is missing, failed, or did not finish in time.
    """
    if shutil.which(tool) is None:
        raise PerftestError(f"{tool} is not installed (Debian package perftest)", missing=True)
    port = _free_port()
    common = [tool, "-d", device, "-x", str(gid_index), "-F", "-p", str(port), *args]
    pin_server, pin_client = ([["taskset", "-c", str(c)] for c in cpus] if cpus else [[], []])
    deadline = time.monotonic() + timeout
    server = subprocess.Popen([*pin_server, *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    client_out = ""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PerftestError(f"{tool} did not finish within {timeout:.0f} s", client_out)
            started = time.monotonic()
            try:
                client = subprocess.run([*pin_client, *common, "127.0.0.1"], capture_output=True, text=True,
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
            server.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise PerftestError(f"{tool} server did not finish within {timeout:.0f} s",
                                client_out) from None
        return client_out, seconds
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()
