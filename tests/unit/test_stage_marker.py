"""``tests/stage_marker.py`` without a device: a pytest session with ``AIORDMA_PARALLEL_DONE``
set touches that file once the given share of its tests are done (how `make test` starts the
two-host stage near the end of the device stage's parallel part), with and without xdist; and
never without the variable. Real pytest runs of a small tree with this project's conftest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..bounds import hang_guard
from .test_suite_rules import suite

# Each test records whether the marker existed when it ran, by its number.
SEEN = """import os
import pytest

@pytest.mark.parametrize("n", range(8))
def test_n(n):
    with open(os.environ["SEEN"], "a") as f:
        f.write(f"{n} {os.path.exists(os.environ['MARKER'])}\\n")
"""


def run(root: Path, env: dict[str, str], *args: str) -> dict[int, bool]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "tests", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=hang_guard(), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = Path(env["SEEN"]).read_text().split()
    return {int(n): seen == "True" for n, seen in zip(lines[::2], lines[1::2], strict=True)}


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["one process", "xdist"])
def test_the_marker_is_touched_once_the_share_is_done(tmp_path: Path, xdist: tuple[str, ...]
                                                      ) -> None:
    root = suite(tmp_path, {"tests/unit/test_seen.py": SEEN})
    marker = tmp_path / "done"
    env = {**os.environ, "SEEN": str(tmp_path / "seen"), "MARKER": str(marker),
           "AIORDMA_PARALLEL_DONE": str(marker), "AIORDMA_PARALLEL_DONE_AT": "0.5"}
    seen = run(root, env, *xdist)
    assert marker.exists()
    assert sorted(seen) == list(range(8))
    # half done: the marker is there for the tests that start after 4 have finished (under
    # xdist, a test already running when the 4th finished may not see it)
    assert sum(seen.values()) >= (4 if not xdist else 2), seen
    assert sum(seen.values()) <= 4, seen  # and not before half were done


def test_no_marker_without_the_variable(tmp_path: Path) -> None:
    root = suite(tmp_path, {"tests/unit/test_seen.py": SEEN})
    marker = tmp_path / "done"
    env = {k: v for k, v in os.environ.items()
           if k not in ("AIORDMA_PARALLEL_DONE", "AIORDMA_PARALLEL_DONE_AT")}
    seen = run(root, {**env, "SEEN": str(tmp_path / "seen"), "MARKER": str(marker)})
    assert not any(seen.values()) and not marker.exists()
