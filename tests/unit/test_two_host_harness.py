"""The two-VM harness without VMs: host 2's command agent and host 1's client
(:mod:`harness.host_agent`, :mod:`harness.remote`) as real processes on real sockets on this
machine's loopback; the pair's guest scripts and QEMU arguments (:mod:`harness.pair`); the
command line (``python -m harness``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aiordma import OperationTimeout
from harness import pair, remote, vm
from harness.boot import kill_group
from harness.cli import build_parser
from harness.cli import strip_dashes as _strip_dashes
from harness.remote import HostLostError, NotTwoHostsError, RemoteProcess, RemoteStartError


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[str]]:
    """The agent, listening on a free port of 127.0.0.1; ``AIORDMA_AGENT`` points at it."""
    proc = subprocess.Popen([sys.executable, "-m", "harness.host_agent", "--listen",
                             "127.0.0.1:0"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    assert m, line
    monkeypatch.setenv("AIORDMA_AGENT", f"127.0.0.1:{m.group(1)}")
    yield proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(10)
    proc.stderr.close()


def test_a_process_on_host_2_gives_its_lines_stderr_and_status(agent: object) -> None:
    with RemoteProcess(["sh", "-c", "echo one; echo oops >&2; printf 'two\\nthree'; exit 3"]
                       ) as p:
        assert [p.readline(30), p.readline(30), p.readline(30)] == ["one\n", "two\n", "three"]
        assert p.readline(30) == "" and p.readline(30) == ""  # the end, every time
        assert p.wait(30) == 3
        assert p.stderr == "oops\n"


def test_expect_skips_lines_and_says_when_it_exited_first(agent: object) -> None:
    with RemoteProcess(["sh", "-c", "echo noise; echo 'PORT 7'; sleep 30"]) as p:
        assert p.expect("PORT ", 30) == "PORT 7\n"
    with RemoteProcess(["sh", "-c", "echo why >&2; exit 4"]) as p, \
            pytest.raises(Exception, match=r"exited \(status 4\) before printing 'PORT '.*why"):
        p.expect("PORT ", 30)


def test_waits_are_bounded_while_the_process_is_quiet(agent: object) -> None:
    with RemoteProcess(["sleep", "30"]) as p:
        t0 = time.monotonic()
        with pytest.raises(OperationTimeout, match="printed no line within 0.5 s"):
            p.readline(0.5)
        with pytest.raises(OperationTimeout, match="still runs after 0.5 s"):
            p.wait(0.5)
        assert time.monotonic() - t0 < 10


def test_a_signal_shows_as_a_negative_status(agent: object) -> None:
    with RemoteProcess(["sh", "-c", "kill -9 $$"]) as p:
        assert p.wait(30) == -9


def test_leaving_kills_the_process_and_its_group(agent: object) -> None:
    with RemoteProcess(["sh", "-c", "sleep 300 & echo $!; wait"]) as p:
        child = int(p.readline(30))
        os.kill(child, 0)  # (the agent runs on this machine here: its pids are ours to see)
    deadline = time.monotonic() + 20
    while _alive(child):
        assert time.monotonic() < deadline, "the background child outlived the connection"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_host_that_stops_answering_is_lost_not_waited_for(
        agent: subprocess.Popen[str]) -> None:
    with RemoteProcess(["sleep", "60"], lost_after=2.0) as p:
        time.sleep(1.5)  # some heartbeats first
        os.kill(agent.pid, signal.SIGSTOP)  # a VM that froze or died: no FIN, no heartbeat
        t0 = time.monotonic()
        with pytest.raises(HostLostError, match="sent nothing for 2 s"):
            p.wait(60)
        assert time.monotonic() - t0 < 30
        with pytest.raises(HostLostError):
            p.readline(1)
        os.kill(agent.pid, signal.SIGCONT)


def test_a_command_that_cannot_start_fails_typed(agent: object) -> None:
    with RemoteProcess(["/nonexistent/command"]) as p:
        with pytest.raises(RemoteStartError, match="could not start.*nonexistent"):
            p.readline(30)
        with pytest.raises(RemoteStartError):
            p.wait(30)


def test_exec_passes_output_and_status_through(agent: object,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    assert remote.exec_on_host2(["sh", "-c", "echo out; echo err >&2; exit 5"]) == 5
    assert remote.exec_on_host2(["sh", "-c", "kill -15 $$"]) == 128 + 15
    out, err = capfd.readouterr()
    assert (out, err) == ("out\n", "err\n")
    with pytest.raises(OperationTimeout, match="still ran after 0.5 s"):
        remote.exec_on_host2(["sleep", "30"], timeout=0.5)


def test_rsh_runs_the_words_by_sh_on_host_2_only(agent: object,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """What Open MPI's mpirun does with its rsh agent: ``agent HOST 'VAR=x;' 'export' ...``;
    the words are one shell command on host 2."""
    monkeypatch.setenv("AIORDMA_HOST1", "10.77.0.1")
    monkeypatch.setenv("AIORDMA_HOST2", "10.77.0.2")
    for host in ("10.77.0.2", "aiordma-host2", "2"):
        assert remote.rsh_on_host2(host, ["V=$((6*7));", "export", "V;", "sh", "-c",
                                          "'echo $V; exit 3'"]) == 3
    assert capfd.readouterr().out == "42\n" * 3
    for host in ("10.77.0.1", "aiordma-host1", "elsewhere"):
        with pytest.raises(NotTwoHostsError, match="is not host 2"):
            remote.rsh_on_host2(host, ["true"])
    with pytest.raises(RemoteStartError, match="no command"):
        remote.rsh_on_host2("10.77.0.2", [])


def test_outside_a_pair_or_without_an_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIORDMA_AGENT", raising=False)
    with pytest.raises(NotTwoHostsError, match="python -m harness run --hosts 2"):
        RemoteProcess(["true"])
    monkeypatch.delenv("AIORDMA_HOST2", raising=False)
    with pytest.raises(NotTwoHostsError):
        remote.host_addresses()
    monkeypatch.setenv("AIORDMA_AGENT", "127.0.0.1:1")  # nobody listens there
    with pytest.raises(HostLostError, match="not reachable"):
        RemoteProcess(["true"], connect_timeout=5)
    with pytest.raises(HostLostError, match=r"127.0.0.1:1 did not answer within 0.5 s \(\d+ "
                       r"tries across the link\); the last try: .*not reachable"):
        remote.wait_for_agent(0.5)


def test_ping_then_stop_ends_the_agent(agent: subprocess.Popen[str]) -> None:
    remote.wait_for_agent(30)
    assert remote.main(["--stop"]) == 0
    assert agent.wait(30) == 0


def test_guest_scripts_are_shell_and_say_what_they_do() -> None:
    s1 = pair.guest_script(1, [".venv/bin/python", "-m", "pytest", "-k", "a b; rm -rf /"])
    s2 = pair.guest_script(2, [])
    for s in (s1, s2):
        assert subprocess.run(["sh", "-n"], input=s, text=True, check=False).returncode == 0
        assert "rdma link add rxe0 type rxe netdev eth0" in s
        assert "AIORDMA_HOST1=10.77.0.1 AIORDMA_HOST2=10.77.0.2 AIORDMA_AGENT=10.77.0.2:7790" in s
    assert "ip addr add 10.77.0.1/24 dev eth0" in s1 and "10.77.0.2/24 dev eth0" in s2
    assert "-m harness.host_agent --listen 10.77.0.2:7790" in s2.splitlines()[-1]
    lines = s1.splitlines()
    i = lines.index(".venv/bin/python -m pytest -k 'a b; rm -rf /'")
    assert pair.HOST1_UP in lines[i - 3]  # up (rxe0 on eth0), then waits for the agent
    assert "--wait" in lines[i - 2] and "|| exit 95" in lines[i - 2]  # the agent answers first
    assert pair.HOST1_UP not in s2 and pair.READY_MARK in lines[i - 1]
    assert lines[i + 1:] == ["rc=$?", f"{sys.executable} -m harness.remote --stop || true",
                             "exit $rc"]
    assert "--wait 250 " in pair.guest_script(1, ["true"], agent_wait=250)
    for s in (s1, s2):  # each wait of the set-up says why it gave up
        assert "fail 'waiting 5 s for eth0'" in s
        assert "fail \"waiting 5 s for rxe0's port to turn ACTIVE\"" in s


def test_the_link_joins_the_two_cards_and_nothing_else(tmp_path: object) -> None:
    a1, a2 = pair.nic_args("/r", 1), pair.nic_args("/r", 2)
    assert a1[1] == ("dgram,id=link,local.type=unix,local.path=/r/link1.sock,"
                     "remote.type=unix,remote.path=/r/link2.sock")
    assert a2[1] == ("dgram,id=link,local.type=unix,local.path=/r/link2.sock,"
                     "remote.type=unix,remote.path=/r/link1.sock")
    assert a1[3] != a2[3] and all("virtio-net-pci" in a[3] for a in (a1, a2))
    prep = vm.Prepared(vm.Kernel("/boot/vmlinuz-x", "x"), "/v", "/i")
    kw: dict[str, Any] = {"run_dir": "/r", "rwdir": "/w", "out_path": "/o", "status_path": "/s",
                          "console_log": "/c"}
    one = vm.qemu_command(prep, **kw)
    two = vm.qemu_command(prep, cpus=1, memory="1G", nic=a1, **kw)
    assert "-netdev" not in one and one[one.index("-net") + 1] == "none"
    assert "-net" not in two and two.count("-netdev") == 1
    assert two[two.index("-smp") + 1] == "1" and two[two.index("-m") + 1] == "1G"


def test_the_command_line() -> None:
    p = build_parser()
    a = p.parse_args(["run", "--hosts", "2", "--", "sh", "x.sh"])
    assert (a.hosts, _strip_dashes(a.cmd)) == (2, ["sh", "x.sh"])
    assert p.parse_args(["run", "--", "true"]).hosts == 1
    e = p.parse_args(["exec", "--timeout", "9", "2", "--", "ls", "-l"])  # options first
    assert (e.command, e.host, e.timeout, _strip_dashes(e.cmd)) == ("exec", 2, 9.0,
                                                                   ["ls", "-l"])
    with pytest.raises(SystemExit):
        p.parse_args(["exec", "3", "--", "ls"])
    assert p.parse_args(["kill", "2"]).command == "kill"
    r = p.parse_args(["rsh", "10.77.0.2", "orted", "-mca", "ess", "env"])  # as mpirun
    assert (r.command, r.host, r.cmd) == ("rsh", "10.77.0.2", ["orted", "-mca", "ess", "env"])
    assert p.parse_args(["boot", "2"]).command == "boot"
    with pytest.raises(SystemExit):
        p.parse_args(["kill", "1"])


def test_the_command_runs_from_the_repository(tmp_path: Any) -> None:
    """``python -m harness`` with no agent in reach: a typed error, said in one line."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    out = subprocess.run([sys.executable, "-m", "harness", "exec", "2", "--", "true"],
                         capture_output=True, text=True, timeout=60, check=False, cwd=root,
                         env=env)
    assert out.returncode == 2
    assert out.stderr.startswith("harness: NotTwoHostsError: not on host 1 of a two-VM run")


