"""Regenerate the fault catalogue's table (docs/faults.md, "## The catalogue") from the tests
themselves and the junit XML files of runs: one row per test behind a fault, with the fault
and its promise (from the table as it stands), the test's id and the assertion behind it (read
from the test's source), and the test's outcome in each run given.

    .venv/bin/python scripts/fault_catalogue.py [--run NAME=FILE[,FILE...]]... [--write]

``--run`` names one run and its junit files (``make test`` writes build/junit-*.xml: give a
run's device, device-serial and two-hosts files); each run is a column: ``pass`` when every
case of the test that ran (its loops, every parameter) passed, ``FAIL`` when one failed or errored,
``skip``, or ``-`` where the run has no such test. Without ``--write`` the table is printed;
with it, it replaces the catalogue's table in docs/faults.md (the fault and promise cells are
kept, so the table can be regenerated from itself).

The tests of a row are the backticked names in its tests cell: ``test_x.py::test_y``, a file
(``test_x.py``: the names after it are its tests; named alone, the file is one row, its tests
counted), or a bare name (a test of the file named before it, else of any test file). The assertion is the ``assert``
statement marked with a ``# catalogue`` comment (on any of its lines; in the test, else in a
function of its file that it calls by name, shown "(in `name`)"), else the test's first
``assert``, else its first ``pytest.raises``; shown without its message, ``(k of n)`` saying
which of the test's asserts it is.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "faults.md"
SECTION = "## The catalogue"
TEST_DIRS = ("tests/rxe", "tests/unit")
HEADER = ["fault", "promise", "test", "assertion behind it"]
TOKEN = re.compile(r"`([^`]+)`")
QUALIFIED = re.compile(r"^(?:[\w/]*/)?(test_\w+\.py)::(test_\w+)$")


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the catalogue: a fault, its promise and the text naming its tests."""

    fault: str
    promise: str
    tests: str


@dataclass(frozen=True, slots=True)
class TestRef:
    """A test function: its file (relative to the repository) and name ("": the whole file)."""

    path: str
    name: str

    @property
    def nodeid(self) -> str:
        return f"{self.path}::{self.name}" if self.name else self.path


def cells(line: str) -> list[str]:
    """A markdown table line's cells (a ``|`` inside backticks is kept)."""
    out, cur, code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return out


def table_span(lines: list[str]) -> tuple[int, int]:
    """The catalogue table's first and past-last line indexes."""
    start = next(i for i, line in enumerate(lines) if line.startswith(SECTION))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    end = first
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return first, end


def read_rows(text: str) -> list[Row]:
    """The catalogue's rows: from the hand-written table (fault, outcome, tests) or a
    generated one (fault, promise, test, ...: a row with empty fault continues the last)."""
    lines = text.splitlines()
    first, end = table_span(lines)
    header = [h.lower() for h in cells(lines[first])]
    generated = header[:3] == HEADER[:3]
    rows: list[Row] = []
    for line in lines[first + 2:end]:
        c = cells(line)
        if generated and not c[0] and rows:
            last = rows[-1]
            rows[-1] = Row(last.fault, last.promise, f"{last.tests}, {c[2]}")
        else:
            rows.append(Row(c[0], c[1], c[2]))
    return rows


@functools.cache
def test_files(root: Path) -> dict[str, Path]:
    """Test file name -> its path (tests/rxe's first)."""
    files: dict[str, Path] = {}
    for d in TEST_DIRS:
        for p in sorted((root / d).glob("test_*.py")):
            files.setdefault(p.name, p)
    return files


@functools.cache
def functions(path: Path, every: bool = False
              ) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """A test file's top-level test functions by name (``every``: all its functions)."""
    tree = ast.parse(path.read_text(), str(path))
    return {n.name: n for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and (every or n.name.startswith("test_"))}


def resolve(cell: str, root: Path) -> tuple[list[TestRef], list[str]]:
    """The tests a tests cell names, and the names it gives that no test file defines."""
    files = test_files(root)
    defs = {name: functions(p) for name, p in files.items()}
    refs: list[TestRef] = []
    missing: list[str] = []
    current: str | None = None
    whole: TestRef | None = None  # the current file, until one of its tests is named

    def add(fname: str, test: str) -> None:
        nonlocal whole
        if fname in files and test in defs[fname]:
            ref = TestRef(str(files[fname].relative_to(root)), test)
            if whole is not None and whole.path == ref.path:
                refs.remove(whole)  # (the file is named for its tests)
                whole = None
            if ref not in refs:
                refs.append(ref)
        else:
            missing.append(f"{fname}::{test}")

    for token in TOKEN.findall(cell):
        m = QUALIFIED.match(token)
        if m:
            current, whole = m.group(1), None
            add(*m.groups())
        elif re.fullmatch(r"(?:[\w/]*/)?test_\w+\.py", token):
            current, whole = token.rsplit("/", 1)[-1], None
            if current not in files:
                missing.append(current)
                current = None
            else:
                whole = TestRef(str(files[current].relative_to(root)), "")
                refs.append(whole)
        elif re.fullmatch(r"test_\w+", token):
            if current is not None and token in defs[current]:
                add(current, token)
            else:
                owner = next((f for f, d in defs.items() if token in d), None)
                if owner is None:
                    missing.append(token)
                else:
                    add(owner, token)
    return refs, missing


