"""The two-VM harness without VMs: host 2's command agent and host 1's client
(:mod:`aiordma.tools.host_agent`, :mod:`aiordma.tools.remote`) as real processes on real
sockets on this machine's loopback; the pair's guest scripts and QEMU arguments
(:mod:`aiordma.tools.vm_pair`); the command line."""

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
from aiordma.tools import remote, vm, vm_pair
from aiordma.tools.cli import _strip_dashes, build_parser
from aiordma.tools.remote import HostLostError, NotTwoHostsError, RemoteProcess, RemoteStartError


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[str]]:
    """The agent, listening on a free port of 127.0.0.1; ``AIORDMA_AGENT`` points at it."""
    proc = subprocess.Popen([sys.executable, "-m", "aiordma.tools.host_agent", "--listen",
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


def test_outside_a_pair_or_without_an_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIORDMA_AGENT", raising=False)
    with pytest.raises(NotTwoHostsError, match="aiordma rxe run --hosts 2"):
        RemoteProcess(["true"])
    monkeypatch.delenv("AIORDMA_HOST2", raising=False)
    with pytest.raises(NotTwoHostsError):
        remote.host_addresses()
    monkeypatch.setenv("AIORDMA_AGENT", "127.0.0.1:1")  # nobody listens there
    with pytest.raises(HostLostError, match="not reachable"):
        RemoteProcess(["true"], connect_timeout=5)
    with pytest.raises(HostLostError):
        remote.wait_for_agent(0.5)


def test_ping_then_stop_ends_the_agent(agent: subprocess.Popen[str]) -> None:
    remote.wait_for_agent(30)
    assert remote.main(["--stop"]) == 0
    assert agent.wait(30) == 0


def test_guest_scripts_are_shell_and_say_what_they_do() -> None:
    s1 = vm_pair.guest_script(1, [".venv/bin/python", "-m", "pytest", "-k", "a b; rm -rf /"])
    s2 = vm_pair.guest_script(2, [])
    for s in (s1, s2):
        assert subprocess.run(["sh", "-n"], input=s, text=True, check=False).returncode == 0
        assert "rdma link add rxe0 type rxe netdev eth0" in s
        assert "AIORDMA_HOST1=10.77.0.1 AIORDMA_HOST2=10.77.0.2 AIORDMA_AGENT=10.77.0.2:7790" in s
    assert "ip addr add 10.77.0.1/24 dev eth0" in s1 and "10.77.0.2/24 dev eth0" in s2
    assert "-m aiordma.tools.host_agent --listen 10.77.0.2:7790" in s2.splitlines()[-1]
    lines = s1.splitlines()
    i = lines.index(".venv/bin/python -m pytest -k 'a b; rm -rf /'")
    assert "--wait" in lines[i - 2] and "|| exit 95" in lines[i - 2]  # the agent answers first
    assert lines[i + 1:] == ["rc=$?", f"{sys.executable} -m aiordma.tools.remote --stop || true",
                             "exit $rc"]


def test_the_link_joins_the_two_cards_and_nothing_else(tmp_path: object) -> None:
    a1, a2 = vm_pair.nic_args("/r", 1), vm_pair.nic_args("/r", 2)
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
    a = p.parse_args(["rxe", "run", "--hosts", "2", "--", "sh", "x.sh"])
    assert (a.hosts, _strip_dashes(a.cmd)) == (2, ["sh", "x.sh"])
    assert p.parse_args(["rxe", "run", "--", "true"]).hosts == 1
    e = p.parse_args(["rxe", "exec", "--timeout", "9", "2", "--", "ls", "-l"])  # options first
    assert (e.action, e.host, e.timeout, _strip_dashes(e.cmd)) == ("exec", 2, 9.0, ["ls", "-l"])
    with pytest.raises(SystemExit):
        p.parse_args(["rxe", "exec", "3", "--", "ls"])
