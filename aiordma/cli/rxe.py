"""Soft-RoCE (rxe) on this host: ``aiordma rxe status|up|down``, and running a command where
this host has a device.

* ``status``: devices and ports, or why there is none, and whether rxe can be made here.
* ``up`` / ``down``: create or remove an rxe device on a dummy interface, where the kernel
  allows it (root, ``rdma_rxe`` available).
* :func:`run_here`: run a command on this host's device, making ``rxe0`` first (and removing
  it after) where there is none; the demo and the bench re-run themselves so.

A host whose kernel has no RDMA at all (no ``rdma_rxe``) cannot get a device from here: the
repository's developer harness (``python -m harness run -- CMD``, not installed) boots a small
VM with Soft-RoCE for that.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiordma import DeviceError

__all__ = ["DEFAULT_ADDR", "DEFAULT_NETDEV", "DEFAULT_RXE", "RxeSetup", "host_active_port",
           "host_can_make_rxe", "run_here", "rxe_down", "rxe_up"]

DEFAULT_NETDEV = "aiordma0"
DEFAULT_ADDR = "10.77.0.1/24"  # on a dummy interface: packets never leave the machine
DEFAULT_RXE = "rxe0"
#: What to tell a user whose host can have no device: where one is found after all.
VM_HINT = ("in a checkout of aiordma, `python -m harness run -- CMD` runs a command in a small "
           "VM with Soft-RoCE (`make demo` runs the demo so)")


def log(msg: str) -> None:
    """A line of the rxe set-up's own, on stderr (``[rxe] ...``)."""
    print(f"[rxe] {msg}", file=sys.stderr, flush=True)


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, text=True, capture_output=True, check=check, timeout=60)


@dataclass(frozen=True, slots=True)
class RxeSetup:
    """What ``rxe_up`` made, so that ``rxe_down`` removes exactly that."""

    device: str
    netdev: str
    created_netdev: bool


def host_active_port() -> bool:
    """Whether this host has an RDMA device with an ACTIVE port (no pyverbs needed)."""
    for state in glob.glob("/sys/class/infiniband/*/ports/*/state"):
        try:
            with open(state) as f:
                if "ACTIVE" in f.read():
                    return True
        except OSError:
            continue
    return False


def host_can_make_rxe() -> str | None:
    """None if ``rxe_up`` can work here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "creating an rxe device needs root"
    if shutil.which("rdma") is None:
        return "the `rdma` tool (iproute2) is missing"
    if os.path.isdir("/sys/module/rdma_rxe"):
        return None
    if shutil.which("modprobe") is None:
        return "modprobe is missing"
    probe = _sh("modprobe", "-n", "rdma_rxe", check=False)
    if probe.returncode != 0:
        return (f"the running kernel ({os.uname().release}) cannot load rdma_rxe: "
                f"{(probe.stderr or probe.stdout).strip() or 'module not found'}")
    return None


def rxe_up(netdev: str | None = None, *, address: str = DEFAULT_ADDR,
           name: str = DEFAULT_RXE) -> RxeSetup:
    """Create ``name`` (rxe) on ``netdev``, or on a new dummy interface with ``address``.

    Raises:
        DeviceError: the kernel or the permissions do not allow it.
    """
    why = host_can_make_rxe()
    if why:
        raise DeviceError(why)
    _sh("modprobe", "rdma_rxe")
    existing = _sh("rdma", "link", "show", check=False).stdout
    m = re.search(rf"link {re.escape(name)}/\d+ .*netdev (\S+)", existing)
    if m:
        return RxeSetup(name, m.group(1), False)
    created = False
    if netdev is None:
        netdev = DEFAULT_NETDEV
        if not os.path.isdir(f"/sys/class/net/{netdev}"):
            _sh("ip", "link", "add", netdev, "type", "dummy")
            _sh("ip", "addr", "add", address, "dev", netdev)
            created = True
        _sh("ip", "link", "set", netdev, "up")
    res = _sh("rdma", "link", "add", name, "type", "rxe", "netdev", netdev, check=False)
    if res.returncode != 0:
        raise DeviceError(f"rdma link add {name} failed: {res.stderr.strip()}")
    # The port turns ACTIVE shortly after the link is added.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not host_active_port():
        time.sleep(0.05)
    return RxeSetup(name, netdev, created)


def rxe_down(name: str = DEFAULT_RXE, *, netdev: str | None = DEFAULT_NETDEV) -> None:
    """Remove the rxe device ``name`` and (if it is ours) the dummy interface."""
    _sh("rdma", "link", "delete", name, check=False)
    if netdev and os.path.isdir(f"/sys/class/net/{netdev}"):
        kind = _sh("ip", "-d", "link", "show", netdev, check=False).stdout
        if " dummy " in kind:
            _sh("ip", "link", "delete", netdev, check=False)


def run_here(cmd: Sequence[str]) -> int:
    """Run ``cmd`` on this host's RDMA device: at once if a port is ACTIVE, else after creating
    ``rxe0`` on a dummy interface (removed after); return its exit status.

    Raises:
        DeviceError: nothing to run, or this host has no device and cannot make one (both
            reasons, and where a VM is to be had).
    """
    if not cmd:
        raise DeviceError("nothing to run: give a command after --")
    if host_active_port():
        log("host has an ACTIVE RDMA port: running here")
        return subprocess.call(list(cmd))
    why = host_can_make_rxe()
    if why is not None:
        raise DeviceError(f"no RDMA device here, and none can be made ({why}); {VM_HINT}")
    setup = rxe_up()
    log(f"created {setup.device} on {setup.netdev}: running here")
    try:
        return subprocess.call(list(cmd))
    finally:
        rxe_down(setup.device, netdev=setup.netdev if setup.created_netdev else None)
