"""``vitrim vlm ask --model FOLDER_OR_HUB_ID --image PIC "question"``: the user's own VLM, next to the demo's ``--run``.

The arguments are added to the ``ask`` parser of :mod:`vitrim.cli.vlm_demo`; the work is :mod:`vitrim.vlm_user`.

Two methods of different stages stack (``vitrim.vlm.stacking``): ``--method`` twice, each followed by its own
``--keep`` and ``--set``, e.g. ``--method visionzip --keep 8 --method fastv --keep 0.5 --set layer=1``. With one
``--method`` its ``--keep`` and ``--set`` may come anywhere.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Any

from vitrim.cli.common import Bounded, check_output_folder, parse_keep_text
from vitrim.extras import require

DEMO_KEEP = "0.25"  # the digits demo's --keep when none is given
ORDERED = "method_flags"  # the namespace attribute listing (flag, value) of --method / --keep / --set in order


class InOrder(argparse.Action):
    """Stores the value as ``store`` does (``append`` with ``append=True``) and records ``(flag, value)`` in the
    order given, so each ``--keep`` / ``--set`` can be told to belong to the ``--method`` before it."""

    def __init__(self, *args: Any, append: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.append = append

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if self.append:
            setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])
        else:
            setattr(namespace, self.dest, values)
        flags = getattr(namespace, ORDERED, None) or []
        setattr(namespace, ORDERED, [*flags, (self.dest, values)])


def methods_given(args: argparse.Namespace) -> list[str]:
    """The --method values in the order given."""
    return [value for flag, value in getattr(args, ORDERED, None) or [] if flag == "method"]


def stacked_methods(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """Two or more --method: per method, its name and options (its --keep and --set, which follow it)."""
    stack: list[tuple[str, dict[str, Any]]] = []
    for flag, value in getattr(args, ORDERED, None) or []:
        if flag == "method":
            stack.append((value, {}))
        elif not stack:
            raise ValueError(f"with two --method, give each --keep / --set after its --method (got --{flag} first)")
        elif flag == "keep":
            stack[-1][1]["keep"] = parse_keep_text(value)
        else:
            stack[-1][1].update(parse_options([value]))
    return stack


def add_user_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--set``, ``--max-new-tokens``, ``--out`` on the ``ask`` parser."""
    p.add_argument(
        "--model",
        default=None,
        metavar="FOLDER_OR_HUB_ID",
        help="your own VLM: a checkpoint folder or a hub id from the local hub cache (LLaVA-1.5, LLaVA-NeXT, "
        "Qwen2-VL / 2.5-VL / 3-VL, Gemma 3, PaliGemma); instead of the digits demo's --run",
    )
    p.add_argument(
        "--set",
        action=InOrder,
        append=True,
        default=[],
        metavar="OPTION=VALUE",
        help="an option of --method (repeatable), e.g. --set layer=2 (with --model; with two --method, of the one "
        "before it)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=Bounded(int, 1, 4096, "tokens generated for the answer"),
        default=None,
        help="tokens generated (with --model; default 32)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="where --model runs: cpu (float32), cuda (the checkpoint's dtype; default when a GPU is visible)",
    )
    p.add_argument(
        "--out", default=None, help="folder for selection.json and kept_tokens.png (with --model; default: none)"
    )
    # with --model, no --keep means the method's own default (pdrop takes none: its layers and ratios say it all);
    # the demo's default (0.25) is filled in by demo_mode
    p.set_defaults(keep=None)


def parse_options(settings: list[str]) -> dict[str, Any]:
    """``["layer=2", "lambda=0.5", "mode=x"]`` -> ``{"layer": 2, "lambda": 0.5, "mode": "x"}`` (Python literals,
    else the text)."""
    options: dict[str, Any] = {}
    for setting in settings:
        name, sep, text = setting.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"--set expects OPTION=VALUE, got {setting!r}")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            value = text.strip()
        options[name.strip()] = value
    return options


def read_picture(path: str) -> Any:
    """The --image file as an RGB PIL image: its size checked from the header before any pixel is decoded
    (:func:`vitrim.data.image_file.open_image`: a decompression bomb is refused), a clear error for a missing or
    unreadable file."""
    require("PIL", feature="reading --image")
    from PIL import UnidentifiedImageError

    from vitrim.data.image_file import ImageRefused, open_image

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--image {path}: no such file")
    try:
        return open_image(file, "RGB")
    except ImageRefused as err:
        raise ValueError(f"--image {path}: {err}") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as err:  # Pillow: SyntaxError for some broken headers
        raise ValueError(f"--image {path}: not a picture PIL can read ({err})") from None


