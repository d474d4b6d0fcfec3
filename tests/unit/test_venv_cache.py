"""``scripts/venv_cache.py``: a venv saved in one clone and restored in another names the new
clone's paths (scripts' ``#!`` lines, ``pyvenv.cfg``, the editable install's finder and
``direct_url.json``), drops the finder's stale bytecode, keeps symlinks, and restore refuses
(exit status 1) when nothing is cached under the key or the clone already has a venv. A
stand-in venv tree; no pip. No device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "venv_cache.py"


def run(*args: str | Path) -> int:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], timeout=60,
                          check=False).returncode


def stand_in_venv(project: Path) -> Path:
    venv = project / ".venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    (site / "__pycache__").mkdir(parents=True)
    (site / "aiordma-0.1.0.dist-info").mkdir()
    (venv / "bin").mkdir()
    (venv / "bin" / "pytest").write_text(f"#!{venv}/bin/python\nimport pytest\n")
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = python3 -m venv {venv}\n")
    (site / "__editable___aiordma_finder.py").write_text(f"MAPPING = {{'aiordma': '{project}/aiordma'}}\n")
    (site / "__pycache__" / "__editable___aiordma_finder.cpython-311.pyc").write_bytes(b"stale")
    (site / "aiordma-0.1.0.dist-info" / "direct_url.json").write_text(
        f'{{"url": "file://{project}"}}')
    (site / "other.py").write_text(f"# {project} stays as it is: not a file restore rewrites\n")
    return venv


def test_a_venv_saved_in_one_clone_is_restored_in_another_with_its_paths(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, second = tmp_path / "clone1", tmp_path / "clone2"
    assert run("save", stand_in_venv(first), cache, "k1") == 0
    second.mkdir()
    assert run("restore", second / ".venv", cache, "k1") == 0
    venv = second / ".venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    assert (venv / "bin" / "pytest").read_text().startswith(f"#!{second}/.venv/bin/python\n")
    assert (venv / "bin" / "python").is_symlink()
    assert str(second / ".venv") in (venv / "pyvenv.cfg").read_text()
    assert f"'{second}/aiordma'" in (site / "__editable___aiordma_finder.py").read_text()
    assert str(second) in (site / "aiordma-0.1.0.dist-info" / "direct_url.json").read_text()
    assert not list((site / "__pycache__").glob("__editable__*"))
    assert str(first) in (site / "other.py").read_text()
    # a second restore into a clone that has its venv, or an unknown key: nothing done
    assert run("restore", venv, cache, "k1") == 1
    third = tmp_path / "clone3"
    third.mkdir()
    assert run("restore", third / ".venv", cache, "no-such-key") == 1
    assert not (third / ".venv").exists()


def test_saving_again_replaces_the_copy_whole(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    venv = stand_in_venv(tmp_path / "clone1")
    assert run("save", venv, cache, "k") == 0
    (venv / "docs-extra-marker").write_text("")
    assert run("save", venv, cache, "k") == 0
    assert (cache / "venv" / "k" / "venv" / "docs-extra-marker").exists()
    assert sorted(p.name for p in (cache / "venv").iterdir()) == ["k"]  # no leftovers
