"""Check that aiordma and what pyproject.toml names for it and its tests are installed and
import.

    python scripts/check_deps.py [PYPROJECT]

``scripts/setup.sh`` runs it with the venv's interpreter on every run (about 0.4 s), so a
dependency that is missing, too old or broken fails the set-up, naming it, instead of
silently changing what the tests do (without pytest-timeout, the suite's global timeout
would vanish). The list is read from ``[project] dependencies`` and the ``test`` extra, so it
covers every test dependency by construction. Exit status 1 and one line per problem on
stderr when something is wrong; nothing on stdout.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any


def _requirement_class() -> Any:
    """``packaging``'s Requirement: the installed one, or the copy every pip carries."""
    for name in ("packaging.requirements", "pip._vendor.packaging.requirements"):
        try:
            return importlib.import_module(name).Requirement
        except ImportError:
            pass
    raise SystemExit("[setup] dependency check: neither packaging nor pip imports here")


# distributions whose module is not named after them
MODULES = {"pytest-asyncio": "pytest_asyncio", "pytest-timeout": "pytest_timeout",
           "pytest-xdist": "xdist", "opentelemetry-api": "opentelemetry.trace",
           "opentelemetry-sdk": "opentelemetry.sdk.trace"}


def requirements(pyproject: Path) -> tuple[str, list[Any]]:
    """The project's name and what it and its tests need."""
    project = tomllib.loads(pyproject.read_text())["project"]
    names = [*project.get("dependencies", []),
             *project.get("optional-dependencies", {}).get("test", [])]
    requirement = _requirement_class()
    return project["name"], [requirement(n) for n in names]


def problems(name: str, reqs: list[Any]) -> list[str]:
    found = []
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        found.append(f"import {name} failed: {type(exc).__name__}: {exc}")
    for req in reqs:
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            found.append(f"{req.name} is not installed (pyproject.toml wants {req})")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            found.append(f"{req.name} {version} is installed; pyproject.toml wants {req}")
            continue
        module = MODULES.get(req.name, req.name.replace("-", "_"))
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001  # any failure to import is the finding
            found.append(f"{req.name}: import {module} failed: {type(exc).__name__}: {exc}")
    return found


def main(argv: list[str]) -> int:
    pyproject = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / \
        "pyproject.toml"
    found = problems(*requirements(pyproject))
    for line in found:
        print(f"[setup] dependency check: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
