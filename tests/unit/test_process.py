"""aiordma/_process.py: helper processes that announce themselves (no device needed)."""

from __future__ import annotations

import sys
import time

import pytest

from aiordma import AiordmaError
from aiordma.tools.process import announced


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_yields_the_announcement_and_stops_the_process() -> None:
    t0 = time.monotonic()
    with announced(py("import time; print('serving x on h:1', flush=True); time.sleep(60)"),
                   "serving x") as line:
        assert line == "serving x on h:1\n"
    assert time.monotonic() - t0 < 30  # terminated, not waited for


@pytest.mark.parametrize(("code", "said"), [
    ("print('something else')", "something else"),
    ("import sys; sys.exit(3)", "exited with status 3"),
    ("import time; time.sleep(60)", "nothing within 1.0 s"),
])
def test_a_process_that_does_not_announce_is_a_typed_error(code: str, said: str) -> None:
    with pytest.raises(AiordmaError, match=said), announced(py(code), "serving", timeout=1.0):
        pass
