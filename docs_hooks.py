"""MkDocs hook (mkdocs.yml ``hooks``): the house's docstrings cite other objects with Sphinx roles, ``:func:`apply```,
which Markdown renders as ``:func:<code>apply</code>``; the API pages show the name as code, without the role (and
``:class:`~vitrim.reduce.base.Reducer``` as ``Reducer``, as Sphinx would)."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):<code>(?:~[\w.]*\.)?")  # ~a.b.C shows as C


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub("<code>", html)
