"""What several commands share: ``--threads``, the ``--set key=value`` grammar, the data options."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from vitrim.literals import parse_assignments


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``; :func:`vitrim.cli.main` applies it once, before the command runs."""
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch (default: torch's choice). On a machine shared with other jobs, 1 can be many "
        "times faster than 2: threads that wait for each other lose their cores",
    )


def apply_threads(threads: int) -> None:
    """Apply ``--threads`` (0 keeps torch's default)."""
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"--threads must be an int >= 0, got {threads!r}")
    if threads:
        torch.set_num_threads(threads)


def check_counts(args: argparse.Namespace, names: tuple[str, ...], *, minimum: int, expected: str) -> None:
    """Each option in ``names`` (dests, e.g. ``"batch_size"``) must be >= ``minimum``; the error names the flag.

    ``expected`` words the rule as the message says it: ``--batch-size must be a positive int, got 0``.
    """
    for name in names:
        value = getattr(args, name)
        if value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be {expected}, got {value}")


def parse_set(items: list[str] | None, option: str, form: str) -> dict[str, Any]:
    """Repeated ``--set depth=4 --set embed_dim=32,num_heads=2`` -> one dict (later values win).

    ``form`` is the option's metavar: an error shows the form ``--help`` shows (``vitrim.literals`` reads the text).
    """
    values: dict[str, Any] = {}
    for text in items or []:
        values.update(parse_assignments(text, option, form))
    return values


def parse_ints(text: str, option: str) -> tuple[int, ...]:
    """``"64,128"`` -> ``(64, 128)``; ``ValueError`` naming ``option`` when a part is not an int."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{option} must be comma-separated ints, got {text!r}") from None


def add_data_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """``--data``, ``--val-data``, ``--workers`` and the digits options.

    ``defaults`` (e.g. a TrainConfig's) fill them; None leaves them unset.
    """
    d = defaults or {}
    parser.add_argument(
        "--data",
        default=d.get("data"),
        help="'digits' (bundled), an image folder (train/ and val/ of class folders, or class folders) or WebDataset "
        "shards ('shards/train-{000000..000099}.tar', optionally '|N' samples)",
    )
    parser.add_argument(
        "--val-data",
        default=d.get("val_data"),
        help="evaluation data given apart: a folder of class folders or shards (needed when --data is shards)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=d.get("workers"),
        help="DataLoader processes that read and decode images (default: none for digits, min(4, cores) for files)",
    )
    parser.add_argument("--test-fraction", type=float, default=d.get("test_fraction"), help="test share per class")
    parser.add_argument("--clutter", type=int, default=d.get("clutter"), help="digits: fragments of other digits")
    parser.add_argument("--noise", type=float, default=d.get("noise"), help="digits: std of Gaussian pixel noise")
    parser.add_argument("--align", type=int, default=d.get("align"), help="digits: digits on multiples of N pixels")
    parser.add_argument("--seed", type=int, default=d.get("seed"), help="seed of the split, placements and init")


def check_output_file(path: str, option: str) -> Path:
    """A file the command will write: its folder must exist and be a folder (checked before any work)."""
    out = Path(path)
    folder = out.parent
    if not folder.exists():
        raise FileNotFoundError(f"{option} {path!r}: folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{option} {path!r}: {str(folder)!r} is a file, expected a folder")
    if out.is_dir():
        raise ValueError(f"{option} {path!r} is a folder, expected a file name")
    return out


def check_output_folder(path: str, option: str) -> Path:
    """A folder the command will create or fill: nothing on its way may be a file (checked before any work)."""
    out = Path(path)
    for part in (out, *out.parents):  # e.g. --out notes.txt/run: mkdir would fail deep inside the run
        if part.exists() and not part.is_dir():
            raise ValueError(f"{option} {path!r}: {str(part)!r} is a file, expected a folder")
    return out


# The library's arguments that a command's flags set: a library error names the argument (``data 'x' expands to no
# shard``); the command shows the flag the user typed (``--data 'x' …``).
FLAGS = {"data": "--data", "val_data": "--val-data", "mctf": "--mctf", "teacher": "--teacher"}
_LEADING = re.compile(r"^(data|mctf|teacher)\b")  # plain words: only as the subject the message starts with
_ANYWHERE = re.compile(r"(?<![\w-])(val_data)\b")  # names no prose uses


def in_flags(message: str) -> str:
    """A library error in the command's words: the arguments it names (:data:`FLAGS`) become their flags."""
    message = _LEADING.sub(lambda m: FLAGS[m[1]], message)
    return _ANYWHERE.sub(lambda m: FLAGS[m[1]], message)
