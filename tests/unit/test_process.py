"""aiordma/bench/process.py: helper processes that announce themselves (no device needed)."""

from __future__ import annotations

import sys
import time

import pytest

from aiordma import AiordmaError
from aiordma.bench.process import announced, announced_process


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_yields_the_announcement_and_stops_the_process() -> None:
    t0 = time.monotonic()
    with announced(py("import time; print('serving x on h:1', flush=True); time.sleep(60)"),
                   "serving x") as line:
        assert line == "serving x on h:1\n"
    assert time.monotonic() - t0 < 30  # terminated, not waited for


def test_announced_process_yields_the_process_too() -> None:
    with announced_process(py("import os; print('serving', os.getpid(), flush=True); "
                              "import time; time.sleep(60)"), "serving") as (line, proc):
        assert int(line.split()[1]) == proc.pid and proc.poll() is None
    assert proc.poll() is not None  # stopped on exit


@pytest.mark.parametrize(("code", "said"), [
    ("print('something else')", "something else"),
    ("import sys; sys.exit(3)", "exited with status 3"),
    ("import time; time.sleep(60)", "nothing within 1.0 s"),
])
def test_a_process_that_does_not_announce_is_a_typed_error(code: str, said: str) -> None:
    with pytest.raises(AiordmaError, match=said), announced(py(code), "serving", timeout=1.0):
        pass
