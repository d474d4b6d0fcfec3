"""The harness's bound on a VM's boot (:mod:`harness.boot`), with a stand-in for QEMU: a shell
script that writes a console log and then answers as a guest would, or never. No VM, no
device; the bound is set small (1 s) so that a boot that never answers costs seconds here.

What is checked is the harness's promise (issue 36): a guest silent past its bound is killed
and booted once more, then the run fails with a :class:`~harness.boot.BootError` that names
the console logs and shows their last lines, within the two bounds and a little; a guest
that answers is run as before (its output and exit status pass through, its command has its
own time limit); a guest that stops before it is ready is not booted again."""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aiordma import DeviceError
from harness import boot, pair, run
from harness.boot import READY_MARK, BootError, boot_bound

#: A bound of 1 s: the base, on a machine reported idle.
BOUND = boot_bound(1.0, load=0.0, cpus=2)
#: What the harness may add to its bounds here (starting processes, a loaded machine): a hang
#: guard, not a timing.
SLACK = 20.0

CONSOLE = "Linux version 6.1.0 (stand-in) booting\nRun /init as init process\n"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run directories and kept console logs go under the test's directory."""
    monkeypatch.setenv("AIORDMA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def stand_in(tmp_path: Path, body: str) -> Callable[[str], list[str]]:
    """A stand-in QEMU for :func:`harness.run.run_guest`: ``sh -c SCRIPT`` with the run
    directory as ``$1`` and a count of its starts in ``$2`` (``boots``). Like QEMU, it writes
    the console log into the run directory."""
    counter = tmp_path / "boots"
    counter.write_text("0")
    script = (f'n=$(($(cat "$2") + 1)); echo $n > "$2"; echo $$ >> {tmp_path}/pids\n'
              f'printf %s {shlex.quote(CONSOLE)} > "$1/console.log"\n'
              f'echo "boot $n: no guest-ready line yet" >> "$1/console.log"\n{body}')
    return lambda run_dir: ["sh", "-c", script, "qemu", run_dir, str(counter)]


def boots(tmp_path: Path) -> int:
    return int((tmp_path / "boots").read_text())


SILENT = "exec sleep 600"  # QEMU busy, the guest silent: the hang seen once in 14 boots


def test_the_bound_scales_with_the_load_and_can_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet, busy = boot_bound(60, load=0.0, cpus=2), boot_bound(60, load=4.0, cpus=2)
    assert (quiet.seconds, busy.seconds) == (60.0, 180.0)
    assert busy.describe() == "180 s (60 s x (1 + load average 4.00 / 2 CPUs))"
    monkeypatch.setenv(boot.BOUND_ENV, "7.5")
    assert boot_bound(load=0.0, cpus=1).seconds == 7.5
    monkeypatch.delenv(boot.BOUND_ENV)
    assert boot_bound(load=0.0, cpus=1).base == boot.BOOT_BOUND
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv(boot.BOUND_ENV, bad)
        with pytest.raises(DeviceError, match=boot.BOUND_ENV):
            boot_bound()


def test_a_guest_that_never_answers_is_booted_twice_then_fails_naming_its_console(
        tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    with pytest.raises(BootError) as info:
        run.run_guest(stand_in(tmp_path, SILENT), ["true"], bound=BOUND)
    took = time.monotonic() - t0
    assert boots(tmp_path) == 2  # killed, booted once more, killed
    assert 2 * BOUND.seconds <= took < 2 * BOUND.seconds + SLACK
    msg = str(info.value)
    assert msg.startswith("the VM printed no guest-ready line within 1 s (1 s x (1 + load "
                          "average 0.00 / 2 CPUs)), on 2 boots: QEMU killed each time.")
    kept = sorted((cache / "vm" / "failed-boots").glob("*.console.log"))
    assert len(kept) == 2 and all(str(k) in msg for k in kept)
    assert msg.endswith("Run /init as init process\nboot 2: no guest-ready line yet")
    assert "boot 1: no guest-ready line" in kept[0].read_text()
    err = capsys.readouterr().err
    assert "no guest-ready line within 1 s" in err and "booting once more" in err
    assert not list((cache / "vm").glob("run-*"))  # the run directories are gone
    pids = (tmp_path / "pids").read_text().split()
    assert len(pids) == 2 and not [p for p in pids if os.path.exists(f"/proc/{p}")]  # killed


def test_a_guest_silent_once_then_ready_runs_the_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ready = (f'[ $n -eq 1 ] && exec sleep 600\necho "{READY_MARK} (rxe0 on aiordma0)"\n'
             'echo hello from the guest\necho 3 > "$1/status"\n')
    assert run.run_guest(stand_in(tmp_path, ready), ["true"], bound=BOUND) == 3
    assert boots(tmp_path) == 2
    out, err = capsys.readouterr()
    assert out == "hello from the guest\n"  # the ready line is the harness's, not passed on
    assert "booting once more" in err and "exit status 3" in err


def test_a_ready_guest_whose_command_hangs_is_killed_at_its_time_limit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After the ready line the command's own ``timeout`` bounds the run, even when the
    command prints nothing (the wait no longer needs a line to notice the time)."""
    hangs = f'echo "{READY_MARK}"\nexec sleep 600\n'
    t0 = time.monotonic()
    assert run.run_guest(stand_in(tmp_path, hangs), ["true"], bound=BOUND, timeout=1.5) == 124
    assert time.monotonic() - t0 < 1.5 + SLACK
    assert boots(tmp_path) == 1
    assert "time limit (1.5 s) reached" in capsys.readouterr().err


def test_a_guest_that_stops_before_it_is_ready_is_not_booted_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails = 'echo "[rxe] guest: modprobe rdma_rxe failed"\necho 97 > "$1/status"\n'
    assert run.run_guest(stand_in(tmp_path, fails), ["true"], bound=BOUND) == 97
    assert boots(tmp_path) == 1
    out, err = capsys.readouterr()
    assert "modprobe rdma_rxe failed" in out and "never became ready (exit status 97" in err


# -- the pair: each VM has the bound -------------------------------------------------------------


def pair_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pair"
    for n in (1, 2):
        (d / f"host{n}").mkdir(parents=True)
    return d


def pair_stand_in(run_dir: Path, n: int, body: str) -> list[str]:
    """Host ``n``'s stand-in QEMU (its console log in ``run_dir/host<n>``)."""
    d = run_dir / f"host{n}"
    script = (f"printf %s {shlex.quote(CONSOLE)} > {d}/console.log\n"
              f"echo 'host {n}: no guest-ready line yet' >> {d}/console.log\n{body}")
    return ["sh", "-c", script]


def test_a_pair_whose_host_2_never_answers_fails_naming_host_2s_console(
        tmp_path: Path, cache: Path) -> None:
    d = pair_dir(tmp_path)
    host1 = pair_stand_in(d, 1, f"echo '{pair.HOST1_UP} (rxe0 on eth0)' >&2\nexec sleep 600")
    host2 = pair_stand_in(d, 2, SILENT)
    t0 = time.monotonic()
    with pytest.raises(BootError) as info:
        pair.run_guests(host1, host2, str(d), bound=BOUND)
    assert 2 * BOUND.seconds <= time.monotonic() - t0 < 2 * BOUND.seconds + SLACK
    msg = str(info.value)
    assert msg.startswith("host 2 of the pair printed no guest-ready line within 1 s")
    kept = sorted((cache / "vm" / "failed-boots").glob("*host2-boot*.console.log"))
    assert len(kept) == 2 and all(str(k) in msg for k in kept)
    assert msg.endswith("host 2: no guest-ready line yet")


def test_a_pair_that_comes_up_runs_the_command_on_host_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = pair_dir(tmp_path)
    host1 = pair_stand_in(d, 1, f"echo '{pair.HOST1_UP}'\nsleep 0.5\necho '{READY_MARK}'\n"
                          f"echo on host 1\necho 5 > {d}/host1/status")
    host2 = pair_stand_in(d, 2, f"echo '{pair.AGENT_READY} 10.77.0.2:7790'\nsleep 1")
    assert pair.run_guests(host1, host2, str(d), bound=BOUND) == 5
    out, err = capsys.readouterr()
    assert out == "on host 1\n"
    assert "pair up: host 1 up after" in err and "[host2-vm] [host-agent] listening" in err
    assert "exit status 5" in err and "booting it once more" not in err


def test_the_harness_command_fails_with_the_error(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m harness run``: a BootError ends the command with status 2 and the error,
    on one line first (what ``make test`` shows)."""
    from harness import cli

    def fails(*args: object, **kwargs: object) -> int:
        raise boot.boot_failure("the VM", BOUND, ["/c/1.console.log", "/c/2.console.log"])

    monkeypatch.setattr(run, "run_with_device", fails)
    assert cli.main(["run", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("harness: BootError: the VM printed no guest-ready line within 1 s")
    assert "Console logs: /c/1.console.log; /c/2.console.log." in err
