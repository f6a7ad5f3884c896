"""``vitrim explain``: one attention matrix by hand, printed (and drawn with ``--out``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from vitrim.cli.common import SEED, check_output_file
from vitrim.extras import require
from vitrim.viz.explain import explain_numbers, format_explanation, plot_explanation
from vitrim.viz.maps import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

E = TypeVar("E")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("explain", help="walk through one attention matrix by hand, and why we divide by √d")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the toy embeddings and weights")
    parser.add_argument("--out", default=None, help="also draw every step into this PNG file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return show_explanation(args, explain_numbers, format_explanation, plot_explanation)


def show_explanation(
    args: argparse.Namespace, numbers: Callable[[int], E], describe: Callable[[E], str], plot: Callable[[E], Figure]
) -> int:
    """Print the walk-through of ``--seed``; with ``--out`` also draw it (the file checked before any work).

    Shared by ``vitrim explain`` and ``vitrim explain --cross`` (vitrim.cli.translate), which differ only in their
    ``numbers`` (seed -> explanation), ``describe`` (-> text) and ``plot`` (-> figure).
    """
    if args.out:
        check_output_file(args.out, "--out")
        require("matplotlib", feature="--out")
    ex = numbers(args.seed)
    print(describe(ex))
    if args.out:
        save_figure(plot(ex), args.out)
        print(f"\nwrote {args.out}")
    return 0
