"""This machine's load average, copied into each VM's run directory while the VM lives, so that
a command in the guest can read it (:func:`aiordma.bench.hostload.host_load`: the guest's own
``os.getloadavg()`` says nothing of the other VMs and jobs sharing this machine's cores)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Self

from aiordma.bench.hostload import FILE

__all__ = ["INTERVAL", "HostLoadWriter"]

#: Seconds between two copies.
INTERVAL = 2.0


class HostLoadWriter:
    """A thread copying ``/proc/loadavg`` into ``dirs`` (each VM's run directory) every
    ``interval`` seconds until closed; use it as a context manager around a VM's life. Each
    copy replaces the file whole (written aside, then renamed), so a reader never sees half
    of one."""

    def __init__(self, dirs: Sequence[str], *, interval: float = INTERVAL,
                 source: str = "/proc/loadavg") -> None:
        self._dirs = list(dirs)
        self._interval = interval
        self._source = source
        self._stop = threading.Event()
        self.write_once()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hostload")
        self._thread.start()

    def write_once(self) -> None:
        try:
            with open(self._source) as f:
                text = f.read()
        except OSError:
            return
        for d in self._dirs:
            tmp = os.path.join(d, f".{FILE}.tmp")
            with contextlib.suppress(OSError):
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, os.path.join(d, FILE))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.write_once()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
