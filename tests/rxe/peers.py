"""Starting ``peer_process.py`` (a listener in another process) for two-process tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def peer_process(loop: str = "asyncio", die_after: int | None = None) -> Iterator[int]:
    """Run the peer; yield its port; kill it on exit."""
    script = os.path.join(os.path.dirname(__file__), "peer_process.py")
    args = [sys.executable, script, "--loop", loop]
    if die_after is not None:
        args += ["--die-after", str(die_after)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "" if it died first: no hang
        assert line.startswith("PORT "), f"peer process said {line!r}"
        yield int(line.split()[1])
    finally:
        proc.kill()
        proc.wait(timeout=30)
