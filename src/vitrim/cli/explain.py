"""``vitrim explain``: one attention matrix by hand, printed (and drawn with ``--out``)."""

from __future__ import annotations

import argparse

from vitrim.cli.common import check_output_file
from vitrim.extras import require
from vitrim.viz.explain import explain_numbers, format_explanation, plot_explanation
from vitrim.viz.maps import save_figure


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("explain", help="walk through one attention matrix by hand, and why we divide by √d")
    parser.add_argument("--seed", type=int, default=0, help="seed of the toy embeddings and weights")
    parser.add_argument("--out", default=None, help="also draw every step into this PNG file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out:
        check_output_file(args.out, "--out")
        require("matplotlib", feature="--out")
    ex = explain_numbers(args.seed)
    print(format_explanation(ex))
    if args.out:
        save_figure(plot_explanation(ex), args.out)
        print(f"\nwrote {args.out}")
    return 0
