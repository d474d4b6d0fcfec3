"""Two VMs on a private wire: ``python -m harness run --hosts 2 -- CMD``.

Each VM is the one-host VM of :mod:`.vm` (same kernel, initramfs and 9p shares of the host's
root and the current directory) with one virtio-net card more. The two cards are joined only
to each other: QEMU's ``dgram`` network backend over a pair of Unix datagram sockets in the
run directory (each VM sends its Ethernet frames to the other's socket), so no frame reaches
any IP network, not even this machine's loopback. In each guest, ``virtio_net`` and
``rdma_rxe`` are loaded (by ``modprobe`` from the host's module tree, as the one-host VM loads
``rdma_rxe``), ``eth0`` gets :data:`HOST1` or :data:`HOST2` on a /24 link subnet and ``rxe0``
is made on it: RDMA between the hosts crosses the wire as RoCE v2 (UDP 4791).

Host 2 runs only the command agent (:mod:`.host_agent`). Host 1 says it is up (rxe0 on its
card), waits until the agent answers, then runs CMD with ``AIORDMA_HOST1``, ``AIORDMA_HOST2`` and ``AIORDMA_AGENT`` set (how CMD
starts processes on host 2: :mod:`.remote`), then asks the agent to stop so that host 2 syncs
and powers off. CMD's output and exit status pass through; host 2's own lines are shown
prefixed with ``[host2-vm]``. Each VM gets one vCPU and :data:`MEMORY`: the machine this runs
on has two cores, and a VM with two vCPUs beside another would only make them contend.

**Every wait is bounded.** Each VM has the boot's bound (:func:`.boot.boot_bound`) to say it
is up (host 1's :data:`HOST1_UP`, host 2's agent listening): one that stays silent is killed
and booted once more, and a second silence ends the run with a
:class:`~harness.boot.BootError` naming that VM's console logs. Host 1 then waits for host 2's
agent across the link for twice that bound and a minute (exit status 95 and the reason if it
never answers); the command has ``timeout``; host 2 gets 20 s to power off.

**Host 2 can be made to vanish, and booted again**, from host 1: host 1 has one more virtio
serial port (:data:`~harness.remote.CONTROL_PORT`), whose other end is this harness
(QEMU connects it to a Unix socket the harness listens on). A line ``kill 2`` on it makes the
harness SIGKILL host 2's QEMU process: its guest stops between two instructions, and sends
nothing more, no FIN, no RST, not even a link-down (host 1's frames to it are dropped, since
nobody reads its end of the link). ``boot 2`` boots a new host 2 from the same files (its
agent, rxe0 and address as before). Each is answered with one line, ``ok ...`` or ``err ...``.
Host 1's side: :func:`harness.remote.kill_host2`, :func:`~harness.remote.boot_host2`
(``python -m harness kill 2``, ``python -m harness boot 2``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, cast

from aiordma import DeviceError
from aiordma._verbs.load import cache_dir

from . import host_agent, vm
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
from .remote import CONTROL_PORT
from .run import script_header, vm_route

__all__ = ["AGENT_READY", "HOST1", "HOST1_UP", "HOST2", "MEMORY", "control_args",
           "guest_script", "nic_args", "run_pair"]

HOST1, HOST2, PREFIX = "10.77.0.1", "10.77.0.2", 24
#: Memory per VM. Host 1 runs pytest and its clients (the device suite's processes use 100-300
#: MB each), host 2 the servers; 1 GiB each left more than half free in the runs measured.
MEMORY = "1G"
#: Host 2's line once it is up: its agent listens.
AGENT_READY = "[host-agent] listening on"
#: Host 1's line once it is up (rxe0 on its card), before it waits for host 2's agent.
HOST1_UP = "[aiordma-rxe] host 1 up"
#: Seconds host 2 gets to power off once its agent is stopped.
POWER_OFF = 20.0


def nic_args(run_dir: str, n: int) -> list[str]:
    """QEMU arguments of host ``n``'s card: a dgram netdev from its own Unix socket to the
    other host's."""
    me, other = os.path.join(run_dir, f"link{n}.sock"), os.path.join(run_dir, f"link{3 - n}.sock")
    return ["-netdev", (f"dgram,id=link,local.type=unix,local.path={me},"
                       f"remote.type=unix,remote.path={other}"),
            "-device", f"virtio-net-pci,netdev=link,mac=52:54:00:77:00:0{n}"]


