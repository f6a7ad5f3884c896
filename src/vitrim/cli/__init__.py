"""The ``vitrim`` command: every parser of the project lives in this package, one module per subcommand.

A subcommand is a module here with ``register(subparsers)`` (its parser sets ``func(args) -> int``) and a line in
``COMMANDS``. ``main`` applies ``--threads`` once, then runs the command. A user error (a bad value, a missing or
unreadable file, a path that cannot be written) prints one line ``vitrim: error: …`` and exits with code 2, and so does
running out of memory (sizes within every option's bound can still exceed a machine's); anything else is a bug and
keeps its traceback. An optional library that is not installed (an extra, see
:mod:`vitrim.extras`) is one line too, naming the extra to install. ``--debug`` shows the traceback of user errors.

Warnings (vitrim's, or a library's) are held while the command runs: a command that fails prints its one error line
and nothing else; one that succeeds prints each distinct warning once, after its work, as ``vitrim: warning: …``
(one line: its first). ``--debug`` shows them as Python does, as they happen.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from vitrim.cli import (
    bench,
    demo,
    eval,
    explain,
    export,
    models,
    train,
    translate,
    video_demo,
    viz,
    vlm,
    vlm_demo,
    vlm_methods,
)
from vitrim.cli.common import apply_threads, in_flags
from vitrim.extras import missing_extra_message

COMMANDS = {
    "bench": bench,
    "demo": demo,
    "eval": eval,
    "explain": explain,
    "export": export,
    "models": models,
    "train": train,
    "viz": viz,
    "vlm": vlm,
    "translate": translate,  # after demo and explain: it adds `vitrim demo translate` and `vitrim explain --cross`
}
# Modules that add modes to the commands above rather than a command of their own (registered after them).
# `vitrim demo vlm`, `vitrim viz vlm`, `vitrim vlm ask`, `vitrim vlm methods`, `vitrim demo video`
EXTENSIONS = (vlm_demo, vlm_methods, video_demo)
USER_ERRORS = (ValueError, TypeError, KeyError, OSError)  # OSError: missing, unreadable or unwritable paths
OUT_OF_MEMORY = "the sizes asked for need more memory than this machine has; ask for smaller ones"
# The extra to name when a command misses an optional library that several extras install (vitrim.extras).
COMMAND_EXTRAS = {"viz": "viz", "explain": "viz", "export": "export", "train": "train", "eval": "train"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitrim", description="Attention and Vision Transformers that trim tokens.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors in your arguments too")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (*COMMANDS.values(), *EXTENSIONS):
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:
        return _run(args)
    with warnings.catch_warnings(record=True) as caught:  # the active filters still decide what is caught
        code = _run(args)
    if code == 0:
        for message in dict.fromkeys(_first_line(w.message) for w in caught):
            print(f"vitrim: warning: {message}", file=sys.stderr)
    return code


def _first_line(message: Warning | str) -> str:
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return lines[0] if lines else type(message).__name__


def _run(args: argparse.Namespace) -> int:
    try:
        apply_threads(getattr(args, "threads", 0))
        return int(args.func(args) or 0)
    except ModuleNotFoundError as err:  # an optional dependency (an extra) that is not installed
        missing = missing_extra_message(err, prefer=COMMAND_EXTRAS.get(args.command))
        if missing is None or args.debug:
            raise
        print(f"vitrim: error: vitrim {args.command} needs {missing}", file=sys.stderr)
        return 2
    except USER_ERRORS as err:
        if args.debug:
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"vitrim: error: {in_flags(str(message))}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as err:  # sizes within every bound can still exceed this machine's memory
        if args.debug or not is_out_of_memory(err):
            raise
        print(
            f"vitrim: error: out of memory ({_first_line(str(err) or type(err).__name__)}): {OUT_OF_MEMORY}",
            file=sys.stderr,
        )
        return 2


def is_out_of_memory(err: BaseException) -> bool:
    """Python's MemoryError, torch's CPU allocator failing ("can't allocate memory") or a GPU's out-of-memory error."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err)
    return "can't allocate memory" in text or "out of memory" in text.lower()
