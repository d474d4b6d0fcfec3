"""Two VMs on a private wire: ``aiordma rxe run --hosts 2 -- CMD``.

Each VM is the one-host VM of :mod:`.vm` (same kernel, initramfs and 9p shares of the host's
root and the current directory) with one virtio-net card more. The two cards are joined only
to each other: QEMU's ``dgram`` network backend over a pair of Unix datagram sockets in the
run directory (each VM sends its Ethernet frames to the other's socket), so no frame reaches
any IP network, not even this machine's loopback. In each guest, ``virtio_net`` and
``rdma_rxe`` are loaded (by ``modprobe`` from the host's module tree, as the one-host VM loads
``rdma_rxe``), ``eth0`` gets :data:`HOST1` or :data:`HOST2` on a /24 link subnet and ``rxe0``
is made on it: RDMA between the hosts crosses the wire as RoCE v2 (UDP 4791).

Host 2 runs only the command agent (:mod:`.host_agent`). Host 1 waits until the agent answers,
then runs CMD with ``AIORDMA_HOST1``, ``AIORDMA_HOST2`` and ``AIORDMA_AGENT`` set (how CMD
starts processes on host 2: :mod:`.remote`), then asks the agent to stop so that host 2 syncs
and powers off. CMD's output and exit status pass through; host 2's own lines are shown
prefixed with ``[host2-vm]``. Each VM gets one vCPU and :data:`MEMORY`: the machine this runs
on has two cores, and a VM with two vCPUs beside another would only make them contend.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, cast

from aiordma import DeviceError
from aiordma._native import cache_dir

from . import host_agent, vm
from .rxe import READY_MARK, _log, _read_status, _tail, script_header, vm_route

__all__ = ["HOST1", "HOST2", "MEMORY", "guest_script", "nic_args", "run_pair"]

HOST1, HOST2, PREFIX = "10.77.0.1", "10.77.0.2", 24
#: Memory per VM. Host 1 runs pytest and its clients (the device suite's processes use 100-300
#: MB each), host 2 the servers; 1 GiB each left more than half free in the runs measured.
MEMORY = "1G"
AGENT_READY = "[host-agent] listening on"


def nic_args(run_dir: str, n: int) -> list[str]:
    """QEMU arguments of host ``n``'s card: a dgram netdev from its own Unix socket to the
    other host's."""
    me, other = os.path.join(run_dir, f"link{n}.sock"), os.path.join(run_dir, f"link{3 - n}.sock")
    return ["-netdev", (f"dgram,id=link,local.type=unix,local.path={me},"
                       f"remote.type=unix,remote.path={other}"),
            "-device", f"virtio-net-pci,netdev=link,mac=52:54:00:77:00:0{n}"]


def guest_script(n: int, cmd: list[str], *, agent_wait: float = 300.0) -> str:
    """Host ``n``'s shell lines: the card, its address and ``rxe0`` on it; then (host 2) the
    agent, or (host 1) the wait for the agent, CMD, and the agent's stop. Exit status 97: the
    set-up failed; 95: host 2's agent never answered."""
    addr = HOST1 if n == 1 else HOST2
    py = shlex.quote(sys.executable)
    lines = [
        "fail() { echo \"[rxe] host " + str(n) + ": $1 failed\" >&2; exit 97; }",
        "modprobe virtio_net || fail 'modprobe virtio_net'",
        "modprobe rdma_rxe || fail 'modprobe rdma_rxe'",
        "i=0",  # the card's interface appears once virtio_net has probed it
        "until [ -e /sys/class/net/eth0 ]; do",
        "  i=$((i + 1)); [ $i -gt 100 ] && fail 'finding eth0'; sleep 0.05",
        "done",
        f"ip addr add {addr}/{PREFIX} dev eth0 || fail 'ip addr add'",
        "ip link set eth0 up || fail 'ip link set up'",
        "rdma link add rxe0 type rxe netdev eth0 || fail 'rdma link add'",
        "i=0",
        "until grep -qs ACTIVE /sys/class/infiniband/rxe0/ports/1/state; do",
        "  i=$((i + 1)); [ $i -gt 100 ] && break; sleep 0.05",
        "done",
        f"hostname aiordma-host{n} 2>/dev/null",
        (f"export AIORDMA_HOST1={HOST1} AIORDMA_HOST2={HOST2}"
        f" AIORDMA_AGENT={HOST2}:{host_agent.PORT}"),
    ]
    if n == 2:
        lines.append(f"exec {py} -m aiordma.tools.host_agent --listen {HOST2}:{host_agent.PORT}")
    else:
        lines += [
            f"{py} -m aiordma.tools.remote --wait {agent_wait:g} || exit 95",
            f"echo '{READY_MARK} (rxe0 on eth0, {HOST1}; host 2 at {HOST2})' >&2",
            shlex.join(cmd),
            "rc=$?",
            f"{py} -m aiordma.tools.remote --stop || true",
            "exit $rc",
        ]
    return "\n".join(lines) + "\n"


