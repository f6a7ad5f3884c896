"""``vitrim demo``: a ViT, DynamicViT and a CNN on the bundled digits, evaluated, timed and drawn in a report."""

from __future__ import annotations

import argparse
from pathlib import Path

from vitrim.cli.common import SEED, add_threads_argument, check_output_folder
from vitrim.demos.vision import FULL, NAMES, QUICK, run_demo, ship_run
from vitrim.extras import require


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="a ViT, DynamicViT and a CNN on bundled digits: accuracy, speed-up, kept tokens (no downloads)",
        description="Evaluate, time and draw the five models of the demo's recipe on the bundled digits (a ViT, "
        "DynamicViT with keep ratio 0.7 fine-tuned from it, both again with 4 registers, a small CNN), whose trained "
        "weights ship with vitrim; write report.md and summary.json. --retrain trains them from scratch first.",
    )
    p.add_argument("--out", default="runs/demo", help="run folder (its dense/, dynamicvit/, ... cnn/ are replaced)")
    p.add_argument(
        "--retrain",
        action="store_true",
        help="train the five models from scratch with the recipe that made the shipped weights (about 12 min on 2 "
        "cores; training runs on 2 threads whatever --threads says: the recipe's numbers depend on it)",
    )
    p.add_argument("--quick", action="store_true", help="train tiny models, one epoch each: checks the plumbing")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the split, placements and training (needs --retrain)")
    add_ship_to_argument(p, "models")
    p.add_argument("--quiet", action="store_true", help="no progress bars or per-epoch lines")
    add_threads_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    ship_to = check_ship_to(args)
    check_seed(args)
    require("matplotlib", "PIL", feature="the demo's pictures")  # before training, not after
    out = check_output_folder(args.out, "--out")
    shipped = not (args.retrain or args.quick)
    summary = run_demo(out, QUICK if args.quick else FULL, seed=args.seed, quiet=args.quiet, shipped=shipped)
    note = "  (shipped weights; --retrain trains them from scratch)" if shipped else ""
    print(f"report: {out / 'report.md'}{note}")
    for name in (n for n in NAMES if n in summary):
        row = summary[name]
        print(
            f"  {name:<14} top-1 {row['top1']:.4f}  {row['gflops']:.4f} GFLOPs  {row['images_per_s']:.0f} images/s"
            f"  ({row['speedup']:.2f}x dense)"
        )
    if ship_to is not None:
        ship_run(out, ship_to)
        print(f"shipped: {ship_to}")
    return 0


def add_ship_to_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--ship-to DIR`` of a demo (``vitrim demo``, ``vitrim demo translate``): where ``what`` it trained goes."""
    parser.add_argument(
        "--ship-to",
        default=None,
        metavar="DIR",
        help=f"after --retrain, copy the trained {what} there as the shipped weights (make demo-weights)",
    )


def check_ship_to(args: argparse.Namespace) -> Path | None:
    """``--ship-to``'s folder (None without it), checked before any work: it needs ``--retrain``."""
    if args.ship_to is None:
        return None
    if not args.retrain:
        raise ValueError(f"--ship-to {args.ship_to!r} needs --retrain: only a run that trained the recipe is shipped")
    return check_output_folder(args.ship_to, "--ship-to")


def check_seed(args: argparse.Namespace) -> None:
    """A ``--seed`` other than 0 needs ``--retrain`` or ``--quick``: the shipped weights were trained with seed 0."""
    if args.seed != 0 and not (args.retrain or args.quick):
        raise ValueError(f"--seed {args.seed} needs --retrain or --quick: the shipped weights were trained with seed 0")
