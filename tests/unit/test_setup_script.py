"""``scripts/setup.sh`` stops, saying why, when an install fails or something the tests need is
missing, instead of going on. Each case runs the real script in a scratch copy of the project
(its ``scripts/`` and a ``pyproject.toml``), with stand-ins on ``PATH`` for ``dpkg-query``,
``apt-get`` and ``sudo`` so that nothing is installed on this machine. No device."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = """[project]
name = "aiordma"
version = "0"
dependencies = ["msgpack>=1.0"]
[project.optional-dependencies]
test = [{test}]
"""


def scratch(tmp_path: Path, *, installed: bool, test_deps: str = '"pytest>=8"') -> Path:
    """A copy of the project's scripts with a pyproject.toml, and a ``bin`` of stand-ins:
    ``dpkg-query`` says every package is there (or none), ``apt-get`` fails."""
    here = tmp_path / "project"
    shutil.copytree(ROOT / "scripts", here / "scripts")
    (here / "pyproject.toml").write_text(PYPROJECT.format(test=test_deps))
    fake = tmp_path / "bin"
    fake.mkdir()
    status = "install ok installed" if installed else ""
    stand_ins = {"dpkg-query": f"printf '%s' '{status}'", "apt-get": "exit 100",
                 "sudo": 'exec "$@"'}
    for name, body in stand_ins.items():
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    return here


def run_setup(here: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{here.parent / 'bin'}:{os.environ['PATH']}",
           "PYTHON": sys.executable}
    return subprocess.run(["bash", str(here / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_failed_apt_get_stops_the_setup(tmp_path: Path) -> None:
    done = run_setup(scratch(tmp_path, installed=False))
    assert done.returncode != 0
    assert "[setup] apt-get update failed (exit status 100)" in done.stderr, done.stderr
    assert "ready in" not in done.stderr


def test_a_failed_pip_install_stops_the_setup(tmp_path: Path) -> None:
    here = scratch(tmp_path, installed=True)
    # a venv without pip: `python -m pip install` fails at once
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(here / ".venv")],
                   check=True, timeout=60)
    done = run_setup(here)
    assert done.returncode != 0
    assert "No module named pip" in done.stderr
    assert "[setup] pip install failed: see" in done.stderr, done.stderr
    assert not (here / ".venv" / ".aiordma-installed").exists()  # not marked as installed
    assert "ready in" not in done.stderr


def venv_like_this_one(here: Path) -> None:
    """``.venv/bin/python`` runs this interpreter, and the venv is marked as installed for
    this pyproject.toml (the set-up then installs nothing)."""
    bindir = here / ".venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python").chmod(0o755)
    digest = hashlib.sha256((here / "pyproject.toml").read_bytes()).hexdigest()
    (here / ".venv" / ".aiordma-installed").write_text(digest + "\n")


def test_a_missing_test_dependency_stops_the_setup_on_every_run(tmp_path: Path) -> None:
    # the venv was installed before (its stamp matches), and a test dependency is gone or
    # too old since: every run checks, not only the one that installs
    here = scratch(tmp_path, installed=True,
                   test_deps='"pytest>=8", "aiordma-no-such-plugin>=1", "hypothesis>=999"')
    venv_like_this_one(here)
    done = run_setup(here)
    assert done.returncode != 0
    assert ("dependency check: aiordma-no-such-plugin is not installed (pyproject.toml wants "
            "aiordma-no-such-plugin>=1)") in done.stderr, done.stderr
    assert "pyproject.toml wants hypothesis>=999" in done.stderr
    assert done.stderr.count("dependency check:") == 2  # what is there passes
    assert "the venv lacks what aiordma or its tests need" in done.stderr


def test_every_test_dependency_of_this_project_is_checked_and_present() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_deps.py"),
                           str(ROOT / "pyproject.toml")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_deps
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    name, reqs = check_deps.requirements(ROOT / "pyproject.toml")
    assert name == "aiordma"
    assert {r.name for r in reqs} >= {"msgpack", "uvloop", "pytest", "pytest-asyncio",
                                      "pytest-timeout", "pytest-xdist", "hypothesis", "numpy"}
