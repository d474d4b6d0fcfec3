"""Every Python example in README.md runs, as a program of its own, on the device: the
documentation cannot drift from the API unnoticed. The collectives example runs under the
local launcher with 3 ranks, as the README says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
PROGRAMS = [b for b in BLOCKS if "asyncio.run(main())" in b]
TIMEOUT = 240


def test_the_readme_has_its_examples() -> None:
    assert len(PROGRAMS) >= 5  # endpoints, one-sided, RPC, key-value, collectives


@pytest.mark.parametrize("source", PROGRAMS, ids=lambda s: s.splitlines()[0][:40])
def test_readme_example_runs(rdma_device: object, source: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(source)
    cmd = [sys.executable, str(script)]
    if "Group.from_env" in source:
        cmd = [sys.executable, "-m", "services.collectives.launch", "-n", "3", "--", *cmd]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    if "Group.from_env" in source:
        assert done.stdout.startswith("ok "), done.stdout
