"""The rxe harness: find or make an RDMA device, on this host or in a small VM.

* ``status``: devices and ports, or why there is none and which route is available.
* ``up`` / ``down``: create or remove a Soft-RoCE (rxe) device on a dummy interface, where the
  kernel allows it (root, ``rdma_rxe`` available).
* ``run -- CMD``: run CMD where an RDMA device exists: here if a port is ACTIVE (or rxe can be
  created here); otherwise in a small QEMU VM (:mod:`aiordma.tools.vm`) booted with Debian's
  kernel under software emulation, with ``rdma_rxe`` loaded and ``rxe0`` on a dummy interface.
  The host's root file system (so the project tree and its venv) is shared into the guest
  read-only, the current directory read-write; CMD's output and exit status pass through, and
  the boot time is reported.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from aiordma import DeviceError
from aiordma._verbs.load import cache_dir
from aiordma.tools import vm
from aiordma.tools.hostload import HostLoadWriter

__all__ = ["RxeSetup", "run_with_device", "rxe_down", "rxe_up", "vm_route"]

DEFAULT_NETDEV = "aiordma0"
DEFAULT_ADDR = "10.77.0.1/24"  # on a dummy interface: packets never leave the machine
DEFAULT_RXE = "rxe0"
READY_MARK = "[aiordma-rxe] guest ready"


def _log(msg: str) -> None:
    print(f"[rxe] {msg}", file=sys.stderr, flush=True)


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, text=True, capture_output=True, check=check)


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


# -- the VM route ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class VmRoute:
    qemu: str
    kernel: vm.Kernel


def vm_route() -> VmRoute | str:
    """How to boot a VM with rxe here, or the reason it cannot be done."""
    missing = []
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        missing.append("QEMU (apt-get install qemu-system-x86)")
    if not os.path.exists("/bin/busybox"):
        missing.append("a static busybox for the VM's initramfs (apt-get install busybox-static)")
    if shutil.which("modprobe") is None:
        missing.append("modprobe (apt-get install kmod)")
    kernels = vm.find_kernels("rdma_rxe")
    if not kernels:
        missing.append("a kernel with the rdma_rxe module (apt-get install linux-image-amd64)")
    if missing:
        return "cannot boot an RDMA VM: missing " + "; ".join(missing)
    assert qemu is not None
    return VmRoute(qemu, kernels[0])


def guest_script(cmd: list[str]) -> str:
    """The shell lines the VM runs: bring rxe up as :func:`rxe_up` does, announce readiness,
    then ``exec`` ``cmd``. Plain shell, not Python: a Python start-up (and importing aiordma
    over 9p) takes seconds under software emulation, and the guest only needs four commands.
    Exit status 97: rxe could not be set up."""
    netdev, addr, name = shlex.quote(DEFAULT_NETDEV), shlex.quote(DEFAULT_ADDR), DEFAULT_RXE
    fail = "{ echo \"[rxe] guest: $1 failed\" >&2; exit 97; }"
    return "\n".join([
        f"fail() {fail}",
        "modprobe rdma_rxe || fail 'modprobe rdma_rxe'",
        f"ip link add {netdev} type dummy || fail 'ip link add'",
        f"ip addr add {addr} dev {netdev} || fail 'ip addr add'",
        f"ip link set {netdev} up || fail 'ip link set up'",
        f"rdma link add {name} type rxe netdev {netdev} || fail 'rdma link add'",
        "i=0",  # the port turns ACTIVE shortly after the link is added (5 s at most)
        "until grep -qs ACTIVE /sys/class/infiniband/*/ports/*/state; do",
        "  i=$((i + 1)); [ $i -gt 100 ] && break; sleep 0.05",
        "done",
        f"echo '{READY_MARK} ({name} on {DEFAULT_NETDEV})' >&2",
        f"exec {shlex.join(cmd)}" if cmd else "exit 0",
    ]) + "\n"


def guest_main(cmd: list[str]) -> int:
    """Inside the VM: bring rxe up, announce readiness, run ``cmd``, return its status.

    (``aiordma rxe _guest``: the same as :func:`guest_script`, from Python.)"""
    try:
        setup = rxe_up()
    except DeviceError as exc:
        _log(f"guest: {exc}")
        return 97
    print(f"{READY_MARK} ({setup.device} on {setup.netdev})", file=sys.stderr, flush=True)
    if not cmd:
        return 0
    try:
        return subprocess.call(cmd)
    except FileNotFoundError as exc:
        _log(f"guest: {exc}")
        return 127


_ENV_PASS = re.compile(r"^(AIORDMA_|HYPOTHESIS|PYTEST_|PYTHON|CI$|TERM$|HOME$|LANG$|LC_|TZ$)")


def script_header() -> str:
    """The first lines of a guest's ``run.sh``: this process's ``AIORDMA_*``, test and locale
    variables, a ``PATH`` with this venv's ``bin`` first, the current directory."""
    bindir = os.path.dirname(sys.executable)
    env_lines = [f"export {k}={shlex.quote(v)}" for k, v in os.environ.items()
                 if _ENV_PASS.match(k)]
    guest_path = os.pathsep.join([bindir, "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
                                  "/usr/bin", "/sbin", "/bin"])
    return "".join([
        "#!/bin/sh\n",
        "\n".join(env_lines) + "\n",
        f"export PATH={shlex.quote(guest_path)}\n",
        "ulimit -n 65536 2>/dev/null\n",
        f"cd {shlex.quote(os.getcwd())} || exit 96\n",
    ])


