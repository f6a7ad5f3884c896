"""Every shell command of README.md and docs/ runs as written, in a fresh folder, unless its block is marked
``<!-- parse-only: reason -->`` (it needs the network, a GPU or ImageNet, or trains or times for minutes; its
``vitrim`` calls are still parsed by test_docs.py).

A block's lines run in order in one folder (a command may read what one before it wrote), each in bash, with the
project's environment first on PATH (``vitrim``, ``python``, and ``.venv/bin/...`` as the pages write them) and the
files the page names as stand-ins (docs_standins.py: the demo's runs, cat.jpg, ...). Each must exit 0; what a block
prints must match the ```text block that follows it, if there is one. The pages say how long a command takes; this
test does not time them. The default suite runs one page's (`vitrim vlm flops`, seconds), the rest run under ``full``
(together about two minutes of CPU; tests/vlm_demo/test_cli.py runs `vitrim vlm ask` and `vitrim viz vlm` by default).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from doc_pages import BLOCKS, output_matches, page_name, reader_environment
from docs_standins import standins_for
from markdown_blocks import Block, code_blocks, printed_output

SHELL_LANGS = ("bash", "sh", "shell", "console")
DEFAULT_PAGES = {"docs/vlm-cost.md"}  # the rest run under `full` (make test-all)
RUNNABLE = [
    (page, k, block)
    for page, blocks in BLOCKS.items()
    for k, block in enumerate(blocks)
    if block.lang in SHELL_LANGS and block.parse_only is None
]


def _param(page: Path, k: int, block: Block) -> object:
    marks = [] if page_name(page) in DEFAULT_PAGES else [pytest.mark.full]
    return pytest.param(page, k, block, id=f"{page_name(page)}:{block.line}", marks=marks)


def command_lines(code: str) -> list[str]:
    """The commands of a shell block: one per logical line (continuations joined), blank lines and comments out."""
    joined = code.replace("\\\n", " ").splitlines()
    return [line.strip() for line in joined if line.strip() and not line.strip().startswith("#")]


@pytest.mark.parametrize(("page", "index", "block"), [_param(*entry) for entry in RUNNABLE])
def test_shell_commands_run_as_written(
    page: Path, index: int, block: Block, tmp_path: Path, standin_cache: Path
) -> None:
    text = page.read_text(encoding="utf-8")
    standins_for(text, standin_cache, tmp_path)
    (tmp_path / ".venv").symlink_to(sys.prefix, target_is_directory=True)  # `.venv/bin/vitrim` as the pages write it
    env = reader_environment()
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    printed = []
    for line in command_lines(block.code):
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        where = f"{page_name(page)}:{block.line}: {line}"
        assert done.returncode == 0, f"{where}\nexited {done.returncode}:\n{done.stderr[-3000:]}"
        printed.append(done.stdout)
    shown = printed_output(BLOCKS[page], text.splitlines()).get(index)
    if shown is not None and not output_matches(shown.code, "".join(printed)):
        raise AssertionError(
            f"{page_name(page)}:{block.line} prints\n{''.join(printed)}\nwhere the page shows\n{shown.code}"
        )


def test_every_parse_only_block_is_a_shell_block_and_says_why() -> None:
    marked = [(page, b) for page, blocks in BLOCKS.items() for b in blocks if b.parse_only is not None]
    assert all(b.lang in SHELL_LANGS and len(b.parse_only or "") >= 10 for _, b in marked), [
        f"{page_name(p)}:{b.line}" for p, b in marked
    ]
    assert len(RUNNABLE) >= 8, f"only {len(RUNNABLE)} shell blocks run: is the parse-only marker overused?"


def test_command_lines_join_continuations_and_drop_comments() -> None:
    code = "# a comment\nvitrim a \\\n  --b 1   # trailing\n\ncat x.txt\n"
    assert command_lines(code) == ["vitrim a    --b 1   # trailing", "cat x.txt"]


def test_a_parse_only_marker_is_read_before_a_shell_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- parse-only: needs a GPU here -->\n\n```bash\nvitrim x\n```\n\n```bash\nvitrim y\n```\n")
    assert [b.parse_only for b in code_blocks(page)] == ["needs a GPU here", None]
