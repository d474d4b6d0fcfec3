"""The docs' whole programs: every ``python`` block of README.md and of the site's pages
(``docs/**/*.md``) that ends in ``asyncio.run(main())``. They are run on a device by
``tests/rxe/test_readme_examples.py`` and checked without one by ``tests/unit/test_docs.py``
(that every ``python`` block is such a program) and ``tests/unit/test_suite_rules.py``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class Block:
    """One ``python`` block: where it is (page relative to the root, line of its fence)."""

    page: str
    line: int
    source: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_program(self) -> bool:
        """A whole program: its last line runs ``main()``."""
        return self.source.rstrip().splitlines()[-1].startswith("asyncio.run(main())")


def blocks(pages: list[Path] = PAGES, root: Path = ROOT) -> list[Block]:
    """The ``python`` blocks of ``pages``, in order."""
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            found.append(Block(str(page.relative_to(root)), text.count("\n", 0, m.start()) + 1,
                               m.group(1)))
    return found


BLOCKS = blocks()
README_PROGRAMS = [b for b in BLOCKS if b.page == "README.md" and b.is_program]


def unique(found: list[Block]) -> list[Block]:
    """Each program once (a README example that is also a guide's), named by its first page."""
    first: dict[str, Block] = {}
    for b in found:
        first.setdefault(b.source, b)
    return list(first.values())


PROGRAMS = unique([b for b in BLOCKS if b.is_program])
