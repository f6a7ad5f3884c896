"""``vitrim vlm methods``: every method of vitrim.vlm with its stage, its options and their defaults.

Read from the method registry, nothing restated here: each method class's ``stage``, its ``defaults`` (its own
options, under the authors' names, with the paper defaults; a tower method's unset ones take the reducer's own
default), ``default_keep()`` (the ``keep=`` it uses when none is given) and the first paragraph of its docstring,
which says what ``keep=`` and ``layer=`` mean for it. Registered as an extension of the ``vlm`` command
(``vitrim.cli.EXTENSIONS``).
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


REDUCER_DEFAULT = "(the reducer's default)"  # the value listed for a tower method's option left to its reducer


@dataclass(frozen=True)
class MethodInfo:
    """One row of ``vitrim vlm methods``: ``options`` maps each of the method's own options to its default, or to
    ``REDUCER_DEFAULT``; ``default_keep`` is None when keep= is needed or refused (the summary says which)."""

    name: str
    stage: str
    options: dict[str, Any]
    default_keep: float | int | None
    summary: str

    def shown_options(self) -> list[str]:
        """``name=default`` per option, a bare name for one left to the reducer's default."""
        return [k if v == REDUCER_DEFAULT else f"{k}={v!r}" for k, v in self.options.items()]


def method_infos(stage: str | None = None) -> list[MethodInfo]:
    """Every registered method (of ``stage`` when given), grouped by stage in the registry's stage order."""
    from vitrim import vlm  # noqa: F401  (registers every method)
    from vitrim.vlm.registry import STAGES, method_class, methods

    if stage is not None and stage not in STAGES:
        raise ValueError(f"--stage must be one of {', '.join(STAGES)}; got {stage!r}")
    infos = []
    for name in methods():
        cls = method_class(name)
        if stage is not None and cls.stage != stage:
            continue
        options = {k: REDUCER_DEFAULT if v is inspect.Parameter.empty else v for k, v in cls.defaults.items()}
        doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
        summary = " ".join(doc.replace("``", "").split())  # the docstring's literals, as a terminal shows them
        infos.append(MethodInfo(name, cls.stage, options, cls().default_keep(), summary))
    return sorted(infos, key=lambda info: (STAGES.index(info.stage), info.name))


def format_infos(infos: list[MethodInfo]) -> str:
    """The listing: a title per stage, then per method its options with their defaults and its summary."""
    blocks = []
    for stage, members in itertools.groupby(infos, key=lambda info: info.stage):
        lines = [f"{stage}: {STAGE_TITLES.get(stage, stage)}"]
        for info in members:
            shown = info.shown_options()
            if info.default_keep is not None:
                shown.append(f"keep={info.default_keep:.3g} when not given")
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
    infos = method_infos(args.stage)
    print(format_infos(infos))
    if out is not None:
        out.write_text(json.dumps([asdict(info) for info in infos], indent=2, default=repr) + "\n")
    return 0
