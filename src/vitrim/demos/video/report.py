"""``report.md`` of ``vitrim demo video``: the model, the data, the full model's accuracy, the methods' table and
plot (:func:`vitrim.demos.vlm.pictures.plot_accuracy_vs_kept`, on video tokens), what did not run, how to reproduce.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitrim.demos.video.data import FRAME, FRAMES, QUESTION_TYPES, TEMPORAL, TOKENS_PER_TEMPORAL_PATCH
from vitrim.demos.video.sweep import KEPT_FRACTIONS, SweepResult
from vitrim.demos.video.words import VIDEO_TOKENS, WORDS
from vitrim.demos.vlm.sweep import BASELINE_SEEDS, SEEDED_BASELINES

PLOT_FILE = "accuracy_vs_kept.png"


def write_report(out: Path, summary: dict[str, Any], details: dict[str, Any], sweep: SweepResult) -> None:
    """Draw the plot (when a method ran) and write ``report.md`` into ``out``."""
    from vitrim.demos.vlm.pictures import plot_accuracy_vs_kept
    from vitrim.viz.maps import save_figure

    if summary["methods"]:
        swept = {**summary, "full": details["full_on_swept_clips"]}  # the full model on the methods' clips
        figure = plot_accuracy_vs_kept(swept, kinds=QUESTION_TYPES, tokens=VIDEO_TOKENS, unit="video")
        save_figure(figure, out / PLOT_FILE)
    (out / "report.md").write_text(markdown(summary, details, sweep))


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _cell(row: dict[str, Any], kind: str) -> str:
    if "accuracy_by_seed" not in row:
        return _pct(row["accuracy"][kind])
    seeds = [one[kind] for one in row["accuracy_by_seed"]]
    return f"{_pct(row['accuracy'][kind])} [{_pct(min(seeds))}–{_pct(max(seeds))}]"


def table(summary: dict[str, Any], full: dict[str, float]) -> list[str]:
    """The methods' table (markdown lines): the full model on the same clips (``full``), then per method and kept
    fraction the video tokens it kept (measured), the exact match per question type and the prefill speed-up."""
    lines = [
        "| method | asked | video tokens kept | " + " | ".join(QUESTION_TYPES) + " | prefill speed-up |",
        "|---" * (len(QUESTION_TYPES) + 4) + "|",
        "| full model | 100 % | 64 | " + " | ".join(_pct(full[k]) for k in QUESTION_TYPES) + " | 1.00× |",
    ]
    for method, rows in summary["methods"].items():
        for fraction in KEPT_FRACTIONS:
            row = rows[fraction]
            cells = " | ".join(_cell(row, k) for k in QUESTION_TYPES)
            lines.append(
                f"| {method} | {float(fraction) * 100:g} % | {row['kept_tokens']:.1f} | {cells} | "
                f"{row['prefill_speedup']:.2f}× |"
            )
    return lines


def markdown(summary: dict[str, Any], details: dict[str, Any], sweep: SweepResult) -> str:
    training, plan, full = details["training"], details["plan"], summary["full"]
    met = all(full[k] >= details["target"] for k in QUESTION_TYPES)
    lines = [
        "# The digits video model: accuracy against video tokens kept",
        "",
        "## The model",
        "",
        "transformers' `Qwen2VLForConditionalGeneration` at toy size: Qwen2-VL's vision tower (3-D patch embedding "
        f"over 2 frames × 4×4 pixels, {plan['vision'].get('depth', 3)} blocks, the 2×2 patch merger) and a Qwen2 "
        f"decoder with M-RoPE (4 layers), over a vocabulary of {len(WORDS)} words; "
        f"{training['parameters']:,} parameters. Trained from scratch in {training['seconds']:.0f} s on "
        f"{training['threads']} thread(s) of this 2-core machine ({plan['train']['tower_steps']} tower steps, "
        f"{plan['train']['steps']} steps of {plan['train']['batch_size']} conversations; load average "
        f"{training['load_average_before']} when training started).",
        "",
        "## The data",
        "",
        f"A clip is {FRAMES} frames of {FRAME}×{FRAME} pixels, {TEMPORAL} temporal patches of 2 frames: "
        f"{TEMPORAL} × {TOKENS_PER_TEMPORAL_PATCH} = {VIDEO_TOKENS} video tokens. One handwritten digit appears "
        "at some temporal patch, moves at every temporal patch and may vanish. Questions: "
        '"which digit appears ?" -> "seven"; "when does it appear ?" -> "first half" / "second half"; "how many '
        'frames show it ?" -> "two" … "eight". Held out: '
        f"{details['held_out']['clips']} clips of glyphs never seen in training, one question of each type "
        f"({details['held_out']['questions']} questions); exact match of the greedy answer (`model.generate`).",
        "",
        "## The full model",
        "",
        "| question | exact match (%) |",
        "|---|---|",
        *[f"| {k} | {_pct(full[k])} |" for k in QUESTION_TYPES],
        "",
        f"Target: the full model ≥ 95 % on every question type: {'met' if met else 'NOT met'}.",
        "",
        "## Methods: exact match (%) at 50, 25 and 12.5 % of the video tokens",
        "",
        f"On the first {details['held_out']['swept_clips']} held-out clips (the full model's row: on those too).",
        "",
        *table(summary, details["full_on_swept_clips"]),
        "",
        f"{', '.join(SEEDED_BASELINES)}: the mean over seeds {', '.join(map(str, BASELINE_SEEDS))}, the lowest and "
        "highest seed's in brackets. Video tokens kept: measured (`last_selection`), the mean over the timing batch. "
        f"Prefill speed-up: the median of {plan['repeats']} interleaved prefills of {plan['timing_batch']} prompts, "
        f"load average {details['load_average_at_evaluation']}.",
        "",
        f"![accuracy against video tokens kept]({PLOT_FILE})" if summary["methods"] else "No method ran.",
        "",
    ]
    if sweep.not_run:
        lines += ["Methods that did not run on this model, and why:", ""]
        lines += [f"- {m}: {why}" for m, why in sweep.not_run.items()] + [""]
    lines += [
        "## Reproduce",
        "",
        "    vitrim demo video               # the shipped weights: evaluate, sweep, draw (this report)",
        "    vitrim demo video --retrain     # train the model from scratch first",
        "",
    ]
    return "\n".join(lines)
