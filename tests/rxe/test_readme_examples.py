"""Every whole program in the docs (README.md and the site's pages, ``docs/**/*.md``) runs on
the device: the documentation cannot drift from the API unnoticed. Each runs as ``__main__`` in
this process (a new event loop each; starting Python is the slow part in the VM); a
collectives program runs as separate processes under the local launcher, as its page says,
with 3 ranks. (That every ``python`` block of the docs is such a program is checked without a
device, in ``tests/unit/test_docs.py``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..readme_programs import PROGRAMS, ROOT, Block

TIMEOUT = 240


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda b: b.where)
def test_readme_example_runs(rdma_device: object, program: Block, tmp_path: Path) -> None:
    if "Group.from_env" not in program.source:
        # running the page's program is the test
        exec(compile(program.source, program.where, "exec"), {"__name__": "__main__"})  # noqa: S102
        return
    script = tmp_path / "example.py"
    script.write_text(program.source)
    cmd = [sys.executable, "-m", "aiordma.services.collectives.launch", "-n", "3", "--", sys.executable,
           str(script)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert done.stdout.startswith("[rank0]:ok "), done.stdout  # (the launcher's rank prefix)
