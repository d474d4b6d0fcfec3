"""Starting a helper process that announces itself with a line on stdout (a server's
"serving ... on host:port", a peer's READY line), bounded, and always stopping it."""

from __future__ import annotations

import contextlib
import selectors
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from aiordma import AiordmaError

__all__ = ["announced", "announced_process"]


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(min(1.0, left)):
                line = proc.stdout.readline()
                if line:
                    return line
                try:  # end of its output: it is exiting
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return "(closed its output)"
            if proc.poll() is not None:
                return f"(exited with status {proc.returncode})"
    return f"(nothing within {timeout} s)"


@contextlib.contextmanager
def announced(cmd: Sequence[str], prefix: str, *, timeout: float = 60.0,
              env: dict[str, str] | None = None,
              stderr: IO[str] | None = None) -> Iterator[str]:
    """Run ``cmd``; yield its first stdout line once it starts with ``prefix``; on exit
    terminate it (kill after 10 s). ``stderr``: a file for its stderr (default: ours).

    Raises:
        AiordmaError: it said something else, exited, or said nothing within ``timeout``.
    """
    with announced_process(cmd, prefix, timeout=timeout, env=env, stderr=stderr) as (line, _proc):
        yield line


@contextlib.contextmanager
def announced_process(cmd: Sequence[str], prefix: str, *, timeout: float = 60.0,
                      env: dict[str, str] | None = None,
                      stderr: IO[str] | None = None, popen: Callable[..., Any] = subprocess.Popen
                      ) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """:func:`announced`, yielding the process too (``line, proc``): for a caller that needs
    its pid, e.g. to count the kernel's resources of a server process. ``popen``: what starts
    it (``subprocess.Popen``'s signature; the device tests give a warm start's).

    Raises:
        AiordmaError: it said something else, exited, or said nothing within ``timeout``.
    """
    proc = popen(list(cmd), stdout=subprocess.PIPE, text=True, env=env, stderr=stderr)
    try:
        line = _first_line(proc, timeout)
        if not line.startswith(prefix):
            raise AiordmaError(f"{cmd[-1]!r} did not start: it said {line.strip()!r}")
        yield line, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
