"""The load average of the machine that runs the VMs, as a command inside them can see it.

Inside a VM, ``os.getloadavg()`` is the guest's own load: it says nothing of the other VMs and
jobs that share this machine's cores, which is what a figure measured in the VM depends on.
So the repository's VM harness copies this machine's ``/proc/loadavg`` into each VM's run
directory every few seconds (``harness/hostload.py``), and the bench reads it in the guest
with :func:`host_load`: the run directory is mounted at :data:`GUEST_DIR` over 9p without
caching, so each read asks the host. Outside such a VM, :func:`host_load` is
``os.getloadavg()``.
"""

from __future__ import annotations

import os

__all__ = ["FILE", "GUEST_DIR", "host_load", "parse_loadavg"]

#: The file's name in each VM's run directory.
FILE = "hostload"
#: Where a guest sees its run directory (the harness's guest init mounts it there).
GUEST_DIR = "/run/aiordma-vm"


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
