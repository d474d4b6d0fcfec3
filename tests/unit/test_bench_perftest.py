"""The perftest output parsers, on real output captured on rxe0 in the project's VM
(perftest 4.5, Debian 6.1 kernel under TCG, 2 vCPUs, ``-d rxe0 -x 1 -F``; client side unless
named SERVER). Trailing whitespace and tabs are kept as perftest printed them."""

import shutil
import time

import pytest

from aiordma.bench.perftest import (
    PerftestError,
    _connect_failed,
    check_against_wall_clock,
    parse_bandwidth,
    parse_latency,
    pinning,
    run_pair,
)

SEND_LAT_EVENTS = """\
---------------------------------------------------------------------------------------
                    Send Latency Test
 Test with events. Using rxe0_comp0
 Dual-port       : OFF		Device         : rxe0
 Number of qps   : 1		Transport type : IB
 Connection type : RC		Using SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : OFF
 TX depth        : 1
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 rdma_cm QPs	 : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0011 PSN 0x86624c
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
 remote address: LID 0000 QPN 0x0012 PSN 0x8df29
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 64      200          288.72         56742.58      2859.69  	       3328.91     	4543.81		46211.11 		56742.58
---------------------------------------------------------------------------------------
"""

SEND_LAT_EVENTS_SERVER = """\

************************************
* Waiting for client to connect... *
************************************
---------------------------------------------------------------------------------------
                    Send Latency Test
 Test with events. Using rxe0_comp0
 Dual-port       : OFF		Device         : rxe0
 Number of qps   : 1		Transport type : IB
 Connection type : RC		Using SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : OFF
 RX depth        : 200
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 rdma_cm QPs	 : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0012 PSN 0x8df29
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
 remote address: LID 0000 QPN 0x0011 PSN 0x86624c
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 64      200          223.58         58582.09      2948.74  	       3299.89     	3830.90		38201.06 		58582.09
---------------------------------------------------------------------------------------
"""

SEND_LAT_POLL = """\
---------------------------------------------------------------------------------------
                    Send Latency Test
 Dual-port       : OFF		Device         : rxe0
 Number of qps   : 1		Transport type : IB
 Connection type : RC		Using SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : OFF
 TX depth        : 1
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 rdma_cm QPs	 : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0013 PSN 0x489742
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
 remote address: LID 0000 QPN 0x0014 PSN 0x63e0b7
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 64      200          21.19          4870.63      21.80    	       52.51       	290.54 		3990.26 		4870.63
---------------------------------------------------------------------------------------
"""

WRITE_BW_4K = """\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF		Device         : rxe0
 Number of qps   : 1		Transport type : IB
 Connection type : RC		Using SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : OFF
 TX depth        : 128
 CQ Moderation   : 100
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 rdma_cm QPs	 : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0016 PSN 0x802c97 RKey 0x00078e VAddr 0x0055aa2de01000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
 remote address: LID 0000 QPN 0x0015 PSN 0xe0f7e RKey 0x0006e9 VAddr 0x0056545b074000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 4096       200              9.97               6.19   		   0.001583
---------------------------------------------------------------------------------------
"""

READ_BW_4M = """\
Device not recognized to implement inline feature. Disabling it
---------------------------------------------------------------------------------------
---------------------------------------------------------------------------------------
                    RDMA_Read BW Test
 Dual-port       : OFF		Device         : rxe0
 Number of qps   : 1		Transport type : IB
 Connection type : RC		Using SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : OFF
 TX depth        : 10
 CQ Moderation   : 1
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 1
 Outstand reads  : 128
 rdma_cm QPs	 : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0019 PSN 0x83330e OUT 0x80 RKey 0x000b98 VAddr 0x007f2a9a2e6000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
 remote address: LID 0000 QPN 0x001a PSN 0x2f9592 OUT 0x80 RKey 0x000ae5 VAddr 0x007f1f76ae6000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 4194304    10               17.00              10.30  		   0.000003
---------------------------------------------------------------------------------------
"""

SEND_BW_64 = """\
---------------------------------------------------------------------------------------
                    Send BW Test
 Dual-port       : OFF		Device         : rxe0
 Number of qps   : 1		Transport type : IB
 Connection type : RC		Using SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : OFF
 TX depth        : 64
 CQ Moderation   : 64
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 rdma_cm QPs	 : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x001c PSN 0xbd8b21
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
 remote address: LID 0000 QPN 0x001b PSN 0x15d3d0
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 64         2000             1.75               0.36   		   0.005928
---------------------------------------------------------------------------------------
"""

NO_SERVER = """\
Couldn't connect to 127.0.0.1:18699
Unable to open file descriptor for socket connection Unable to init the socket connection
"""

def test_latency_with_events() -> None:
    r = parse_latency(SEND_LAT_EVENTS)
    assert (r.size, r.iterations) == (64, 200)
    assert (r.t_min, r.t_max, r.t_typical, r.t_avg) == (288.72, 56742.58, 2859.69, 3328.91)
    assert (r.t_stdev, r.p99, r.p999) == (4543.81, 46211.11, 56742.58)


def test_latency_server_side_banner_is_skipped() -> None:
    r = parse_latency(SEND_LAT_EVENTS_SERVER)
    assert r.t_typical == 2948.74 and r.iterations == 200


def test_latency_busy_polling() -> None:
    r = parse_latency(SEND_LAT_POLL)
    assert (r.t_min, r.t_typical, r.p99) == (21.19, 21.80, 3990.26)


