"""The test suite's own rules, without a device: every async test runs on both loops, the
README has its programs (one per capability), and ``--require-rdma`` (``tests/conftest.py``)
fails a run whose device layer did not really run: a skipped test, a module that skips itself
at import, a run with no device test at all, a device-free test in ``tests/rxe`` (which would
count as a device test that ran). Each ``--require-rdma`` case runs pytest on a small tree of
its own that uses this project's ``tests/conftest.py`` as is."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

from ..loops import LOOP_NAMES, kept_loop, loop_and_base
from ..readme_programs import README_PROGRAMS

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
LOOPS = Path(__file__).resolve().parents[1] / "loops.py"  # (the conftest imports it,
START_GATE = Path(__file__).resolve().parents[1] / "start_gate.py"  # and this)

# a device fixture that needs no device: what a run on a machine with one looks like
FAKE_DEVICE = """
import pytest

@pytest.fixture
def rdma_device():
    return object()
"""
DEVICE_TEST = "def test_on_the_device(rdma_device):\n    assert rdma_device is not None\n"
MODULE_SKIP = ("import pytest\n\npytest.skip('no device here', allow_module_level=True)\n\n\n"
               "def test_never_collected(rdma_device):\n    pass\n")
DEVICE_FREE = "def test_needs_nothing():\n    assert 1 + 1 == 2\n"
UNIT_TEST = "def test_unit():\n    pass\n"


async def test_runs_on_the_parametrized_loop(request: pytest.FixtureRequest) -> None:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, uvloop.Loop) == ("uvloop" in request.node.callspec.id)


def test_the_readme_has_its_examples() -> None:
    assert len(README_PROGRAMS) >= 8  # one per capability: tests/unit/test_docs.py names them


def suite(tmp_path: Path, files: dict[str, str]) -> Path:
    """A test tree with this project's conftest and ``files`` (path -> text)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    shutil.copy(CONFTEST, tmp_path / "tests" / "conftest.py")
    shutil.copy(LOOPS, tmp_path / "tests" / "loops.py")
    shutil.copy(START_GATE, tmp_path / "tests" / "start_gate.py")
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def pytest_run(root: Path, *args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "tests", *args], cwd=root, capture_output=True, text=True,
                          timeout=120, check=False)
    return done.returncode, done.stdout + done.stderr


def test_a_run_where_the_device_tests_ran_passes(tmp_path: Path) -> None:
    root = suite(tmp_path, {"tests/rxe/conftest.py": FAKE_DEVICE,
                            "tests/rxe/test_dev.py": DEVICE_TEST,
                            "tests/unit/test_u.py": UNIT_TEST})
    rc, out = pytest_run(root, "--require-rdma")
    assert rc == 0, out
    assert "device tests: 1 passed, 0 failed, 0 skipped" in out


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_module_that_skips_itself_fails_require_rdma(tmp_path: Path, workers: list[str]
                                                       ) -> None:
    root = suite(tmp_path, {"tests/rxe/conftest.py": FAKE_DEVICE,
                            "tests/rxe/test_dev.py": DEVICE_TEST,
                            "tests/rxe/test_gone.py": MODULE_SKIP})
    rc, out = pytest_run(root, *workers)
    assert rc == 0, out  # without the option, a skip is a skip
    rc, out = pytest_run(root, "--require-rdma", *workers)
    assert rc != 0, out
    assert "--require-rdma: FAILED: 1 device test(s) or module(s) were skipped" in out, out


def test_a_device_test_skipped_for_want_of_a_device_fails_require_rdma(tmp_path: Path) -> None:
    # the project's own rdma_device fixture, on this host: no device (skip), or one (pass)
    root = suite(tmp_path, {"tests/rxe/test_dev.py": DEVICE_TEST})
    rc, out = pytest_run(root, "--require-rdma")
    from aiordma.lowlevel import list_devices

    if list_devices():
        assert rc == 0, out
    else:
        assert rc != 0 and "--require-rdma: FAILED: 1 device test(s)" in out, out


def test_no_device_test_ran_fires(tmp_path: Path) -> None:
    root = suite(tmp_path, {"tests/rxe/conftest.py": FAKE_DEVICE,
                            "tests/rxe/test_dev.py": DEVICE_TEST,
                            "tests/unit/test_u.py": UNIT_TEST})
    rc, out = pytest_run(root, "--require-rdma", "-k", "unit")
    assert rc != 0, out
    assert "--require-rdma: FAILED: no device test ran" in out


def test_a_device_free_test_in_the_device_layer_fails(tmp_path: Path) -> None:
    # With device tests that skip themselves at import, a device-free test there would be
    # the only "device test that ran": --require-rdma would pass a run where no device was
    # used. It fails instead, with or without the option.
    root = suite(tmp_path, {"tests/rxe/test_gone.py": MODULE_SKIP,
                            "tests/rxe/test_free.py": DEVICE_FREE})
    for args in ([], ["--require-rdma"]):
        rc, out = pytest_run(root, *args)
        assert rc != 0, out
        assert "uses no device (no rdma_device fixture): device-free tests belong in " \
               "tests/unit" in out


