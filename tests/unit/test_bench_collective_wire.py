"""Allreduce across two hosts (``harness.bench.collective_wire``) without a device: the
sizes, the command lines, where the ranks ran, the counters' movement, the rows and the table,
the arguments' checks; and the rank program's place under mpirun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aiordma.bench.collective_rows import merge_ranks
from aiordma.bench.collective_worker import _place
from aiordma.bench.peers import PeerInstall, PeerRouteError, mpi_route, mpirun_argv
from aiordma.bench.plan import KIB, MIB
from harness.bench import collective_wire as cw


def test_sizes() -> None:
    assert cw.parse_sizes("8,64K,1M,4M") == cw.SIZES == (8, 64 * KIB, MIB, 4 * MIB)
    assert cw.parse_sizes("4096, 16m") == (4096, 16 * MIB)
    for bad in ("", "6", "0", "-4", "1.5M", "64KB", "x", "8,,16"):
        with pytest.raises(ValueError):
            cw.parse_sizes(bad)


def _peers() -> PeerInstall:
    return PeerInstall(ucxx="0.52", ucx="1.13.1", ucx_min_supported="1.19.0",
                       venv_python="/v/bin/python", ucxx_env={}, open_mpi="4.1.4",
                       mpi4py="3.1.4", libfabric="1.17", mpi_python="/usr/bin/python3",
                       mpirun="/usr/bin/mpirun")


def test_command_lines_put_two_ranks_on_each_host() -> None:
    hosts = cw.host_args("10.77.0.1", "10.77.0.2", "/v/bin/python -m harness rsh")
    assert hosts == ["--host", "10.77.0.1:2,10.77.0.2:2", "--map-by", "slot",
                     "--mca", "plm_rsh_agent", "/v/bin/python -m harness rsh",
                     "--mca", "oob_tcp_if_include", "eth0"]
    mine = cw.aiordma_argv("/usr/bin/mpirun", hosts, master="10.77.0.1", port=29500,
                           python="/v/bin/python", worker=["--sizes", "8"])
    assert mine[:5] == ["/usr/bin/mpirun", "--allow-run-as-root", "-np", "4", "--bind-to"]
    assert "MASTER_ADDR=10.77.0.1" in mine and "MASTER_PORT=29500" in mine
    assert mine[-5:] == ["/v/bin/python", "-m", "aiordma.bench.collective_worker",
                         "--sizes", "8"]
    one_host = mpirun_argv(_peers(), "rxe", 4, device="rxe0", netdev="eth0",
                           program=["/usr/bin/python3", "w.py"])
    theirs = cw.across(one_host, hosts)
    assert theirs[0] == "/usr/bin/mpirun" and theirs[1:1 + len(hosts)] == hosts
    assert theirs[1 + len(hosts):] == one_host[1:]  # the route's options all kept
    assert "verbs;ofi_rxm" in theirs and "FI_UNIVERSE_SIZE=8" in theirs
    yielding = cw.across(one_host, hosts, yield_when_idle=True)
    assert yielding == [*theirs[:1 + len(hosts)], "--mca", "mpi_yield_when_idle", "1",
                        *theirs[1 + len(hosts):]]


def test_placement_wants_two_ranks_on_each_of_two_hosts() -> None:
    def docs(*hosts: str) -> dict[int, dict[str, str]]:
        return {r: {"host": h} for r, h in enumerate(hosts)}

    assert cw.placement(docs("h1", "h1", "h2", "h2")) == "ranks 0-1 on h1, 2-3 on h2"
    for bad in (docs("h1", "h1", "h1", "h1"), docs("h1", "h2", "h1", "h2"),
                docs("h1", "h1", "h2"), {r: {} for r in range(4)}):
        with pytest.raises(PeerRouteError, match="not 2 on each host"):
            cw.placement(bad)


def test_mpi_route_tells_ranks_on_two_hosts_apart_by_host_and_pid() -> None:
    lines = []
    for host in ("aiordma-host1", "aiordma-host2"):
        for pid in (475, 477):  # the same pids on both hosts
            tag = f"[{host}:{pid:05d}]"
            lines += [f"{tag} select: component cm selected",
                      f"{tag} mca:base:select:(  mtl) Selected component [ofi]",
                      f"{tag} ../mtl_ofi_component.c:365: mtl:ofi:provider: rxe0"]
    proof = mpi_route("rxe", "\n".join(lines), 4, device="rxe0",
                      mapped=["libfabric.so.1.18.2", "librxe-rdmav34.so"])
    assert proof.startswith("pml cm + mtl ofi (verbs;ofi_rxm) on rxe0, all 4 ranks")


def test_counters_moved() -> None:
    before = {"eth0 tx bytes": 1_000, "eth0 rx bytes": 0, "rxe0 sent_pkts": 10,
              "rxe0 rcvd_pkts": 0, "rxe0 rcvd_seq_err": 5, "rxe0 duplicate_request": 1}
    after = {"eth0 tx bytes": 12_301_000, "eth0 rx bytes": 12_100_000,
             "rxe0 sent_pkts": 12_010, "rxe0 rcvd_pkts": 11_900, "rxe0 rcvd_seq_err": 1_205,
             "rxe0 duplicate_request": 1}
    assert cw.moved(before, after) == ("host 1 eth0 tx 12.3 MB, rx 12.1 MB; rxe0 sent 12,000 "
                                       "pkts, rcvd 11,900; rxe0 also: rcvd_seq_err +1,200")
    del after["rxe0 rcvd_seq_err"], after["rxe0 duplicate_request"]
    assert cw.moved(after, after).endswith("rxe0 sent 0 pkts, rcvd 0")
    # (zeros where there is no such device)
    assert {"eth0 tx bytes", "eth0 rx bytes", "rxe0 sent_pkts"} <= set(cw.counters())


def _rank(r: int, times: list[float], error: str | None = None) -> dict[str, object]:
    return {"rank": r, "host": "h", "runs": {"rxe": {"error": None, "cases": [
        {"collective": "allreduce", "bytes": 8, "times": times, "error": error}]}}}


def test_rows_from_the_merged_ranks() -> None:
    docs = {r: _rank(r, [0.001 * (r + 1), 0.002]) for r in range(4)}
    merged = merge_ranks(docs, 4, "")
    (ok, missing) = cw.rows_from("ompi-rxe", [8, 64 * KIB], merged, "rxe", "how")
    assert ok.call_us == pytest.approx(3000) and ok.call_min_us == pytest.approx(2000)
    assert ok.call_max_us == pytest.approx(4000) and ok.calls == 2 and ok.error is None
    assert ok.calls_us == pytest.approx((4000, 2000))
    assert missing.error == "not run: the launch ended before this size"
    (gone,) = cw.rows_from("ompi-rxe", [8], {}, "rxe", "how", ended="mpirun status 1: boom")
    assert gone.error == "not run: the launch ended before this size (mpirun status 1: boom)"
    (failed,) = cw.rows_from("ompi-rxe", [8], merged, "rxe", "how", "route not proven: x")
    assert failed.error == "route not proven: x" and failed.call_us is None
    docs[2] = _rank(2, [], "ValueError: 1 wrong elements")
    (wrong,) = cw.rows_from("ompi-rxe", [8], merge_ranks(docs, 4, ""), "rxe", "how")
    assert wrong.error == "rank 2: ValueError: 1 wrong elements"


def test_the_table_puts_each_size_s_systems_together_with_the_ratio() -> None:
    rows = [cw.WireRow(system="ompi-rxe", nbytes=MIB, call_us=20_000, call_min_us=15_000,
                       call_max_us=30_000, calls=5, how="mpi4py"),
            cw.WireRow(system="aiordma", nbytes=MIB, call_us=50_000, call_min_us=40_000,
                       call_max_us=123_456, calls=5, how="Group"),
            cw.WireRow(system="aiordma", nbytes=8, call_us=1_234, call_min_us=900,
                       call_max_us=2_000, calls=5, how="Group"),
            cw.WireRow(system="ompi-tcp", nbytes=MIB, error="route not proven: tcp", how="x")]
    lines = cw.format_table(rows).splitlines()
    assert lines[0].startswith("| size per rank | system | median ms | best ms")
    assert lines[2] == "| 8 B | aiordma | 1.23 | 0.90 | 2.00 |  | Group |"
    assert lines[3] == "| 1 MiB | aiordma | 50.0 | 40.0 | 123 | 2.50x | Group |"
    assert lines[4] == "| 1 MiB | Open MPI over rxe | 20.0 | 15.0 | 30.0 |  | mpi4py |"
    assert lines[5] == "| 1 MiB | Open MPI over TCP | FAILED | | | | route not proven: tcp |"


def test_arguments_are_checked() -> None:
    a = cw.parse_args([])
    assert a.sizes == cw.SIZES and a.systems == list(cw.SYSTEMS) and a.loop == "uvloop"
    assert not a.ompi_yield and a.json is None
    a = cw.parse_args(["--systems", "aiordma, ompi-tcp", "--sizes", "64K", "--calls", "3"])
    assert a.systems == ["aiordma", "ompi-tcp"] and a.sizes == (64 * KIB,) and a.calls == 3
    for bad in (["--systems", "nccl"], ["--systems", ","], ["--sizes", "3"], ["--calls", "0"],
                ["--warmup", "-1"], ["--timeout", "0"], ["--case-timeout", "-1"],
                ["--loop", "trio"]):
        with pytest.raises(SystemExit):
            cw.parse_args(bad)


def test_outside_the_pair_it_says_so() -> None:
    out = subprocess.run([sys.executable, "-m", "harness.bench.collective_wire",
                          "--systems", "aiordma"], capture_output=True, text=True, timeout=60,
                         check=False, env={"PATH": "/usr/bin:/bin"},
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode != 0 and "AIORDMA_HOST1" in out.stderr
    assert "Traceback" not in out.stderr and "harness run --hosts 2" in out.stderr


def test_the_rank_program_finds_its_place_under_each_launcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert _place() == (0, 1)  # no launcher: the group's formation says why
    monkeypatch.setenv("MASTER_ADDR", "10.77.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert _place() == (3, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _place() == (1, 2)  # torchrun's variables win, as in Group.from_env


def test_the_ranks_files_are_read_whole_or_not_at_all(tmp_path: Path) -> None:
    for r in (0, 1, 3):
        (tmp_path / f"rank-{r}.json").write_text(json.dumps({"rank": r, "host": "h"}))
    (tmp_path / "rank-2.json").write_text("")  # seen empty (another VM's unflushed write)
    (tmp_path / "rank-3.json.tmp").write_text("{")
    # outside the pair, reading on host 2 fails too: rank 2 is left out, and merge_ranks
    # then says it wrote nothing
    docs = cw.read_ranks(str(tmp_path), tries=1)
    assert sorted(docs) == [0, 1, 3] and docs[3] == {"rank": 3, "host": "h"}
