"""``vitrim demo video``: the digits video model (a Qwen2-VL trained on clips of a moving digit) and every video
method of vitrim.vlm measured on it (:mod:`vitrim.demos.video`). Registered after ``demo`` (vitrim.cli EXTENSIONS).
"""

from __future__ import annotations

import argparse

from vitrim.cli.common import SEED, add_threads_argument, check_output_folder
from vitrim.cli.demo import add_ship_to_argument, check_seed, check_ship_to
from vitrim.cli.vlm_demo import _modes, _registered
from vitrim.extras import require


def register(subparsers: argparse._SubParsersAction) -> None:
    p = _modes(_registered(subparsers, "demo"), "demo_mode", "MODE").add_parser(
        "video",
        help="a digits Qwen2-VL on clips: accuracy on questions about time against video tokens kept",
        description="Score the digits video model (transformers' Qwen2VLForConditionalGeneration at toy size, trained "
        "on clips of 8 frames in which a handwritten digit appears, moves and goes; its weights ship with vitrim) on "
        'held-out clips: "which digit appears ?", "when does it appear ?", "how many frames show it ?"; then every '
        "video method of vitrim.vlm and every image method per temporal patch at 50, 25 and 12.5 %% of the 64 video "
        "tokens. Writes summary.json, details.json, report.md and a plot. --retrain trains it from scratch first.",
    )
    p.add_argument("--out", default="runs/video", help="run folder (default: %(default)s)")
    p.add_argument("--retrain", action="store_true", help="train the model from scratch with the shipped one's recipe")
    p.add_argument("--quick", action="store_true", help="a tiny model, 3 steps, 4 clips: checks the plumbing")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the data and the training (needs --retrain)")
    p.add_argument("--methods", default=None, help="comma-separated methods of vitrim.vlm to sweep (default: all)")
    add_ship_to_argument(p, "model")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    add_threads_argument(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from vitrim.demos.video.demo import FULL, QUICK, run_video_demo, ship_run
    from vitrim.demos.video.sweep import check_methods

    ship_to = check_ship_to(args)
    check_seed(args)
    if args.quick and ship_to is not None:
        raise ValueError(f"--ship-to {args.ship_to!r} ships the FULL recipe; --quick trains a plumbing check")
    require("transformers", feature="the video demo")
    require("matplotlib", "PIL", feature="the video demo's plot")
    out = check_output_folder(args.out, "--out")
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    check_methods(methods)
    retrain = args.retrain or args.quick
    summary = run_video_demo(
        out, QUICK if args.quick else FULL, seed=args.seed, quiet=args.quiet, retrain=retrain, methods=methods
    )
    note = "" if retrain else "  (shipped weights; --retrain trains them from scratch)"
    print(f"report: {out / 'report.md'}{note}")
    print("  full model  " + "  ".join(f"{k} {v:.3f}" for k, v in summary["full"].items()))
    if ship_to is not None:
        ship_run(out, ship_to, methods, quiet=args.quiet)
        print(f"shipped: {ship_to}")
    return 0