# -- host 1's control port to the harness: kill 2, boot 2 ----------------------------------------


def test_the_harness_kills_and_boots_host_2_on_request(tmp_path: Any) -> None:
    """``_Host2`` with ``sleep`` standing in for QEMU, driven through the control server over
    a real Unix socket (QEMU's end of host 1's port connects to it as this test does)."""
    import socket
    import threading

    (tmp_path / "link2.sock").write_bytes(b"")  # a killed QEMU leaves its socket file behind
    host2 = pair._Host2(["sleep", "600"], str(tmp_path))
    host2.start()
    assert not (tmp_path / "link2.sock").exists()  # removed before the start: its path is free
    first = host2.proc
    assert first is not None and first.poll() is None
    path = str(tmp_path / "control.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    server = threading.Thread(target=pair._serve_control, args=(listener, host2), daemon=True)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as qemu, \
                qemu.makefile("rwb", buffering=0) as port:
            qemu.connect(path)
            qemu.settimeout(30)

            def ask(line: str) -> str:
                port.write(line.encode() + b"\n")
                return port.readline().decode().strip()

            assert ask("status 2") == "ok running"
            assert ask("boot 2") == "err host 2 is running"
            assert ask("kill 2") == f"ok killed host 2 (QEMU pid {first.pid})"
            assert first.poll() == -signal.SIGKILL  # killed, and reaped before the answer
            assert ask("status 2") == "ok stopped"
            assert ask("kill 2") == "err host 2 is not running"
            assert ask("boot 2") == "ok booting host 2 (boot 2)"
            second = host2.proc
            assert second is not first and second is not None and second.poll() is None
            assert ask("reboot everything").startswith("err unknown request")
        # The port's end closed; a host 1 booted again connects anew, and is served.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as qemu, \
                qemu.makefile("rwb", buffering=0) as port:
            qemu.connect(path)
            qemu.settimeout(30)
            port.write(b"status 2\n")
            assert port.readline() == b"ok running\n"
        pair.close_control(listener)
        server.join(10)
        assert not server.is_alive()  # the listener closed: the server is done
    finally:
        listener.close()
        for p in host2.all:
            kill_group(p)
    assert host2.all == [first, second]


def test_host_1_asks_the_harness_through_its_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """``control_request`` against a pty standing in for the virtio serial port: the request
    line goes out, the answer comes back; an ``err`` answer and silence are typed."""
    import threading
    import tty

    from aiordma import AiordmaError

    master, slave = os.openpty()
    tty.setraw(slave)
    monkeypatch.setattr(remote, "_control_port", lambda: os.ttyname(slave))
    seen: list[bytes] = []

    def harness(answers: list[bytes]) -> None:
        for answer in answers:
            line = b""
            while not line.endswith(b"\n"):
                line += os.read(master, 100)
            seen.append(line)
            if answer:
                os.write(master, answer)

    try:
        t = threading.Thread(target=harness, args=([b"ok killed host 2 (QEMU pid 7)\n",
                                                    b"err host 2 is running\n", b""],))
        t.start()
        before = time.monotonic()
        assert remote.kill_host2() >= before
        with pytest.raises(AiordmaError, match="host 2 is running"):
            remote.control_request("boot 2")
        with pytest.raises(OperationTimeout, match="did not answer"):
            remote.control_request("status 2", timeout=0.5)
        t.join(10)
        assert seen == [b"kill 2\n", b"boot 2\n", b"status 2\n"]
    finally:
        os.close(slave)
        os.close(master)


def test_without_a_control_port_it_is_not_a_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "listdir", lambda path: [])
    with pytest.raises(NotTwoHostsError, match="aiordma.pair"):
        remote.kill_host2()


def test_the_control_port_is_a_virtio_serial_port_to_a_unix_socket() -> None:
    a = pair.control_args("/r/control.sock")
    assert a == ["-chardev", "socket,id=pairctl,path=/r/control.sock",
                 "-device", "virtserialport,chardev=pairctl,name=aiordma.pair"]
