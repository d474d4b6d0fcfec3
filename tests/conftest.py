"""Test configuration shared by the three layers.

* ``tests/unit``: no device, no pyverbs needed (pure logic, sans-I/O protocols).
* ``tests/rxe``: real verbs on a real device (rxe or a NIC), marked ``rxe``; every test there
  uses the ``rdma_device`` fixture (directly or through another fixture), and one that does not
  fails: a device-free test belongs in ``tests/unit``. Run directly on a machine without a
  device, they skip with the reason; ``--require-rdma`` (what ``make test`` passes) turns any
  such skip (a test's, or a whole module's at import), or a run with no device test at all,
  into a failure (``tests/unit/test_suite_rules.py`` runs pytest on such trees).

Every failure is named, even when pytest's own report of it breaks: ``make test``'s stages
write a junit XML file each into ``build/`` (``scripts/test_summary.py`` prints the failed
ids from them last); each test carries its node id there as a property; a failure's report is
made with the garbage collector paused (:func:`pytest_runtest_makereport`); and an INTERNALERROR
is written beside the XML file (:func:`pytest_internalerror`). See docs/testing.md.

Options follow rdma-core's ``tests/``: ``--rdma-dev`` and ``--rdma-gid`` pick the device and
GID index. Every async test runs on the default asyncio loop and on uvloop; ``--loops one``
(what ``make test`` passes) runs each device test on one of the two, chosen per test and
commit (``tests/loops.py``), except those marked ``both_loops``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

from tests import start_gate
from tests.loops import LOOP_NAMES, kept_loop, loop_and_base

# Hypothesis profiles: "ci" bounds example counts so the whole suite fits CI's time budget
# (Python runs ~8x slower under the VM's software emulation) and is derandomized, so a CI run
# is repeatable; "dev" explores more, with fresh random examples each run.
settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

LOOP_FACTORIES = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    return LOOP_FACTORIES


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("aiordma")
    g.addoption("--rdma-dev", default=None, help="RDMA device for device tests (default: first "
                "with an ACTIVE port)")
    g.addoption("--rdma-gid", type=int, default=None, help="GID index for device tests")
    g.addoption("--require-rdma", action="store_true",
                help="fail the run if any device test was skipped or none ran")
    g.addoption("--loops", choices=("both", "one"), default="both",
                help="both: every async test on asyncio and on uvloop; one: each device test "
                "not marked both_loops on one of them, chosen by its id and --loop-seed")
    g.addoption("--loop-seed", default="0", help="the seed of --loops one (make test: the "
                "commit's hash)")
    g.addoption("--start-when", default=None, metavar="FILE",
                help="run the tests marked timer_bound first, at once, and the others once "
                "FILE exists (a bounded wait: tests/start_gate.py; make test's two-host stage)")


def _in_rxe(nodeid: str) -> bool:
    """Whether a node id (``tests/rxe/test_x.py::test_y``, relative to the rootdir) is in the
    device layer."""
    return ("/" + nodeid.replace(os.sep, "/")).find("/tests/rxe/") >= 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_rxe(item.nodeid):
            item.add_marker(pytest.mark.rxe)
        # (junit XML names a test by class and name only: this is its id, as pytest prints it)
        item.user_properties.append(("nodeid", item.nodeid))
    if config.getoption("--loops") == "one":
        keep = _one_loop_each(items, config.getoption("--loop-seed"))
        if not all(keep):
            config.hook.pytest_deselected(items=[i for i, k in zip(items, keep) if not k])
            items[:] = [i for i, k in zip(items, keep) if k]
    if config.getoption("--start-when"):  # (the tests that need not wait first, in order)
        items.sort(key=lambda item: item.get_closest_marker("timer_bound") is None)


def _item_loop(item: pytest.Item) -> str | None:
    """The loop an item runs on: its ``loop`` parameter, or pytest-asyncio's loop factory."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if params.get("loop") in LOOP_NAMES:
        return str(params["loop"])
    factory = params.get("_asyncio_loop_factory")
    return next((name for name, f in LOOP_FACTORIES.items() if f is factory), None)


def _one_loop_applies(item: pytest.Item) -> bool:
    """Whether ``--loops one`` runs this item's test on one loop: a device test not marked
    ``both_loops``."""
    return _in_rxe(item.nodeid) and not item.get_closest_marker("both_loops")


def _one_loop_each(items: list[pytest.Item], seed: str) -> list[bool]:
    """Under ``--loops one``: which items run. A device test not marked ``both_loops`` that
    has an item on each loop keeps the one :func:`tests.loops.kept_loop` names; a test with
    an item on one loop only (a case written for that loop) keeps it."""
    named = [loop_and_base(item.nodeid, _item_loop(item)) if _one_loop_applies(item) else None
             for item in items]
    loops_of: dict[str, set[str]] = {}
    for n in named:
        if n is not None:
            loops_of.setdefault(n[1], set()).add(n[0])
    return [n is None or len(loops_of[n[1]]) < 2 or kept_loop(n[1], seed) == n[0]
            for n in named]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # CPython 3.11 before 3.11.8 (this venv runs 3.11.7) keeps one AST recursion counter per
    # interpreter (python/cpython#106905): an ast.parse() run by a finalizer during another
    # one's AST construction corrupts it, and the outer parse raises "SystemError: AST
    # constructor recursion depth mismatch". pytest parses the test's source file to format a
    # failure, and the garbage collector can run then; asyncio's finalizer of a future whose
    # exception nobody retrieved logs that exception, and 3.11's traceback module parses each
    # frame's line for its ^^^ carets. The xdist worker then died with an INTERNALERROR and the
    # failure was never reported (tests/unit/test_failures_named.py shows it). With the
    # collector paused, no finalizer runs while the report is made.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return (yield)
    finally:
        if enabled:
            gc.enable()


