"""``python -m harness bench``, the parts that need no device and no VM: the wire's sysfs and
``tc`` parsers and the check that a row crossed the link (:mod:`harness.bench.wire`), the
command line's rules (:mod:`harness.bench.across`), and this machine's load written for the
guests (:mod:`harness.hostload`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from aiordma import AiordmaError
from aiordma.bench.hostload import FILE, host_load
from harness.bench.across import areas_across, bench_argv, pair_timeout
from harness.bench.wire import (
    Counters,
    LinkEnd,
    NotCrossed,
    check_crossed,
    counter_command,
    find_end,
    parse_counters,
)
from harness.cli import build_parser, main
from harness.hostload import HostLoadWriter

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
    assert d.loss == 0.0 and not d.here and d.only == "abcdefght"  # (aiordma bench's options)
    args = build_parser().parse_args(["bench", "--loss", "1", "--quick"])
    assert args.loss == 1.0
    argv = bench_argv(args, json_path="/w/b.json", png_path=None, only="abcdefg")
    assert argv[:4] == [sys.executable, "-m", "harness", "bench"] and "--here" in argv
    assert argv[argv.index("--loss") + 1] == "1" and argv[argv.index("--json") + 1] == "/w/b.json"
    assert argv[argv.index("--only") + 1] == "abcdefg" and "--quick" in argv
    one = bench_argv(build_parser().parse_args(["bench"]), json_path=None, png_path=None,
                     only="ab")
    assert "--loss" not in one
    assert build_parser().parse_args(one[3:]).here  # host 1's command parses as itself
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--peers"])


@pytest.mark.parametrize(("argv", "says"), [
    (["bench", "--only", "h"], "not run there"),
    (["bench", "--loss", "-1"], "--loss"),
    (["bench", "--loss", "100"], "--loss"),
    (["bench", "--here"], "not on host 1"),
])
def test_bench_refuses_what_two_hosts_cannot_run(argv: list[str], says: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("AIORDMA_AGENT", raising=False)
    assert main(argv) == 2
    assert says in capsys.readouterr().err


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
