"""A cached copy of a finished venv, so that a fresh clone's set-up copies it instead of
installing the same packages again (pip took 14-40 s here for the test extra, 11-12 s more for
the docs extra).

    python scripts/venv_cache.py save    VENV CACHE_DIR KEY
    python scripts/venv_cache.py restore VENV CACHE_DIR KEY

``scripts/setup.sh`` restores into a clone that has no venv yet, and saves after it installed
one; ``scripts/docs.sh`` saves again after it added the docs extra. KEY names what the venv
holds (setup.sh hashes pyproject.toml, the Cython version, the interpreter and where pyverbs
comes from), so a changed pyproject.toml makes a new copy. A venv names its own path (the
scripts' ``#!`` lines, ``activate``, ``pyvenv.cfg``) and the project's (the editable install's
finder and ``direct_url.json``); restore rewrites both. The copy is made beside its final
place and renamed into it, so set-ups running at the same time never see half a copy.
Exit status 1 from restore: nothing cached under KEY (setup.sh then installs as before).
Standard library only; any Python 3.11 runs it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ORIGIN = "aiordma-venv-origin"  # in the cached copy: the project path it was made in


def _entry(cache: Path, key: str) -> Path:
    return cache / "venv" / key


def save(venv: Path, cache: Path, key: str) -> None:
    entry = _entry(cache, key)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=entry.parent))
    try:
        shutil.copytree(venv, tmp / "venv", symlinks=True)
        (tmp / ORIGIN).write_text(str(venv.resolve().parent))
        if entry.exists():  # replaced whole (docs.sh saves a venv with more in it)
            old = Path(tempfile.mkdtemp(prefix=f".{key}.old.", dir=entry.parent))
            os.replace(entry, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rewrite(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    if old in data:
        path.write_bytes(data.replace(old, new))


def restore(venv: Path, cache: Path, key: str) -> int:
    entry = _entry(cache, key)
    if not (entry / ORIGIN).is_file() or venv.exists():
        return 1
    origin = (entry / ORIGIN).read_text().encode()
    project = str(venv.resolve().parent).encode()
    tmp = Path(tempfile.mkdtemp(prefix=".venv.", dir=venv.parent))
    try:
        shutil.copytree(entry / "venv", tmp / "venv", symlinks=True)
        root = tmp / "venv"
        texts = [p for p in (root / "bin").iterdir() if p.is_file() and not p.is_symlink()]
        texts.append(root / "pyvenv.cfg")
        site = next((root / "lib").glob("python3*/site-packages"))
        texts += list(site.glob("__editable__*.py")) + list(site.glob("__editable__*.pth"))
        texts += list(site.glob("*.dist-info/direct_url.json"))
        for path in texts:
            if path.stat().st_size < 1 << 20:  # scripts and small files, not binaries
                _rewrite(path, origin, project)
        for pyc in site.glob("__pycache__/__editable__*"):
            pyc.unlink()  # compiled with the old path in it
        os.replace(root, venv)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] not in ("save", "restore"):
        print(__doc__, file=sys.stderr)
        return 2
    venv, cache, key = Path(argv[1]).absolute(), Path(argv[2]), argv[3]
    if argv[0] == "save":
        save(venv, cache, key)
        return 0
    return restore(venv, cache, key)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
