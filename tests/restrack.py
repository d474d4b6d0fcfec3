"""The kernel's own count of a process's RDMA resources, for leak checks.

The kernel tracks every verbs object it creates for a process (its resource tracking,
"restrack"), and iproute2's ``rdma resource show KIND`` lists them with the owner's pid;
``rdma -j`` prints the same as JSON. So a count taken here does not depend on aiordma's
bookkeeping (:func:`aiordma.lowlevel.resource_counts`, which a close that fails half-way could
leave wrong): it is what the kernel still holds for the process.

Seen in the VM (kernel 6.1, iproute2 6.1, rxe), a process that opened a device and registered
one region: ``rdma resource show`` printed ``rxe0: pd 2 cq 1 qp 1 cm_id 0 mr 1 ctx 1 srq 0``,
and ``rdma -j resource show mr`` one entry with ``"pid": <its pid>, "comm": "python"``. The
objects the kernel makes for itself (ib_core's GSI queue pair, its CQ and PD 0) carry no pid and
are never counted. A killed process's objects are gone from the lists once the kernel has
released its files.

Needs the ``rdma`` command and the right to dump the lists (root in the VM); without them,
:func:`kernel_counts` raises :class:`RestrackUnavailable` rather than count nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable

__all__ = ["KINDS", "RestrackUnavailable", "count_by_pid", "kernel_counts"]

# The kinds of object aiordma creates (it uses no SRQ and no RDMA-CM id): the kernel's name,
# and the key of aiordma.lowlevel.resource_counts() that counts the same objects.
KINDS: dict[str, str] = {"ctx": "contexts", "pd": "pds", "cq": "cqs", "qp": "qps", "mr": "mrs"}

BOUND = 180.0  # seconds for one `rdma` command (thousands of objects in the VM): a hang guard


class RestrackUnavailable(RuntimeError):
    """The kernel's lists cannot be read here (no ``rdma`` command, or it failed)."""


def count_by_pid(listing: str) -> Counter[int]:
    """How many objects of one kind each pid owns, from ``rdma -j resource show KIND``.

    Objects without a pid (the kernel's own) are left out.

    Raises:
        RestrackUnavailable: the text is not the JSON list ``rdma -j`` prints.
    """
    try:
        entries = json.loads(listing) if listing.strip() else []
    except ValueError as exc:
        raise RestrackUnavailable(f"`rdma -j` printed something else: {listing[:200]!r}") from exc
    if not isinstance(entries, list):
        raise RestrackUnavailable(f"`rdma -j` printed {type(entries).__name__}, not a list")
    return Counter(e["pid"] for e in entries if isinstance(e, dict) and "pid" in e)


def kernel_counts(pids: Iterable[int]) -> dict[int, dict[str, int]]:
    """The kernel's count of each kind in :data:`KINDS`, for each of ``pids`` (every kind
    present, 0 where it holds none).

    Raises:
        RestrackUnavailable: no ``rdma`` command, or it failed.
    """
    rdma = shutil.which("rdma") or next(
        (p for p in ("/usr/sbin/rdma", "/sbin/rdma", "/usr/bin/rdma") if os.path.exists(p)),
        None)
    if rdma is None:
        raise RestrackUnavailable("the kernel's resource counts need the `rdma` command "
                                  "(Debian package iproute2)")
    wanted = list(pids)
    out: dict[int, dict[str, int]] = {pid: {} for pid in wanted}
    for kind in KINDS:
        done = subprocess.run([rdma, "-j", "resource", "show", kind], capture_output=True,
                              text=True, timeout=BOUND, check=False)
        if done.returncode != 0:
            raise RestrackUnavailable(f"`rdma -j resource show {kind}` failed "
                                      f"({done.returncode}): {done.stderr.strip()[:200]}")
        by_pid = count_by_pid(done.stdout)
        for pid in wanted:
            out[pid][kind] = by_pid.get(pid, 0)
    return out