@pytest.mark.parametrize(("text", "size", "iters", "peak", "avg", "rate"), [
    (WRITE_BW_4K, 4096, 200, 9.97, 6.19, 0.001583),
    (READ_BW_4M, 4194304, 10, 17.00, 10.30, 0.000003),  # opens with an inline warning
    (SEND_BW_64, 64, 2000, 1.75, 0.36, 0.005928),
])
def test_bandwidth(text: str, size: int, iters: int, peak: float, avg: float,
                   rate: float) -> None:
    r = parse_bandwidth(text)
    assert (r.size, r.iterations, r.bw_peak, r.bw_avg, r.msg_rate) == (size, iters, peak, avg,
                                                                        rate)


def test_a_latency_parser_refuses_bandwidth_output_and_the_reverse() -> None:
    with pytest.raises(PerftestError):
        parse_latency(WRITE_BW_4K)
    with pytest.raises(PerftestError):
        parse_bandwidth(SEND_LAT_POLL)


@pytest.mark.parametrize("text", ["", NO_SERVER, SEND_LAT_POLL.split(" 64      200")[0]])
def test_no_result_line_is_an_error_carrying_the_output(text: str) -> None:
    with pytest.raises(PerftestError) as info:
        parse_latency(text)
    assert info.value.output == text


def test_a_client_started_before_its_server_is_recognised() -> None:
    assert _connect_failed(NO_SERVER)
    assert not _connect_failed(SEND_LAT_POLL)


def test_a_missing_tool_is_an_error() -> None:
    with pytest.raises(PerftestError, match="not installed"):
        run_pair("ib_no_such_test", [], device="rxe0", gid_index=1, timeout=5)


@pytest.mark.skipif(shutil.which("ib_send_lat") is None, reason="perftest is not installed")
def test_a_failing_pair_is_reported_with_its_output_and_not_waited_for() -> None:
    t0 = time.monotonic()
    with pytest.raises(PerftestError) as info:
        run_pair("ib_send_lat", ["-s", "64", "-n", "5"], device="nosuch0", gid_index=1,
                 timeout=30, cpus=pinning())
    assert "device" in info.value.output  # "IB device nosuch0 not found", or no devices at all
    assert time.monotonic() - t0 < 25


def test_figures_are_checked_against_the_wall_clock() -> None:
    lat = parse_latency(SEND_LAT_EVENTS)  # 200 round trips, t_typical 2859.69 us
    check_against_wall_clock(lat, 200 * 2859.69e-6 * 1.01)  # possible
    with pytest.raises(PerftestError, match="impossible"):
        check_against_wall_clock(lat, 200 * 2859.69e-6 * 0.99)
    bw = parse_bandwidth(WRITE_BW_4K)  # 200 x 4 KiB at 6.19 MiB/s: at least 0.126 s
    check_against_wall_clock(bw, 0.2)
    with pytest.raises(PerftestError, match="impossible"):
        check_against_wall_clock(bw, 0.1)
    zero = parse_bandwidth(WRITE_BW_4K.replace("6.19", "0.00"))  # the unsynchronized-TSC case
    with pytest.raises(PerftestError):
        check_against_wall_clock(zero, 1000.0)


def test_a_failed_pair_is_run_again_and_each_failure_is_kept(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The runner's retry bookkeeping: run_pair is replaced (the captured real output above
    stands in for a successful run); nothing here touches a device."""
    from aiordma.bench import runner
    from aiordma.bench.measure import Results
    from aiordma.bench.plan import Plan

    calls: list[str] = []

    def flaky(tool: str, args: list[str], **_: object) -> tuple[str, float]:
        calls.append(tool)
        if tool == "ib_send_lat" and "-e" in args and calls.count(tool) == 1:
            raise PerftestError("ib_send_lat client exited with status 1", "Couldn't post send\n")
        if tool == "ib_send_lat":
            return SEND_LAT_EVENTS, 1000.0
        raise PerftestError(f"{tool} client exited with status 1", "always fails\n")

    monkeypatch.setattr(runner, "run_pair", flaky)
    results = Results()
    dev = runner.DeviceChoice(name="rxe0", gid_index=1, port=1, mtu=1024, gid_ip=None)
    runner._perftest_rows(Plan.quick(), "a", dev, results)
    row = results.rows["pt.send_lat-e.64"]
    assert not row.failed and row.metrics["t_typical_us"].samples == [2859.69]
    assert len(row.errors) == 1 and "Couldn't post send" in row.errors[0]
    # every pair that keeps failing is tried _PERFTEST_ATTEMPTS times, then reported failed
    monkeypatch.setattr(runner, "run_pair", lambda tool, args, **_: flaky("ib_write_bw", args))
    results = Results()
    runner._perftest_rows(Plan.quick(), "a", dev, results)
    assert all(r.failed and len(r.errors) == runner._PERFTEST_ATTEMPTS
               for r in results.rows.values())


def test_a_missing_tool_is_not_tried_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from aiordma.bench import runner
    from aiordma.bench.measure import Results
    from aiordma.bench.plan import Plan

    monkeypatch.setattr(shutil, "which", lambda _: None)
    results = Results()
    dev = runner.DeviceChoice(name="rxe0", gid_index=1, port=1, mtu=1024, gid_ip=None)
    runner._perftest_rows(Plan.quick(), "a", dev, results)
    assert results.rows and all(len(r.errors) == 1 and "not installed" in r.errors[0]
                                for r in results.rows.values())
