"""protocols/ (installed as aiordma.protocols) is sans-I/O: none of its modules imports asyncio,
sockets, TLS, pyverbs or the rest of aiordma (the package's own ``__init__`` loads nothing
until a name is used, so importing ``aiordma.protocols`` brings in only the protocols).

Two independent checks: the source (every import statement, and any dynamic import of a
literal name) and the running interpreter (importing every module in a fresh process loads
none of them)."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from aiordma import protocols

FORBIDDEN = frozenset({"asyncio", "socket", "selectors", "ssl", "pyverbs", "aiordma"})
PACKAGE_DIR = Path(protocols.__file__).parent
ROOT = PACKAGE_DIR.parent
SOURCES = sorted(PACKAGE_DIR.rglob("*.py"))


def forbidden_imports(source: str, filename: str = "<string>") -> list[str]:
    """The forbidden top-level modules ``source`` imports, statically or by a literal name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call):  # __import__("x"), importlib.import_module("x")
            func = node.func
            name = func.id if isinstance(func, ast.Name) else (
                func.attr if isinstance(func, ast.Attribute) else "")
            if name in ("__import__", "import_module") and node.args and isinstance(
                    node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [n for n in names if n.split(".")[0] in FORBIDDEN
                  and not (n == "aiordma.protocols" or n.startswith("aiordma.protocols."))]
    return found


@pytest.mark.parametrize("source", [
    "import asyncio", "import os, socket", "import asyncio.events as ev", "from ssl import wrap",
    "from selectors import DefaultSelector", "import pyverbs.qp", "from aiordma import Endpoint",
    "def f():\n    import socket", "try:\n    import uvloop\nexcept ImportError:\n    import asyncio",
    "__import__('socket')", "import importlib\nimportlib.import_module('aiordma._reactor.reactor')",
    "if TYPE_CHECKING:\n    from asyncio import Future",
])
def test_the_checker_catches_forbidden_imports(source: str) -> None:
    assert forbidden_imports(source)


@pytest.mark.parametrize("source", [
    "import struct", "from . import socket", "from .asyncio import x", "import asyncio_compat",
    "import sslib", "x = 'import asyncio'", "from enum import Enum",
    "from aiordma.protocols import framing", "import aiordma.protocols.errors",
])
def test_the_checker_allows_everything_else(source: str) -> None:
    assert not forbidden_imports(source)


def test_sources_were_found() -> None:
    names = {p.relative_to(PACKAGE_DIR).as_posix() for p in SOURCES}
    assert {"__init__.py", "handshake/__init__.py", "rpc/_codec.py", "collectives/_matching.py",
            "framing.py", "messages/_credits.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_forbidden_import_statements(path: Path) -> None:
    assert forbidden_imports(path.read_text(encoding="utf-8"), str(path)) == []


PROBE = """
import importlib, json, pkgutil, sys
forbidden = set(sys.argv[1].split(","))
def seen():
    top = {m.split(".")[0] for m in sys.modules} - {"aiordma"}
    rest = {m for m in sys.modules
            if m.startswith("aiordma.") and not m.startswith("aiordma.protocols")}
    return sorted((top & forbidden) | rest)
before = seen()
import aiordma.protocols as protocols
names = ["aiordma.protocols"] + [m.name for m in pkgutil.walk_packages(protocols.__path__,
                                                                       "aiordma.protocols.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "file": protocols.__file__,
                  "preloaded": before, "loaded": seen()}))
"""


def test_importing_every_module_loads_no_io_module() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, ",".join(sorted(FORBIDDEN))], cwd="/",
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert Path(result["file"]).resolve() == Path(protocols.__file__).resolve()
    expected = {"aiordma.protocols", *(m.name for m in pkgutil.walk_packages(
        protocols.__path__, "aiordma.protocols."))}
    assert set(result["modules"]) == expected
    assert {"aiordma.protocols.handshake", "aiordma.protocols.handshake._state",
            "aiordma.protocols.rpc._codec", "aiordma.protocols.framing",
            "aiordma.protocols.messages._credits"} <= expected
    # The interpreter itself starts without them, so this is not vacuous ...
    assert result["preloaded"] == []
    # ... and nothing in protocols/ (nor msgpack, which it uses) pulls one in, nor any other
    # part of aiordma (its __init__ loads names on first use).
    assert result["loaded"] == []
