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

A list is read more than once. The kernel sends a long list in parts and resumes each part at
a position, not at an object (``res_get_common_dumpit`` in drivers/infiniband/core/nldev.c keeps
``cb->args[0] = idx``), so when another process destroys objects between two parts, the
objects that moved up are never sent: CI (stop 43) counted 61 of a test's 64 queue pairs while
another test process closed hundreds. So :func:`kernel_counts` reads each list until two reads
in a row show the same objects (by number) for the pids asked about, and if they never do
within :data:`READS` reads, counts every object any read showed.

Needs the ``rdma`` command and the right to dump the lists (root in the VM); without them,
:func:`kernel_counts` raises :class:`RestrackUnavailable` rather than count nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable

__all__ = ["KINDS", "RestrackUnavailable", "ids_by_pid", "kernel_counts"]

# The kinds of object every aiordma process creates: the kernel's name, and the key of
# aiordma.lowlevel.resource_counts() that counts the same objects (a shared receive pool's SRQ
# is asked for by name; aiordma makes no RDMA-CM id).
KINDS: dict[str, str] = {"ctx": "contexts", "pd": "pds", "cq": "cqs", "qp": "qps", "mr": "mrs"}

# The field that numbers an object of each kind in ``rdma -j resource show KIND`` (iproute2's
# rdma/res-*.c); "srq" is not in KINDS but can be asked for.
NUMBER: dict[str, str] = {"ctx": "ctxn", "pd": "pdn", "cq": "cqn", "qp": "lqpn", "mr": "mrn",
                          "srq": "srqn"}

READS = 5  # reads of one list at most, waiting for two in a row to agree

BOUND = 180.0  # seconds for one `rdma` command (thousands of objects in the VM): a hang guard


class RestrackUnavailable(RuntimeError):
    """The kernel's lists cannot be read here (no ``rdma`` command, or it failed)."""


def _entries(listing: str) -> list[dict[str, object]]:
    try:
        entries = json.loads(listing) if listing.strip() else []
    except ValueError as exc:
        raise RestrackUnavailable(f"`rdma -j` printed something else: {listing[:200]!r}") from exc
    if not isinstance(entries, list):
        raise RestrackUnavailable(f"`rdma -j` printed {type(entries).__name__}, not a list")
    return [e for e in entries if isinstance(e, dict) and "pid" in e]


def ids_by_pid(listing: str, kind: str) -> dict[int, set[tuple[str, int]]]:
    """The objects of ``kind`` each pid owns, from ``rdma -j resource show KIND``: each as
    (device, number). Objects without a pid (the kernel's own) are left out.

    Raises:
        RestrackUnavailable: the text is not the JSON list ``rdma -j`` prints, or an entry has
            no number.
    """
    field = NUMBER[kind]
    out: dict[int, set[tuple[str, int]]] = {}
    for e in _entries(listing):
        if field not in e:
            raise RestrackUnavailable(f"`rdma -j resource show {kind}` printed an entry "
                                      f"without {field!r}: {e}")
        out.setdefault(int(str(e["pid"])), set()).add((str(e.get("ifname")),
                                                      int(str(e[field]))))
    return out


def kernel_counts(pids: Iterable[int],
                  kinds: Iterable[str] = tuple(KINDS)) -> dict[int, dict[str, int]]:
    """The kernel's count of each of ``kinds`` (those of :data:`KINDS` by default), for each of
    ``pids`` (every kind present, 0 where it holds none). Each list is read until two reads in
    a row agree on these pids' objects (see the module's note).

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
    for kind in kinds:
        seen = _agreed(rdma, kind, wanted)
        for pid in wanted:
            out[pid][kind] = len(seen.get(pid, ()))
    return out


def _agreed(rdma: str, kind: str, pids: list[int]) -> dict[int, set[tuple[str, int]]]:
    """The pids' objects of ``kind``: what two reads in a row agree on, else what any of
    :data:`READS` reads showed."""
    union: dict[int, set[tuple[str, int]]] = {}
    last: dict[int, set[tuple[str, int]]] | None = None
    for _ in range(READS):
        done = subprocess.run([rdma, "-j", "resource", "show", kind], capture_output=True,
                              text=True, timeout=BOUND, check=False)
        if done.returncode != 0:
            raise RestrackUnavailable(f"`rdma -j resource show {kind}` failed "
                                      f"({done.returncode}): {done.stderr.strip()[:200]}")
        by_pid = ids_by_pid(done.stdout, kind)
        now = {pid: by_pid.get(pid, set()) for pid in pids}
        if now == last:
            return now
        for pid, objects in now.items():
            union.setdefault(pid, set()).update(objects)
        last = now
    return union
