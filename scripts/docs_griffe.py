"""A griffe extension for the API reference (mkdocs.yml names it).

The docstrings write cross-references as Sphinx roles (``:class:`Endpoint```,
``:meth:`~aiordma.Endpoint.send```) and a few examples under ``.. code-block:: python``, which
Markdown would show as written. This turns each role into inline code (the last part of a
``~`` path, as Sphinx shows it) and drops the directive's line, so the indented block after it
is a Markdown code block. The sources are not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|exc|data|obj|const):`(~?)([^`]+)`")
DIRECTIVE = re.compile(r"^[ \t]*\.\. code-block::[ \t]*\w*[ \t]*\n", re.MULTILINE)


def plain(text: str) -> str:
    """``text`` with Sphinx roles as inline code and code-block directives dropped."""
    def role(m: re.Match[str]) -> str:
        target = m.group(2)
        return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"

    return DIRECTIVE.sub("", ROLE.sub(role, text))


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
