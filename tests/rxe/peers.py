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


@contextlib.contextmanager
def served_by_cli(service: str, *options: str, timeout: float = 60.0) -> Iterator[int]:
    """Run ``aiordma serve SERVICE OPTIONS`` in another process; yield its port; stop it on
    exit. Waits at most ``timeout`` for the "serving" line."""
    from aiordma._process import announced

    args = [sys.executable, "-m", "aiordma", "serve", service, "--port", "0", *options]
    with announced(args, f"serving {service} on ", timeout=timeout) as line:
        yield int(line.split()[3].rsplit(":", 1)[1])