def demo_mode(args: argparse.Namespace) -> None:
    """The demo's mode (no --model): the flags that only --model reads are refused, not ignored; --keep defaults to
    0.25 of the demo's 64 tokens."""
    given = [
        flag
        for flag, value in (("--set", args.set), ("--max-new-tokens", args.max_new_tokens), ("--out", args.out))
        if value
    ]
    if given:
        raise ValueError(f"{', '.join(given)} go with --model (your own VLM); the digits demo takes none")
    if len(methods_given(args)) > 1:
        raise ValueError("two --method (a stack) go with --model (your own VLM); the digits demo takes one")
    if args.keep is None:
        args.keep = DEMO_KEEP


def pick_device(name: str | None) -> str:
    """``--device``: cpu, cuda or cuda:N (default: cuda when a GPU is visible)."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no GPU is visible to torch")
    return name


def run_user_ask(args: argparse.Namespace) -> int:
    from vitrim.vlm_user import ask, load_vlm, save_answer

    if args.run is not None:
        raise ValueError("--model and --run name two models; give one")
    max_new_tokens = 32 if args.max_new_tokens is None else args.max_new_tokens
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    method: str | list[tuple[str, dict[str, Any]]] | None = args.method
    if len(methods_given(args)) > 1:
        method, options = stacked_methods(args), {}
    else:
        options = parse_options(args.set)
        if args.method is None and options:
            raise ValueError(f"--set {args.set[0]} needs --method")
        if args.method is None and args.keep is not None:
            raise ValueError(f"--keep {args.keep} needs --method")
        if args.keep is not None:
            options = {"keep": parse_keep_text(args.keep), **options}
    out = None if args.out is None else check_output_folder(args.out, "--out")
    picture = read_picture(args.image)
    from transformers.utils import logging

    logging.disable_progress_bar()  # the loading bars would bury the answer and the one-line errors
    model, processor = load_vlm(args.model, device=pick_device(args.device))
    answer = ask(model, processor, picture, args.question, method, max_new_tokens, **options)
    print(answer.text)
    total, entered, selected = answer.total[0], answer.entered[0], answer.selected[0]
    if answer.method is None:
        print(f"all {total} image tokens entered the LLM (no --method)")
    elif answer.stage == "tower" and entered == total:
        patches = len(answer.boxes[0].boxes) if answer.boxes[0].views == ("patches",) else total
        print(
            f"{answer.method}: {selected} tower tokens of {patches} patches reach its feature layer, put back on the "
            f"patch grid; all {total} image tokens entered the LLM"
        )
    elif answer.stage == "in_llm":
        # a [CLS] handed on before the LLM (VisionZip) counts among those that entered and, never dropped, among
        # those that stay: said in both places, so the counts add up
        cls = bool(answer.groups and answer.groups[0] and len(answer.groups[0][0]) == 0)
        into = f"all {entered}" if entered == total else f"{entered} of {total}"
        print(
            f"{answer.method}: {into} image tokens entered the LLM"
            + (" (one of them the tower's [CLS])" * cls)
            + f"; {selected} of them stay after its layer"
            + (f" (the [CLS] and {selected - 1} image tokens)" * cls)
        )
    else:
        cls = bool(answer.groups and answer.groups[0] and len(answer.groups[0][0]) == 0)
        print(
            f"{answer.method}: {entered} of {total} image tokens entered the LLM"
            + (" (one of them the tower's [CLS])" * cls)
        )
    if out is not None:
        reply = answer.text if len(answer.text) <= 40 else answer.text[:39] + "…"
        stacked = [entry["options"] for entry in answer.stack]  # stage order, as answer.method names them
        keeps = ", ".join(str(o.get("keep", "default")) for o in stacked) if isinstance(method, list) else args.keep
        title = f'{answer.method or "no method"}, keep {keeps}: "{args.question}" -> "{reply}"'
        for path in save_answer(answer, picture, Path(out), title=title):
            print(f"wrote {path}")
    return 0
