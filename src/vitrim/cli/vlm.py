"""``vitrim vlm flops``: the analytic prefill MACs of real vision-language models, with and without each method, for
one image or (``--video``) a clip."""

from __future__ import annotations

import argparse
import dataclasses
import json

from vitrim.cli.common import TEXT_TOKENS, check_output_file, parse_fractions, parse_ints
from vitrim.vlm import flops_video
from vitrim.vlm.flops import CONFIGS, PrefillCost, cost_table, counted_methods
from vitrim.vlm.method import method_class
from vitrim.vlm.method import methods as registered


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("vlm", help="vision-language models: the cost of token reduction")
    kinds = parser.add_subparsers(dest="vlm_kind", required=True, metavar="KIND")
    p = kinds.add_parser(
        "flops",
        help="analytic prefill GMACs of LLaVA-1.5-7B, Qwen2.5-VL-7B, Qwen3-VL-8B, Gemma-3-4B with and without each "
        "method, for one image or (--video) a clip",
        description="Prefill multiply-adds of one image and the text tokens, by part (tower, projector, LLM, the "
        "method's own products), counted analytically from the published configs (vitrim.vlm.flops).",
    )
    p.add_argument(
        "--models", default=None, help=f"comma-separated, of: {', '.join(CONFIGS)} (with --video: "
        f"{', '.join(flops_video.VIDEO_MODELS)}, the default then)",
    )  # fmt: skip
    p.add_argument("--keep", default=None, help="comma-separated image tokens kept per image (default 64,128,192)")
    counted = counted_methods()  # read from the registry now: a method registered before the parser is built counts
    p.add_argument(
        "--methods", default=None, help=f"comma-separated, of: {', '.join(counted)} (with --video also "
        f"{', '.join(flops_video.STACKS)}; default: every one that takes the input)",
    )  # fmt: skip
    p.add_argument(
        "--video", default=None, metavar="T[,T]",
        help="count a clip of T temporal patches (two frames each; LLaVA-OneVision: T frames) instead of one image, "
        "e.g. 16,64",
    )  # fmt: skip
    p.add_argument(
        "--size",
        default=None,
        help=f"with --video: the Qwen clips' side in pixels (default {flops_video.QWEN_VIDEO_SIZE}); LLaVA-OneVision "
        "resizes every frame to its 384 (another size is refused when --models names it)",
    )
    p.add_argument(
        "--share", default=None, help="with --video: comma-separated fractions of the video's tokens kept, "
        "given to each method in its own options (default 0.5,0.25,0.125)",
    )  # fmt: skip
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


def _refuse_uncounted(text: str | None) -> None:
    """A method registered but without a cost count is named as such, not as "unknown"."""
    counted = counted_methods()
    names = [] if text is None else [n.strip() for n in text.split(",")]
    uncounted = [n for n in names if n in registered() and n not in counted]
    if uncounted:
        raise ValueError(
            f"--methods: vlm method {uncounted[0]!r} has no cost count (its file defines no cost()); counted: "
            f"{', '.join(counted)}"
        )