def guest_script(n: int, cmd: list[str], *, agent_wait: float = 300.0) -> str:
    """Host ``n``'s shell lines: the card, its address and ``rxe0`` on it; then (host 2) the
    agent, or (host 1) its up line, the wait for the agent (``agent_wait`` seconds), CMD, and
    the agent's stop. Exit status 97: the set-up failed (the line before says which step);
    95: host 2's agent never answered (the reason is printed)."""
    addr = HOST1 if n == 1 else HOST2
    lines = [
        "fail() { echo \"[rxe] host " + str(n) + ": $1 failed\" >&2; exit 97; }",
        "modprobe virtio_net || fail 'modprobe virtio_net'",
        "modprobe rdma_rxe || fail 'modprobe rdma_rxe'",
        "i=0",  # the card's interface appears once virtio_net has probed it
        "until [ -e /sys/class/net/eth0 ]; do",
        "  i=$((i + 1)); [ $i -gt 100 ] && fail 'waiting 5 s for eth0'; sleep 0.05",
        "done",
        f"ip addr add {addr}/{PREFIX} dev eth0 || fail 'ip addr add'",
        "ip link set eth0 up || fail 'ip link set up'",
        "rdma link add rxe0 type rxe netdev eth0 || fail 'rdma link add'",
        "i=0",
        "until grep -qs ACTIVE /sys/class/infiniband/rxe0/ports/1/state; do",
        ("  i=$((i + 1)); [ $i -gt 100 ] && fail \"waiting 5 s for rxe0's port to turn ACTIVE\";"
         " sleep 0.05"),
        "done",
        f"hostname aiordma-host{n} 2>/dev/null",
        (f"export AIORDMA_HOST1={HOST1} AIORDMA_HOST2={HOST2}"
        f" AIORDMA_AGENT={HOST2}:{host_agent.PORT}"),
    ]
    if n == 2:
        # (this interpreter, in the current directory: the guest's is the same, and the
        # harness is found there as it was here)
        agent = shlex.join([sys.executable, "-m", "harness.host_agent"])
        lines.append(f"exec {agent} --listen {HOST2}:{host_agent.PORT}")
    else:
        remote = shlex.join([sys.executable, "-m", "harness.remote"])
        lines += [
            f"echo '{HOST1_UP} (rxe0 on eth0, {HOST1})' >&2",
            f"{remote} --wait {agent_wait:g} || exit 95",
            f"echo '{READY_MARK} (rxe0 on eth0, {HOST1}; host 2 at {HOST2})' >&2",
            shlex.join(cmd),
            "rc=$?",
            f"{remote} --stop || true",
            "exit $rc",
        ]
    return "\n".join(lines) + "\n"


