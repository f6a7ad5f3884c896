"""``vitrim demo``: train a ViT, DynamicViT and a CNN on the bundled digits and write a report."""

from __future__ import annotations

import argparse
from pathlib import Path

from vitrim.cli.common import add_threads_argument, check_output_folder
from vitrim.demo import FULL, NAMES, QUICK, run_demo
from vitrim.extras import require


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a ViT, DynamicViT and a CNN on bundled digits; write a report (no downloads)",
        description="Train a small ViT on the bundled digits, fine-tune DynamicViT (keep ratio 0.7) from it, train "
        "a small CNN, then evaluate and benchmark all three and write report.md and summary.json.",
    )
    p.add_argument("--out", default="runs/demo", help="run folder (its dense/, dynamicvit/, cnn/ are replaced)")
    p.add_argument("--quick", action="store_true", help="tiny models, one epoch each: checks the plumbing (<1 min)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars or per-epoch lines")
    add_threads_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require("matplotlib", "PIL", feature="the demo's pictures")  # before training, not after
    summary = run_demo(
        check_output_folder(args.out, "--out"), QUICK if args.quick else FULL, seed=args.seed, quiet=args.quiet
    )
    print(f"report: {Path(args.out) / 'report.md'}")
    for name in (n for n in NAMES if n in summary):
        row = summary[name]
        print(
            f"  {name:<10} top-1 {row['top1']:.4f}  {row['gflops']:.4f} GFLOPs  {row['images_per_s']:.0f} images/s"
            f"  ({row['speedup']:.2f}x dense)"
        )
    return 0