def format_video_rows(rows: list[PrefillCost]) -> str:
    """A Markdown table of a clip: the share asked for, the method's options it gives, GMACs by part, the ratio to
    the unmodified clip, the video tokens entering the LLM and their mean over its layers."""
    base = rows[0].total
    lines = [
        "| method | share | options (keep: per temporal patch) | tower | projector | LLM | method's own | total | "
        "ratio | video tokens into LLM | layer-mean video tokens |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        given = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.options.items())
        if r.keep is not None:
            given = ", ".join(filter(None, [f"keep={r.keep}", given]))
        lines.append(
            f"| {r.method} | {'all' if r.share is None else f'{r.share:g}'} | {given} | {r.tower / 1e9:.0f} | "
            f"{r.projector / 1e9:.0f} | {r.llm / 1e9:.0f} | {r.method_own / 1e9:.2f} | {r.total / 1e9:.0f} | "
            f"{r.total / base:.3f} | {r.image_tokens_entering_llm} | {r.image_tokens_layer_mean:.0f} |"
        )
    return "\n".join(lines)


def run_video_flops(args: argparse.Namespace) -> int:
    """``--video``: every model of :data:`flops_video.VIDEO_MODELS` asked for, at every clip length and share."""
    if args.keep is not None:
        raise ValueError("--keep counts an image's tokens; with --video give --share (fractions of the video's)")
    lengths = parse_ints(args.video, "--video")
    size = None if args.size is None else parse_ints(args.size, "--size")[0]
    shares = parse_fractions("0.5,0.25,0.125" if args.share is None else args.share, "--share")
    models = _names(args.models or ",".join(flops_video.VIDEO_MODELS), "--models", list(flops_video.VIDEO_MODELS))
    _refuse_uncounted(args.methods)
    known = flops_video.video_methods()
    # default: each clip's own; a method vitrim refuses on a model is left out of its rows, saying why
    methods = None if args.methods is None else _names(args.methods, "--methods", (*known, *counted_methods()))
    configs = [flops_video.video_config(name) for name in models]
    # --size is the Qwen clips' side; LLaVA-OneVision resizes every frame to its own (refused only when it is named)
    fixed = args.models is None
    clips = [
        flops_video.clip(vlm, t, None if fixed and vlm.pooled_side is not None else size)
        for vlm in configs
        for t in lengths
    ]
    out = None if args.json is None else check_output_file(args.json, "--json")
    results = {}
    for video in clips:
        asked = flops_video.video_methods(video) if methods is None else methods
        refused = {name: why for name in asked if (why := flops_video.refused_on(video, name)) is not None}
        runs = [name for name in asked if name not in refused]
        rows = flops_video.video_cost_table(video, shares, text_tokens=args.text_tokens, methods=runs)
        results[video.name] = [dataclasses.asdict(r) | {"total": r.total} for r in rows]
        stamps = video.temporal_patches * video.text_per_temporal_patch
        print(
            f"{video.name}: {video.tower.patches} patches, {video.tokens_per_temporal_patch} video tokens per "
            f"{video.video_unit}, {video.image_tokens} in all + {args.text_tokens} text tokens"
            + (f" + {stamps} timestamp tokens" if stamps else "")
            + (f" + {video.text_per_video} newline token" if video.text_per_video else "")
            + f" into {video.llm.name}. GMACs (multiply-adds) of one prefill:"
        )
        print()
        print(format_video_rows(rows))
        for why in refused.values():
            print(f"left out: {why}")
        print()
    print(
        "share: the fraction of the video's tokens asked for, in each method's own options (evs, vidcom2: "
        "video_pruning_rate = 1 - share; temporal_downsample: stride = 1/share; fastvid, flashvid: retention_ratio; "
        "an image method: keep = share of each temporal patch's tokens). fastvid: at most its budget (an upper bound); "
        "flashvid: its budget, 1.25 x the share (a lower bound), then flashvid_llm keeps 0.3 of it from layer 20."
    )
    if out is not None:
        payload = {"text_tokens": args.text_tokens, "size": size, "shares": list(shares), "clips": results}
        out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def run_flops(args: argparse.Namespace) -> int:
    if args.video is not None:
        return run_video_flops(args)
    for option in ("size", "share"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option} describes a clip; give --video T too")
    models = _names(args.models or ",".join(CONFIGS), "--models", list(CONFIGS))
    counted = counted_methods()
    _refuse_uncounted(args.methods)
    videos = [n.strip() for n in (args.methods or "").split(",") if n.strip() in counted]
    videos = [n for n in videos if method_class(n).reads_time]
    if videos:
        raise ValueError(f"--methods: {videos[0]!r} reduces videos and refuses images; give --video T")
    image_methods = [n for n in counted if not method_class(n).reads_time]
    methods = _names(args.methods or ",".join(image_methods), "--methods", counted)
    keeps = _keeps(args.keep or "64,128,192")
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