def run_in_vm(cmd: list[str], *, memory: str = "2G", cpus: int = 2, kvm: bool = False,
              timeout: float | None = None) -> int:
    """Boot a VM with rxe (:mod:`aiordma.tools.vm`) and run ``cmd`` there; return its status."""
    route = vm_route()
    if isinstance(route, str):
        raise DeviceError(route)
    t0 = time.monotonic()
    prep = vm.prepare(route.kernel)
    if time.monotonic() - t0 > 1:
        _log(f"prepared the VM's boot image and initramfs in {time.monotonic() - t0:.1f} s (once)")
    vm_dir = cache_dir() / "vm"
    vm_dir.mkdir(parents=True, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="run-", dir=vm_dir)
    script = os.path.join(run_dir, "run.sh")
    status_path = os.path.join(run_dir, "status")
    console_log = os.path.join(run_dir, "console.log")
    with open(script, "w") as f:
        f.write(script_header())
        f.write(guest_script(cmd))
    args = vm.qemu_command(prep, run_dir=run_dir, rwdir=os.getcwd(), out_path="/proc/self/fd/1",
                           status_path=status_path, console_log=console_log, memory=memory,
                           cpus=cpus, kvm=kvm)
    args[0] = route.qemu
    _log(f"booting {route.kernel.release} under {'KVM' if kvm else 'software emulation'}"
         f" ({cpus} CPUs, {memory})")
    t0 = time.monotonic()
    ready_at: float | None = None
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # so that the VM is killed and the script removed

    old_term = signal.signal(signal.SIGTERM, on_term)
    # this machine's load average, readable in the guest (aiordma.tools.hostload)
    load_writer = HostLoadWriter([run_dir])
    try:
        assert proc.stdout is not None
        deadline = None if timeout is None else t0 + timeout
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            if ready_at is None and READY_MARK in line:
                ready_at = time.monotonic()
                _log(f"VM up with rxe in {ready_at - t0:.1f} s")
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
        qemu_rc = proc.wait(timeout=None if deadline is None else max(1, deadline - time.monotonic()))
        status = _read_status(status_path)
        if status is None:
            _log(f"the VM stopped without the command's exit status (QEMU exit status {qemu_rc});"
                 " the kernel's console said:")
            sys.stderr.write(_tail(console_log))
    except (KeyboardInterrupt, TimeoutError, subprocess.TimeoutExpired) as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _log("VM killed: " + ("time limit reached" if not isinstance(exc, KeyboardInterrupt)
                              else "interrupted"))
        return 124 if not isinstance(exc, KeyboardInterrupt) else 130
    finally:
        load_writer.close()
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(run_dir, ignore_errors=True)
    total = time.monotonic() - t0
    rc = 1 if status is None else status
    if ready_at is None:
        _log(f"the guest never became ready (exit status {rc}, {total:.1f} s)")
        return rc or 1
    boot = ready_at - t0
    _log(f"VM: boot + rxe {boot:.1f} s, command + shutdown {total - boot:.1f} s,"
         f" exit status {rc}")
    return rc


def _read_status(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no console log)\n"


def run_with_device(cmd: list[str], *, force_vm: bool = False, kvm: bool = False,
                    timeout: float | None = None) -> int:
    """Run ``cmd`` where an RDMA device exists (host first, then a VM); return its status."""
    if not cmd:
        raise DeviceError("nothing to run: give a command after --")
    if not force_vm:
        if host_active_port():
            _log("host has an ACTIVE RDMA port: running here")
            return subprocess.call(cmd)
        if host_can_make_rxe() is None:
            setup = rxe_up()
            _log(f"created {setup.device} on {setup.netdev}: running here")
            try:
                return subprocess.call(cmd)
            finally:
                rxe_down(setup.device, netdev=setup.netdev if setup.created_netdev else None)
    route = vm_route()
    if isinstance(route, str):
        why = host_can_make_rxe()
        raise DeviceError(f"no RDMA device here ({why}), and {route}")
    return run_in_vm(cmd, kvm=kvm, timeout=timeout)
