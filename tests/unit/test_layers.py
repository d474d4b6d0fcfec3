"""The package's layers, read from its sources (tests/unit/import_graph.py). No device.

From the bottom: the sans-I/O protocols; the shared small pieces (errors, argument checks,
counters, the transport seam); the verbs layer (every pyverbs import, the compiled fast path);
devices; the completion reactor; memory; endpoints; the RPC layer and the in-memory channel;
the services; the bench; the ``aiordma`` command and its demos; the harness (the repository's
VM and two-host harness, not installed). A module imports only its own layer or lower ones,
pyverbs is imported only by the verbs layer, nothing installed names the harness, and no
import circle exists anywhere, not even through function-local imports."""

from __future__ import annotations

import ast
import re

import pytest

from .import_graph import cycles, graph, modules

LAYERS = ("protocols", "base", "verbs", "device", "reactor", "memory", "endpoint", "rpc",
          "services", "bench", "cli", "harness")
_PREFIXES = (  # (module name or package, layer); the longest match wins
    ("aiordma.protocols", "protocols"),
    ("aiordma", "base"),  # the package itself (lazy names), _errors, _args, _places, ...
    ("aiordma._verbs", "verbs"),
    ("aiordma._device", "device"),
    ("aiordma._reactor", "reactor"),
    ("aiordma._memory", "memory"),
    ("aiordma._endpoint", "endpoint"),
    ("aiordma._tcp", "endpoint"),  # the TCP transport's channel, set up beside endpoints
    ("aiordma.lowlevel", "endpoint"),
    ("aiordma.rpc", "rpc"),
    ("aiordma.testing", "rpc"),
    ("aiordma.services", "services"),
    ("aiordma.bench", "bench"),
    ("aiordma.cli", "cli"),
    ("aiordma.__main__", "cli"),
    ("harness", "harness"),
)


def layer(name: str) -> int:
    best = max((p for p in _PREFIXES if name == p[0] or name.startswith(p[0] + ".")),
               key=lambda p: len(p[0]))
    return LAYERS.index(best[1])


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_covers_every_part() -> None:
    names = set(modules(harness=True))
    for expected in ("aiordma._reactor.reactor", "aiordma._endpoint.endpoint",
                     "aiordma._memory.region", "aiordma._verbs.qp", "aiordma.rpc._client",
                     "aiordma.protocols.messages", "aiordma.services.kv._store",
                     "aiordma.cli.command", "aiordma.bench.runner", "harness.run",
                     "harness.pair", "harness.bench.wire"):
        assert expected in names
    assert not any(_in(n, "harness") for n in modules())  # (the installed package's)
    g = graph(harness=True)
    assert "aiordma.protocols.messages" in g["aiordma._endpoint.driver"]
    assert "aiordma.rpc" in g["aiordma.services.kv._store"]
    assert "aiordma._verbs.cq" in g["aiordma._reactor.reactor"]
    assert "aiordma.bench.process" in g["aiordma.cli.demo_kv"]
    assert "aiordma.cli.rxe" in g["harness.run"] and "aiordma.bench.link" in g["harness.bench.wire"]


def test_each_module_imports_only_its_layer_or_lower() -> None:
    wrong = [f"{a} ({LAYERS[layer(a)]}) imports {b} ({LAYERS[layer(b)]})"
             for a, targets in graph(harness=True).items() for b in targets
             if layer(b) > layer(a)]
    assert wrong == []


def test_the_lazy_package_names_are_not_a_way_around_the_layers() -> None:
    """``aiordma/__init__.py`` loads its names on first use; a lower layer that took one
    (``from aiordma import Endpoint``) would import a higher one behind the graph's back."""
    lazy = {"Listener", "connect", "listen", "Config", "Endpoint", "EndpointStats", "Immediate",
            "LocalSlice", "MemoryRegion", "RemoteBuffer", "Exposure", "TcpChannel"}
    wrong = []
    for name, path in modules().items():
        if layer(name) > LAYERS.index("endpoint"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "aiordma" and not node.level:
                wrong += [f"{name} takes aiordma.{a.name}" for a in node.names if a.name in lazy]
    assert wrong == []


def test_only_the_verbs_layer_imports_pyverbs() -> None:
    wrong = []
    for name, path in modules().items():
        if layer(name) == LAYERS.index("verbs"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = [node.module or ""]
            else:
                continue
            wrong += [f"{name} imports {f}" for f in found if f.split(".")[0] == "pyverbs"]
    assert wrong == []


def test_the_installed_package_never_names_the_harness() -> None:
    """An import of it is caught above; a string that is one of its module names (a
    ``python -m harness...`` it would start) would fail in an installed copy, which has no
    harness. (Prose that points a developer at the harness is fine.)"""
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


@pytest.mark.parametrize(("name", "expected"), [
    ("aiordma.protocols.rpc", "protocols"), ("aiordma._errors", "base"),
    ("aiordma._verbs.qp", "verbs"), ("aiordma.rpc._pool", "rpc"),
    ("aiordma.services.kv", "services"), ("aiordma._endpoint", "endpoint"),
    ("aiordma.cli.demo_micro", "cli"), ("harness.bench.wire", "harness"),
])
def test_layer_names_the_longest_prefix(name: str, expected: str) -> None:
    assert LAYERS[layer(name)] == expected