def _relay(stream: IO[bytes], prefix: str, ready: str, marks: dict[str, float],
           key: str, t0: float) -> None:
    for raw in stream:
        line = raw.decode(errors="replace")
        if key not in marks and ready in line:
            marks[key] = time.monotonic() - t0
        sys.stderr.write(prefix + line if prefix else line)
        sys.stderr.flush()


def run_pair(cmd: list[str], *, memory: str = MEMORY, timeout: float | None = None) -> int:
    """Boot the pair, run ``cmd`` on host 1, return its exit status (124: ``timeout`` passed,
    both VMs killed; 130: interrupted).

    Raises:
        DeviceError: there is nothing to run, or a VM cannot be booted here (what is missing).
    """
    if not cmd:
        raise DeviceError("nothing to run: give a command after --")
    route = vm_route()
    if isinstance(route, str):
        raise DeviceError(route)
    prep = vm.prepare(route.kernel)
    vm_dir = cache_dir() / "vm"
    vm_dir.mkdir(parents=True, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="pair-", dir=vm_dir)
    procs: list[subprocess.Popen[bytes]] = []
    args = {}
    for n in (1, 2):
        d = os.path.join(run_dir, f"host{n}")
        os.mkdir(d)
        with open(os.path.join(d, "run.sh"), "w") as f:
            f.write(script_header())
            f.write(guest_script(n, cmd))
        a = vm.qemu_command(prep, run_dir=d, rwdir=os.getcwd(), out_path="/proc/self/fd/1",
                            status_path=os.path.join(d, "status"),
                            console_log=os.path.join(d, "console.log"), memory=memory, cpus=1,
                            nic=nic_args(run_dir, n))
        a[0] = route.qemu
        args[n] = a
    _log(f"booting two VMs ({route.kernel.release}, software emulation, 1 CPU and {memory} "
         f"each), joined by a private link ({HOST1} - {HOST2})")
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    timed_out = threading.Event()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    timer = None
    try:
        for n in (2, 1):  # host 2 first: its agent is what host 1 waits for
            procs.append(subprocess.Popen(args[n], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        vm2, vm1 = procs
        out2, out1 = cast(IO[bytes], vm2.stdout), cast(IO[bytes], vm1.stdout)  # (PIPEs)
        relay2 = threading.Thread(target=_relay, daemon=True,
                                  args=(out2, "[host2-vm] ", AGENT_READY, marks, "2", t0))
        relay2.start()
        if timeout is not None:
            def expire() -> None:
                timed_out.set()
                for p in procs:
                    _kill(p)
            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
        for raw in out1:
            line = raw.decode(errors="replace")
            if "1" not in marks and READY_MARK in line:
                marks["1"] = time.monotonic() - t0
                _log(f"pair up: host 2's agent listening at {marks.get('2', float('nan')):.1f}"
                     f" s, host 1 ready (rxe0 up, agent answered) at {marks['1']:.1f} s")
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
        vm1.wait()
        try:  # host 2 powers off once its agent is stopped
            vm2.wait(timeout=20)
        except subprocess.TimeoutExpired:
            _log("host 2 did not power off within 20 s: killed")
        status = _read_status(os.path.join(run_dir, "host1", "status"))
        if timed_out.is_set():
            _log(f"both VMs killed: time limit ({timeout} s) reached")
            return 124
        if status is None:
            _log(f"host 1 stopped without the command's exit status (QEMU exit status "
                 f"{vm1.returncode}); its console said:")
            sys.stderr.write(_tail(os.path.join(run_dir, "host1", "console.log")))
            sys.stderr.write("[rxe] host 2's console said:\n"
                             + _tail(os.path.join(run_dir, "host2", "console.log")))
            return 1
    except KeyboardInterrupt:
        _log("interrupted: both VMs killed")
        return 130
    finally:
        if timer is not None:
            timer.cancel()
        for p in procs:
            _kill(p)
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(run_dir, ignore_errors=True)
    total = time.monotonic() - t0
    if "1" not in marks:
        _log(f"the pair never became ready (exit status {status}, {total:.1f} s)")
        return status or 1
    _log(f"pair: boot {marks['1']:.1f} s, command + shutdown {total - marks['1']:.1f} s, "
         f"exit status {status}")
    return status


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
