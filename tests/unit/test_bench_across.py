"""The bench's rows across a link to a second host (:mod:`aiordma.bench.link`), the parts that
need no device and no second host: the rows' payloads and their runs under loss, perftest's
pair across the link (with a stand-in tool), the peer started through the link and its READY
line, and the host load a guest reads. (The link between two VMs, its counters and the
command that boots the pair are the harness's: tests/unit/test_harness_bench.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import pytest

from aiordma.bench import run_bench
from aiordma.bench.hostload import host_load, parse_loadavg
from aiordma.bench.link import Link, Payload, RemoteProcess
from aiordma.bench.measure import Versus
from aiordma.bench.peer import PeerPorts, parse_ready, peer_command, remote_peer_process
from aiordma.bench.perftest import Across, RemoteServer, run_pair
from aiordma.bench.plan import Plan
from aiordma.bench.runner import (
    HEADLINE,
    failure,
    loss_tag,
    lossy_spec,
    perftest_jobs,
    python_specs,
)

# -- the rows' payloads and runs under loss ---------------------------------------------------


def test_every_row_across_the_wire_has_a_payload_and_a_headline() -> None:
    plan = Plan.quick()
    ports = PeerPorts(1, 2, 3, 4, "10.77.0.2")
    for loop in ("asyncio", "uvloop"):
        specs = python_specs(plan, "abcdefg", ports, loop, across=True)
        keys = [k for k, _, _ in specs]
        assert not any("inproc" in k for k in keys)  # its traffic cannot leave the device
        for key, meta, _ in specs:
            assert isinstance(meta["payload"], Payload) and meta["headline"], key
            assert meta["payload"].sent + meta["payload"].received > 0, key
            assert meta["payload"].roce == (meta["system"] == "aiordma"), key
            assert set(meta["headline"]) == set(HEADLINE[meta["area"]])
    # on one device the in-process row is there
    assert any("inproc" in k for k, _, _ in python_specs(plan, "a", PeerPorts(1, 2, 3, 4),
                                                         "uvloop"))


def test_perftest_payloads_go_the_right_way() -> None:
    plan = Plan.quick()
    jobs = {j.key: j for j in perftest_jobs(plan, "abcd")}
    write, read = jobs["pt.ib_write_bw.4096"], jobs["pt.ib_read_bw.4096"]
    assert write.payload == Payload(4096 * plan.bw_iters(4096), 0)
    assert read.payload == Payload(0, 4096 * plan.bw_iters(4096))
    assert jobs["pt.send_lat-e.64"].payload == Payload(64 * plan.rtt_iters, 64 * plan.rtt_iters)
    assert jobs["pt.ib_send_bw.64"].headline == ("msgs_per_s",)
    assert write.headline == ("mibs",) and jobs["pt.send_lat.64"].headline == ("t_typical_us",)


def test_a_row_under_loss_is_compared_with_itself_and_with_its_baselines_under_loss() -> None:
    assert loss_tag(1.0) == "@loss1%" and loss_tag(0.5) == "@loss0.5%"
    meta = {"area": "b", "what": "RDMA WRITE 1 MiB", "system": "aiordma", "loop": "uvloop",
            "versus": [Versus(metric="mibs", base="pt.ib_write_bw.1048576", base_metric="mibs",
                              label="ib_write_bw")]}
    key, lossy = lossy_spec("b.write.1048576.aiordma.uvloop", meta, 1.0, ("mibs",))
    assert key == "b.write.1048576.aiordma.uvloop@loss1%"
    assert lossy["what"] == "RDMA WRITE 1 MiB, 1 % loss"
    first, second = lossy["versus"]
    assert (first.base, first.label) == ("b.write.1048576.aiordma.uvloop", "without loss")
    assert (second.base, second.label) == ("pt.ib_write_bw.1048576@loss1%",
                                           "ib_write_bw at 1 % loss")
    assert meta["what"] == "RDMA WRITE 1 MiB"  # the row without loss is left as it was


def test_a_rows_failure_names_the_first_error_inside_its_task_group() -> None:
    group = ExceptionGroup("unhandled errors in a TaskGroup", [
        ExceptionGroup("inner", [ConnectionResetError("peer gone")]), TimeoutError()])
    assert failure(group) == "ConnectionResetError: peer gone"
    assert failure(TimeoutError()) == "TimeoutError: "


def test_a_drive_that_runs_out_of_time_leaves_no_task_behind() -> None:
    from aiordma.bench.service_rows import _drive

    async def main() -> None:
        calls = 0

        async def call() -> None:
            nonlocal calls
            calls += 1
            if calls > 2:  # the warm-up passes, then every call hangs
                await asyncio.sleep(3600)

        with pytest.raises(TimeoutError):
            await _drive(call, 100, 8, 2, 0.2)
        assert asyncio.all_tasks() == {asyncio.current_task()}

        async def bad() -> None:
            raise ConnectionResetError("peer gone")

        with pytest.raises(ExceptionGroup) as info:
            await _drive(bad, 10, 4, 0, 5.0)
        assert failure(info.value) == "ConnectionResetError: peer gone"

    asyncio.run(main())


def test_run_bench_refuses_before_touching_a_device() -> None:
    with pytest.raises(ValueError, match="loss"):
        run_bench(loss=1.0)
    link: Any = object()  # (refused before it is used)
    with pytest.raises(ValueError, match="without the peers"):
        run_bench(link=link, only="abcdefgh")
    with pytest.raises(ValueError, match="without the peers"):
        run_bench(link=link, only="a", peers=True)
    with pytest.raises(ValueError, match="loss"):
        run_bench(link=link, only="a", loss=100.0)




# -- perftest across the link (a stand-in tool, no device) ------------------------------------


def test_perftest_runs_its_server_on_host_2_and_its_client_towards_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "ib_fake_lat"
    log = tmp_path / "client.argv"
    tool.write_text(f"#!/bin/sh\necho \"$@\" > {log}\necho client done\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    started: list[list[str]] = []
    killed: list[bool] = []

    class Host2Server:
        def __init__(self, argv: list[str]) -> None:
            started.append(argv)

        def poll(self) -> int | None:
            return 0

        def wait(self, timeout: float) -> int:
            return 0

        def kill(self) -> None:
            killed.append(True)

    across = Across(address="10.77.0.2", device="rxe9", gid_index=3, start=Host2Server)
    out, seconds = run_pair("ib_fake_lat", ["-s", "64"], device="rxe0", gid_index=1,
                            timeout=30, cpus=(0, 1), across=across)
    assert out == "client done\n" and seconds >= 0 and killed == [True]
    (server,) = started
    assert server[:5] == ["ib_fake_lat", "-d", "rxe9", "-x", "3"] and "taskset" not in server
    client = log.read_text().split()
    assert client[:4] == ["-d", "rxe0", "-x", "1"] and client[-1] == "10.77.0.2"
    assert client[client.index("-p") + 1] == server[server.index("-p") + 1]




# -- the far host's processes, through the link --------------------------------------------


class StandIn:
    """A process "on the far host" that is a local one (what :meth:`Link.start` returns)."""

    def __init__(self, argv: list[str], lines: list[str], *, status: int = 0,
                 hangs: bool = False) -> None:
        self.argv, self.stderr, self.killed = argv, "", False
        self._lines, self._status, self._hangs = lines, status, hangs

    def poll(self) -> int | None:
        return None if self._hangs else self._status

    def wait(self, timeout: float) -> int:
        from aiordma import OperationTimeout

        if self._hangs:
            raise OperationTimeout(f"{self.argv!r} still runs after {timeout} s")
        return self._status

    def expect(self, prefix: str, timeout: float) -> str:
        return next(line for line in self._lines if line.startswith(prefix))

    def kill(self) -> None:
        self.killed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class FarEnd:
    address, device, port, gid_index, netdev = "10.77.0.2", "rxe0", 1, 1, "eth0"


class StandInLink:
    """A :class:`~aiordma.bench.link.Link` whose far host is this one."""

    here = there = FarEnd()

    def __init__(self, lines: list[str]) -> None:
        self.started: list[StandIn] = []
        self.lines = lines

    def start(self, argv: list[str]) -> RemoteProcess:
        self.started.append(StandIn(argv, self.lines))
        return self.started[-1]

    def snapshot(self) -> Any:
        return None

    def crossed(self, before: Any, payload: Payload, *, mtu: int) -> str:
        return "crossed"

    @contextlib.contextmanager
    def lossy(self, percent: float) -> Iterator[None]:
        yield

    def describe(self) -> str:
        return "a stand-in"


def test_the_peer_starts_on_the_far_host_through_the_link() -> None:
    link = StandInLink(["noise\n", "READY endpoint=1 echo=2 kv=3 tcp=4\n"])
    checked: Link = link  # (it is one, as mypy sees it)
    with remote_peer_process("asyncio", link=checked, keepalive=10) as ports:
        assert ports == PeerPorts(1, 2, 3, 4, "10.77.0.2")
        (peer,) = link.started
        assert peer.argv[-4:] == ["--host", "10.77.0.2", "--keepalive", "10"]
        assert not peer.killed
    assert peer.killed  # (its process group, on the far host)


def test_perftests_server_on_the_far_host_is_waited_for_within_bounds() -> None:
    done = RemoteServer(StandIn(["ib_x"], [], status=0))
    assert done.poll() == 0 and done.wait(1) == 0
    hung = RemoteServer(StandIn(["ib_x"], [], hangs=True))
    with pytest.raises(subprocess.TimeoutExpired):
        hung.wait(0.1)
    hung.kill()


# -- the peer's READY line and the host's load -------------------------------------------------------------


def test_the_peers_ready_line() -> None:
    assert parse_ready("READY endpoint=1 echo=2 kv=3 tcp=4\n", "10.77.0.2") == PeerPorts(
        1, 2, 3, 4, "10.77.0.2")
    assert parse_ready("READY endpoint=1 echo=2 kv=3 tcp=4").host == "127.0.0.1"
    for bad in ("", "READY endpoint=1 echo=2", "HELLO endpoint=1 echo=2 kv=3 tcp=4"):
        with pytest.raises(ValueError):
            parse_ready(bad)
    assert peer_command("uvloop")[-2:] == ["--loop", "uvloop"]
    across = peer_command("asyncio", host="10.77.0.2", keepalive=10)
    assert across[-4:] == ["--host", "10.77.0.2", "--keepalive", "10"]


def test_loadavg_is_parsed() -> None:
    assert parse_loadavg("0.79 1.00 1.55 2/345 6789\n") == (0.79, 1.0, 1.55)
    assert parse_loadavg("") is None and parse_loadavg("x y z") is None



def test_outside_a_vm_the_host_load_is_this_machines(tmp_path: Path) -> None:
    assert host_load(str(tmp_path / "absent")) == os.getloadavg()  # not in a VM
    (tmp_path / "hostload").write_text("3.50 2.25 1.00 1/2 3\n")  # what the harness writes
    assert host_load(str(tmp_path)) == (3.5, 2.25, 1.0)
    (tmp_path / "hostload").unlink()
    assert host_load(str(tmp_path)) is None  # a VM whose harness wrote nothing yet