def pytest_internalerror(excrepr: Any, excinfo: Any) -> None:
    # pytest prints no summary after an INTERNALERROR: keep its text beside the junit XML file
    # (``<xml>.internalerror``), where scripts/test_summary.py finds it.
    _beside_junit(".internalerror", f"{excrepr}\n")


# Tests started and not finished (under xdist, the controller hears of both from the workers):
# at the end, any left were running in a process, or being reported by a pytest, that died.
_unfinished: dict[str, None] = {}


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _unfinished[nodeid] = None


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _unfinished.pop(nodeid, None)


def _beside_junit(suffix: str, text: str) -> None:
    """Append ``text`` to the junit XML file's name + ``suffix``, if this run writes one (the
    controller only: an xdist worker's errors and reports reach it)."""
    path = _junit["path"]
    if path:
        with contextlib.suppress(OSError), open(path + suffix, "a") as f:
            f.write(text)


_junit: dict[str, str | None] = {"path": None}


_gate = {"open": False}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    # --start-when: the first test not marked timer_bound waits for the file (they run first:
    # pytest_collection_modifyitems), outside every test's own time and timeout.
    path = item.config.getoption("--start-when")
    if path and not _gate["open"] and not item.get_closest_marker("timer_bound"):
        try:
            waited = start_gate.wait_for(path)
        except TimeoutError as e:
            pytest.exit(str(e), returncode=pytest.ExitCode.INTERRUPTED)
        _gate["open"] = True
        print(f"\n--start-when: {path} appeared after {waited:.1f} s", flush=True)
    return (yield)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        _junit["path"] = getattr(config.option, "xmlpath", None) or None


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A test in tests/rxe that needs no device would count as a device test that ran, so
    # --require-rdma's "no device test ran" could never fire: such a test fails here.
    if _in_rxe(item.nodeid) and "rdma_device" not in getattr(item, "fixturenames", ()):
        pytest.fail(f"{item.nodeid} uses no device (no rdma_device fixture): device-free "
                    f"tests belong in tests/unit", pytrace=False)
    # Tests across two hosts need host 2 (its agent, AIORDMA_AGENT): elsewhere they skip, and
    # --require-rdma counts that skip as a failure (scripts/device-tests.sh deselects them).
    if item.get_closest_marker("two_hosts") and not os.environ.get("AIORDMA_AGENT"):
        pytest.skip("needs two hosts: run it on host 1 of `python -m harness run --hosts 2` "
                    "(scripts/two-host-tests.sh)")


_rxe_outcomes: dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "rxe" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _rxe_outcomes[report.outcome] = _rxe_outcomes.get(report.outcome, 0) + 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # A module that skips itself at import (pytest.skip(allow_module_level=True),
    # importorskip) has no test reports: its collection report is the only trace. (Under
    # xdist, workers forward such reports to the controller, which calls this hook too.)
    if report.skipped and _in_rxe(report.nodeid):
        _rxe_outcomes["skipped"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unfinished:  # (``<xml>.unfinished``: read by scripts/test_summary.py)
        _beside_junit(".unfinished", "".join(f"{nodeid}\n" for nodeid in _unfinished))
    if not session.config.getoption("--require-rdma") or hasattr(session.config, "workerinput"):
        return  # (an xdist worker sees only its share; the controller decides)
    ran = _rxe_outcomes["passed"] + _rxe_outcomes["failed"]
    problem = None
    if _rxe_outcomes["skipped"]:
        problem = f"{_rxe_outcomes['skipped']} device test(s) or module(s) were skipped"
    elif ran == 0:
        problem = "no device test ran"
    if problem:
        session.config._aiordma_require_problem = problem  # type: ignore[attr-defined]
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        _beside_junit(".problems", f"--require-rdma: {problem}\n")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    tr = terminalreporter
    tr.write_line(f"device tests: {_rxe_outcomes['passed']} passed, {_rxe_outcomes['failed']} "
                  f"failed, {_rxe_outcomes['skipped']} skipped")
    if config.getoption("--loops") == "one":
        tr.write_line(f"loops: each device test on one loop (seed "
                      f"{config.getoption('--loop-seed')}), those marked both_loops on both; "
                      f"--loops both runs all on both")
    problem = getattr(config, "_aiordma_require_problem", None)
    if problem:
        tr.write_line(f"--require-rdma: FAILED: {problem}", red=True, bold=True)


@pytest.fixture
def test_loops(request: pytest.FixtureRequest) -> list[str]:
    """The loops a test that runs both loops inside itself (one item, not one per loop)
    should cover: both, or under ``--loops one`` the one :func:`tests.loops.kept_loop` names
    for its id (a device test not marked ``both_loops``)."""
    item = request.node
    if request.config.getoption("--loops") == "one" and _one_loop_applies(item):
        return [kept_loop(item.nodeid, request.config.getoption("--loop-seed"))]
    return list(LOOP_NAMES)


@pytest.fixture(scope="session")
def rdma_device(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A :class:`aiordma.lowlevel.Device` on the chosen (or first ACTIVE) port; skip if none."""
    from aiordma import DeviceError
    from aiordma.lowlevel import Device

    try:
        dev = Device(request.config.getoption("--rdma-dev"),
                     gid_index=request.config.getoption("--rdma-gid"))
    except DeviceError as exc:
        pytest.skip(f"no usable RDMA device: {exc}")
    with dev:
        yield dev