def called_helpers(fn: ast.AST, defined: dict[str, ast.AST]) -> list[str]:
    """The module-level functions of the test's file that ``fn`` calls by name, in the order
    of their first call (tests excluded)."""
    calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Name) and n.func.id in defined
                    and not n.func.id.startswith("test_")),
                   key=lambda n: (n.lineno, n.col_offset))
    return list(dict.fromkeys(n.func.id for n in calls))  # type: ignore[attr-defined]


def one_line(node: ast.AST, source: str) -> str:
    text = " ".join((ast.get_source_segment(source, node) or "").split())
    return text if len(text) <= 140 else text[:137] + "..."


def is_marked(node: ast.Assert, lines: list[str]) -> bool:
    """Whether a ``# catalogue`` comment stands on one of the assert's lines."""
    return any("# catalogue" in line for line in lines[node.lineno - 1:node.end_lineno])


def assertion(ref: TestRef, root: Path) -> str:
    """The assertion behind a test (see the module's docstring)."""
    path = root / ref.path
    if not ref.name:
        return f"(the file's {len(functions(path))} tests)"
    source = path.read_text()
    fn = functions(path)[ref.name]
    lines = source.splitlines()
    asserts = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assert)),
                     key=lambda n: n.lineno)
    marked = [a for a in asserts if is_marked(a, lines)]
    if not marked:  # a marked assert in a helper of the same file that the test calls
        every = functions(path, every=True)
        for name in called_helpers(fn, every):
            found = sorted((n for n in ast.walk(every[name])
                            if isinstance(n, ast.Assert) and is_marked(n, lines)),
                           key=lambda n: n.lineno)
            if found:
                return f"`assert {one_line(found[0].test, source)}` (in `{name}`)"
    if marked or asserts:
        chosen = (marked or asserts)[0]  # (shown without its message)
        return (f"`assert {one_line(chosen.test, source)}` "
                f"({asserts.index(chosen) + 1} of {len(asserts)})")
    raises = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
              and one_line(n.func, source) == "pytest.raises"]
    if raises:
        return f"`{one_line(min(raises, key=lambda n: n.lineno), source)}` (no assert)"
    return "(no assert: checked by the helpers it calls)"


def outcomes(files: list[Path]) -> dict[str, str]:
    """Test id (parameters dropped) -> "pass", "FAIL" or "skip" over a run's junit files."""
    result: dict[str, str] = {}
    rank = {"skip": 0, "pass": 1, "FAIL": 2}
    for f in files:
        root = ET.parse(f).getroot()
        for case in root.iter("testcase"):
            if not case.get("name") or case.get("classname") == "pytest":
                continue
            nodeid = next((p.get("value") for p in case.iter("property")
                           if p.get("name") == "nodeid"), None)
            if not nodeid:
                nodeid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            base = nodeid.split("[", 1)[0]
            kinds = {child.tag for child in case}
            got = ("FAIL" if kinds & {"failure", "error"} else
                   "skip" if "skipped" in kinds else "pass")
            old = result.get(base)
            if old is None or rank[got] > rank[old] or old == "skip":
                result[base] = got if old != "FAIL" else old
    return result


def file_outcome(run: dict[str, str], path: str) -> str:
    """A whole file's outcome in a run: its worst test's."""
    got = {v for k, v in run.items() if k.startswith(f"{path}::")}
    return next((o for o in ("FAIL", "pass", "skip") if o in got), "-")


def build(rows: list[Row], runs: dict[str, dict[str, str]], root: Path
          ) -> tuple[list[str], list[str]]:
    """The regenerated table's lines, and the test names no file defines."""
    head = HEADER + list(runs)
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    missing: list[str] = []
    for row in rows:
        refs, lost = resolve(row.tests, root)
        missing.extend(lost)
        for i, ref in enumerate(refs):
            marks = [run.get(ref.nodeid, "-") if ref.name else file_outcome(run, ref.path)
                     for run in runs.values()]
            fault, promise = (row.fault, row.promise) if i == 0 else ("", "")
            out.append("| " + " | ".join([fault, promise, f"`{ref.nodeid}`",
                                          assertion(ref, root), *marks]) + " |")
        if not refs:
            out.append("| " + " | ".join([row.fault, row.promise, "(no test found)", "",
                                          *["-"] * len(runs)]) + " |")
    return out, missing


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--run", action="append", default=[], metavar="NAME=FILE[,FILE...]",
                        help="a run's junit XML files (repeat for each run)")
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (its tests/)")
    parser.add_argument("--write", action="store_true", help="replace the table in --doc")
    args = parser.parse_args(argv)
    runs: dict[str, dict[str, str]] = {}
    for spec in args.run:
        name, sep, files = spec.partition("=")
        if not sep or not name or not files:
            parser.error(f"--run {spec!r}: give NAME=FILE[,FILE...]")
        try:
            runs[name] = outcomes([Path(f) for f in files.split(",")])
        except (OSError, ET.ParseError) as exc:
            parser.error(f"--run {spec!r}: {exc}")
    text = args.doc.read_text()
    table, missing = build(read_rows(text), runs, args.root)
    if missing:
        print(f"fault_catalogue: named in the table, defined by no test file: "
              f"{', '.join(dict.fromkeys(missing))}", file=sys.stderr)
    if args.write:
        lines = text.splitlines()
        first, end = table_span(lines)
        args.doc.write_text("\n".join(lines[:first] + table + lines[end:]) + "\n")
    else:
        print("\n".join(table))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
