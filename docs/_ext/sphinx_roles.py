"""A griffe extension for the API reference (docs/reference.md, loaded by mkdocs.yml).

The package's docstrings cross-reference in reStructuredText roles (``:func:`save```), and
mkdocstrings renders docstrings as Markdown, where a role would show as its markup. Each role
becomes inline code as the objects are loaded, before any docstring is parsed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# :func:`save`, :class:`~ckptcache.Client`, :py:meth:`x` -> `save`, `Client`, `x`
_ROLE = re.compile(r":(?:py:)?[a-z]+:`~?(?:[^`<]*<)?([^`>]+)>?`")


def plain(text: str) -> str:
    """``text`` with every reST role made inline code (``~`` keeps the last part of the name)."""

    def one(m: re.Match[str]) -> str:
        name = m[1]
        if m[0].split("`", 1)[1].startswith("~"):
            name = name.rsplit(".", 1)[-1]
        return f"`{name}`"

    return _ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring as the objects are loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
