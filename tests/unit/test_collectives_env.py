"""aiordma.services.collectives without a device: the launcher environment (torchrun, mpirun, srun) and the
local launcher (real processes, no RDMA; their output a whole line at a time, prefixed with the
rank), and the package's public names."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import aiordma
import aiordma.services.collectives as coll
from aiordma.services.collectives import LaunchEnvironmentError, launch_environment
from aiordma.services.collectives.launch import RankLines, free_port, rank_environment, run

ROOT = str(Path(__file__).resolve().parents[2])
MASTER = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}


def test_torchrun_variables() -> None:
    env = launch_environment({"RANK": "2", "WORLD_SIZE": "4", **MASTER})
    assert (env.rank, env.world_size, env.master_addr, env.master_port, env.source) == (
        2, 4, "10.1.2.3", 29500, "torchrun")


def test_srun_variables() -> None:
    env = launch_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", **MASTER})
    assert (env.rank, env.world_size, env.source) == (0, 8, "slurm")


def test_mpirun_variables() -> None:
    env = launch_environment({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                              "OMPI_COMM_WORLD_LOCAL_RANK": "1", **MASTER})
    assert (env.rank, env.world_size, env.source) == (3, 4, "mpirun")


def test_mpirun_variables_win_over_srun_ones_and_lose_to_torchruns() -> None:
    both = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8", **MASTER}
    assert launch_environment(both).source == "mpirun"
    assert launch_environment({**both, "RANK": "0", "WORLD_SIZE": "1"}).source == "torchrun"


def test_torchrun_variables_win_over_srun_ones() -> None:
    env = launch_environment({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "5",
                              "SLURM_NTASKS": "8", **MASTER})
    assert (env.rank, env.world_size, env.source) == (1, 2, "torchrun")


@pytest.mark.parametrize(("env", "missing", "needle"), [
    ({}, ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), "no launcher environment"),
    ({"RANK": "0", **MASTER}, ("WORLD_SIZE",), "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, ("MASTER_PORT",), "MASTER_PORT"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, ("MASTER_ADDR", "MASTER_PORT"), "scontrol"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, ("MASTER_ADDR", "MASTER_PORT"),
     "mpirun -x MASTER_ADDR"),
    ({"OMPI_COMM_WORLD_RANK": "0", **MASTER}, ("OMPI_COMM_WORLD_SIZE",), "OMPI_COMM_WORLD_SIZE"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": " ", "MASTER_PORT": "1"},
     ("MASTER_ADDR",), "MASTER_ADDR"),
])
def test_missing_variables_are_named(env: dict[str, str], missing: tuple[str, ...],
                                     needle: str) -> None:
    with pytest.raises(LaunchEnvironmentError, match=needle) as info:
        launch_environment(env)
    assert info.value.missing == missing
    assert isinstance(info.value, aiordma.AiordmaError)


@pytest.mark.parametrize("env", [
    {"RANK": "x", "WORLD_SIZE": "2", **MASTER},
    {"RANK": "2", "WORLD_SIZE": "2", **MASTER},
    {"RANK": "-1", "WORLD_SIZE": "2", **MASTER},
    {"RANK": "0", "WORLD_SIZE": "0", **MASTER},
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "0"},
    {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4", **MASTER},
])
def test_invalid_values_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(LaunchEnvironmentError) as info:
        launch_environment(env)
    assert info.value.missing == ()


def test_the_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("MASTER_ADDR", "node1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert launch_environment().rank == 3


def test_rank_environment_is_torchruns() -> None:
    env = rank_environment({"PATH": "/bin"}, 1, 3, "127.0.0.1", 4000)
    assert env == {"PATH": "/bin", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3",
                   "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "4000"}
    assert launch_environment(env).rank == 1


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    assert 1024 <= port <= 65535  # a real port, not 0 (which any bind() accepts)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port


def test_the_launcher_gives_each_rank_its_variables(tmp_path: os.PathLike[str]) -> None:
    code = ("import os, sys; from aiordma.services.collectives import launch_environment as e; "
            "v = e(); open(os.path.join(sys.argv[1], str(v.rank)), 'w').write("
            "f'{v.world_size} {v.master_addr} {v.master_port}')")
    status = run([sys.executable, "-c", code, str(tmp_path)], 3,
                 environ={**os.environ, "PYTHONPATH": ROOT}, master_port=4321)
    assert status == 0
    assert sorted(os.listdir(tmp_path)) == ["0", "1", "2"]
    for r in range(3):
        assert Path(tmp_path, str(r)).read_text() == "3 127.0.0.1 4321"


def test_one_failing_rank_stops_the_others_and_sets_the_status() -> None:
    code = "import os, sys, time; r = int(os.environ['RANK']); time.sleep(60 if r else 0.2); " \
           "sys.exit(0 if r else 7)"
    t0 = time.monotonic()
    assert run([sys.executable, "-c", code], 3, grace=1.0) == 7
    assert time.monotonic() - t0 < 30  # the sleeping ranks were terminated


def test_the_command_line() -> None:
    out = subprocess.run([sys.executable, "-m", "aiordma.services.collectives.launch", "-n", "2", "--",
                          sys.executable, "-c",  # one write() each: the ranks share the pipe
                          "import os; os.write(1, (os.environ['RANK'] + '\\n').encode())"],
                         capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert sorted(out.stdout.split()) == ["[rank0]:0", "[rank1]:1"], (out.stdout, out.stderr)
    bad = subprocess.run([sys.executable, "-m", "aiordma.services.collectives.launch", "-n", "2"],
                         capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert bad.returncode == 2 and "no command" in bad.stderr, (bad.returncode, bad.stderr)


def test_the_launcher_does_not_import_numpy_or_aiordma() -> None:
    # only the packages on the way (their __init__ loads nothing until a name is used)
    way = ("aiordma", "aiordma.services", "aiordma.services.collectives",
           "aiordma.services.collectives.launch", "aiordma.services.collectives._env",
           "aiordma.protocols", "aiordma.protocols.errors")
    code = ("import sys, aiordma.services.collectives.launch; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'pyverbs') "
            f"or (m.startswith('aiordma') and m not in {way!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
    with pytest.raises(AttributeError):
        _ = coll.NoSuchName  # type: ignore[attr-defined]


def test_public_names_are_pinned_and_errors_documented() -> None:
    assert sorted(coll.__all__) == sorted([
        "REDUCE_OPS", "CollectiveArgumentError", "CollectiveMismatchError", "Group",
        "GroupError", "LaunchEnvironment", "LaunchEnvironmentError", "RendezvousError",
        "Thresholds", "Window", "launch_environment"])
    for name in coll.__all__:
        obj = getattr(coll, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, aiordma.AiordmaError) and len(obj.__doc__ or "") > 20, name
    assert issubclass(coll.CollectiveMismatchError, aiordma.RemoteProtocolError)
    assert issubclass(coll.CollectiveArgumentError, ValueError)


# -- the launcher's output: whole lines, prefixed with the rank ------------------------------------

LINES = st.lists(st.text(st.characters(blacklist_characters="\n", codec="utf-8"), max_size=30),
                 max_size=6)


@given(outputs=st.lists(LINES, min_size=1, max_size=4), data=st.data(),
       ends_with_newline=st.booleans())
def test_rank_lines_come_out_whole_and_prefixed_however_the_bytes_arrive(
        outputs: list[list[str]], data: st.DataObject, ends_with_newline: bool) -> None:
    streams = []
    for lines in outputs:
        text = "\n".join(lines) + ("\n" if ends_with_newline and lines else "")
        streams.append(text.encode())
    readers = [RankLines(r) for r in range(len(streams))]
    pos = [0] * len(streams)
    out = b""
    while any(p < len(s) for p, s in zip(pos, streams, strict=True)):  # interleaved chunks
        r = data.draw(st.sampled_from([i for i, s in enumerate(streams) if pos[i] < len(s)]))
        n = data.draw(st.integers(1, len(streams[r]) - pos[r]))
        got = readers[r].feed(streams[r][pos[r]:pos[r] + n])
        pos[r] += n
        assert got == b"" or got.endswith(b"\n")  # whole lines only
        out += got
    for reader in readers:
        out += reader.close()
    per_rank: dict[int, list[bytes]] = {r: [] for r in range(len(streams))}
    for line in out.split(b"\n")[:-1]:
        head, _, rest = line.partition(b"]:")
        assert head.startswith(b"[rank"), line
        per_rank[int(head[5:])].append(rest)
    for r, s in enumerate(streams):
        want = s.split(b"\n")
        if want and want[-1] == b"":
            want = want[:-1]
        assert per_rank[r] == want


def test_a_line_past_the_limit_is_cut() -> None:
    lines = RankLines(3, limit=8)
    assert lines.feed(b"abcdefghij") == b"[rank3]:abcdefgh\n"
    assert lines.feed(b"k\nxy") == b"[rank3]:ijk\n"
    assert lines.close() == b"[rank3]:xy\n" and lines.close() == b""
    plain = RankLines(0, prefix=False)
    assert plain.feed(b"a\nb") == b"a\n" and plain.close() == b"b\n"


def test_ranks_writing_a_byte_at_a_time_never_join_mid_line() -> None:
    """Before: the ranks shared the launcher's stdout, and lines of two ranks could join
    ("...OKrank 0: ..."). Each rank writes its lines a byte at a time, in step with the
    others."""
    code = ("import os, sys, time; r = os.environ['RANK']\n"
            "for i in range(4):\n"
            "    for ch in f'line {i} of rank {r}\\n':\n"
            "        os.write(1, ch.encode()); time.sleep(0.001)\n"
            "os.write(2, f'err of rank {r}'.encode())\n")  # (no newline at the end)
    out, err = io.BytesIO(), io.BytesIO()
    assert run([sys.executable, "-c", code], 3, stdout=out, stderr=err) == 0
    lines = out.getvalue().decode().splitlines()
    assert sorted(lines) == sorted(f"[rank{r}]:line {i} of rank {r}" for r in range(3)
                                   for i in range(4)), lines
    for r in range(3):  # each rank's lines in its order
        assert [x for x in lines if x.startswith(f"[rank{r}]")] == [
            f"[rank{r}]:line {i} of rank {r}" for i in range(4)]
    assert sorted(err.getvalue().decode().splitlines()) == [f"[rank{r}]:err of rank {r}"
                                                            for r in range(3)]
