"""The ``aiordma`` command's parser and the harness's decisions, without a device or a VM."""

import json
import subprocess
import sys

import pytest

from aiordma.cli.command import build_parser
from harness import run as _run
from harness.cli import build_parser as harness_parser
from harness.cli import strip_dashes


def test_harness_run_keeps_the_command_verbatim() -> None:
    args = harness_parser().parse_args(["run", "--", "python", "-c", "print(1)", "--x"])
    assert args.cmd == ["--", "python", "-c", "print(1)", "--x"]
    assert strip_dashes(args.cmd) == ["python", "-c", "print(1)", "--x"]


def test_the_installed_command_keeps_the_users_commands_only() -> None:
    """``aiordma rxe`` sets rxe up on this host; running in a VM and the two-host pair are the
    repository's harness (``python -m harness``), which the wheel does not hold."""
    p = build_parser()
    for argv in (["devices"], ["rxe", "status"], ["rxe", "up"], ["rxe", "down"],
                 ["serve", "echo"], ["stats", "h:1"], ["demo"], ["bench", "--peers"]):
        p.parse_args(argv)
    for argv in (["rxe", "run", "--", "true"], ["rxe", "exec", "2", "--", "true"],
                 ["rxe", "kill", "2"], ["bench", "--hosts", "2"], ["bench", "--loss", "1"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)


def test_without_a_device_the_command_says_where_one_is(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """No ACTIVE port and no way to make rxe here: a typed error that names the reason and
    the harness's VM (``make demo`` boots it), not a VM booted by the installed command."""
    from aiordma.cli import main, rxe

    monkeypatch.setattr(rxe, "host_active_port", lambda: False)
    monkeypatch.setattr(rxe, "host_can_make_rxe", lambda: "creating an rxe device needs root")
    for argv in (["demo", "endpoints"], ["bench", "--quick", "--json", "", "--png", ""]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "DeviceError: no RDMA device here, and none can be made (creating an rxe " \
               "device needs root)" in err, err
        assert "python -m harness run -- CMD" in err


def test_devices_json_reports_a_reason_when_there_is_no_device() -> None:
    out = subprocess.run([sys.executable, "-m", "aiordma", "devices", "--json"],
                         capture_output=True, text=True, timeout=60, check=False)
    data = json.loads(out.stdout)
    assert isinstance(data["devices"], list)
    if not data["devices"]:
        assert data["reason"]  # says why: no kernel support, no device configured, ...
    from aiordma.lowlevel import verbs_path

    assert data["verbs_path"] == verbs_path()  # which verbs path endpoints would use here


def test_vm_route_is_a_route_or_a_reason() -> None:
    route = _run.vm_route()
    if isinstance(route, str):
        assert "missing" in route
    else:
        assert route.kernel.image.startswith("/boot/vmlinuz-")
        assert route.kernel.release in route.kernel.image


def test_the_vm_guest_script_is_valid_shell_and_execs_the_command() -> None:
    """The VM runs rxe's set-up as plain shell (no Python start-up before the ready mark);
    checked here for syntax and quoting (the device tests run it for real in the VM)."""
    import subprocess

    from harness.run import READY_MARK, guest_script

    script = guest_script([".venv/bin/python", "-m", "pytest", "-k", "a b; rm -rf /"])
    assert subprocess.run(["sh", "-n"], input=script, text=True, check=False).returncode == 0
    lines = script.splitlines()
    assert READY_MARK in lines[-2] and lines[-1] == (
        "exec .venv/bin/python -m pytest -k 'a b; rm -rf /'")
    assert "rdma link add rxe0 type rxe netdev aiordma0" in script
    assert "fail \"waiting 5 s for rxe0's port to turn ACTIVE\"" in script  # says why
    assert guest_script([]).splitlines()[-1] == "exit 0"


def test_serial_device_tests_are_marked_per_module() -> None:
    """scripts/device-tests.sh runs the serial stage on the files that say
    ``pytestmark = pytest.mark.serial`` (so it does not collect the whole suite again): a test
    marked serial any other way would run in neither stage."""
    import pathlib
    rxe = pathlib.Path(__file__).parents[1] / "rxe"
    for path in rxe.glob("*.py"):
        lines = [ln for ln in path.read_text().splitlines() if "mark.serial" in ln]
        assert all(ln.startswith("pytestmark = pytest.mark.serial") for ln in lines), path
    assert "grep -l '^pytestmark = pytest.mark.serial'" in (
        rxe.parents[1] / "scripts" / "device-tests.sh").read_text()
