"""The last thing `make test` prints: each stage's counts and the id of every test that failed,
read from the junit XML files the stages wrote into build/, so that a failure is named even
when pytest itself crashed before printing its own summary.

    .venv/bin/python scripts/test_summary.py [--status N] build/junit-unit.xml ...

Each file is a stage, named by the file (``junit-device.xml``: ``device``). A file that is
absent means the stage did not run, or died before pytest wrote it (the VM never booted, the
process was killed): that is said, never taken for green. A pytest INTERNALERROR (its text is
kept beside the file as ``<file>.internalerror`` by ``tests/conftest.py``, and junitxml records
one too) is shown by its cause; a test that started and never finished (its worker died while
running or reporting it: ``<file>.unfinished``) is named. The ids come
from the ``nodeid`` property ``tests/conftest.py`` gives each test; a file without it (another
project's, an older run's) falls back to the junit class and name.

A run's verdicts that are no test's (``--require-rdma``'s: ``<file>.problems``) are shown.
``--status N``: the stages' exit status; not 0 with every file green is said too (a stage that
failed in a way no file records). Exit status: 0 when every stage wrote its file and nothing
above was found, else 1.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "[summary]"
ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception|Exit|Interrupt)\b: .*")


@dataclass
class Stage:
    """What one stage's junit file (and its INTERNALERROR file, if any) says."""

    name: str
    path: Path
    found: bool = False
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("passed", "failed", "errors", "skipped"), 0))
    failed: list[str] = field(default_factory=list)  # "id" or "id (error)", in file order
    internal_error: str | None = None  # the INTERNALERROR's error line
    unfinished: list[str] = field(default_factory=list)  # started, never reported
    problems: list[str] = field(default_factory=list)  # e.g. --require-rdma's verdict

    @property
    def green(self) -> bool:
        return (self.found and not self.failed and self.internal_error is None
                and not self.unfinished and not self.problems)


def stage_name(path: Path) -> str:
    """``build/junit-device-serial.xml`` -> ``device-serial``."""
    name = path.name.removesuffix(".xml")
    return name.removeprefix("junit-") or name


def test_id(case: ET.Element) -> str:
    """The test's node id: its ``nodeid`` property, else rebuilt from class and name."""
    for prop in case.iter("property"):
        if prop.get("name") == "nodeid" and prop.get("value"):
            return str(prop.get("value"))
    classname, name = case.get("classname", ""), case.get("name", "?")
    return f"{classname.replace('.', '/')}.py::{name}" if classname else name


def read(path: Path) -> Stage:
    """One stage's results; a file pytest left unreadable counts as absent."""
    stage = Stage(stage_name(path), path)
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        root = None
    if root is not None:
        stage.found = True
        for case in root.iter("testcase"):
            if case.get("classname") == "pytest" and case.get("name") == "internal":
                stage.internal_error = cause(case.findtext("error") or "")  # (junitxml's own)
                continue
            if not case.get("name"):
                continue  # (junitxml leaves an empty one where an xdist worker died)
            tid = test_id(case)
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                stage.counts["failed"] += 1
                stage.failed.append(tid)
            if "error" in kinds:
                stage.counts["errors"] += 1
                stage.failed.append(f"{tid} (error)")
            if "skipped" in kinds:
                stage.counts["skipped"] += 1
            if not kinds & {"failure", "error", "skipped"}:
                stage.counts["passed"] += 1
    text = beside(path, ".internalerror")
    if text is not None:
        stage.internal_error = cause(text)
    text = beside(path, ".unfinished")
    if text is not None:
        stage.unfinished = list(dict.fromkeys(text.split()))
    text = beside(path, ".problems")
    if text is not None:
        stage.problems = [line for line in text.splitlines() if line.strip()]
    return stage


def beside(path: Path, suffix: str) -> str | None:
    """The text of the file ``tests/conftest.py`` kept beside ``path``, or None."""
    try:
        return path.with_name(path.name + suffix).read_text(errors="replace")
    except OSError:
        return None


def cause(text: str) -> str:
    """An INTERNALERROR's cause: its last error line that is not xdist's own wrapping
    AssertionError (e.g. the SystemError), else its last error line."""
    errors = [m.group(0).strip() for m in ERROR_LINE.finditer(text)]
    causes = [e for e in errors if not e.startswith("AssertionError")] or errors
    return causes[-1][:200] if causes else "(no error line: see the run's output)"


def report(stages: list[Stage], status: int = 0) -> list[str]:
    """The summary's lines; ``status``: the stages' exit status, if known (not 0 with every
    file green: a stage failed in a way no file records, which is said too)."""
    lines = []
    for s in stages:
        if not s.found:
            lines.append(f"{PREFIX} {s.name}: NO REPORT ({s.path} absent: the stage did not run, "
                         f"or died before pytest wrote it)")
        else:
            c = s.counts
            lines.append(f"{PREFIX} {s.name}: {c['passed']} passed, {c['failed']} failed, "
                         f"{c['errors']} errors, {c['skipped']} skipped ({s.path})")
        lines.extend(f"{PREFIX}   FAILED {tid}" for tid in s.failed)
        if s.internal_error is not None:
            lines.append(f"{PREFIX}   pytest INTERNALERROR: {s.internal_error}")
        lines.extend(f"{PREFIX}   PROBLEM {p}" for p in s.problems)
        lines.extend(f"{PREFIX}   UNFINISHED {tid} (started, never reported: the process "
                     f"running or reporting it died)" for tid in s.unfinished)
    bad = [s for s in stages if not s.green]
    if not bad and status:
        lines.append(f"{PREFIX} NOT GREEN: exit status {status}, though every stage's report is "
                     f"green: see the stages' output above")
    elif not bad:
        lines.append(f"{PREFIX} all {len(stages)} stages green")
    else:
        lines.append(f"{PREFIX} NOT GREEN: {sum(len(s.failed) for s in stages)} failed or "
                     f"errored, {sum(len(s.unfinished) for s in stages)} unfinished, "
                     f"{sum(not s.found for s in stages)} stage(s) without a report, "
                     f"{sum(s.internal_error is not None for s in stages)} INTERNALERROR(s)")
    return lines


def main(argv: list[str]) -> int:
    status = 0
    if argv[:1] == ["--status"] and len(argv) > 1 and argv[1].isdigit():
        status, argv = int(argv[1]), argv[2:]
    if not argv or any(a.startswith("-") for a in argv):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    stages = [read(Path(a)) for a in argv]
    print("\n".join(report(stages, status)), flush=True)
    return 0 if all(s.green for s in stages) and not status else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
