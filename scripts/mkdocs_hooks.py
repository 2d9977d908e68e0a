"""MkDocs hook (mkdocs.yml ``hooks:``): docstrings cross-reference with Sphinx roles (``:class:`X```), which
Markdown renders as the role name followed by code; keep the code and drop the role name."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Remove ``:class:`` and the like in front of inline code."""
    return _ROLE.sub("", html)
