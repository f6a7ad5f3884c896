"""What several commands share: ``--threads``, the ``--set key=value`` grammar, the data options, and the bounds of
every numeric option (:class:`Bounded`)."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitrim.literals import parse_assignments
from vitrim.models.config_limits import FROM_THE_COMMAND_LINE, LIMITS, check_file_config


@dataclass(frozen=True)
class Bounded:
    """An argparse ``type=`` for a numeric option: its text as an int (or a finite float) in [low, high], a range that
    says what the number is (``what``). Anything else is argparse's usage error, whose line names the option, the
    value and the range (``argument --canvas: expected an int in [0, 199] (...), got '500'``), before any work.
    ``low_open``/``high_open`` exclude that end (a probability of dropping in [0, 1))."""

    kind: type
    low: float
    high: float
    what: str
    low_open: bool = False
    high_open: bool = False

    def __call__(self, text: str) -> Any:
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not math.isfinite(value) or not self.contains(value):
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}")
        return value

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        kind = "an int" if self.kind is int else "a number"
        brackets = ("(" if self.low_open else "[", ")" if self.high_open else "]")
        return f"{kind} in {brackets[0]}{_plain(self.low)}, {_plain(self.high)}{brackets[1]} ({self.what})"

    @property
    def __name__(self) -> str:  # argparse names a type by it in some messages
        return self.kind.__name__


def _plain(number: float) -> str:
    """4294967295 as itself, 0.0 as 0, 1e-06 as 1e-06: the range as a user would type it."""
    return str(int(number)) if float(number).is_integer() and abs(number) < 1e15 else f"{number:g}"


# Bounds shared by several commands. Sizes read from files have their limits in vitrim.models.config_limits; an option
# that sets the same size takes the same one.
SEED = Bounded(int, 0, 2**32 - 1, "a seed: numpy's seeds are 32-bit")
THREADS = Bounded(int, 0, 1024, "CPU threads, 0: torch's choice")
BATCH = Bounded(int, 1, 65536, "images in one batch")
IMAGE_SIDE = Bounded(int, 1, LIMITS["img_size"], "an image side in pixels, at most what a model config may ask for")
TIMED = Bounded(int, 1, 100_000, "timed calls")
UNTIMED = Bounded(int, 0, 100_000, "untimed calls")
TEXT_TOKENS = Bounded(int, 0, 2**17, "text tokens of a prompt, at most a 128k-token context")
PROBABILITY = Bounded(float, 0.0, 1.0, "a probability")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``; :func:`vitrim.cli.main` applies it once, before the command runs."""
    parser.add_argument(
        "--threads",
        type=THREADS,
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


def parse_set(items: list[str] | None, option: str, form: str) -> dict[str, Any]:
    """Repeated ``--set depth=4 --set embed_dim=32,num_heads=2`` -> one dict (later values win).

    ``form`` is the option's metavar: an error shows the form ``--help`` shows (``vitrim.literals`` reads the text).
    """
    values: dict[str, Any] = {}
    for text in items or []:
        values.update(parse_assignments(text, option, form))
    return values


def parse_model_set(items: list[str] | None, option: str, form: str) -> dict[str, Any]:
    """``--set`` of create_model overrides (:func:`parse_set`), each size bounded as a config file's is
    (:func:`vitrim.models.config_limits.check_file_config`): ``--set embed_dim=1000000000`` is one line naming it,
    not an allocation the machine may grant and then spend hours filling."""
    values = parse_set(items, option, form)
    check_file_config(values, option, origin=FROM_THE_COMMAND_LINE)
    return values


def parse_ints(text: str, option: str, bound: Bounded | None = None) -> tuple[int, ...]:
    """``"64,128"`` -> ``(64, 128)``; ``ValueError`` naming ``option`` when a part is not an int or not in ``bound``."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{option} must be comma-separated ints, got {text!r}") from None
    if bound is not None and not all(bound.contains(v) for v in values):
        raise ValueError(f"{option} must be comma-separated ints, each {bound.describe()[3:]}, got {text!r}")
    return values


def parse_fractions(text: str, option: str) -> tuple[float, ...]:
    """``"0.5,0.25"`` -> ``(0.5, 0.25)``; ``ValueError`` naming ``option`` unless each part is a fraction in (0, 1]."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 < v <= 1 for v in values):
        raise ValueError(f"{option} must be comma-separated fractions in (0, 1], got {text!r}")
    return values


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
        type=Bounded(int, 0, 256, "loader processes"),
        default=d.get("workers"),
        help="DataLoader processes that read and decode images (default: none for digits, min(4, cores) for files)",
    )
    share = Bounded(float, 0.0, 1.0, "the share of each class held out", low_open=True, high_open=True)
    parser.add_argument("--test-fraction", type=share, default=d.get("test_fraction"), help="test share per class")
    clutter = Bounded(int, 0, 64, "fragments per canvas")
    parser.add_argument("--clutter", type=clutter, default=d.get("clutter"), help="digits: fragments of other digits")
    noise = Bounded(float, 0.0, 10.0, "a pixel-noise std, on ink in [0, 1]")
    parser.add_argument("--noise", type=noise, default=d.get("noise"), help="digits: std of Gaussian pixel noise")
    align = Bounded(int, 1, LIMITS["img_size"], "pixels, at most an image side; the data checks it against the canvas")
    parser.add_argument("--align", type=align, default=d.get("align"), help="digits: digits on multiples of N pixels")
    parser.add_argument("--seed", type=SEED, default=d.get("seed"), help="seed of the split, placements and init")


def parse_keep_text(text: str, option: str = "--keep") -> int | float:
    """``--keep``'s text: a count of image tokens (``"64"``) or a fraction in (0, 1] (``"0.25"``); ``ValueError``
    naming the option and the value otherwise (the one reading of ``keep=`` from a command line)."""
    expected = f"{option} must be a token count (64) or a fraction in (0, 1] (0.25), got {text!r}"
    try:
        value: int | float = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(expected) from None
    if value <= 0 or (isinstance(value, float) and not value <= 1):
        raise ValueError(expected)
    return value


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
FLAGS = {"data": "--data", "val_data": "--val-data", "mctf": "--mctf", "teacher": "--teacher", "methods": "--methods"}
_LEADING = re.compile(r"^(data|mctf|teacher|methods)\b")  # plain words: only as the subject the message starts with
_ANYWHERE = re.compile(r"(?<![\w-])(val_data)\b")  # names no prose uses


def in_flags(message: str) -> str:
    """A library error in the command's words: the arguments it names (:data:`FLAGS`) become their flags."""
    message = _LEADING.sub(lambda m: FLAGS[m[1]], message)
    return _ANYWHERE.sub(lambda m: FLAGS[m[1]], message)
