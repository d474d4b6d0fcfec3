"""Running a command where an RDMA device is: ``python -m harness run -- CMD``.

Here if a port is ACTIVE; else here after creating ``rxe0`` on a dummy interface if the kernel
has ``rdma_rxe`` and this is root (both through the installed :mod:`aiordma.cli.rxe`);
otherwise in a small QEMU VM (:mod:`.vm`) booted with Debian's kernel under software
emulation, with ``rdma_rxe`` loaded and ``rxe0`` on a dummy interface. The host's root file
system (so the project tree and its venv) is shared into the guest read-only, the current
directory read-write; CMD's output and exit status pass through, and the boot time is
reported. The boot is bounded (:mod:`.boot`): a guest silent past its bound is killed and
booted once more, then the run fails with the console log's last lines.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiordma import DeviceError
from aiordma._verbs.load import cache_dir
from aiordma.cli.rxe import (
    DEFAULT_ADDR,
    DEFAULT_NETDEV,
    DEFAULT_RXE,
    host_active_port,
    host_can_make_rxe,
    run_here,
)

from . import vm
from .boot import (
    READY_MARK,
    BootBound,
    QemuOutput,
    boot_bound,
    boot_failure,
    interrupt,
    keep_console_log,
    kill_group,
    log,
    read_status,
    tail,
)
from .hostload import HostLoadWriter

__all__ = ["VmRoute", "guest_script", "run_guest", "run_in_vm", "run_with_device",
           "script_header", "vm_route"]


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


def guest_script(cmd: Sequence[str]) -> str:
    """The shell lines the VM runs: bring rxe up as :func:`aiordma.cli.rxe.rxe_up` does,
    announce readiness,
    then ``exec`` ``cmd``. Plain shell, not Python: a Python start-up (and importing aiordma
    over 9p) takes seconds under software emulation, and the guest only needs four commands.
    Exit status 97: rxe could not be set up (the line before says which step)."""
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
        (f"  i=$((i + 1)); [ $i -gt 100 ] && fail \"waiting 5 s for {name}'s port to turn "
         "ACTIVE\"; sleep 0.05"),
        "done",
        f"echo '{READY_MARK} ({name} on {DEFAULT_NETDEV})' >&2",
        f"exec {shlex.join(cmd)}" if cmd else "exit 0",
    ]) + "\n"


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


def run_in_vm(cmd: Sequence[str], *, memory: str = "2G", cpus: int = 2, kvm: bool = False,
              timeout: float | None = None, bound: BootBound | None = None) -> int:
    """Boot a VM with rxe (:mod:`.vm`) and run ``cmd`` there; return its status (124: the
    ``timeout`` passed, the VM killed; 130: interrupted).

    Raises:
        DeviceError: no VM can be booted here (what is missing).
        BootError: the guest said nothing within its bound, twice.
    """
    route = vm_route()
    if isinstance(route, str):
        raise DeviceError(route)
    t0 = time.monotonic()
    prep = vm.prepare(route.kernel)
    if time.monotonic() - t0 > 1:
        log(f"prepared the VM's boot image and initramfs in {time.monotonic() - t0:.1f} s (once)")

    def qemu_args(run_dir: str) -> list[str]:
        args = vm.qemu_command(prep, run_dir=run_dir, rwdir=os.getcwd(),
                               out_path="/proc/self/fd/1",
                               status_path=os.path.join(run_dir, "status"),
                               console_log=os.path.join(run_dir, "console.log"),
                               memory=memory, cpus=cpus, kvm=kvm)
        args[0] = route.qemu
        return args

    bound = bound or boot_bound()
    log(f"booting {route.kernel.release} under {'KVM' if kvm else 'software emulation'}"
        f" ({cpus} CPUs, {memory}); it has {bound.describe()} to come up")
    return run_guest(qemu_args, cmd, timeout=timeout, bound=bound)


def run_guest(qemu_args: Callable[[str], list[str]], cmd: Sequence[str], *,
              timeout: float | None = None, bound: BootBound | None = None) -> int:
    """Boot the guest ``qemu_args(run_dir)`` starts, which runs ``run_dir/run.sh`` (``cmd``
    after rxe's set-up), pass its output through, return ``cmd``'s exit status.

    The guest has ``bound`` (default :func:`~.boot.boot_bound`) to print
    :data:`~.boot.READY_MARK`; if it does not, QEMU is killed and the guest booted once more.
    A guest that stops before it is ready (its set-up failed) is not booted again: its
    status is returned, and its console's last lines shown.

    Raises:
        BootError: no ready line within the bound on either boot.
    """
    bound = bound or boot_bound()
    vm_dir = cache_dir() / "vm"
    vm_dir.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    old_term = signal.signal(signal.SIGTERM, interrupt)
    try:
        for boot in (1, 2):
            run_dir = tempfile.mkdtemp(prefix="run-", dir=vm_dir)
            try:
                with open(os.path.join(run_dir, "run.sh"), "w") as f:
                    f.write(script_header())
                    f.write(guest_script(cmd))
                # (this machine's load average, readable in the guest: aiordma.bench.hostload)
                with HostLoadWriter([run_dir]):
                    rc = _boot_and_run(qemu_args(run_dir), run_dir, bound, timeout)
                if rc is not None:
                    return rc
                failed.append(keep_console_log(os.path.join(run_dir, "console.log"),
                                               f"boot{boot}"))
                log(f"no guest-ready line within {bound.describe()} (boot {boot}): QEMU "
                    f"killed; console log kept: {failed[-1]}"
                    + ("; booting once more" if boot == 1 else ""))
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
        raise boot_failure("the VM", bound, failed)
    except KeyboardInterrupt:
        log("interrupted: VM killed")
        return 130
    finally:
        signal.signal(signal.SIGTERM, old_term)



def _boot_and_run(args: list[str], run_dir: str, bound: BootBound,
                  timeout: float | None) -> int | None:
    """One boot: the command's exit status, or None when the guest was silent past
    ``bound`` (QEMU killed)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.stdout is not None  # (a PIPE)
        out = QemuOutput(proc.stdout)
        ready_at: float | None = None
        deadline: float | None = t0 + bound.seconds
        while True:
            try:
                line = out.next_line(deadline)
            except TimeoutError:
                if ready_at is None:
                    return None
                log(f"VM killed: time limit ({timeout:g} s) reached")
                return 124
            if line is None:
                break
            if ready_at is None and READY_MARK in line:
                ready_at = time.monotonic()
                log(f"VM up with rxe in {ready_at - t0:.1f} s")
                deadline = None if timeout is None else t0 + timeout
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
        qemu_rc = proc.wait(timeout=30)  # (its output ended: QEMU is exiting)
    finally:
        kill_group(proc)
    status = read_status(os.path.join(run_dir, "status"))
    total = time.monotonic() - t0
    if status is None:
        log(f"the VM stopped without the command's exit status (QEMU exit status {qemu_rc});"
            " the kernel's console said:")
        sys.stderr.write(tail(os.path.join(run_dir, "console.log")))
    rc = 1 if status is None else status
    if ready_at is None:
        log(f"the guest never became ready (exit status {rc}, {total:.1f} s)")
        return rc or 1
    boot = ready_at - t0
    log(f"VM: boot + rxe {boot:.1f} s, command + shutdown {total - boot:.1f} s,"
        f" exit status {rc}")
    return rc



def run_with_device(cmd: Sequence[str], *, force_vm: bool = False, kvm: bool = False,
                    timeout: float | None = None) -> int:
    """Run ``cmd`` where an RDMA device exists (this host first, then a VM); its status.

    Raises:
        DeviceError: nothing to run, or no device here and no VM can be booted.
        BootError: the VM did not boot (see :func:`run_guest`).
    """
    if not cmd:
        raise DeviceError("nothing to run: give a command after --")
    if not force_vm and (host_active_port() or host_can_make_rxe() is None):
        return run_here(cmd)
    route = vm_route()
    if isinstance(route, str):
        why = host_can_make_rxe()
        raise DeviceError(f"no RDMA device here ({why}), and {route}")
    return run_in_vm(cmd, kvm=kvm, timeout=timeout)