class _Host2:
    """Host 2's QEMU process: started, killed on request (a host that vanishes), started
    again. The process and its relay of output are replaced under a lock; :attr:`up` is set
    once the current boot's agent listens, and :attr:`took` notes when, for each boot."""

    def __init__(self, args: list[str], run_dir: str) -> None:
        self.args = args
        self.run_dir = run_dir
        self.lock = threading.Lock()
        self.all: list[subprocess.Popen[bytes]] = []  # every QEMU started, for the clean-up
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0
        self.started_at = 0.0
        self.up = threading.Event()
        self.took: list[float | None] = []  # per boot: seconds until its agent listened

    def start(self) -> None:
        with self.lock:
            self._start()

    def _start(self) -> None:
        # The killed QEMU's socket file is still there, and binding its path again would fail.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.run_dir, "link2.sock"))
        self.boots += 1
        self.up = threading.Event()
        self.started_at = time.monotonic()
        self.took.append(None)
        proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._relay, daemon=True,
                         args=(proc, self.up, self.started_at, self.boots - 1)).start()
        self.proc = proc
        self.all.append(proc)

    def _relay(self, proc: subprocess.Popen[bytes], up: threading.Event, started: float,
               boot: int) -> None:
        """Host 2's lines to stderr, prefixed; ``up`` set (and the time it took noted) when
        its agent listens."""
        for raw in cast(IO[bytes], proc.stdout):
            line = raw.decode(errors="replace")
            if not up.is_set() and AGENT_READY in line:
                self.took[boot] = time.monotonic() - started
                up.set()
            sys.stderr.write("[host2-vm] " + line)
            sys.stderr.flush()

    def kill_current(self) -> None:
        """Kill the current boot (silent past its bound)."""
        with self.lock:
            if self.proc is not None:
                kill_group(self.proc)

    def request(self, line: str) -> str:
        """The answer to one request of host 1's control port."""
        with self.lock:
            proc = self.proc
            running = proc is not None and proc.poll() is None
            if line == "kill 2":
                if proc is None or not running:
                    return "err host 2 is not running"
                kill_group(proc)
                log(f"host 2 killed on host 1's request (QEMU pid {proc.pid}, SIGKILL)")
                return f"ok killed host 2 (QEMU pid {proc.pid})"
            if line == "boot 2":
                if running:
                    return "err host 2 is running"
                self._start()
                log(f"host 2 booting again on host 1's request (boot {self.boots})")
                return f"ok booting host 2 (boot {self.boots})"
            if line == "status 2":
                return "ok running" if running else "ok stopped"
            return f"err unknown request {line!r} (kill 2, boot 2, status 2)"

    def wait(self, timeout: float) -> None:
        with self.lock:
            proc = self.proc
        if proc is not None:
            proc.wait(timeout=timeout)


def _serve_control(listener: socket.socket, host2: _Host2) -> None:
    """Host 1's control port: one request a line. QEMU connects its end at start (again
    after a boot of host 1 that was silent past its bound); served until the listener is
    closed."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn, conn.makefile("rwb", buffering=0) as f:
            for raw in f:
                answer = host2.request(raw.decode(errors="replace").strip())
                try:
                    f.write(answer.encode() + b"\n")
                except OSError:
                    break


def close_control(listener: socket.socket) -> None:
    """Close the control port's listener, waking :func:`_serve_control` from its ``accept``
    (a close alone does not, on Linux; a shutdown does)."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def control_args(path: str) -> list[str]:
    """QEMU arguments of host 1's control port: a virtio serial port named
    :data:`~harness.remote.CONTROL_PORT` whose other end connects to the Unix socket
    ``path`` (the harness listens there)."""
    return ["-chardev", f"socket,id=pairctl,path={path}",
            "-device", f"virtserialport,chardev=pairctl,name={CONTROL_PORT}"]


