"""``vitrim bench attention|models``."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark attention backends or models")
    kinds = parser.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    from vitrim.bench import attention, models

    attention.register(kinds)
    models.register(kinds)
