"""The import graph of the installed package and of the developer harness, read from the
sources (no import is run).

Every ``import``/``from`` statement counts, at module level or inside a function, except those
under ``if TYPE_CHECKING:`` (they never run). Names are the installed ones: the repository's
``protocols/`` is ``aiordma.protocols``, ``services/`` is ``aiordma.services``; ``harness/``
(not installed) is ``harness``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"aiordma": ROOT / "aiordma", "aiordma.protocols": ROOT / "protocols",
           "aiordma.services": ROOT / "services"}
#: The repository's developer harness: not installed.
HARNESS = {"harness": ROOT / "harness"}


def modules(*, harness: bool = False) -> dict[str, Path]:
    """Installed module name -> source file (with ``harness``, the harness's modules too)."""
    found: dict[str, Path] = {}
    for package, folder in {**FOLDERS, **(HARNESS if harness else {})}.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _is_package(name: str, path: Path) -> bool:
    return path.name == "__init__.py"


def _skip_type_checking(tree: ast.AST) -> list[ast.AST]:
    nodes: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's own modules ``name`` imports (resolved to the longest known name)."""
    package = name if _is_package(name, path) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _skip_type_checking(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets.add(mod)
            targets.update(f"{mod}.{a.name}" for a in node.names)  # from pkg import module
    out = set()
    for t in targets:
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name and not name.startswith(t + "."):  # parents are imported anyway
            out.add(t)
    return out


def graph(*, harness: bool = False) -> dict[str, set[str]]:
    mods = modules(harness=harness)
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out