LOOPED = """
import pytest


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [1, 2, 3])
async def test_async(rdma_device, size):
    pass


@pytest.mark.parametrize("ending", ["return", "raise"])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_own_loop(rdma_device, loop, ending):
    pass


def test_no_loop(rdma_device):
    pass


@pytest.mark.parametrize(("loop", "case"), [("asyncio", "a"), ("uvloop", "a"), ("uvloop", "b")])
def test_cases(rdma_device, loop, case):
    pass


def test_inside(rdma_device, test_loops):
    print(f"LOOPS {','.join(test_loops)}")
"""
BOTH = ("import pytest\n\npytestmark = pytest.mark.both_loops\n\n\n@pytest.mark.asyncio\n"
        "async def test_integration(rdma_device):\n    pass\n")
UNIT_ASYNC = "import pytest\n\n\n@pytest.mark.asyncio\nasync def test_unit_async():\n    pass\n"


def passed_ids(out: str) -> list[str]:
    """The ids (without the file) that passed, from ``-rA``'s summary."""
    return sorted(line.split("::", 1)[1] for line in out.splitlines()
                  if line.startswith("PASSED "))


@pytest.mark.parametrize("seed", ["0", "1a2b3c4", "f00d"])
def test_loops_one_runs_each_device_test_on_one_loop(tmp_path: Path, seed: str) -> None:
    root = suite(tmp_path, {"tests/rxe/conftest.py": FAKE_DEVICE,
                            "tests/rxe/test_looped.py": LOOPED,
                            "tests/rxe/test_both.py": BOTH,
                            "tests/unit/test_u.py": UNIT_ASYNC})
    rc, out = pytest_run(root, "--require-rdma", "-rA", "--loops", "one", "--loop-seed", seed)
    assert rc == 0, out
    ran = passed_ids(out)
    assert f"loops: each device test on one loop (seed {seed})" in out
    # the loop integration's tests and the device-free ones: both loops
    for test in ("test_integration", "test_unit_async"):
        assert f"{test}[asyncio]" in ran and f"{test}[uvloop]" in ran, ran
    assert "test_no_loop" in ran
    assert "test_cases[uvloop-b]" in ran  # a case written for one loop only: kept
    # a test that runs the loops inside itself is given the one its id keeps
    assert f"LOOPS {kept_loop('tests/rxe/test_looped.py::test_inside', seed)}\n" in out
    # every other device test: exactly one of its two loops, the one kept_loop names
    tests = {f"test_async[{n}]": lambda lp, n=n: f"test_async[{lp}-{n}]" for n in (1, 2, 3)}
    tests |= {f"test_own_loop[{e}]": lambda lp, e=e: f"test_own_loop[{lp}-{e}]"
              for e in ("return", "raise")}
    tests["test_cases[a]"] = lambda lp: f"test_cases[{lp}-a]"
    for base, with_loop in tests.items():
        on = [lp for lp in LOOP_NAMES if with_loop(lp) in ran]
        assert on == [kept_loop(f"tests/rxe/test_looped.py::{base}", seed)], (base, ran)
    assert f"{len(ran)} passed, " in out.replace(" in ", ", ")
    rc, out = pytest_run(root, "--require-rdma", "-rA")  # --loops both: everything, twice
    assert rc == 0, out
    assert len(passed_ids(out)) == 3 * 2 + 2 * 2 + 1 + 3 + 1 + 2 + 2, out
    assert "LOOPS asyncio,uvloop\n" in out


def test_the_kept_loop_is_stable_and_either_one() -> None:
    names = [f"tests/rxe/test_x.py::test_{i}" for i in range(200)]
    first = [kept_loop(n, "abc") for n in names]
    assert first == [kept_loop(n, "abc") for n in names]  # the same seed: the same choice
    assert 70 <= first.count("uvloop") <= 130  # both loops, about half each
    assert first != [kept_loop(n, "abd") for n in names]  # another seed: another choice


@pytest.mark.parametrize(("nodeid", "loop", "expected"), [
    ("t.py::test_a[asyncio]", "asyncio", ("asyncio", "t.py::test_a")),
    ("t.py::test_a[uvloop-8]", "uvloop", ("uvloop", "t.py::test_a[8]")),
    ("t.py::test_a[raise-uvloop]", "uvloop", ("uvloop", "t.py::test_a[raise]")),
    ("t.py::test_asyncio_thing[2]", None, None),
    ("t.py::test_a[2]", "trio", None),
    ("t.py::test_a", "asyncio", None),
])
def test_a_tests_loop_and_its_id_without_it(nodeid: str, loop: str | None,
                                            expected: tuple[str, str] | None) -> None:
    assert loop_and_base(nodeid, loop) == expected
