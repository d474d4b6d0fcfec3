"""The docs' own rules, without a device: the README stays short and names the two commands,
every ``python`` block of the README and of the site's pages is a whole program (so the device
test that runs them, ``tests/rxe/test_readme_examples.py``, runs every one: a page cannot show
a snippet that no test runs), and the API reference documents only the public modules, by
their public names. ``make docs`` checks the rest (links, anchors, the navigation, the
docstrings) by building the site strictly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ..readme_programs import BLOCKS, PROGRAMS, README_PROGRAMS, ROOT, Block, blocks, unique

PUBLIC = {"aiordma", "aiordma.rpc", "aiordma.lowlevel", "aiordma.transport", "aiordma.testing",
          "aiordma.services.kv", "aiordma.services.collectives", "aiordma.services.echo",
          "aiordma.rpc.metrics", "aiordma.rpc.tracing"}


def test_the_readme_is_short_and_names_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert "make demo\nmake test\n" in text  # .ci/run runs `make test`, as the README says


def test_the_readme_has_an_example_per_capability() -> None:
    sources = "\n".join(b.source for b in README_PROGRAMS)
    for capability in ("aiordma.listen", "ep.write", "ep.fetch_add", "serve(", "client.stream",
                       "interceptors=", "connect_pool", "kv.connect", "Group.from_env"):
        assert capability in sources, capability


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_every_python_block_is_a_program_the_device_tests_run(block: Block) -> None:
    assert block.is_program, (
        f"{block.where}: a python block that is not a whole program (ending in "
        "asyncio.run(main())) would run in no test; fence a fragment as text")
    assert block.source in {p.source for p in PROGRAMS}


def test_the_collector_finds_programs_and_fragments(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nimport asyncio\n\nasync def main():\n    pass\n\n"
                    "asyncio.run(main())  # or uvloop.run(main())\n```\n\n```python\nx = 1\n```\n"
                    "\n```sh\nmake test\n```\n")
    found = blocks([page], root=tmp_path)
    assert [(b.where, b.is_program) for b in found] == [("page.md:3", True), ("page.md:12", False)]
    assert len(unique(found + found)) == 2


def test_the_api_reference_names_only_public_modules() -> None:
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented.update(re.findall(r"^::: ([\w.]+)", page.read_text(), re.MULTILINE))
    assert documented == PUBLIC


def test_contributing_is_in_the_site() -> None:
    assert (ROOT / "docs" / "contributing.md").read_text().strip() == '--8<-- "CONTRIBUTING.md"'
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert "72 characters" in text and "tests/unit" in text and "--hosts 2" in text
    assert "aiordma bench" in text


def test_the_readme_links_to_pages_that_exist() -> None:
    """The README is read on its own (a repository's front page, PyPI), outside the site that
    ``make docs`` checks: its relative links must name files of the repository."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text) if "://" not in t]
    assert len(links) > 10
    assert [t for t in links if not (ROOT / t).is_file()] == []
