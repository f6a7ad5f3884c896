"""``report.md`` of ``vitrim demo translate``: the numbers, how they were measured, the pictures, how to reproduce."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def report(summary: dict[str, Any], out: Path) -> str:
    data, train, model = summary["data"], summary["train"], summary["model"]
    layer = summary["alignment_layer"]
    lines = [
        "# vitrim demo translate: cross-attention at work",
        "",
        f"English number words 1 … {data['max_number']} → German (split into morphemes) and French, written by"
        f" `num2words`; one encoder–decoder for both languages (the decoder's first token names the language)."
        f" A fixed, seeded split: {data['train_numbers']} numbers to train on, {data['test_numbers']} held out"
        " (no number in both, in either language). Every number below is on the held-out numbers.",
        "",
        "| | exact match (greedy) | chrF | alignment accuracy | held-out sentences |",
        "|---|---:|---:|---:|---:|",
        f"| all | {100 * summary['exact_match']:.2f}% | {summary['chrf']:.2f} |"
        f" {100 * summary['alignment_accuracy']:.2f}% | {summary['sentences']} |",
    ]
    for lang, row in summary["alignment_by_language"].items():
        scores = summary[lang]
        lines.append(
            f"| {lang} | {100 * scores['exact_match']:.2f}% | {scores['chrf']:.2f} | {100 * row:.2f}%"
            f" | {scores['sentences']} |"
        )
    targets = summary["targets"]
    lines += [
        "",
        "Targets: " + "; ".join(f"{k}: {'reached' if v else 'NOT reached'}" for k, v in targets.items()),
        "",
        _time(summary, train) + f" Model: dim {model['dim']}, {model['encoder_depth']} + {model['decoder_depth']}"
        f" layers, {model['num_heads']} heads, dropout {model['dropout']}, {summary['parameters']:,} parameters.",
        "",
        "## How it is scored",
        "",
        "- exact match: the greedy translation equals num2words' text, token for token; chrF: sacrebleu's corpus chrF"
        " of the detokenized text (German morphemes joined, French hyphens restored).",
        f"- alignment accuracy: the reference translation is fed to the decoder (teacher forcing); for each target"
        f" token, the row of decoder layer {layer}'s cross-attention that predicted it, averaged over the heads, must"
        f" be largest at the English word it is aligned to. Scored: {summary['alignment_tokens']} target tokens (every"
        " token but `<eos>` and French hyphens). The rule: a target word is aligned to the English word of the same"
        " group (thousands, hundreds, rest) and role (digit, thousand/hundred, tens, units, teen, connector);"
        " German `und` and French `et` to the English hyphen; all of `quatre-vingt-dix` to `ninety`. See"
        " `vitrim.data.numbers`.",
        "- the layer is chosen on 2,000 *training* pairs (accuracy per decoder layer there: "
        + ", ".join(f"layer {i}: {100 * a:.1f}%" for i, a in enumerate(summary["alignment_train_by_layer"]))
        + "); on the held-out pairs: "
        + ", ".join(f"layer {i}: {100 * a:.1f}%" for i, a in enumerate(summary["alignment_test_by_layer"]))
        + ".",
        "",
        "## Cross-attention of held-out sentences",
        "",
        "Rows: the target tokens (queries), the last row is the step that wrote `<eos>`; columns: the English tokens"
        " (keys and values). Each row sums to 1. A red frame marks the true alignment, a dot the row's largest"
        " weight. In German the units come before the tens: the frames of `ein und zwanzig` (over `twenty - one`) run"
        " along the anti-diagonal, top-right to bottom-left, instead of the diagonal: the attention crosses.",
        "",
    ]
    lines += [f"![{name}]({name})" for name in summary["pictures"]]
    if summary["errors"]:
        lines += ["", "## Held-out sentences translated wrongly (at most 20)", "", "| number | lang | expected | got |",
                  "|---:|---|---|---|"]  # fmt: skip
        lines += [f"| {e['number']} | {e['lang']} | {e['expected']} | {e['got']} |" for e in summary["errors"]]
    lines += [
        "",
        "## Use it",
        "",
        f'    vitrim translate "twenty-one" --run {out} --to de --show-attention twenty_one.png',
        f'    vitrim translate "ninety-seven" --run {out} --to fr --beam 4',
        "    vitrim explain --cross          # one cross-attention matrix by hand",
        "",
    ]
    return "\n".join(lines)


def _time(summary: dict[str, Any], train: dict[str, Any]) -> str:
    steps = f"{train['steps']} steps{', stopped early by the time limit' if train['stopped_early'] else ''}"
    if summary.get("weights") == "shipped":
        return (
            f"Time: {summary['seconds']:.0f} s on {summary['threads']} thread(s), scoring and drawing the model shipped"
            f" with vitrim; `vitrim demo translate --retrain` made it ({train['train_seconds']:.0f} s of training,"
            f" {steps}, on {train['threads']} thread(s)) and trains it again from scratch."
        )
    return (
        f"Time: {summary['seconds']:.0f} s in all ({train['train_seconds']:.0f} s training, {steps}) on"
        f" {summary['threads']} thread(s)."
    )
