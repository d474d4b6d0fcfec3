"""``aiordma bench --hosts 2``, the parts that need no device and no VM: the wire's sysfs and
``tc`` parsers and the check that a row crossed the link, the rows' payloads and their runs
under loss, the command-line rules, perftest's pair across the wire (with a stand-in tool),
the peer's READY line, and the host load a guest reads."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path

import pytest

from aiordma import AiordmaError
from aiordma.tools.bench import run_bench
from aiordma.tools.bench.measure import Versus
from aiordma.tools.bench.peer import PeerPorts, parse_ready, peer_command
from aiordma.tools.bench.perftest import Across, run_pair
from aiordma.tools.bench.plan import Plan
from aiordma.tools.bench.runner import (
    HEADLINE,
    failure,
    loss_tag,
    lossy_spec,
    perftest_jobs,
    python_specs,
)
from aiordma.tools.bench.wire import (
    Counters,
    LinkEnd,
    NotCrossed,
    Payload,
    check_crossed,
    counter_command,
    find_end,
    parse_counters,
)
from aiordma.tools.cli import areas_across, bench_argv, build_parser, main, pair_timeout
from aiordma.tools.hostload import FILE, HostLoadWriter, host_load, parse_loadavg

# `grep -H .` over rxe0's GIDs, types and interfaces, as LISTING prints them (GID 0 is the
# link-local one, RoCE v1 and v2 each for both addresses); a second device carries another
# address.
LISTING_OUTPUT = """\
/sys/class/infiniband/rxe0/ports/1/gids/0:fe80:0000:0000:0000:5054:00ff:fe12:3401
/sys/class/infiniband/rxe0/ports/1/gids/1:0000:0000:0000:0000:0000:ffff:0a4d:0001
/sys/class/infiniband/rxe0/ports/1/gids/2:fe80:0000:0000:0000:5054:00ff:fe12:3401
/sys/class/infiniband/rxe0/ports/1/gids/3:0000:0000:0000:0000:0000:ffff:0a4d:0001
/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/0:IB/RoCE v1
/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/1:RoCE v2
/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/2:IB/RoCE v1
/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/3:IB/RoCE v1
/sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/0:eth0
/sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/1:eth0
/sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/2:eth0
/sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/3:eth0
/sys/class/infiniband/rxe1/ports/1/gids/1:0000:0000:0000:0000:0000:ffff:0a4d:0002
/sys/class/infiniband/rxe1/ports/1/gid_attrs/types/1:RoCE v2
/sys/class/infiniband/rxe1/ports/1/gid_attrs/ndevs/1:d0
"""

# what `tc -s qdisc show dev eth0` prints with netem on it
TC_NETEM = """\
qdisc netem 8001: root refcnt 2 limit 1000 loss 1%
 Sent 1841826 bytes 1707 pkt (dropped 17, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""

# -- the link's ends --------------------------------------------------------------------------


def test_the_roce_v2_gid_of_an_address_is_found_with_its_interface() -> None:
    assert find_end(LISTING_OUTPUT, "10.77.0.1") == LinkEnd(
        address="10.77.0.1", device="rxe0", port=1, gid_index=1, netdev="eth0")
    assert find_end(LISTING_OUTPUT, "10.77.0.2") == LinkEnd(
        address="10.77.0.2", device="rxe1", port=1, gid_index=1, netdev="d0")


def test_an_address_without_a_roce_v2_gid_is_an_error() -> None:
    with pytest.raises(AiordmaError, match="no RoCE v2 GID carries 10.77.0.9"):
        find_end(LISTING_OUTPUT, "10.77.0.9")
    v1_only = "\n".join(line for line in LISTING_OUTPUT.splitlines()
                        if "/1:" not in line and "rxe1" not in line)
    with pytest.raises(AiordmaError):  # only RoCE v1 GIDs carry it
        find_end(v1_only, "10.77.0.1")
    with pytest.raises(AiordmaError):
        find_end("", "10.77.0.1")


def test_counter_files_and_command() -> None:
    end = find_end(LISTING_OUTPUT, "10.77.0.1")
    assert end.counter_files() == [
        "/sys/class/net/eth0/statistics/tx_bytes", "/sys/class/net/eth0/statistics/rx_bytes",
        "/sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts",
        "/sys/class/infiniband/rxe0/ports/1/hw_counters/rcvd_pkts"]
    plain = counter_command(end, netem=False)
    assert plain[:2] == ["sh", "-c"] and "tc" not in plain[2]
    assert plain[2] == "cat " + " ".join(end.counter_files())
    assert plain[2] + " && tc -s qdisc show dev eth0" == counter_command(end, netem=True)[2]


# -- counters ---------------------------------------------------------------------------------


def test_counters_are_parsed_with_and_without_netem() -> None:
    assert parse_counters("100\n200\n3\n4\n") == Counters(100, 200, 3, 4, 0)
    assert parse_counters("100\n200\n3\n4\n" + TC_NETEM) == Counters(100, 200, 3, 4, 17)
    # without netem on it, tc shows another qdisc: nothing dropped by netem
    assert parse_counters("1\n2\n3\n4\nqdisc pfifo_fast 0: root refcnt 2 bands 3\n Sent 5 "
                          "bytes 1 pkt (dropped 9, overlimits 0 requeues 0)\n").dropped == 0


@pytest.mark.parametrize("text", ["", "1\n2\n3\n", "1\n2\nx\n4\n",
                                  "cat: /sys/class/net/eth0/statistics/tx_bytes: No such file"])
def test_unreadable_counters_are_an_error(text: str) -> None:
    with pytest.raises(AiordmaError, match="unreadable counters"):
        parse_counters(text)


def test_counters_subtract_field_by_field() -> None:
    assert Counters(10, 20, 30, 40, 5) - Counters(1, 2, 3, 4, 1) == Counters(9, 18, 27, 36, 4)


# -- did a row cross? -------------------------------------------------------------------------

MB = 1_000_000


def test_a_row_that_crossed_passes_and_says_what_the_counters_saw() -> None:
    here, there = Counters(2 * MB, 70_000, 2100, 1100), Counters(70_000, 2 * MB, 1100, 2100)
    proof = check_crossed(here, there, sent=MB, received=0, roce=True, mtu=1024)
    assert proof.startswith("crossed the wire: host 1 out 2.00 MB, in 0.07 MB")
    assert "RoCE packets on host 1: 2100 sent, 1100 received; on host 2: 1100 sent, 2100 " \
           "received" in proof
    assert "netem" not in proof


def test_a_row_looped_back_on_one_device_does_not_cross() -> None:
    # both ends on host 1's rxe0: its packet counters move, the link's bytes do not
    here = Counters(300, 200, 5000, 5000)
    with pytest.raises(NotCrossed, match="did not cross the wire: 1.00 MB sent, but the link "
                                         "counted 300 B out of host 1 and 0 B into host 2"):
        check_crossed(here, Counters(0, 0, 0, 0), sent=MB, received=0, roce=True, mtu=1024)


@pytest.mark.parametrize(("here", "there", "problem"), [
    # received: host 2 sent less than the payload back
    (Counters(MB, MB, 2000, 2000), Counters(10, MB, 0, 0), "received, but the link"),
    # host 1 sent it, host 2 never saw it
    (Counters(MB, MB, 2000, 2000), Counters(MB, 0, 0, 0), "sent, but the link"),
    # bytes crossed, but not as RoCE (e.g. over TCP): too few RDMA packets
    (Counters(MB, MB, 10, 10), Counters(MB, MB, 10, 10), "need at least 1954 RoCE packets"),
    # looped back on host 1 while other traffic filled the link: host 2's port saw nothing
    (Counters(MB, MB, 2000, 2000), Counters(MB, MB, 0, 0), "host 2's port counted 0 sent"),
])
def test_each_counter_that_moved_too_little_is_named(here: Counters, there: Counters,
                                                     problem: str) -> None:
    with pytest.raises(NotCrossed, match=problem):
        check_crossed(here, there, sent=MB, received=MB, roce=True, mtu=1024)


def test_the_tcp_baseline_needs_no_roce_packets() -> None:
    proof = check_crossed(Counters(MB, MB, 0, 0), Counters(MB, MB, 0, 0), sent=MB,
                          received=MB, roce=False, mtu=1024)
    assert "RoCE" not in proof


def test_what_netem_dropped_goes_with_the_proof() -> None:
    proof = check_crossed(Counters(MB, 0, 1000, 50, 12), Counters(0, MB, 50, 1000, 3), sent=MB,
                          received=0, roce=True, mtu=1024)
    assert proof.endswith("netem dropped 12 leaving host 1, 3 leaving host 2")


def test_an_empty_payload_crosses_trivially() -> None:
    zero = Counters(0, 0, 0, 0)
    assert check_crossed(zero, zero, sent=0, received=0, roce=True, mtu=1024)


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
    from aiordma.tools.bench.service_rows import _drive

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


# -- the command line -------------------------------------------------------------------------


def test_areas_across_leave_out_the_collectives() -> None:
    assert areas_across("abcdefgh") == "abcdefg"
    assert areas_across("a,e,h") == "ae"
    assert areas_across("h") == ""


def test_pair_timeout_grows_with_repeats_and_loss() -> None:
    quick = pair_timeout(quick=True, repeat=1, loss=0.0)
    assert 0 < quick < pair_timeout(quick=False, repeat=1, loss=0.0)
    assert pair_timeout(quick=True, repeat=3, loss=0.0) == 3 * quick
    assert pair_timeout(quick=True, repeat=1, loss=1.0) == 2 * quick


def test_bench_options_for_two_hosts() -> None:
    d = build_parser().parse_args(["bench"])
    assert d.hosts == 1 and d.loss == 0.0
    args = build_parser().parse_args(["bench", "--hosts", "2", "--loss", "1", "--quick"])
    assert (args.hosts, args.loss) == (2, 1.0)
    argv = bench_argv(args, json_path="/w/b.json", png_path=None, only="abcdefg")
    assert argv[:4] == [sys.executable, "-m", "aiordma", "bench"] and "--here" in argv
    assert argv[argv.index("--hosts") + 1] == "2" and argv[argv.index("--loss") + 1] == "1"
    assert argv[argv.index("--only") + 1] == "abcdefg" and "--quick" in argv
    one = bench_argv(build_parser().parse_args(["bench"]), json_path=None, png_path=None,
                     only="ab")
    assert "--hosts" not in one and "--loss" not in one
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--hosts", "3"])


@pytest.mark.parametrize(("argv", "says"), [
    (["bench", "--loss", "1"], "--loss needs --hosts 2"),
    (["bench", "--hosts", "2", "--peers"], "not run there"),
    (["bench", "--hosts", "2", "--only", "h"], "not run there"),
    (["bench", "--hosts", "2", "--loss", "-1"], "--loss"),
    (["bench", "--hosts", "2", "--loss", "100"], "--loss"),
    (["bench", "--hosts", "2", "--here"], "not on host 1"),
])
def test_bench_refuses_what_two_hosts_cannot_run(argv: list[str], says: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("AIORDMA_AGENT", raising=False)
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_run_bench_refuses_before_touching_a_device() -> None:
    with pytest.raises(ValueError, match="loss"):
        run_bench(loss=1.0)
    with pytest.raises(ValueError, match="without the peers"):
        run_bench(hosts=2, only="abcdefgh")
    with pytest.raises(ValueError, match="without the peers"):
        run_bench(hosts=2, only="a", peers=True)


# -- perftest across the wire (a stand-in tool, no device) ------------------------------------


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


# -- the peer and the host's load -------------------------------------------------------------


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


def test_a_guest_reads_the_load_its_harness_writes(tmp_path: Path) -> None:
    src = tmp_path / "loadavg"
    src.write_text("3.50 2.25 1.00 1/2 3\n")
    guests = [tmp_path / "host1", tmp_path / "host2"]
    for g in guests:
        g.mkdir()
    assert host_load(str(guests[0])) is None  # the harness has written nothing yet
    with HostLoadWriter([str(g) for g in guests], interval=0.05, source=str(src)) as writer:
        assert all(host_load(str(g)) == (3.5, 2.25, 1.0) for g in guests)  # written at once
        src.write_text("0.10 0.20 0.30 1/2 3\n")
        writer.write_once()
        assert host_load(str(guests[1])) == (0.1, 0.2, 0.3)
    assert sorted(os.listdir(guests[0])) == [FILE]  # no temporary file left behind
    assert host_load(str(tmp_path / "absent")) == os.getloadavg()  # not in a VM
