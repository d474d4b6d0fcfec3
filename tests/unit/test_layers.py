"""The package's layers, read from its sources (tests/unit/import_graph.py). No device.

protocols (sans-I/O) < the core (reactor, endpoint, memory, RPC) < services < tools (CLI, rxe
harness, demos, bench): a module imports only its own layer or lower ones, and no import
circle exists anywhere, not even through function-local imports."""

from __future__ import annotations

import pytest

from .import_graph import cycles, graph, modules

LAYERS = ("protocols", "core", "services", "tools")


def layer(name: str) -> int:
    if name == "aiordma.protocols" or name.startswith("aiordma.protocols."):
        return 0
    if name == "aiordma.services" or name.startswith("aiordma.services."):
        return 2
    if name.startswith("aiordma.tools") or name == "aiordma.__main__":
        return 3
    return 1


def test_the_graph_covers_every_part() -> None:
    names = set(modules())
    for expected in ("aiordma._reactor.reactor", "aiordma._endpoint.endpoint", "aiordma._memory.region", "aiordma.rpc",
                     "aiordma.protocols.messages", "aiordma.services.kv._store",
                     "aiordma.tools.cli", "aiordma.tools.bench.runner"):
        assert expected in names
    g = graph()
    assert "aiordma.protocols.messages" in g["aiordma._endpoint.endpoint"]
    assert "aiordma.rpc" in g["aiordma.services.kv._store"]


def test_each_module_imports_only_its_layer_or_lower() -> None:
    wrong = [f"{a} ({LAYERS[layer(a)]}) imports {b} ({LAYERS[layer(b)]})"
             for a, targets in graph().items() for b in targets if layer(b) > layer(a)]
    assert wrong == []


def test_there_is_no_import_circle() -> None:
    assert cycles(graph()) == []


@pytest.mark.parametrize(("g", "expected"), [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_circle_finder_finds_circles(g: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(g) == expected
