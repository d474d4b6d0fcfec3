"""Every Python example in README.md runs on the device: the documentation cannot drift from
the API unnoticed. Each runs as ``__main__`` in this process (a new event loop each; starting
Python is the slow part in the VM); the collectives example runs as separate processes under
the local launcher, as the README says, with 3 ranks. (That the README has them is checked
without a device, in ``tests/unit/test_suite_rules.py``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..readme_programs import PROGRAMS, ROOT

TIMEOUT = 240


@pytest.mark.parametrize("source", PROGRAMS, ids=lambda s: s.splitlines()[0][:40])
def test_readme_example_runs(rdma_device: object, source: str, tmp_path: Path) -> None:
    if "Group.from_env" not in source:
        # running the README's program is the test
        exec(compile(source, "README.md example", "exec"), {"__name__": "__main__"})  # noqa: S102
        return
    script = tmp_path / "example.py"
    script.write_text(source)
    cmd = [sys.executable, "-m", "aiordma.services.collectives.launch", "-n", "3", "--", sys.executable,
           str(script)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stdout.startswith("[rank0]:ok "), done.stdout  # (the launcher's rank prefix)
