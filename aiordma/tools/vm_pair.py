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

**Host 2 can be made to vanish, and booted again**, from host 1: host 1 has one more virtio
serial port (:data:`~aiordma.tools.remote.CONTROL_PORT`), whose other end is this harness
(QEMU connects it to a Unix socket the harness listens on). A line ``kill 2`` on it makes the
harness SIGKILL host 2's QEMU process: its guest stops between two instructions, and sends
nothing more, no FIN, no RST, not even a link-down (host 1's frames to it are dropped, since
nobody reads its end of the link). ``boot 2`` boots a new host 2 from the same files (its
agent, rxe0 and address as before). Each is answered with one line, ``ok ...`` or ``err ...``.
Host 1's side: :func:`aiordma.tools.remote.kill_host2`, :func:`~aiordma.tools.remote.boot_host2`
(``aiordma rxe kill 2``, ``aiordma rxe boot 2``).
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
from .hostload import HostLoadWriter
from .remote import CONTROL_PORT
from .rxe import READY_MARK, _log, _read_status, _tail, script_header, vm_route

__all__ = ["HOST1", "HOST2", "MEMORY", "control_args", "guest_script", "nic_args", "run_pair"]

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


class _Host2:
    """Host 2's QEMU process: started, killed on request (a host that vanishes), started
    again. The process and its relay of output are replaced under a lock."""

    def __init__(self, args: list[str], run_dir: str, t0: float, marks: dict[str, float]) -> None:
        self.args = args
        self.run_dir = run_dir
        self.t0 = t0
        self.marks = marks
        self.lock = threading.Lock()
        self.all: list[subprocess.Popen[bytes]] = []  # every QEMU started, for the clean-up
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0

    def start(self) -> None:
        with self.lock:
            self._start()

    def _start(self) -> None:
        # The killed QEMU's socket file is still there, and binding its path again would fail.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.run_dir, "link2.sock"))
        self.boots += 1
        proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        key = "2" if self.boots == 1 else f"2.{self.boots}"
        t0 = self.t0 if self.boots == 1 else time.monotonic()
        threading.Thread(target=_relay, daemon=True, args=(
            cast(IO[bytes], proc.stdout), "[host2-vm] ", AGENT_READY, self.marks, key, t0),
        ).start()
        self.proc = proc
        self.all.append(proc)

    def request(self, line: str) -> str:
        """The answer to one request of host 1's control port."""
        with self.lock:
            proc = self.proc
            running = proc is not None and proc.poll() is None
            if line == "kill 2":
                if proc is None or not running:
                    return "err host 2 is not running"
                _kill(proc)
                _log(f"host 2 killed on host 1's request (QEMU pid {proc.pid}, SIGKILL)")
                return f"ok killed host 2 (QEMU pid {proc.pid})"
            if line == "boot 2":
                if running:
                    return "err host 2 is running"
                self._start()
                _log(f"host 2 booting again on host 1's request (boot {self.boots})")
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
    """Host 1's control port (QEMU connects its end once, at start): one request a line."""
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
                return


def control_args(path: str) -> list[str]:
    """QEMU arguments of host 1's control port: a virtio serial port named
    :data:`~aiordma.tools.remote.CONTROL_PORT` whose other end connects to the Unix socket
    ``path`` (the harness listens there)."""
    return ["-chardev", f"socket,id=pairctl,path={path}",
            "-device", f"virtserialport,chardev=pairctl,name={CONTROL_PORT}"]


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
    control = os.path.join(run_dir, "control.sock")
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
        if n == 1:
            a += control_args(control)
        args[n] = a
    _log(f"booting two VMs ({route.kernel.release}, software emulation, 1 CPU and {memory} "
         f"each), joined by a private link ({HOST1} - {HOST2})")
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    timed_out = threading.Event()
    host2 = _Host2(args[2], run_dir, t0, marks)
    vm1: subprocess.Popen[bytes] | None = None

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    timer = None
    # this machine's load average, readable in both guests (aiordma.tools.hostload)
    load_writer = HostLoadWriter([os.path.join(run_dir, f"host{n}") for n in (1, 2)])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(control)
        listener.listen(1)
        threading.Thread(target=_serve_control, args=(listener, host2), daemon=True).start()
        host2.start()  # host 2 first: its agent is what host 1 waits for
        vm1 = subprocess.Popen(args[1], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
        out1 = cast(IO[bytes], vm1.stdout)  # (a PIPE)
        if timeout is not None:
            def expire() -> None:
                timed_out.set()
                with host2.lock:
                    for p in [vm1, *host2.all]:
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
            host2.wait(20)
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
        load_writer.close()
        listener.close()
        with host2.lock:
            for p in [*([vm1] if vm1 is not None else []), *host2.all]:
                _kill(p)
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(run_dir, ignore_errors=True)
    total = time.monotonic() - t0
    if "1" not in marks:
        _log(f"the pair never became ready (exit status {status}, {total:.1f} s)")
        return status or 1
    reboots = [f"{marks[k]:.1f} s" for k in sorted((k for k in marks if k.startswith("2.")),
                                                     key=lambda k: int(k[2:]))]
    if host2.boots > 1:
        _log(f"host 2 was booted {host2.boots - 1} more time(s); its agent listening "
             f"{', '.join(reboots) or '(never)'} after each boot request")
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
