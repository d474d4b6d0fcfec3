"""What ``pip install .`` installs: one name, ``aiordma``, with the repository's protocols/ and
services/ inside it as ``aiordma.protocols`` and ``aiordma.services``, and none of the
developer harness (harness/: the VMs, the two-host pair). No device; builds the wheel from a
copy of the sources, the harness included (pip's isolated build, a few seconds)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from .import_graph import ROOT, modules


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("aiordma", "protocols", "services", "harness"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=240)
    (path,) = out.glob("aiordma-*.whl")
    return zipfile.ZipFile(path)


def test_only_aiordma_is_installed(wheel: zipfile.ZipFile) -> None:
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"aiordma"}


def test_every_module_is_installed_under_its_name(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module, path in modules().items():
        installed = module.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py"
                                                else ".py")
        assert installed in names, module
    assert "aiordma/protocols/messages/_protocol.py" in names
    assert "aiordma/services/kv/_store.py" in names


def test_the_command_is_the_cli(wheel: zipfile.ZipFile) -> None:
    (entry,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    assert "aiordma = aiordma.cli:main" in wheel.read(entry).decode()


def test_the_wheel_holds_no_harness(wheel: zipfile.ZipFile) -> None:
    """The VM and two-host harness stays in the repository: no module of it, under any name,
    and nothing of the old ``aiordma/tools`` grab-bag it came from."""
    from .import_graph import HARNESS

    names = wheel.namelist()
    harness_files = {p.name for p in HARNESS["harness"].rglob("*.py")}
    assert {"run.py", "pair.py", "vm.py", "host_agent.py", "remote.py"} <= harness_files
    assert not [n for n in names if n.startswith("harness/") or "/harness/" in n]
    assert not [n for n in names if n.startswith("aiordma/tools/")]
    vm_only = {"pair.py", "vm.py", "host_agent.py", "remote.py", "boot.py", "wire.py",
               "collective_wire.py"}
    assert not [n for n in names if n.rsplit("/", 1)[-1] in vm_only]
    assert "aiordma/cli/rxe.py" in names and "aiordma/bench/runner.py" in names


def test_every_module_started_with_dash_m_exists() -> None:
    """Helper processes are started as ``python -m NAME``: each NAME in the sources must be a
    module of the package or of the tests (a rename left one pointing at nothing once)."""
    import importlib.util
    import re

    names = set()
    for path in [*modules(harness=True).values(), *(ROOT / "tests").rglob("*.py")]:
        names.update(re.findall(r'"-m",\s*"([\w.]+)"', path.read_text(encoding="utf-8")))
    assert "aiordma.bench.peer" in names
    missing = [n for n in sorted(names) if importlib.util.find_spec(n) is None]
    assert missing == []


def test_setup_checks_every_pyverbs_module_the_package_imports() -> None:
    """scripts/setup.sh builds only the pyverbs modules aiordma loads, then imports the ones the
    package names: a new ``import pyverbs.X`` must be in that check, so that a module the
    build left out fails the set-up, not a user's first call."""
    import re
    used = set()
    for path in modules().values():
        used |= set(re.findall(r"(?:from|import) (pyverbs\.\w+)", path.read_text()))
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    check = setup[setup.index("import pyverbs.addr"):]
    check = check[:check.index("assert hasattr")]
    checked = set(re.findall(r"pyverbs\.\w+", check))
    assert used and used <= checked, sorted(used - checked)
