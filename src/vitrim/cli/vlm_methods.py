"""``vitrim vlm methods``: every method of vitrim.vlm with its stage, its options and their defaults.

Read from the library, nothing restated here: ``vitrim.vlm.methods(stage)`` and ``vitrim.vlm.method_info(name)``
(the stage, the method's own options under the authors' names with the paper defaults: None for a tower method's
option left to the reducer's own default), the class's ``default_keep()`` and ``default_layer`` (what ``keep=`` and
``layer=`` are when not given) and the first paragraph of its docstring, which says what they mean for it.
Registered as an extension of the ``vlm`` command (``vitrim.cli.EXTENSIONS``).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import textwrap
from dataclasses import asdict, dataclass
from typing import Any

from vitrim.cli.common import check_output_file

STAGE_TITLES = {
    "pre_llm": "before the LLM (keep= image tokens per image enter it: a count, or a fraction of them)",
    "in_llm": "inside the LLM (keep= image tokens per image stay from decoder layer layer= on)",
    "tower": "inside the vision tower (a vitrim reducer: an option shown without a value takes its default; keep= "
    "image tokens per image leave the tower)",
}


@dataclass(frozen=True)
class MethodListing:
    """One row of ``vitrim vlm methods``: ``options`` maps each of the method's own options to its default (None:
    the reducer's own, for a tower method); ``default_keep`` / ``default_layer``: what ``keep=`` / ``layer=`` are when
    not given (None: needed, refused or not taken; the summary says which)."""

    name: str
    stage: str
    options: dict[str, Any]
    default_keep: float | int | None
    default_layer: int | None
    summary: str

    def shown_options(self) -> list[str]:
        """``name=default`` per option, a bare name for one without a default of its own, then keep= and layer=."""
        shown = [k if v is None else f"{k}={v!r}" for k, v in self.options.items()]
        if self.default_layer is not None:
            shown.append(f"layer={self.default_layer} when not given")
        if self.default_keep is not None:
            shown.append(f"keep={self.default_keep:.3g} when not given")
        return shown


def method_listings(stage: str | None = None) -> list[MethodListing]:
    """Every method of vitrim.vlm (of ``stage`` when given), grouped by stage in the library's stage order."""
    from vitrim import vlm
    from vitrim.vlm.method import STAGES, method_class

    if stage is not None and stage not in STAGES:
        raise ValueError(f"--stage must be one of {', '.join(STAGES)}; got {stage!r}")
    rows = []
    for name in vlm.methods(stage):
        info, cls = vlm.method_info(name), method_class(name)
        paragraph = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
        summary = " ".join(paragraph.replace("``", "").split())  # the docstring's literals, as a terminal shows them
        layer = getattr(cls, "default_layer", None)
        rows.append(MethodListing(name, info.stage, dict(info.defaults), _default_keep(cls), layer, summary))
    return sorted(rows, key=lambda row: (STAGES.index(row.stage), row.name))


def _default_keep(cls: Any) -> float | int | None:
    """``keep=`` of the method with its own defaults when not given; None where it has none, or where the method
    cannot be built with its defaults (it refuses itself at apply, saying why; its summary says what it needs)."""
    try:
        return cls().default_keep()
    except (ValueError, TypeError):
        return None


def format_listings(infos: list[MethodListing]) -> str:
    """The listing: a title per stage, then per method its options with their defaults and its summary."""
    blocks = []
    for stage, members in itertools.groupby(infos, key=lambda info: info.stage):
        lines = [f"{stage}: {STAGE_TITLES.get(stage, stage)}"]
        for info in members:
            shown = info.shown_options()
            lines.append(f"  {info.name:<13} {', '.join(shown) if shown else 'no options of its own'}")
            if stage != "tower":  # a tower method's docstring is the same for all of them: the stage title says it
                lines += textwrap.wrap(info.summary, 104, initial_indent=" " * 16, subsequent_indent=" " * 16)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def register(subparsers: argparse._SubParsersAction) -> None:
    from vitrim.cli.vlm_demo import vlm_commands

    p = vlm_commands(subparsers).add_parser(
        "methods",
        help="every method of vitrim.vlm: its stage, its options and their defaults",
        description="List the methods of vitrim.vlm.apply(model, METHOD, ...) by stage (before the LLM, inside it, "
        "inside the vision tower), each with its own options and their defaults, read from the method registry.",
    )
    p.add_argument("--stage", default=None, help="only this stage: pre_llm, in_llm or tower")
    p.add_argument("--json", default=None, help="also write the list to this file")
    p.set_defaults(func=_run_methods)


def _run_methods(args: argparse.Namespace) -> int:
    out = None if args.json is None else check_output_file(args.json, "--json")
    infos = method_listings(args.stage)
    print(format_listings(infos))
    if out is not None:
        out.write_text(json.dumps([asdict(info) for info in infos], indent=2, default=repr) + "\n")
    return 0
