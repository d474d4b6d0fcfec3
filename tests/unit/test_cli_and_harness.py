"""The CLI parser and the harness's decisions, without a device or a VM."""

import json
import subprocess
import sys

from aiordma.tools import rxe as _rxe
from aiordma.tools.cli import build_parser


def test_rxe_run_keeps_the_command_verbatim() -> None:
    args = build_parser().parse_args(["rxe", "run", "--", "python", "-c", "print(1)", "--x"])
    assert args.cmd == ["--", "python", "-c", "print(1)", "--x"]


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
    route = _rxe.vm_route()
    if isinstance(route, str):
        assert "missing" in route
    else:
        assert route.kernel.image.startswith("/boot/vmlinuz-")
        assert route.kernel.release in route.kernel.image


def test_the_vm_guest_script_is_valid_shell_and_execs_the_command() -> None:
    """The VM runs rxe's set-up as plain shell (no Python start-up before the ready mark);
    checked here for syntax and quoting (the device tests run it for real in the VM)."""
    import subprocess

    from aiordma.tools.rxe import READY_MARK, guest_script

    script = guest_script([".venv/bin/python", "-m", "pytest", "-k", "a b; rm -rf /"])
    assert subprocess.run(["sh", "-n"], input=script, text=True, check=False).returncode == 0
    lines = script.splitlines()
    assert READY_MARK in lines[-2] and lines[-1] == (
        "exec .venv/bin/python -m pytest -k 'a b; rm -rf /'")
    assert "rdma link add rxe0 type rxe netdev aiordma0" in script
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
