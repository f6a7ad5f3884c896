"""The documentation cannot go stale: every ```python block of README.md and docs/ runs, every `vitrim` command in a
```bash block parses.

* Python: the blocks of one page run in order in one namespace (a later block may use an earlier block's names), in
  a fresh working folder where the files the page names exist as stand-ins (``docs_standins.py``). A block that
  cannot run is marked in the page with ``<!-- no-run: reason -->`` on the line before its fence; there may be at
  most ``MAX_NO_RUN`` of those in all. Reducers a page registers are unregistered after it.
* Shell: every ``vitrim`` call of a ```bash block is parsed by the real parser (``vitrim.cli.build_parser``), so a
  renamed flag or subcommand fails here; nothing is run.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import matplotlib
import pytest
from docs_standins import hub_standins_for, standins_for
from markdown_blocks import Block, code_blocks, vitrim_commands

import vitrim.reduce.registry
from vitrim.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_NO_RUN = 5
BLOCKS = {page: code_blocks(page) for page in PAGES}
PYTHON_PAGES = [page for page, blocks in BLOCKS.items() if any(b.lang == "python" and not b.no_run for b in blocks)]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.fixture(scope="session")
def standin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("docs_standins")


@contextlib.contextmanager
def _registry_restored() -> Iterator[None]:
    before = dict(vitrim.reduce.registry._REDUCERS)
    try:
        yield
    finally:
        vitrim.reduce.registry._REDUCERS.clear()
        vitrim.reduce.registry._REDUCERS.update(before)


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_name)
def test_python_blocks_run(page: Path, tmp_path: Path, standin_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    matplotlib.use("Agg")
    standins_for(page.read_text(encoding="utf-8"), standin_cache, tmp_path)
    if hub_standins_for(page.read_text(encoding="utf-8"), standin_cache / "hub"):
        monkeypatch.setenv("HF_HUB_CACHE", str(standin_cache / "hub"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the page reads the stand-in repos; nothing is downloaded
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    with _registry_restored():
        for block in BLOCKS[page]:
            if block.lang != "python" or block.no_run:
                continue
            try:
                exec(compile(block.code, block.where, "exec"), namespace)
            except Exception as err:
                raise AssertionError(f"the python block at {_name(page)}:{block.line} failed: {err!r}") from err


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
    assert [(b.lang, b.line, b.no_run) for b in blocks] == [
        ("python", 3, None),
        ("python", 9, "needs your camera"),
        ("bash", 14, None),
        ("", 19, None),
    ]
    assert blocks[1].code == "y = 2\n"
    assert vitrim_commands(blocks[2].code) == [["train", "--model", "m", "--epochs", "2"], ["eval", "ckpt"]]
