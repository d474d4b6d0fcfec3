"""MkDocs hooks for the documentation site (mkdocs.yml names this file).

The API reference is read from the sources by griffe (mkdocstrings-python), statically. The
package installs as one name, ``aiordma``, but two of its parts live in other folders of the
repository: ``protocols/`` is installed as ``aiordma.protocols`` and ``services/`` as
``aiordma.services`` (``package-dir`` in pyproject.toml). Griffe finds a package's submodules by
listing its folder, so it would not find those two. Before each build, this hook lays out the
installed shape under ``build/docs-api/aiordma/``: a link to every entry of ``aiordma/`` (so
modules the library gains or moves are picked up as they are) and ``protocols`` and
``services`` linked in under their installed names. mkdocs.yml points the handler there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "docs-api"
MAPPED = {"protocols": ROOT / "protocols", "services": ROOT / "services"}


def installed_shape(tree: Path = TREE) -> Path:
    """Lay out ``tree/aiordma`` as ``pip install`` would; returns ``tree``."""
    package = tree / "aiordma"
    if tree.exists():
        shutil.rmtree(tree)
    package.mkdir(parents=True)
    for entry in sorted((ROOT / "aiordma").iterdir()):
        if entry.name != "__pycache__" and entry.name not in MAPPED:
            os.symlink(entry, package / entry.name)
    for name, folder in MAPPED.items():
        os.symlink(folder, package / name)
    return tree


@event_priority(100)  # before mkdocstrings reads its search paths from the config
def on_config(config: Any, **kwargs: Any) -> Any:
    installed_shape()
    return config
