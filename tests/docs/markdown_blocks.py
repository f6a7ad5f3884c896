"""The fenced code blocks of a Markdown page, with the ``<!-- no-run: reason -->`` marker that may precede one.

A fence is three or more backticks or tildes, possibly indented (inside a list item); it closes on the same
characters at least as long. The block's text is dedented by the fence's indentation. A marker counts when it is
the last non-blank line before the fence.

A shell block's commands run in the documentation tests unless the block is marked ``<!-- parse-only: reason -->``
(they cannot run offline, or take minutes). What a ```python or ```bash block prints is the ```text block that
follows it with nothing but blank lines between (:func:`printed_output`); ``...`` there stands for any text, as in a
doctest.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>.+?)\s*-->\s*$")
PARSE_ONLY = re.compile(r"^\s*<!--\s*parse-only:\s*(?P<reason>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word, lower case ("" when none)
    code: str
    no_run: str | None  # the reason given by a no-run marker, or None
    end: int = 0  # 1-based line of the closing fence (the page's last line + 1 when it never closes)
    parse_only: str | None = None  # a shell block's <!-- parse-only: reason --> marker: its commands are not run

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of the page at ``path``, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), len(lines))
        body = [line[indent:] if line[:indent].strip() == "" else line.lstrip() for line in lines[i + 1 : end]]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NO_RUN.match(before)
        parse_only = PARSE_ONLY.match(before)
        blocks.append(
            Block(
                path,
                i + 1,
                opening["info"].lower(),
                "\n".join(body) + "\n",
                marker["reason"] if marker else None,
                end + 1,
                parse_only["reason"] if parse_only else None,
            )
        )
        i = end + 1
    return blocks


SHELL_OPERATORS = {"&&", "||", "|", ";", ">", ">>", "2>", "2>&1", "&"}


def vitrim_commands(code: str) -> list[list[str]]:
    """The argument lists of every ``vitrim`` call in a shell block: ``vitrim ...``, ``.venv/bin/vitrim ...``,
    ``python -m vitrim.cli ...`` (also after ``torchrun``, ``/usr/bin/time -v`` and the like), up to the first shell
    operator; comments and line continuations are understood as the shell does."""
    import shlex

    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for k, word in enumerate(words):
            as_module = word == "vitrim.cli" and k > 0 and words[k - 1] == "-m"  # python -m vitrim.cli, torchrun -m
            if not (word == "vitrim" or word.endswith("/vitrim") or as_module):
                continue
            if k > 0 and words[k - 1].startswith("--"):  # an option's value (lmms-eval --model vitrim), no call
                continue
            args = words[k + 1 :]
            stop = next((j for j, w in enumerate(args) if w in SHELL_OPERATORS), len(args))
            commands.append(args[:stop])
            break
    return commands


def printed_output(blocks: list[Block], page_lines: list[str]) -> dict[int, Block]:
    """``{index of a python or bash block: the text block that shows what it prints}`` (module doc)."""
    shown = {}
    for k, (block, after) in enumerate(itertools.pairwise(blocks)):
        between = page_lines[block.end : after.line - 1]  # the lines after the closing fence, before the next opening
        if block.lang in ("python", "bash") and after.lang == "text" and not any(line.strip() for line in between):
            shown[k] = after
    return shown
