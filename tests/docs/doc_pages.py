"""What both documentation tests read: the pages, their blocks, the environment a reader runs them in, and how a
block's output is compared with the ```text block that shows it."""

from __future__ import annotations

import doctest
import os
from pathlib import Path

from markdown_blocks import code_blocks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = {page: code_blocks(page) for page in PAGES}
DOCTEST_RULES = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE  # "..." stands for any text; runs of space are one


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def reader_environment() -> dict[str, str]:
    """The environment a reader's shell has, plus: this checkout's sources first (the environment's editable install
    may point at another checkout), no window for matplotlib, one thread per process (the suite runs in parallel),
    nothing downloaded from the Hugging Face hub."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def output_matches(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what the page's text block ``shown`` says (doctest's rules, :data:`DOCTEST_RULES`)."""
    return doctest.OutputChecker().check_output(shown, printed, DOCTEST_RULES)
