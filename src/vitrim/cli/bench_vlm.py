"""``vitrim bench vlm``: prefill time of a scaled-down LLaVA-1.5-7B with each pre-LLM method, against the
unmodified model in the same run (:mod:`vitrim.bench.vlm`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from vitrim.bench.allocator import pin_malloc_threshold
from vitrim.bench.vlm_video import SIZES as VIDEO_SIZES
from vitrim.cli.common import (
    TEXT_TOKENS,
    TIMED,
    UNTIMED,
    Bounded,
    add_threads_argument,
    check_output_file,
    parse_fractions,
    parse_ints,
    parse_set,
)

SET_FORM = "KEY=VALUE[,KEY=VALUE]"
VIDEO_LENGTH = Bounded(int, 1, 4096, "temporal patches of the clip")
SIZES = ("vision_layers", "llm_layers", "vocab", "vision_width", "vision_mlp", "vision_heads", "image_size",
         "patch_size", "llm_width", "llm_mlp", "llm_heads")  # fmt: skip


def register_vlm(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "vlm",
        help="prefill time of a scaled-down LLaVA-1.5-7B with each pre-LLM method, against the unmodified model",
        description="Every layer has LLaVA-1.5-7B's shapes, there are fewer of them (--set vision_layers=2,"
        "llm_layers=1 by default); cases are timed in turns (median over rounds), the tower and the method's own "
        "calls apart, and compared with the MAC ratio of vitrim.vlm.flops for the same shapes.",
    )
    p.add_argument(
        "--methods", default="", help="comma-separated vlm methods (default: every pre-LLM method, hiprune and flowcut)"
    )
    p.add_argument("--keep", default=None, help="comma-separated image tokens kept per image (default 64,128,192)")
    p.add_argument(
        "--video", default=None, type=VIDEO_LENGTH, metavar="T",
        help="time a scaled-down Qwen2.5-VL-7B given a clip of T temporal patches instead (vitrim.bench.vlm_video)",
    )  # fmt: skip
    p.add_argument(
        "--share", default=None, help="with --video: comma-separated fractions of the video's tokens kept (default "
        "0.25), given to each method in its own options",
    )  # fmt: skip
    p.add_argument("--text-tokens", type=TEXT_TOKENS, default=94, help="text tokens of the prompt")
    p.add_argument("--repeats", type=TIMED, default=3, help="timed rounds (every case once per round)")
    p.add_argument("--warmup", type=UNTIMED, default=1, help="untimed prefills per case")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        metavar=SET_FORM,
        help=f"model sizes, of: {', '.join(SIZES)} (e.g. vision_layers=4,llm_layers=2); with --video: "
        f"{', '.join(VIDEO_SIZES)}",
    )
    add_threads_argument(p)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.set_defaults(func=run_vlm)


def run_video(args: argparse.Namespace) -> int:
    """``--video T``: the scaled Qwen2.5-VL-7B on a clip (vitrim.bench.vlm_video)."""
    from vitrim.bench import vlm_video

    if args.keep is not None:
        raise ValueError("--keep counts an image's tokens; with --video give --share (fractions of the video's)")
    overrides = parse_set(args.overrides, "--set", SET_FORM)
    unknown = sorted(set(overrides) - set(VIDEO_SIZES))
    if unknown:
        raise ValueError(
            f"--set {unknown[0]!r} is not a size of the video bench; expected some of: {', '.join(VIDEO_SIZES)}"
        )
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    settings = vlm_video.VideoBenchSettings(
        **overrides,
        temporal_patches=args.video,
        text_tokens=args.text_tokens,
        shares=parse_fractions(args.share or "0.25", "--share"),
        methods=methods,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    vlm_video.bench_methods(settings)  # a method that takes no video fails before the model is built
    shapes = (
        f"Qwen2.5-VL-7B shapes, {settings.vision_layers} tower blocks, {settings.llm_layers} LLM layers, "
        f"{settings.temporal_patches} temporal patches of {settings.size}x{settings.size} px = "
        f"{settings.video_tokens} video + {settings.text_tokens} text tokens"
    )
    return _time_and_report(args, settings, vlm_video.run_bench, vlm_video.markdown, "vlm prefill of a video", shapes)


def _time_and_report(
    args: argparse.Namespace,
    settings: Any,
    run: Callable[..., dict[str, Any]],
    markdown: Callable[[list[dict[str, Any]]], str],
    what: str,
    shapes: str,
) -> int:
    """Run the bench of ``settings``, print its header and table, and write ``--json`` (settings and rows)."""
    out = None if args.json is None else check_output_file(args.json, "--json")
    pin_malloc_threshold()
    results = run(settings, log=lambda line: print(line, file=sys.stderr))
    print(
        f"{what}, float32, batch 1, {torch.get_num_threads()} threads, torch {torch.__version__}: {shapes}; median of "
        f"{settings.repeats} rounds"
    )
    print()
    print(markdown(results["rows"]), end="")
    if out is not None:
        out.write_text(json.dumps({"settings": dataclasses.asdict(settings), **results}, indent=2) + "\n")
    return 0


def run_vlm(args: argparse.Namespace) -> int:
    from vitrim.bench import vlm

    if args.video is not None:
        return run_video(args)
    if args.share is not None:
        raise ValueError("--share describes a clip; give --video T too")
    overrides = parse_set(args.overrides, "--set", SET_FORM)
    unknown = sorted(set(overrides) - set(SIZES))
    if unknown:
        raise ValueError(f"--set {unknown[0]!r} is not a model size; expected some of: {', '.join(SIZES)}")
    keeps = parse_ints(args.keep or "64,128,192", "--keep")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    settings = vlm.VLMBenchSettings(
        **overrides,
        text_tokens=args.text_tokens,
        keeps=keeps,
        methods=methods,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    vlm.bench_methods(settings)  # an unknown method fails before the model is built
    shapes = (
        f"LLaVA-1.5-7B shapes, {settings.vision_layers} tower blocks, {settings.llm_layers} LLM layers, "
        f"{(settings.image_size // settings.patch_size) ** 2} image + {settings.text_tokens} text tokens"
    )
    return _time_and_report(args, settings, vlm.run_bench, vlm.markdown, "vlm prefill", shapes)
