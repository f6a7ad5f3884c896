"""Parsers of the digits VLM: ``vitrim demo vlm``, ``vitrim vlm ask`` and ``vitrim viz vlm``.

Registered after ``demo`` and ``viz`` (and after ``translate``, which gives ``demo`` its modes): :func:`register`
adds a mode to each of those parsers, and creates the ``vlm`` command, or adds ``ask`` to it when another module
created it first (:func:`vlm_commands`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vitrim.cli.common import (
    SEED,
    Bounded,
    add_threads_argument,
    check_output_file,
    check_output_folder,
    parse_keep_text,
)
from vitrim.cli.demo import add_ship_to_argument, check_seed, check_ship_to
from vitrim.cli.vlm_user import InOrder, add_user_model_arguments, demo_mode, methods_given, run_user_ask
from vitrim.extras import require

# the demo scores 200 held-out canvases (vitrim.demos.vlm.demo.FULL): --canvas picks one of them
CANVAS_INDEX = Bounded(int, 0, 199, "one of the 200 held-out canvases the demo scores")


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_demo_mode(_modes(_registered(subparsers, "demo"), "demo_mode", "MODE"))
    _register_viz_kind(_modes(_registered(subparsers, "viz"), "viz_kind", "KIND"))
    _register_ask(vlm_commands(subparsers))


def _registered(subparsers: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    parser = subparsers.choices.get(name)
    if parser is None:
        raise RuntimeError(f"vitrim.cli.vlm_demo must be registered after the {name!r} command (vitrim.cli EXTENSIONS)")
    return parser


def _modes(parser: argparse.ArgumentParser, dest: str, metavar: str) -> argparse._SubParsersAction:
    """The sub-command action of ``parser`` (created when it has none yet)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return parser.add_subparsers(dest=dest, metavar=metavar, required=False)


