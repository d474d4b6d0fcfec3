"""The bound on a VM's boot, and QEMU's output read so that every wait on it has one.

A guest says it is ready with a line of its own (:data:`READY_MARK`; in the pair, host 1's
up line and host 2's agent listening) once its kernel is up and rxe is set up: 3.7-4.0 s on a
quiet machine, about twice that beside other CPU-bound jobs. One boot in about 14 once hung with an empty console,
QEMU busy on both CPUs, for more than 5 minutes. So a guest gets :func:`boot_bound` seconds to
say it: :data:`BOOT_BOUND` (or ``$AIORDMA_BOOT_BOUND``) scaled by this machine's 1-minute load
average per CPU. A guest that stays silent past it is killed and booted once more; a second
silence is a :class:`BootError` that names the console log and shows its last lines (the log
is kept, in :func:`failed_boots_dir`).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from aiordma import DeviceError
from aiordma._verbs.load import cache_dir

__all__ = ["BOOT_BOUND", "BOUND_ENV", "READY_MARK", "BootBound", "BootError", "QemuOutput",
           "boot_bound", "boot_failure", "interrupt", "keep_console_log", "kill_group",
           "load_bound", "read_status", "tail"]

#: The line a one-host guest prints once rxe is up (host 1 of a pair: once host 2's agent
#: answers too).
READY_MARK = "[aiordma-rxe] guest ready"

#: Seconds a guest gets to say it is ready on an idle machine (before the load's scaling).
#: Measured (2026-11-26, 2 cores): one-host boots 3.7-4.0 s quiet, 5.1-9.5 s at load 1.9-3.4;
#: in the pair (1 vCPU each, booting together) host 1 up in 4.8-13.3 s and host 2's agent
#: listening in 7.7-18.9 s at load 2.3-3.3 (its bound there: 65-79 s). The hung boot never
#: printed anything. A healthy boot killed by mistake costs one boot more; a hung one costs
#: this bound instead of the minutes it took someone to notice.
BOOT_BOUND = 30.0
#: The environment variable that replaces :data:`BOOT_BOUND` (seconds).
BOUND_ENV = "AIORDMA_BOOT_BOUND"
#: Console logs of failed boots kept (the newest).
KEEP_LOGS = 20


def log(msg: str) -> None:
    """A line of the harness's own, on stderr (``[rxe] ...``, as the installed rxe set-up)."""
    print(f"[rxe] {msg}", file=sys.stderr, flush=True)


class BootError(DeviceError):
    """A VM printed no guest-ready line within its bound, on its first boot and on the one
    after it: QEMU was killed each time. The message names the console logs (kept) and
    shows the last one's last lines."""


@dataclass(frozen=True, slots=True)
class BootBound:
    """How long a guest gets to say it is ready: ``base`` x (1 + ``load`` / ``cpus``)."""

    seconds: float
    base: float
    load: float
    cpus: int

    def describe(self) -> str:
        return (f"{self.seconds:.0f} s ({self.base:g} s x (1 + load average {self.load:.2f} / "
                f"{self.cpus} CPUs))")


def boot_bound(base: float | None = None, *, load: float | None = None,
               cpus: int | None = None) -> BootBound:
    """The boot's bound now: ``base`` (default ``$AIORDMA_BOOT_BOUND``, else
    :data:`BOOT_BOUND`) scaled by the 1-minute load average per CPU (:func:`load_bound`).

    Raises:
        DeviceError: ``$AIORDMA_BOOT_BOUND`` is not a positive number.
    """
    if base is None:
        text = os.environ.get(BOUND_ENV, "")
        try:
            base = float(text) if text else BOOT_BOUND
        except ValueError:
            base = -1.0
        if not base > 0:
            raise DeviceError(f"{BOUND_ENV}={text!r}: give the boot's bound in seconds (> 0)")
    return load_bound(base, load=load, cpus=cpus)


def load_bound(base: float, *, load: float | None = None, cpus: int | None = None) -> BootBound:
    """``base`` seconds scaled by the machine's load: ``base`` x (1 + ``load`` / ``cpus``),
    ``load`` being the 1-minute load average (default: this machine's) and ``cpus`` the CPUs
    it shares (default: this machine's). A machine with one runnable job per core doubles
    it. The one scaling of a wait's bound by the load: the boot's, and the tests' hang guards
    and the load factor their timed promises allow (``tests/bounds.py``)."""
    load = os.getloadavg()[0] if load is None else load
    cpus = cpus or os.cpu_count() or 1
    return BootBound(base * (1 + load / cpus), base, load, cpus)


class QemuOutput:
    """A QEMU process's stdout (the guest command's output, from its virtio serial port),
    read line by line by a thread, so that a wait for a line is bounded even when the guest
    says nothing at all."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True,
                                        name="qemu-output")
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for raw in stream:
                self._lines.put(raw.decode(errors="replace"))
        except (OSError, ValueError):  # (closed under it: QEMU killed)
            pass
        finally:
            self._lines.put(None)

    def next_line(self, deadline: float | None) -> str | None:
        """The next line; None at the end (QEMU exited).

        Raises:
            TimeoutError: no line by ``deadline`` (``time.monotonic()``; None: no bound).
        """
        try:
            if deadline is None:
                line = self._lines.get()
            else:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None
        if line is None:
            self._lines.put(None)  # every later call sees the end too
        return line


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (QEMU is started in its own) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def read_status(path: str) -> int | None:
    """The exit status a guest wrote (its status port's file), or None."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def interrupt(signum: int, frame: object) -> None:
    """A SIGTERM handler: raise KeyboardInterrupt, so that the VMs are killed and the run
    directory removed on the way out."""
    raise KeyboardInterrupt


def tail(path: str, lines: int = 40) -> str:
    """The last ``lines`` lines of a log, or why there are none."""
    try:
        with open(path, errors="replace") as f:
            text = "".join(f.readlines()[-lines:])
    except OSError as exc:
        return f"(no console log: {exc.strerror})\n"
    return text if text.strip() else "(the console log is empty)\n"


def failed_boots_dir() -> Path:
    """Where the console logs of boots that timed out are kept."""
    return cache_dir() / "vm" / "failed-boots"


def keep_console_log(console_log: str, label: str) -> str:
    """Copy a failed boot's console log where it outlives the run directory (the newest
    :data:`KEEP_LOGS` are kept); its new path (or the old one if the copy failed)."""
    where = failed_boots_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        kept = where / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{label}.console.log"
        shutil.copyfile(console_log, kept)
        for old in sorted(where.glob("*.console.log"), key=lambda p: p.stat().st_mtime,
                          reverse=True)[KEEP_LOGS:]:
            old.unlink(missing_ok=True)
    except OSError:
        return console_log
    return str(kept)


def boot_failure(what: str, bound: BootBound, logs: list[str]) -> BootError:
    """The error for ``what`` (e.g. "the VM") silent through both boots."""
    listing = "; ".join(logs)
    return BootError(
        f"{what} printed no guest-ready line within {bound.describe()}, on {len(logs)} boots: "
        f"QEMU killed each time. Console logs: {listing}. The last one ends:\n"
        + tail(logs[-1], 20).rstrip())
