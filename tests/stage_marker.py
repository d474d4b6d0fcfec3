"""A file touched when a share of a pytest session's tests is done: how `make test` starts the
two-host stage near the end of the device stage's parallel part (scripts/test-stages.sh).

``AIORDMA_PARALLEL_DONE`` names the file; ``AIORDMA_PARALLEL_DONE_AT`` the share of the
session's tests that must be finished (0 to 1, default 1: all of them). Only the process that
reports the session registers it (the xdist controller, which hears every worker's reports and
their collections). scripts/device-tests.sh touches the file after the session too, whatever
happened, so a session that dies early still lets the two-host stage start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


class StageMarker:
    """Touches ``path`` once ``share`` of the session's collected tests have finished."""

    def __init__(self, path: str, share: float) -> None:
        self.path = Path(path)
        self.share = min(max(share, 0.0), 1.0)
        self.total = 0
        self.finished = 0
        self.touched = False

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.total = max(self.total, len(ids))  # (every worker collects the same tests)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = max(self.total, len(session.items))  # (without xdist)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown" or self.touched:
            return
        self.finished += 1
        if self.total and self.finished >= self.share * self.total:
            self.touched = True
            self.path.touch()


def register(config: pytest.Config) -> None:
    """Register a :class:`StageMarker` if ``AIORDMA_PARALLEL_DONE`` is set, in the process that
    reports the session (not in an xdist worker)."""
    path = os.environ.get("AIORDMA_PARALLEL_DONE")
    if path and not hasattr(config, "workerinput"):
        share = float(os.environ.get("AIORDMA_PARALLEL_DONE_AT", "1"))
        config.pluginmanager.register(StageMarker(path, share), "aiordma-stage-marker")
