"""The ``vitrim`` command. Each subcommand lives in its own module and registers itself here.

Errors in the user's arguments print one line ``vitrim: error: …`` and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> module with ``register(subparsers)``; the module's parser sets ``func(args) -> int``.
COMMANDS = {
    "bench": "vitrim.bench.cli",
    "demo": "vitrim.demo",
    "models": "vitrim.commands_models",
    "train": "vitrim.train.cli",
    "eval": "vitrim.train.eval_cli",
    "viz": "vitrim.viz.cli",
    "explain": "vitrim.viz.explain",
    "export": "vitrim.export_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitrim", description="Attention and Vision Transformers that trim tokens.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"vitrim: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
