"""``report.md`` of ``vitrim demo vlm``: the model, the data, the table, the plot, the pictures and the commands.

Besides the summary's numbers, the report measures one thing of its own: how much of the ink each method lets into
the LLM (the share of patches with any ink that are kept, or inside a merged token), over the first held-out prompts,
from ``vitrim.vlm.last_selection(model, groups=True)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from vitrim.demos.vlm.attention import last_token_attention
from vitrim.demos.vlm.data import CANVAS, PATCH, QUESTION_TYPES
from vitrim.demos.vlm.evaluate import HeldOut
from vitrim.demos.vlm.pictures import plot_accuracy_vs_kept, plot_attention, plot_selections
from vitrim.demos.vlm.sweep import (
    BASELINE_SEEDS,
    DEMO_OPTIONS,
    KEPT_FRACTIONS,
    SEEDED_BASELINES,
    SweepResult,
    apply_method,
)
from vitrim.demos.vlm.words import IMAGE_TOKENS, WORDS, processor
from vitrim.viz.maps import save_figure

INK_PROMPTS = 48
PICTURE_FRACTIONS = ("0.25", "0.125")


def ink_patches(pixels: np.ndarray) -> np.ndarray:
    """(N, 64) bool: the patches of each (N, CANVAS, CANVAS) canvas that hold any ink."""
    grid = CANVAS // PATCH
    blocks = pixels.reshape(len(pixels), grid, PATCH, grid, PATCH)
    return (blocks > 0).any(axis=(2, 4)).reshape(len(pixels), -1)


@torch.no_grad()
def selections(model: nn.Module, method: str, fraction: str, pixels: np.ndarray, questions: list[Any]) -> list[Any]:
    """Per prompt, the groups of image-token indices that entered the LLM (``last_selection(groups=True)``)."""
    from vitrim import vlm

    pruned = apply_method(model, method, fraction)
    pruned(**processor(pixels, [q.words for q in questions]))
    return list(vlm.last_selection(pruned, groups=True))


def ink_kept(model: nn.Module, data: HeldOut, methods: list[str]) -> dict[str, dict[str, float]]:
    """Per method and kept fraction, the share of ink patches that reach the LLM (alone or merged)."""
    questions = data.questions[:INK_PROMPTS]
    pixels = data.pixels[[q.canvas for q in questions]]
    ink = ink_patches(pixels)
    shares: dict[str, dict[str, float]] = {}
    for method in methods:
        for fraction in KEPT_FRACTIONS:
            reached = np.zeros_like(ink)
            for row, groups in enumerate(selections(model, method, fraction, pixels, questions)):
                for group in groups:
                    reached[row, np.asarray(group).reshape(-1)] = True
            shares.setdefault(method, {})[fraction] = float((reached & ink).sum() / ink.sum())
    return shares


def write_report(
    out: Any,
    model: nn.Module,
    data: HeldOut,
    summary: dict[str, Any],
    details: dict[str, Any],
    sweep: SweepResult,
    answers: list[str],
    *,
    pictures: int,
) -> None:
    """Draw the pictures and write ``report.md`` into ``out``; adds ``ink_kept`` to ``details``."""
    ran = list(summary["methods"])
    files: list[str] = []
    if ran:
        save_figure(plot_accuracy_vs_kept(summary), out / "accuracy_vs_kept.png")
        files.append("accuracy_vs_kept.png")
        details["ink_kept"] = ink_kept(model, data, ran)
    shown = _picture_questions(data, pictures)
    for n, index in enumerate(shown):
        q = data.questions[index]
        pixels = data.pixels[q.canvas]
        for fraction in PICTURE_FRACTIONS if ran else ():
            chosen = {m: selections(model, m, fraction, pixels[None], [q])[0] for m in ran}
            kept = round(float(fraction) * IMAGE_TOKENS)
            title = f'"{" ".join(q.words)}" -> "{" ".join(q.answer)}": {kept} of 64 image tokens kept'
            save_figure(plot_selections(pixels, chosen, title=title), out / f"kept_{n}_{kept}.png")
            files.append(f"kept_{n}_{kept}.png")
        layer = DEMO_OPTIONS["fastv"]["layer"] - 1
        weights = last_token_attention(model, processor(pixels[None], [q.words]), layer)[0]
        title = f"\"{' '.join(q.words)}\": last prompt token's attention, decoder layer {layer} (FastV's ranking)"
        save_figure(plot_attention(pixels, weights, title=title), out / f"fastv_attention_{n}.png")
        files.append(f"fastv_attention_{n}.png")
    (out / "report.md").write_text(_markdown(summary, details, sweep, data, answers, files))


def _picture_questions(data: HeldOut, count: int) -> list[int]:
    """Questions about canvases with two or three digits, one of each type in turn (the interesting ones)."""
    chosen: list[int] = []
    for index, q in enumerate(data.questions):
        busy = sum(d >= 0 for d in data.digits[q.canvas]) >= 2
        if busy and q.kind == QUESTION_TYPES[len(chosen) % len(QUESTION_TYPES)]:
            chosen.append(index)
        if len(chosen) == count:
            break
    return chosen


def _load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _options_note(methods: list[str]) -> str:
    used = {m: DEMO_OPTIONS[m] for m in methods if m in DEMO_OPTIONS}
    if not used:
        return "Every method ran with its authors' defaults and `keep`."
    shown = ", ".join(f"{m} {o}" for m, o in used.items())
    note = f"Options beyond `keep` (the decoder has 4 layers, the papers' LLaMA 32): {shown}; the rest the authors'."
    if "pdrop" in used:
        note += (" PyramidDrop takes no `keep`: at fraction f it gets `ratios=(2f, f, f/2)` (the authors' halving, "
                 "the middle stage at f; their default is f = 0.25).")  # fmt: skip
    if "flashvid_llm" in used:
        note += " FlashVID's in-LLM stage takes no `keep`: at fraction f it gets `llm_retention_ratio=f`."
    return note


def _accuracy_cell(row: dict[str, Any], kind: str) -> str:
    """A table cell: the accuracy (%), and for a seeded baseline its seeds' range."""
    if "accuracy_by_seed" not in row:
        return _pct(row["accuracy"][kind])
    seeds = [one[kind] for one in row["accuracy_by_seed"]]
    return f"{_pct(row['accuracy'][kind])} ({_pct(min(seeds))}–{_pct(max(seeds))})"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _markdown(
    summary: dict[str, Any],
    details: dict[str, Any],
    sweep: SweepResult,
    data: HeldOut,
    answers: list[str],
    files: list[str],
) -> str:
    full, methods = summary["full"], summary["methods"]
    training = details["training"]
    plan = details["plan"]
    load = _load(training.get("load_average_before"))
    lines = [
        "# A digits LLaVA: accuracy against image tokens kept, for every method of vitrim.vlm",
        "",
        "## The model",
        "",
        f"transformers' own `LlavaForConditionalGeneration` ({training['parameters']:,} parameters): a CLIP vision "
        "tower on a 64×64 canvas with 8×8 patches (64 image tokens and [CLS]; LLaVA-1.5's layer −2 features without "
        "[CLS]), a two-layer GELU projector, a Llama decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, 4 "
        "layers) "
        f"over a word-level vocabulary of {len(WORDS)} words. "
        f"Trained from scratch in {training['seconds']:.0f} s on {training['threads']} thread(s) "
        f"({plan['train']['steps']} steps of {plan['train']['batch_size']} conversations; 1-minute load average "
        f"{load} on this 2-core machine when training started).",
        "",
        "## The data",
        "",
        "A 64×64 canvas holds one to three handwritten digits (the bundled UCI digits, 16×16, on an 8-pixel grid: "
        "each covers 2×2 of the 64 patches), of different values, each in its own quadrant. Three questions: "
        '"which digit is top left ?" (or "which digit ?" when there is one) -> "seven"; "where is the seven ?" -> '
        '"top left"; "how many digits ?" -> "three" (needs the whole image). A training conversation asks '
        'all a canvas answers: every quadrant (an empty one: "none"), every digit on it, the count. Held out: '
        f"{details['held_out']['canvases']} canvases drawn from the digits' own held-out split, one question of "
        f"each type ({details['held_out']['questions']} questions). Exact match of the greedy answer "
        "(`model.generate`).",
        "",
        "## Full model",
        "",
        "| question | exact match (%) |",
        "|---|---|",
        *[f"| {k} | {_pct(v)} |" for k, v in full.items()],
        "",
        f'Target ≥ 95 % on "which": {"met" if details["target_which_at_least_0.95"] else "NOT met"}.',
        "",
    ]
    lines += ["## Methods: accuracy (%) and prefill speed-up at 32, 16 and 8 of 64 image tokens", ""]
    if methods:
        header = "| method | kept | " + " | ".join(QUESTION_TYPES) + " | prefill speed-up | ink reaching the LLM |"
        lines += [header, "|---" * (len(QUESTION_TYPES) + 4) + "|"]
        ink = details.get("ink_kept", {})
        for method, rows in methods.items():
            for fraction in KEPT_FRACTIONS:
                row = rows[fraction]
                cells = " | ".join(_accuracy_cell(row, k) for k in QUESTION_TYPES)
                share = ink.get(method, {}).get(fraction)
                kept = round(float(fraction) * IMAGE_TOKENS)
                lines.append(
                    f"| {method} | {kept} | {cells} | {row['prefill_speedup']:.2f}× | "
                    f"{'' if share is None else _pct(share) + ' %'} |"
                )
        lines += [
            "",
            "Prefill speed-up: the median time of one forward of "
            f"{plan['timing_batch']} prompts (tower included) of the unmodified model over that of the trimmed one, "
            f"timed in turns ({plan['repeats']} repeats) on this machine, 1-minute load average "
            f"{_load(details['load_average_at_evaluation'])} (2 cores). "
            + _options_note(list(methods))
            + f" {', '.join(SEEDED_BASELINES)}: the mean over seeds {', '.join(map(str, BASELINE_SEEDS))}, the lowest "
            "and highest seed's accuracy in brackets.",
            "",
        ]
        ink = details.get("ink_kept", {})
        if ink:
            most = sorted(ink, key=lambda m: -ink[m]["0.125"])
            lines += [
                "At 8 tokens, the methods that keep the most ink: "
                + ", ".join(f"{m} {_pct(ink[m]['0.125'])} %" for m in most)
                + ". A method below random keeps background instead of digits.",
                "",
            ]
    else:
        lines += ["No method of vitrim.vlm ran in this run (vitrim.vlm was not available): only the full model.", ""]
    if sweep.not_run:
        lines += ["Methods that did not run on this model, and why:", ""]
        lines += [f"- {m}: {why}" for m, why in sweep.not_run.items()] + [""]
    lines += ["## Pictures", ""]
    lines += [f"![{f}]({f})" for f in files] + [""]
    wrong = [(q, a) for q, a in zip(data.questions, answers) if a != " ".join(q.answer)][:8]
    if wrong:
        lines += ["Some answers the full model got wrong:", ""]
        lines += [f'- "{" ".join(q.words)}" -> "{a}" (expected "{" ".join(q.answer)}")' for q, a in wrong] + [""]
    lines += [
        "## Reproduce",
        "",
        "    vitrim demo vlm                 # the shipped weights: evaluate, sweep, draw (this report)",
        "    vitrim demo vlm --retrain       # train the model from scratch first",
        '    vitrim vlm ask --image digit.png "which digit ?" --method fastv --keep 0.25',
        "    vitrim viz vlm --method visionzip --keep 0.125 --out kept.png",
        "",
    ]
    return "\n".join(lines)
