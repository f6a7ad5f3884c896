"""``vitrim models [PATTERN]``: list the registered model names, one per line (shell-style pattern, e.g. 'deit_*')."""

from __future__ import annotations

import argparse

from vitrim.models import list_models


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="list registered models (names for create_model)")
    parser.add_argument("pattern", nargs="?", default="*", help="shell-style pattern, e.g. 'deit_*' (default: all)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    names = list_models(args.pattern)
    if not names:
        raise ValueError(f"no registered model matches {args.pattern!r}; run `vitrim models` to see them all")
    print("\n".join(names))
    return 0
