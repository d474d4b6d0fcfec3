"""The load average of the machine that runs the VMs, as a command inside them can see it.

Inside a VM, ``os.getloadavg()`` is the guest's own load: it says nothing of the other VMs and
jobs that share this machine's cores, which is what a figure measured in the VM depends on.
So the harness (:func:`aiordma.tools.rxe.run_in_vm`, :func:`aiordma.tools.vm_pair.run_pair`)
copies this machine's ``/proc/loadavg`` into each VM's run directory every
:data:`INTERVAL` seconds (:class:`HostLoadWriter`), and a command in the guest reads it with
:func:`host_load`: the run directory is mounted at :data:`GUEST_DIR` over 9p without caching,
so each read asks the host. Outside a VM, :func:`host_load` is ``os.getloadavg()``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Self

__all__ = ["FILE", "GUEST_DIR", "INTERVAL", "HostLoadWriter", "host_load", "parse_loadavg"]

#: The file's name in each VM's run directory.
FILE = "hostload"
#: Where a guest sees its run directory (:mod:`aiordma.tools.vm`'s init mounts it there).
GUEST_DIR = "/run/aiordma-vm"
#: Seconds between two copies.
INTERVAL = 2.0


def parse_loadavg(text: str) -> tuple[float, float, float] | None:
    """The 1, 5 and 15-minute load averages of a ``/proc/loadavg`` line, or None."""
    parts = text.split()
    try:
        return float(parts[0]), float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        return None


def host_load(guest_dir: str = GUEST_DIR) -> tuple[float, float, float] | None:
    """This machine's load averages (1, 5, 15 min); in a VM of the harness, those of the
    machine running it. None in a VM whose harness did not write them (an older one)."""
    if not os.path.isdir(guest_dir):
        return os.getloadavg()
    try:
        with open(os.path.join(guest_dir, FILE)) as f:
            return parse_loadavg(f.read())
    except OSError:
        return None


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
