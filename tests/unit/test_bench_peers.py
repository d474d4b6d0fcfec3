"""The bench's peers without a device or the peers installed: finding the installation (and
the message when it is missing), the commands, and the route proofs read from the peers' own
output (lines captured from real runs in the project's VM, then altered to show fallbacks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiordma.bench.peer_rows import UCXX_MODES, ucxx_key, ucxx_specs
from aiordma.bench.peers import (
    PeerInstall,
    PeerRouteError,
    PeersNotInstalled,
    find_peers,
    mpi_route,
    mpirun_argv,
    parse_env_file,
    ucx_route,
    ucx_transports_route,
    ucxx_environment,
)
from aiordma.bench.plan import Plan
from aiordma.cli.command import build_parser, main

# UCX 1.13.1, UCX_LOG_LEVEL=info, ucxx 0.52 client in the VM (rxe0)
UCX_LOG = """\
[1795596582.685807] [(none):146  :0]     ucp_context.c:1849 UCX  WARN  UCP API version is incompatible: required >= 1.19, actual 1.13.1 (loaded from /root/.cache/aiordma/peers/ucx-lib/libucp.so)
[1795596583.176861] [(none):146  :0]          parser.c:1916 UCX  INFO  UCX_* env variables: UCX_RNDV_FRAG_MEM_TYPE=host UCX_NET_DEVICES=rxe0:1 UCX_TLS=rc_verbs,self UCX_LOG_LEVEL=info
[1795596583.250919] [(none):146  :0]      ucp_worker.c:1763 UCX  INFO  ep_cfg[1]: tag(rc_verbs/rxe0:1) rma(rc_verbs/rxe0:1) am(rc_verbs/rxe0:1) stream(rc_verbs/rxe0:1) ka(rc_verbs/rxe0:1)
[1795596583.397694] [(none):146  :0]      ucp_worker.c:1763 UCX  INFO    ep_cfg[2]: tag(rc_verbs/rxe0:1) rma(rc_verbs/rxe0:1) am(rc_verbs/rxe0:1) stream(rc_verbs/rxe0:1) ka(rc_verbs/rxe0:1)
"""

# Open MPI 4.1.4, 2 ranks, pml cm / mtl ofi / verbs;ofi_rxm, pml_base_verbose and
# mtl_base_verbose 100, in the VM (excerpt)
MPI_RXE = """\
[aiordma-vm:00151] select: initializing pml component cm
[aiordma-vm:00150] select: initializing pml component cm
[aiordma-vm:00150] mca:base:select:(  mtl) Querying component [ofi]
[aiordma-vm:00150] mca:base:select:(  mtl) Query of component [ofi] set priority to 25
[aiordma-vm:00150] mca:base:select:(  mtl) Selected component [ofi]
[aiordma-vm:00151] mca:base:select:(  mtl) Selected component [ofi]
[aiordma-vm:00151] ../../../../../../ompi/mca/mtl/ofi/mtl_ofi_component.c:365: mtl:ofi:provider: rxe0
[aiordma-vm:00151] select: component ofi selected
[aiordma-vm:00151] select: component cm selected
[aiordma-vm:00150] ../../../../../../ompi/mca/mtl/ofi/mtl_ofi_component.c:365: mtl:ofi:provider: rxe0
[aiordma-vm:00150] select: component ofi selected
[aiordma-vm:00150] select: component cm selected
"""
MAPPED = ["libfabric.so.1.20.0", "libibverbs.so.1.14.44.0", "librdmacm.so.1.3.44.0",
          "librxe-rdmav34.so"]

# ob1 with btl self,vader / self,tcp, btl_base_verbose 30 (excerpts)
MPI_SHM = """\
[aiordma-vm:00167] mca: bml: Using vader btl for send to [[65340,1],1] on node aiordma-vm
[aiordma-vm:00167] mca: bml: Using self btl for send to [[65340,1],0] on node aiordma-vm
[aiordma-vm:00168] mca: bml: Using vader btl for send to [[65340,1],0] on node aiordma-vm
[aiordma-vm:00168] mca: bml: Using self btl for send to [[65340,1],1] on node aiordma-vm
"""
MPI_TCP = MPI_SHM.replace("vader", "tcp")


def test_ucx_route_accepts_rc_verbs_on_the_device_only() -> None:
    assert ucx_route(UCX_LOG, "rxe0", 1) == "UCX endpoints over rc_verbs/rxe0:1 only (2 logged)"
    with_self = UCX_LOG.replace("tag(rc_verbs/rxe0:1)", "tag(self/memory rc_verbs/rxe0:1)")
    assert "2 logged" in ucx_route(with_self, "rxe0", 1)


@pytest.mark.parametrize(("log", "words"), [
    (UCX_LOG.replace("tag(rc_verbs/rxe0:1) rma", "tag(tcp/lo) rma", 1), "UCX used tcp/lo"),
    ("no endpoint lines at all\n", "no endpoint configuration"),
    (UCX_LOG.replace("rc_verbs/rxe0:1", "self/memory"), "never used rc_verbs/rxe0:1"),
])
def test_ucx_route_fails_a_fallback(log: str, words: str) -> None:
    with pytest.raises(PeerRouteError, match=words):
        ucx_route(log, "rxe0", 1)
    with pytest.raises(PeerRouteError):
        ucx_route(UCX_LOG, "rxe1", 1)  # another device


def test_the_timed_runs_transports() -> None:
    # ucxx.get_active_transports() after a timed run in the VM (UCX_TLS=rc_verbs,self)
    assert ucx_transports_route(["rc_verbs", "self"]) == "active transports rc_verbs, self"
    assert ucx_transports_route(["rc_verbs"]) == "active transports rc_verbs"
    for active in (["rc_verbs", "self", "tcp"], ["self"], []):
        with pytest.raises(PeerRouteError, match="not rc_verbs"):
            ucx_transports_route(active)


def test_mpi_route_over_rxe() -> None:
    proof = mpi_route("rxe", MPI_RXE, 2, device="rxe0", mapped=MAPPED)
    assert proof.startswith("pml cm + mtl ofi (verbs;ofi_rxm) on rxe0, all 2 ranks")
    assert "librxe-rdmav34.so" in proof


@pytest.mark.parametrize(("output", "ranks", "mapped", "words"), [
    (MPI_RXE, 3, MAPPED, "only 2 of 3 ranks reported pml cm"),
    (MPI_RXE.replace("provider: rxe0", "provider: aiordma0"), 2, MAPPED,
     r"domain\(s\) \['aiordma0'\]"),
    ("\n".join(x for x in MPI_RXE.splitlines() if "Selected component [ofi]" not in x), 2,
     MAPPED, "reported mtl ofi"),
    (MPI_RXE, 2, ["libfabric.so.1.20.0"], "no rxe verbs provider mapped"),
])
def test_mpi_route_over_rxe_fails_otherwise(output: str, ranks: int, mapped: list[str],
                                            words: str) -> None:
    with pytest.raises(PeerRouteError, match=words):
        mpi_route("rxe", output, ranks, device="rxe0", mapped=mapped)


def test_mpi_route_for_context_rows() -> None:
    assert mpi_route("shm", MPI_SHM, 2, device="rxe0") == "ob1 + vader BTL, all 2 ranks"
    assert mpi_route("tcp", MPI_TCP, 2, device="rxe0") == "ob1 + tcp BTL, all 2 ranks"
    with pytest.raises(PeerRouteError, match=r"were \['tcp'\], not vader"):
        mpi_route("shm", MPI_TCP, 2, device="rxe0")
    with pytest.raises(PeerRouteError, match="none"):
        mpi_route("tcp", "", 2, device="rxe0")
    with pytest.raises(PeerRouteError, match="only 2 of 4 ranks"):
        mpi_route("shm", MPI_SHM, 4, device="rxe0")


def _install(tmp: Path) -> PeerInstall:
    return PeerInstall(ucxx="0.52.0", ucx="1.13.1", ucx_min_supported="1.19.0",
                       venv_python=str(tmp / "python"), ucxx_env={"UCX_TLS": "rc_verbs,self"},
                       open_mpi="4.1.4", mpi4py="3.1.4", libfabric="1.17.0",
                       mpi_python="/usr/bin/python3", mpirun="/usr/bin/mpirun")


def test_mpirun_command_lines(tmp_path: Path) -> None:
    peers = _install(tmp_path)
    rxe = mpirun_argv(peers, "rxe", 4, device="rxe0", netdev="aiordma0", program=["p", "x"])
    assert rxe[:5] == ["/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4"]
    assert rxe[5:7] == ["--bind-to", "none"]
    bound = mpirun_argv(peers, "rxe", 2, device="rxe0", netdev="aiordma0", program=["p"],
                        bind_to_core=True)
    assert bound[5:7] == ["--bind-to", "core"] and bound[7:] == rxe[7:-2] + ["p"]
    text = " ".join(rxe)
    for part in ("--mca pml cm", "--mca mtl ofi", "--mca mtl_ofi_provider_include verbs;ofi_rxm",
                 "-x FI_UNIVERSE_SIZE=8", "-x FI_VERBS_DEVICE_NAME=rxe0", "mtl_base_verbose",
                 "pml_base_verbose"):
        assert part in text
    assert rxe[-2:] == ["p", "x"]
    assert "--mca btl self,vader" in " ".join(
        mpirun_argv(peers, "shm", 2, device="rxe0", netdev="aiordma0", program=["p"]))
    tcp = " ".join(mpirun_argv(peers, "tcp", 2, device="rxe0", netdev="aiordma0",
                               program=["p"]))
    assert "--mca btl self,tcp" in tcp and "--mca btl_tcp_if_include aiordma0" in tcp
    with pytest.raises(ValueError):
        mpirun_argv(peers, "ib", 2, device="rxe0", netdev="x", program=["p"])


def test_ucxx_environment(tmp_path: Path) -> None:
    env = ucxx_environment(_install(tmp_path), "rxe0", 1, base={"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["UCX_TLS"] == "rc_verbs,self"
    assert env["UCX_NET_DEVICES"] == "rxe0:1" and env["UCX_LOG_LEVEL"] == "error"  # timed
    proof = ucxx_environment(_install(tmp_path), "rxe0", 1, base={}, log_level="info")
    assert proof["UCX_LOG_LEVEL"] == "info"
    assert {k: v for k, v in proof.items() if k != "UCX_LOG_LEVEL"} == \
        {k: v for k, v in ucxx_environment(_install(tmp_path), "rxe0", 1, base={}).items()
         if k != "UCX_LOG_LEVEL"}  # the proof's run and the timed run differ in the log only
    assert "older than the UCX >= 1.19.0" in _install(tmp_path).ucxx_note


def test_env_file() -> None:
    assert parse_env_file("# c\n\nA=1\nB = x=y\n") == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError):
        parse_env_file("nonsense\n")


def test_missing_peers_are_named_with_the_script(tmp_path: Path) -> None:
    with pytest.raises(PeersNotInstalled, match="bash scripts/setup-peers.sh"):
        find_peers(tmp_path)
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "ucxx.env").write_text("UCX_TLS=rc_verbs,self\n")
    doc = {"ucxx": "0.52.0", "ucx": "1.13.1", "ucx_min_supported": "1.19.0",
           "venv_python": str(peers / "venv/bin/python"), "env_file": str(peers / "ucxx.env"),
           "open_mpi": "4.1.4", "mpi4py": "3.1.4", "libfabric": "1.17.0",
           "mpi_python": str(peers / "python3")}
    (peers / "ready.json").write_text(json.dumps(doc))
    with pytest.raises(PeersNotInstalled, match="venv/bin/python.*setup-peers.sh"):
        find_peers(tmp_path)


def test_bench_peers_fails_at_once_when_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AIORDMA_CACHE", str(tmp_path))
    assert main(["bench", "--peers", "--quick", "--json", "", "--png", ""]) == 2
    err = capsys.readouterr().err
    assert "aiordma bench --peers:" in err and "scripts/setup-peers.sh" in err
    assert build_parser().parse_args(["bench", "--peers"]).peers
    assert not build_parser().parse_args(["bench"]).peers


def test_ucxx_rows_sit_beside_the_rows_they_compare_with() -> None:
    plan = Plan.quick()
    keys = [k for k, _ in ucxx_specs(plan, "adg", "note")]
    assert keys == [ucxx_key(a, m) for m in UCXX_MODES for a in "adg"]
    assert [k for k, _ in ucxx_specs(plan, "h")] == []
    meta = dict(ucxx_specs(plan, "a", "ucxx on an older UCX"))["a.rtt64.ucxx-polling"]
    assert meta["system"] == "ucxx polling" and meta["loop"] is None
    assert "ucxx on an older UCX" in meta["how"] and "progress mode polling" in meta["how"]