def run_pair(cmd: list[str], *, memory: str = MEMORY, timeout: float | None = None,
             bound: BootBound | None = None) -> int:
    """Boot the pair, run ``cmd`` on host 1, return its exit status (124: ``timeout`` passed,
    both VMs killed; 130: interrupted).

    Raises:
        DeviceError: there is nothing to run, or a VM cannot be booted here (what is missing).
        BootError: a VM said nothing within the boot's bound, twice.
    """
    if not cmd:
        raise DeviceError("nothing to run: give a command after --")
    route = vm_route()
    if isinstance(route, str):
        raise DeviceError(route)
    prep = vm.prepare(route.kernel)
    bound = bound or boot_bound()
    vm_dir = cache_dir() / "vm"
    vm_dir.mkdir(parents=True, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="pair-", dir=vm_dir)
    try:
        args = {}
        for n in (1, 2):
            d = os.path.join(run_dir, f"host{n}")
            os.mkdir(d)
            with open(os.path.join(d, "run.sh"), "w") as f:
                f.write(script_header())
                f.write(guest_script(n, cmd, agent_wait=2 * bound.seconds + 60))
            a = vm.qemu_command(prep, run_dir=d, rwdir=os.getcwd(), out_path="/proc/self/fd/1",
                                status_path=os.path.join(d, "status"),
                                console_log=os.path.join(d, "console.log"), memory=memory,
                                cpus=1, nic=nic_args(run_dir, n))
            a[0] = route.qemu
            if n == 1:
                a += control_args(os.path.join(run_dir, "control.sock"))
            args[n] = a
        log(f"booting two VMs ({route.kernel.release}, software emulation, 1 CPU and {memory} "
            f"each), joined by a private link ({HOST1} - {HOST2}); each has "
            f"{bound.describe()} to come up")
        return run_guests(args[1], args[2], run_dir, bound=bound, timeout=timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_guests(args1: list[str], args2: list[str], run_dir: str, *, bound: BootBound,
               timeout: float | None = None) -> int:
    """Start host 2 (``args2``) and host 1 (``args1``), whose files are in ``run_dir``'s
    ``host1`` and ``host2``, and see them up within ``bound`` (each booted once more if it
    is not); pass host 1's output through; host 1's command's exit status (see
    :func:`run_pair`).

    Raises:
        BootError: a VM said nothing within ``bound``, twice.
    """
    t0 = time.monotonic()
    timed_out = threading.Event()
    host2 = _Host2(args2, run_dir)
    vm1: list[subprocess.Popen[bytes]] = []  # every QEMU of host 1 started, the last current
    old_term = signal.signal(signal.SIGTERM, interrupt)
    timer = None
    # this machine's load average, readable in both guests (aiordma.bench.hostload)
    load_writer = HostLoadWriter([os.path.join(run_dir, f"host{n}") for n in (1, 2)])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    status: int | None = None
    ready_at: float | None = None
    try:
        listener.bind(os.path.join(run_dir, "control.sock"))
        listener.listen(1)
        threading.Thread(target=_serve_control, args=(listener, host2), daemon=True).start()
        host2.start()  # host 2 first: its agent is what host 1 waits for
        out1 = _start_host1(args1, run_dir, vm1)
        if timeout is not None:
            def expire() -> None:
                timed_out.set()
                with host2.lock:
                    for p in [*vm1, *host2.all]:
                        kill_group(p)
            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
        out1, ready_at = _boot_both(args1, run_dir, vm1, out1, host2, bound, t0, timed_out)
        while (line := out1.next_line(None)) is not None:
            if ready_at is None and READY_MARK in line:
                ready_at = time.monotonic() - t0
                log(f"host 1 ready (rxe0 up, host 2's agent answered it) at "
                    f"{ready_at:.1f} s")
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
        vm1[-1].wait(timeout=30)  # (its output ended: QEMU is exiting)
        try:  # host 2 powers off once its agent is stopped
            host2.wait(POWER_OFF)
        except subprocess.TimeoutExpired:
            log(f"host 2 did not power off within {POWER_OFF:g} s: killed")
        status = read_status(os.path.join(run_dir, "host1", "status"))
        if timed_out.is_set():
            log(f"both VMs killed: time limit ({timeout} s) reached")
            return 124
        if status is None:
            log(f"host 1 stopped without the command's exit status (QEMU exit status "
                f"{vm1[-1].returncode}); its console said:")
            sys.stderr.write(tail(os.path.join(run_dir, "host1", "console.log")))
            sys.stderr.write("[rxe] host 2's console said:\n"
                             + tail(os.path.join(run_dir, "host2", "console.log")))
            return 1
    except KeyboardInterrupt:
        log("interrupted: both VMs killed")
        return 130
    finally:
        if timer is not None:
            timer.cancel()
        load_writer.close()
        close_control(listener)
        with host2.lock:
            for p in [*vm1, *host2.all]:
                kill_group(p)
        signal.signal(signal.SIGTERM, old_term)
    total = time.monotonic() - t0
    if ready_at is None:
        log(f"the pair never became ready (exit status {status}, {total:.1f} s)")
        return status or 1
    again = [f"{t:.1f} s" if t is not None else "(never)" for t in host2.took[1:]]
    if again:
        log(f"host 2 was booted {len(again)} more time(s); its agent listening {', '.join(again)}"
            " after each boot")
    log(f"pair: boot {ready_at:.1f} s, command + shutdown {total - ready_at:.1f} s, "
        f"exit status {status}")
    return status



def _start_host1(args: list[str], run_dir: str,
                 started: list[subprocess.Popen[bytes]]) -> QemuOutput:
    with contextlib.suppress(FileNotFoundError):  # (a killed boot's socket file)
        os.unlink(os.path.join(run_dir, "link1.sock"))
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    started.append(proc)
    return QemuOutput(cast(IO[bytes], proc.stdout))


def _boot_both(args1: list[str], run_dir: str, vm1: list[subprocess.Popen[bytes]],
               out1: QemuOutput, host2: _Host2, bound: BootBound, t0: float,
               stop: threading.Event) -> tuple[QemuOutput, float | None]:
    """Until both hosts say they are up, each within ``bound`` of its start, a silent one
    killed and booted once more; host 1's output (of its current boot) and when it was ready
    (None: not yet). Host 1's lines are passed through meanwhile. Returns at once when
    ``stop`` is set (the run's time limit: both VMs were killed).

    Raises:
        BootError: a host silent through both of its boots.
    """
    logs: dict[int, list[str]] = {1: [], 2: []}
    h1_start, h1_up, h1_up_at = t0, False, t0
    ready_at: float | None = None
    while not stop.is_set():
        # (host 1 ready means host 2's agent answered it: host 2 is up too)
        if ready_at is not None or (h1_up and host2.up.is_set()):
            took2 = host2.took[-1]
            log(f"pair up: host 1 up after {h1_up_at - h1_start:.1f} s, host 2's agent "
                f"listening after " + ("?" if took2 is None else f"{took2:.1f}") + " s"
                + (" (after a silent boot)" if logs[1] or logs[2] else "")
                + ("" if ready_at is None else
                   f"; host 1 ready (the agent answered) at {ready_at:.1f} s"))
            return out1, ready_at
        now = time.monotonic()
        for n in (1, 2):
            silent = (not h1_up and ready_at is None and now > h1_start + bound.seconds
                      if n == 1 else
                      not host2.up.is_set() and ready_at is None
                      and now > host2.started_at + bound.seconds)
            if not silent:
                continue
            d = os.path.join(run_dir, f"host{n}")
            if n == 1:
                kill_group(vm1[-1])
            else:
                host2.kill_current()
            logs[n].append(keep_console_log(os.path.join(d, "console.log"),
                                            f"host{n}-boot{len(logs[n]) + 1}"))
            if len(logs[n]) == 2:
                raise boot_failure(f"host {n} of the pair", bound, logs[n])
            log(f"host {n}: no guest-ready line within {bound.describe()}: QEMU killed, "
                f"console log kept: {logs[n][-1]}; booting it once more")
            if n == 1:
                out1, h1_start = _start_host1(args1, run_dir, vm1), time.monotonic()
            else:
                host2.start()
        try:
            line = out1.next_line(time.monotonic() + 0.2)
        except TimeoutError:
            continue
        if line is None:  # host 1 stopped before it was up: its status says why
            return out1, ready_at
        if not h1_up and HOST1_UP in line:
            h1_up, h1_up_at = True, time.monotonic()
            continue
        if ready_at is None and READY_MARK in line:  # (host 2's agent answered: it is up)
            ready_at = time.monotonic() - t0
            h1_up_at = h1_up_at if h1_up else time.monotonic()
            h1_up = True
            continue
        sys.stdout.write(line)
        sys.stdout.flush()
    return out1, ready_at

