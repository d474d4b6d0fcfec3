"""The package's layers, read from its sources (tests/unit/import_graph.py). No device.

protocols (sans-I/O) < the core (reactor, endpoint, memory, RPC) < services < bench < cli (the
``aiordma`` command, the demos) < harness (the repository's VM and two-host harness, not
installed): a module imports only its own layer or lower ones, and no import circle exists
anywhere, not even through function-local imports. Nothing installed names the harness, not
even as a ``python -m harness...`` command it would start."""

from __future__ import annotations

import pytest

from .import_graph import cycles, graph, modules

LAYERS = ("protocols", "core", "services", "bench", "cli", "harness")


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer(name: str) -> int:
    if _in(name, "aiordma.protocols"):
        return 0
    if _in(name, "aiordma.services"):
        return 2
    if _in(name, "aiordma.bench"):
        return 3
    if _in(name, "aiordma.cli") or name == "aiordma.__main__":
        return 4
    if _in(name, "harness"):
        return 5
    return 1


def test_the_graph_covers_every_part() -> None:
    names = set(modules(harness=True))
    for expected in ("aiordma._reactor", "aiordma._endpoint", "aiordma._memory", "aiordma.rpc",
                     "aiordma.protocols.messages", "aiordma.services.kv._store",
                     "aiordma.cli.command", "aiordma.bench.runner", "harness.run",
                     "harness.pair", "harness.bench.wire"):
        assert expected in names
    assert not any(_in(n, "harness") for n in modules())  # (the installed package's)
    g = graph(harness=True)
    assert "aiordma.protocols.messages" in g["aiordma._endpoint"]
    assert "aiordma.rpc" in g["aiordma.services.kv._store"]
    assert "aiordma.bench.process" in g["aiordma.cli.demo_kv"]
    assert "aiordma.cli.rxe" in g["harness.run"] and "aiordma.bench.link" in g["harness.bench.wire"]
    assert [layer(n) for n in ("aiordma.protocols", "aiordma._reactor", "aiordma.services.kv",
                               "aiordma.bench", "aiordma.cli", "harness.run")] == list(range(6))


def test_each_module_imports_only_its_layer_or_lower() -> None:
    wrong = [f"{a} ({LAYERS[layer(a)]}) imports {b} ({LAYERS[layer(b)]})"
             for a, targets in graph(harness=True).items() for b in targets
             if layer(b) > layer(a)]
    assert wrong == []


def test_the_installed_package_never_names_the_harness() -> None:
    """An import of it is caught above; a string that is one of its module names (a
    ``python -m harness...`` it would start) would fail in an installed copy, which has no
    harness. (Prose that points a developer at the harness is fine.)"""
    import ast
    import re

    module = re.compile(r"harness(\.\w+)*")
    named = [f"{name}: {node.value!r}" for name, path in modules().items()
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and module.fullmatch(node.value)]
    assert named == []


def test_there_is_no_import_circle() -> None:
    assert cycles(graph(harness=True)) == []


@pytest.mark.parametrize(("g", "expected"), [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_circle_finder_finds_circles(g: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(g) == expected
