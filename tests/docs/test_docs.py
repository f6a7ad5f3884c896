"""The documentation cannot go stale: every ```python block of README.md and docs/ runs as a reader runs it and prints
what the page shows, every `vitrim` command in a ```bash block parses.

* Python: the blocks of one page run in order in one namespace (a later block may use an earlier block's names) in a
  fresh interpreter of the project's environment (``run_blocks.py``: no conftest, no stub, the blocks' own imports),
  in a fresh working folder where the files the page names exist as stand-ins (``docs_standins.py``). What a block
  prints must match the ```text block that follows it (doctest's rules: ``...`` stands for any text, runs of white
  space are one), and a block followed by none must print nothing. A block that cannot run is marked in the page with
  ``<!-- no-run: reason -->`` on the line before its fence; there may be at most ``MAX_NO_RUN`` of those in all.
* Shell: every ``vitrim`` call of a ```bash block is parsed by the real parser (``vitrim.cli.build_parser``), so a
  renamed flag or subcommand fails here; test_docs_commands.py runs every block not marked parse-only.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from doc_pages import BLOCKS, output_matches, page_name, reader_environment
from docs_standins import hub_standins_for, standins_for
from markdown_blocks import Block, code_blocks, printed_output, vitrim_commands
from run_blocks import END_OF_BLOCK

from vitrim.cli import build_parser

MAX_NO_RUN = 5
PYTHON_PAGES = [page for page, blocks in BLOCKS.items() if any(b.lang == "python" and not b.no_run for b in blocks)]
# Pages whose blocks take 5 s or more on 2 cores (measured 2026-12-02, fresh clones: 5.6-18 s each): run by
# `make test-full` (so by CI) and `make test-all`; the default suite runs the rest (getting-started.md, the first page
# a reader runs, and those under 5 s), and
# test_docs_commands.py parses every page's commands
HEAVY_PAGES = {
    "README.md",
    "docs/benchmarking.md",
    "docs/checkpoints.md",
    "docs/data.md",
    "docs/deployment.md",
    "docs/dynamicvit.md",
    "docs/models.md",
    "docs/optimize.md",
    "docs/reducers.md",
    "docs/training.md",
    "docs/translate.md",
    "docs/video.md",
    "docs/visualisation.md",
    "docs/vlm.md",
    "docs/vlm-cost.md",
    "docs/vlm-inside-the-llm.md",
    "docs/vlm-qwen.md",
}
_name = page_name


def _page_param(page: Path) -> object:
    marks = [pytest.mark.full] if _name(page) in HEAVY_PAGES else []
    return pytest.param(page, id=_name(page), marks=marks)


@pytest.mark.parametrize("page", [_page_param(page) for page in PYTHON_PAGES])
def test_python_blocks_run_and_print_what_the_page_shows(page: Path, tmp_path: Path, standin_cache: Path) -> None:
    text = page.read_text(encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    standins_for(text, standin_cache, work)
    env = reader_environment()
    if hub_standins_for(text, standin_cache / "hub"):
        env["HF_HUB_CACHE"] = str(standin_cache / "hub")  # the stand-in repos (HF_HUB_OFFLINE: nothing downloaded)
    blocks = BLOCKS[page]
    shown = printed_output(blocks, text.splitlines())
    runnable = [(k, b) for k, b in enumerate(blocks) if b.lang == "python" and not b.no_run]
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps([[f"{_name(page)}:{b.line}", b.code] for _, b in runnable]), encoding="utf-8")
    runner = Path(__file__).with_name("run_blocks.py")
    done = subprocess.run(
        [sys.executable, str(runner), str(listing)], cwd=work, env=env, capture_output=True, text=True, timeout=900
    )
    printed = done.stdout.split(END_OF_BLOCK + "\n")
    if done.returncode != 0:
        failed = runnable[len(printed) - 1][1]
        raise AssertionError(f"the python block at {_name(page)}:{failed.line} failed:\n{done.stderr[-4000:]}")
    for (k, block), output in zip(runnable, printed):
        where = f"{_name(page)}:{block.line}"
        if k not in shown:
            if output:
                raise AssertionError(
                    f"{where} prints this, which the page does not show (no ```text block after it):\n{output}"
                )
            continue
        want = shown[k].code
        if not output_matches(want, output):
            raise AssertionError(f"{where} prints\n{output}\nwhere the page shows (line {shown[k].line})\n{want}")


def _marked() -> list[Block]:
    return [b for blocks in BLOCKS.values() for b in blocks if b.no_run]


def test_few_blocks_are_marked_no_run() -> None:
    marked = _marked()
    listing = "\n".join(f"  {_name(b.path)}:{b.line}: {b.no_run}" for b in marked)
    assert len(marked) <= MAX_NO_RUN, f"{len(marked)} blocks are marked no-run (at most {MAX_NO_RUN}):\n{listing}"
    assert all(b.lang == "python" for b in marked), (
        f"only python blocks run; a marker elsewhere means nothing:\n{listing}"
    )


def test_bash_blocks_call_vitrim_as_its_parser_accepts() -> None:
    parser = build_parser()
    checked, failures = 0, []
    for page, blocks in BLOCKS.items():
        for block in (b for b in blocks if b.lang in ("bash", "sh", "shell", "console")):
            for args in vitrim_commands(block.code):
                checked += 1
                stderr = io.StringIO()
                try:
                    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                        parser.parse_args(args)
                except SystemExit:
                    failures.append(
                        f"{_name(page)}:{block.line}: vitrim {' '.join(args)}\n    {stderr.getvalue().strip()}"
                    )
    assert not failures, "commands the parser refuses:\n" + "\n".join(failures)
    assert checked >= 20, f"only {checked} vitrim commands found in the bash blocks: is the block parser broken?"


def test_block_parser_reads_fences_markers_and_commands(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- no-run: needs your camera -->\n\n```python\ny = 2\n```\n"
        "- a list item\n\n    ```bash\n    vitrim train --model m \\\n        --epochs 2  # two\n"
        "    torchrun --nproc-per-node 2 -m vitrim.cli eval ckpt && echo done\n    ```\n~~~\nplain\n~~~\n"
    )
    blocks = code_blocks(page)
    assert printed_output(blocks, page.read_text().splitlines()) == {}  # a bash block follows the python ones
    assert [(b.lang, b.line, b.no_run) for b in blocks] == [
        ("python", 3, None),
        ("python", 9, "needs your camera"),
        ("bash", 14, None),
        ("", 19, None),
    ]
    assert blocks[1].code == "y = 2\n"
    assert vitrim_commands(blocks[2].code) == [["train", "--model", "m", "--epochs", "2"], ["eval", "ckpt"]]


def test_the_text_block_right_after_a_python_block_is_what_it_prints(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(1)\n```\n\n```text\n1\n```\n\n```python\nprint(2)\n```\nSays:\n```text\n2\n```\n"
        "```python\nx = 3\n```\n```text\nnot after a python block's output\n```\n```text\nlone\n```\n"
    )
    blocks = code_blocks(page)
    shown = printed_output(blocks, page.read_text().splitlines())
    assert {k: (blocks[k].line, v.line, v.code) for k, v in shown.items()} == {
        0: (1, 5, "1\n"),  # blank lines between: its output
        4: (16, 19, "not after a python block's output\n"),  # right after the fence
    }  # "Says:" between: a text block of its own, not the output of print(2)
