"""``vitrim vlm flops``: the analytic prefill MACs of real vision-language models, with and without each method."""

from __future__ import annotations

import argparse
import dataclasses
import json

from vitrim.cli.common import TEXT_TOKENS, check_output_file, parse_ints
from vitrim.vlm.flops import CONFIGS, PrefillCost, cost_table, counted_methods
from vitrim.vlm.method import methods as registered


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("vlm", help="vision-language models: the cost of token reduction")
    kinds = parser.add_subparsers(dest="vlm_kind", required=True, metavar="KIND")
    p = kinds.add_parser(
        "flops",
        help="analytic prefill GMACs of LLaVA-1.5-7B, Qwen2.5-VL-7B, Gemma-3-4B with and without each method",
        description="Prefill multiply-adds of one image and the text tokens, by part (tower, projector, LLM, the "
        "method's own products), counted analytically from the published configs (vitrim.vlm.flops).",
    )
    p.add_argument("--models", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--keep", default="64,128,192", help="comma-separated image tokens kept per image")
    counted = counted_methods()  # read from the registry now: a method registered before the parser is built counts
    p.add_argument("--methods", default=",".join(counted), help=f"comma-separated, of: {', '.join(counted)}")
    p.add_argument(
        "--text-tokens", type=TEXT_TOKENS, default=94, help="text tokens of the prompt (94: a 670-token LLaVA one)"
    )
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.set_defaults(func=run_flops)


def _names(text: str, option: str, known: tuple[str, ...] | list[str]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"{option} must name some of: {', '.join(known)}; got {text!r}")
    return names


def _keeps(text: str) -> tuple[int, ...]:
    values = parse_ints(text, "--keep")
    if min(values) <= 0:
        raise ValueError(f"--keep must be positive token counts, got {text!r}")
    return values


def format_rows(rows: list[PrefillCost]) -> str:
    """A Markdown table: GMACs by part, the ratio to the first (unmodified) row, image tokens entering, averaged."""
    base = rows[0].total
    lines = [
        "| method | keep | tower | projector | LLM | method's own | total | ratio | image tokens into LLM | "
        "layer-mean image tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {'all' if r.keep is None else r.keep} | {r.tower / 1e9:.1f} | {r.projector / 1e9:.1f} | "
            f"{r.llm / 1e9:.1f} | {r.method_own / 1e9:.2f} | {r.total / 1e9:.1f} | {r.total / base:.3f} | "
            f"{r.image_tokens_entering_llm} | {r.image_tokens_layer_mean:.1f} |"
        )
    return "\n".join(lines)


def run_flops(args: argparse.Namespace) -> int:
    models = _names(args.models, "--models", list(CONFIGS))
    counted = counted_methods()
    uncounted = [n for n in (n.strip() for n in args.methods.split(",")) if n in registered() and n not in counted]
    if uncounted:  # registered, but its file gives no cost: say that, not "unknown"
        raise ValueError(
            f"--methods: vlm method {uncounted[0]!r} has no cost count (its file defines no cost()); counted: "
            f"{', '.join(counted)}"
        )
    methods = _names(args.methods, "--methods", counted)
    keeps = _keeps(args.keep)
    out = None if args.json is None else check_output_file(args.json, "--json")
    results = {}
    for name in models:
        vlm = CONFIGS[name]
        rows = cost_table(vlm, keeps, text_tokens=args.text_tokens, methods=methods)
        results[name] = [dataclasses.asdict(r) | {"total": r.total} for r in rows]
        note = f"; {vlm.note}" if vlm.note else ""
        print(
            f"{name}: {vlm.tower.name} ({vlm.tower.patches} patches), {vlm.image_tokens} image tokens + "
            f"{args.text_tokens} text tokens into {vlm.llm.name}{note}. GMACs (multiply-adds) of one prefill:"
        )
        print()
        print(format_rows(rows))
        print()
    print(
        "tower: patch embedding + blocks; projector: on the tokens it runs on; LLM: layers + LM head on the last "
        "position; method's own: its scores and similarities. fastv/dart keep from layer 2, pdrop keep/keep÷2/keep÷4 "
        "from layers 8/16/24, tome: ToMe in the tower, keep= spread over its blocks as vitrim.vlm runs it; hiprune: "
        "the tower runs whole, keep tokens from the feature block's MLP on; flowcut: counted as if only its last cut "
        "(before the feature block) pruned, an upper bound."
    )
    if out is not None:
        out.write_text(json.dumps({"text_tokens": args.text_tokens, "models": results}, indent=2) + "\n")
    return 0