def vlm_commands(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The sub-commands of ``vitrim vlm`` (the command is created by whichever module asks first)."""
    parser = subparsers.choices.get("vlm")
    if parser is None:
        parser = subparsers.add_parser("vlm", help="vision-language models: ask the digits VLM, trim image tokens")
        return parser.add_subparsers(dest="vlm_command", metavar="COMMAND", required=True)
    return _modes(parser, "vlm_command", "COMMAND")


# -- vitrim demo vlm -------------------------------------------------------------------------------------------------


def _register_demo_mode(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser(
        "vlm",
        help="a digits LLaVA (transformers' LlavaForConditionalGeneration): accuracy against image tokens kept",
        description="Score the digits LLaVA (a small CLIP tower and Llama decoder, trained on questions about canvases "
        "of one to three handwritten digits; its weights ship with vitrim) per question type on held-out canvases, "
        "then every method of vitrim.vlm at 50, 25 and 12.5 %% of the 64 image tokens with the measured prefill "
        "speed-up; write summary.json, details.json, report.md and pictures. --retrain trains it from scratch first.",
    )
    p.add_argument("--out", default="runs/vlm", help="run folder (default: %(default)s)")
    p.add_argument("--retrain", action="store_true", help="train the model from scratch with the shipped one's recipe")
    p.add_argument("--quick", action="store_true", help="a tiny model, 3 steps, 6 canvases: checks the plumbing")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the data and the training (needs --retrain)")
    p.add_argument(
        "--methods", default=None, help="comma-separated methods of vitrim.vlm to sweep (default: every one)"
    )
    add_ship_to_argument(p, "model")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    add_threads_argument(p)
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from vitrim.demos.vlm.demo import FULL, QUICK, run_vlm_demo, ship_run

    ship_to = check_ship_to(args)
    check_seed(args)
    require("transformers", feature="the VLM demo")
    require("matplotlib", "PIL", feature="the VLM demo's pictures")
    out = check_output_folder(args.out, "--out")
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    shipped = not (args.retrain or args.quick)
    summary = run_vlm_demo(
        out, QUICK if args.quick else FULL, seed=args.seed, quiet=args.quiet, shipped=shipped, methods=methods
    )
    note = "  (shipped weights; --retrain trains them from scratch)" if shipped else ""
    print(f"report: {out / 'report.md'}{note}")
    print("  full model  " + "  ".join(f"{k} {v:.3f}" for k, v in summary["full"].items()))
    if ship_to is not None:
        ship_run(out, ship_to, methods)
        print(f"shipped: {ship_to}")
    return 0


# -- vitrim vlm ask --------------------------------------------------------------------------------------------------


def _add_model_arguments(p: argparse.ArgumentParser, user_model: bool = False) -> None:
    """--run, --method, --keep; ``user_model``: the command also takes --model (its --method help says so)."""
    p.add_argument("--run", default=None, help="a `vitrim demo vlm` run folder (default: the shipped model)")
    stack = " (with --model: twice for a stack of two stages, each followed by its own --keep / --set)"
    p.add_argument(
        "--method",
        action=InOrder,
        default=None,
        help="a method of vitrim.vlm that trims the image tokens" + stack * user_model,
    )
    p.add_argument(
        "--keep", action=InOrder, default="0.25", help="image tokens kept: a count (16) or a fraction (0.25; default)"
    )


def _register_ask(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "ask",
        help="ask the digits VLM a question about a picture (which digit / where is the seven / how many digits)",
        description="Answer a question about a picture with the digits VLM of `vitrim demo vlm`. The picture is read "
        "as grey and resized to the 64x64 canvas (dark ink on a light background is inverted). --method trims its "
        "image tokens with a method of vitrim.vlm, keeping --keep of the 64.",
    )
    p.add_argument("question", help='e.g. "which digit ?", "where is the seven ?", "how many digits ?"')
    p.add_argument("--image", required=True, help="a PNG or JPEG file")
    _add_model_arguments(p, user_model=True)
    add_user_model_arguments(p)  # --model: the user's own VLM instead of the demo's (vitrim.cli.vlm_user)
    add_threads_argument(p)
    p.set_defaults(func=_run_ask)


def _run_ask(args: argparse.Namespace) -> int:
    from vitrim.demos.vlm.ask import ask, load_demo_model, read_canvas

    if args.model is not None:
        return run_user_ask(args)
    demo_mode(args)

    keep = parse_keep_text(args.keep)
    model = load_demo_model(args.run)
    canvas = read_canvas(args.image)
    result = ask(model, canvas, args.question, method=args.method, keep=keep)
    print(result.text)
    if args.method is not None:
        print(result.describe_tokens(args.method))
    return 0


# -- vitrim viz vlm --------------------------------------------------------------------------------------------------


def _register_viz_kind(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "vlm",
        help="the image tokens each method of vitrim.vlm lets into the digits VLM, and FastV's attention",
        description="Draw a canvas with the tokens that each method (or --method) keeps (pruned washed out, merged "
        "groups in one colour), and with --attention the last prompt token's attention over the image at the layer "
        "FastV ranks by.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--image", default=None, help="a PNG or JPEG file (default: a held-out canvas, --canvas)")
    source.add_argument("--canvas", type=CANVAS_INDEX, default=0, help="index of a held-out canvas (default 0)")
    p.add_argument("--question", default="how many digits ?", help="the question asked (default: %(default)s)")
    _add_model_arguments(p)
    p.add_argument("--out", required=True, help="PNG file of the kept tokens")
    p.add_argument("--attention", default=None, metavar="PNG", help="also draw FastV's attention map here")
    p.add_argument(
        "--save-canvas",
        default=None,
        metavar="PNG",
        help="also write the canvas itself here (64x64 grey: a picture `vitrim vlm ask --image` reads)",
    )
    add_threads_argument(p)
    p.set_defaults(func=_run_viz)


def _run_viz(args: argparse.Namespace) -> int:
    from vitrim.demos.vlm.ask import ask, load_demo_model, read_canvas, save_canvas
    from vitrim.demos.vlm.attention import last_token_attention
    from vitrim.demos.vlm.evaluate import held_out
    from vitrim.demos.vlm.pictures import plot_attention, plot_selections
    from vitrim.demos.vlm.sweep import DEMO_OPTIONS, available_methods
    from vitrim.demos.vlm.words import processor, split_words
    from vitrim.viz.maps import save_figure

    require("matplotlib", feature="vitrim viz vlm")
    check_output_file(args.out, "--out")
    if args.attention:
        check_output_file(args.attention, "--attention")
    if args.save_canvas:
        check_output_file(args.save_canvas, "--save-canvas")
    keep = parse_keep_text(args.keep)
    if args.image is not None:
        canvas = read_canvas(args.image)
    else:
        canvas = held_out(args.canvas + 1).pixels[args.canvas]
    if args.save_canvas:
        save_canvas(canvas, Path(args.save_canvas))
        print(f"wrote {args.save_canvas}")
    if len(methods_given(args)) > 1:
        raise ValueError("vitrim viz vlm draws one --method at a time (a stack goes with vitrim vlm ask --model)")
    model = load_demo_model(args.run)
    methods = [args.method] if args.method else available_methods()
    if not methods:
        raise ValueError("vitrim.vlm has no methods in this installation: nothing to draw")
    selections, refused = {}, {}
    for method in methods:
        try:
            result = ask(model, canvas, args.question, method=method, keep=keep)
        except (ValueError, TypeError) as err:  # as the demo's sweep: a method that refuses this model is not drawn
            if args.method:
                raise
            refused[method] = str(err)
            continue
        selections[method] = result.groups
    for method, why in refused.items():
        print(f"not drawn: {method} refuses the digits VLM at --keep {args.keep}: {why}")
    plain = ask(model, canvas, args.question).text
    title = f'"{args.question}" -> "{plain}" (full model); keep {args.keep}'
    save_figure(plot_selections(canvas, selections, title=title), Path(args.out))
    print(f"wrote {args.out}")
    if args.attention:
        layer = DEMO_OPTIONS["fastv"]["layer"] - 1
        weights = last_token_attention(model, processor(canvas[None], [split_words(args.question)]), layer)[0]
        fig = plot_attention(canvas, weights, title=f"last prompt token's attention, decoder layer {layer}")
        save_figure(fig, Path(args.attention))
        print(f"wrote {args.attention}")
    return 0
