"""Parsers of the translation feature: ``vitrim translate``, ``vitrim demo translate``, ``vitrim explain --cross``.

:func:`register` adds the ``translate`` command and extends two commands registered before it (``vitrim.cli``
registers in the order of its COMMANDS dict): ``demo`` gets an optional mode, ``translate`` (plain ``vitrim demo``
and ``vitrim demo --quick`` still run the ViT demo), and ``explain`` gets ``--cross``.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from vitrim.cli.common import SEED, THREADS, Bounded, add_threads_argument, check_output_file, check_output_folder
from vitrim.cli.demo import add_ship_to_argument, check_ship_to
from vitrim.cli.explain import show_explanation
from vitrim.data.numbers import make_pair, number_of
from vitrim.demos.translate.demo import FULL, QUICK, run_translate_demo, ship_run
from vitrim.demos.translate.inference import load_run, row_labels, translate_text
from vitrim.extras import require
from vitrim.viz.cross import plot_cross_attention
from vitrim.viz.explain import format_matrix
from vitrim.viz.explain_cross import explain_cross_numbers, format_cross_explanation, plot_cross_explanation
from vitrim.viz.maps import save_figure


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_translate(subparsers)
    _register_demo_mode(_registered(subparsers, "demo"))
    _register_explain_cross(_registered(subparsers, "explain"))


def _registered(subparsers: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    parser = subparsers.choices.get(name)
    if parser is None:
        raise RuntimeError(f"vitrim.translate_cli must be registered after the {name!r} command (vitrim.cli COMMANDS)")
    return parser


# -- vitrim translate ------------------------------------------------------------------------------------------------


def _register_translate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "translate",
        help="translate English number words with a trained run (vitrim demo translate), show its cross-attention",
        description="Translate English number words (or digits) into German or French with the model that "
        "`vitrim demo translate` trained, and print the cross-attention of the decoder layer that aligns best.",
    )
    p.add_argument("text", help='English number words, e.g. "twenty-one" or "two thousand, three hundred"; or digits')
    p.add_argument(
        "--run", default="runs/translate", help="run folder of `vitrim demo translate` (default: %(default)s)"
    )
    p.add_argument("--to", default="de", help="target language: de or fr (default: %(default)s)")
    p.add_argument(
        "--beam", type=Bounded(int, 1, 64, "hypotheses kept per step"), default=1, help="beam size (default 1: greedy)"
    )
    p.add_argument(
        "--layer",
        type=Bounded(int, 0, 255, "a decoder layer index"),
        default=None,
        help="decoder layer to show (default: the run's best-aligned)",
    )
    p.add_argument("--show-attention", default=None, metavar="PNG", help="draw the cross-attention into this file")
    add_threads_argument(p)
    p.set_defaults(func=_run_translate)


def _run_translate(args: argparse.Namespace) -> int:
    if args.show_attention:
        check_output_file(args.show_attention, "--show-attention")
        require("matplotlib", feature="--show-attention")
    run = load_run(args.run)
    result = translate_text(run, args.text, args.to, beam_size=args.beam)
    depth = result.cross_attention.shape[0]
    layer = run.alignment_layer if args.layer is None else args.layer
    if not 0 <= layer < depth:
        raise ValueError(f"--layer must be in [0, {depth}) (decoder layers of this model), got {layer}")
    heads = result.cross_attention.shape[1]
    weights = result.cross_attention[layer].mean(0)  # (Lt + 1, Ls)
    print(f"{' '.join(result.source)}  ->  {result.text}   ({args.to}: {' '.join(result.target)})")
    title = f"cross-attention, decoder layer {layer}, mean of {heads} heads (rows: output, columns: English)"
    print(format_matrix("A", title, weights, row_labels(result.target), result.source))
    if args.show_attention:
        number = number_of(result.source)
        alignment = None
        if number is not None:
            reference = make_pair(number, args.to)
            if list(reference.target) == result.target:  # the known alignment applies to the reference only
                alignment = [*reference.alignment, None]
        fig = plot_cross_attention(weights, result.source, row_labels(result.target), alignment,
                                   title=f"{args.text!r} -> {result.text!r} ({args.to}), layer {layer}")  # fmt: skip
        save_figure(fig, args.show_attention)
        print(f"wrote {args.show_attention}")
    return 0


# -- vitrim demo translate -------------------------------------------------------------------------------------------


def _register_demo_mode(demo: argparse.ArgumentParser) -> None:
    modes = demo.add_subparsers(dest="demo_mode", metavar="MODE", required=False)
    p = modes.add_parser(
        "translate",
        help="an encoder-decoder that translates number words (en -> de, fr): its scores and cross-attention",
        description="Score and draw the small encoder-decoder of the demo's recipe on English -> German/French "
        "number words (num2words), 1 ... 9999, a seeded 80/20 split of the numbers: its weights ship with vitrim, "
        "--retrain trains it from scratch first (about a minute on 1 thread). Writes summary.json (exact_match, "
        "chrf, alignment_accuracy, seconds), report.md, cross-attention pictures and the model for `vitrim "
        "translate`. No download.",
    )
    p.add_argument("--out", default="runs/translate", help="run folder (default: %(default)s)")
    p.add_argument(
        "--retrain", action="store_true", help="train the model from scratch with the recipe of the shipped one"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 30 steps, numbers up to 120: checks the plumbing")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the split, the initialisation and the batches")
    p.add_argument(
        "--steps",
        type=Bounded(int, 1, 10**7, "training steps"),
        default=None,
        help="training steps (default: the plan's, 700; with --retrain or --quick)",
    )
    add_ship_to_argument(p, "model")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument(
        "--threads",
        type=THREADS,
        default=1,
        help="CPU threads for torch (default 1: this model's matrices are too small to share; on the shared 2-core "
        "machine 700 steps took 63 s on 1 thread and 561 s on 2)",
    )
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    require("num2words", "sacrebleu", "matplotlib", feature="the translation demo")  # before training, not after
    plan = QUICK if args.quick else FULL
    shipped = not (args.retrain or args.quick)
    ship_to = check_ship_to(args)
    if args.steps is not None and shipped:
        raise ValueError(f"--steps {args.steps} needs --retrain or --quick: the shipped model is not trained again")
    if args.seed != 0 and shipped:
        raise ValueError(f"--seed {args.seed} needs --retrain or --quick: the shipped model was trained with seed 0")
    out = check_output_folder(args.out, "--out")
    if args.steps is not None:
        plan = replace(
            plan, train=replace(plan.train, steps=args.steps, warmup_steps=min(plan.train.warmup_steps, args.steps))
        )
    summary = run_translate_demo(out, plan, seed=args.seed, quiet=args.quiet, shipped=shipped)
    note = "  (shipped model; --retrain trains it from scratch)" if shipped else ""
    print(f"report: {out / 'report.md'}{note}")
    print(
        f"  exact match {100 * summary['exact_match']:.2f}%  chrF {summary['chrf']:.2f}  alignment accuracy "
        f"{100 * summary['alignment_accuracy']:.2f}% (decoder layer {summary['alignment_layer']})  "
        f"{summary['seconds']:.0f} s on {summary['threads']} thread(s)"
    )
    if summary["train"]["stopped_early"]:
        print(f"  training stopped early by its time limit, after {summary['train']['steps']} steps: see report.md")
    if ship_to is not None:
        ship_run(out, ship_to)
        print(f"shipped: {ship_to}")
    return 0


# -- vitrim explain --cross ------------------------------------------------------------------------------------------


def _register_explain_cross(explain: argparse.ArgumentParser) -> None:
    explain.add_argument(
        "--cross",
        action="store_true",
        help="cross-attention instead: queries from the target sentence, keys and values from the source",
    )
    self_attention = explain.get_default("func")

    def run(args: argparse.Namespace) -> int:
        return _run_explain_cross(args) if args.cross else int(self_attention(args) or 0)

    explain.set_defaults(func=run)


def _run_explain_cross(args: argparse.Namespace) -> int:
    return show_explanation(args, explain_cross_numbers, format_cross_explanation, plot_cross_explanation)
