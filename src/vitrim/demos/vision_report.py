"""``report.md`` of ``vitrim demo``: the table, where the weights came from, the pictures, how to reproduce."""

from __future__ import annotations

from typing import Any

from vitrim.train import TrainConfig


def report(
    summary: dict[str, Any], pictures: list[str], configs: dict[str, TrainConfig], digits: dict[str, Any], threads: int
) -> str:
    """The report of a demo run: ``configs`` are the recipe's runs (one per model, in order), ``digits`` the data
    options, ``threads`` the torch threads the recipe trains on (0: torch's choice)."""
    names = [n for n in configs if n in summary]
    lines = [
        "# vitrim demo: dense ViT, DynamicViT and a CNN on bundled handwritten digits",
        "",
        "Data: the 1,797 UCI handwritten digits (Alpaydin & Kaynak, CC BY 4.0), each scaled to half the canvas at a"
        f" random position on multiples of {digits['align']} pixels, with {digits['clutter']} fragment(s)"
        f" of another digit and noise {digits['noise']}; a fixed, stratified 80/20 split. Top-1 is the last"
        " epoch's model on the held-out split (no model selection on it).",
        "",
        "| model | top-1 | GFLOPs / image | images/s | speed-up vs dense | params | train s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        r = summary[name]
        lines.append(
            f"| {name} (`{r['model']}`) | {100 * r['top1']:.2f}% | {r['gflops']:.4f} | {r['images_per_s']:.0f} |"
            f" {r['speedup']:.2f}x | {r['params']:,} | {r['train_seconds']:.0f} |"
        )
    lines += ["", _provenance(summary, names)]
    targets = summary["targets"]
    lines += ["", "Targets: " + "; ".join(f"{k}: {'reached' if v else 'NOT reached'}" for k, v in targets.items())]
    for name in (n for n in names if "kept_per_stage" in summary[n]):
        kept = summary[name]["kept_per_stage"]
        lines += [
            "",
            f"{name} kept, per stage, " + ", ".join(f"{100 * d:.0f}%" for d in kept["digit"]) + " of the digit"
            " patches (any ink) and " + ", ".join(f"{100 * b:.0f}%" for b in kept["background"]) + " of the"
            " background patches of these test images.",
        ]
    lines += [
        "",
        "Images/s: one batch of test images, the models timed in turns (median), so they share the load of"
        " the machine; on a busy machine the absolute numbers are low but the ratios hold better.",
        "",
        "## Kept tokens per stage (pruned patches washed out): without and with registers, side by side",
        "",
        "| without registers | with registers |",
        "|---|---|",
    ]
    plain = [p for p in pictures if p.startswith("kept_tokens_") and not p.startswith("kept_tokens_reg_")]
    with_reg = [p for p in pictures if p.startswith("kept_tokens_reg_")]
    for i, a in enumerate(plain):
        b = with_reg[i] if i < len(with_reg) else ""
        lines.append(f"| ![{a}]({a}) | {f'![{b}]({b})' if b else ''} |")
    lines += ["", "## Accuracy vs speed", "", "![accuracy vs speed](accuracy_vs_speed.png)", "", "## Reproduce", ""]
    lines += ["`vitrim demo --retrain` runs these commands, in this order:", ""]
    threads_flag = f" --threads {threads}" if threads else ""
    for c in configs.values():
        sets = " ".join(f"--set {k}={_literal(v)}" for k, v in c.overrides.items())
        extra = (
            f" --teacher {c.teacher} --freeze-backbone-epochs {c.freeze_backbone_epochs}"
            f" --backbone-lr-scale {c.backbone_lr_scale}"
            if c.teacher
            else ""
        )
        extra += "".join(f" --distill {k}={v}" for k, v in c.distill.items())
        data = "".join(f" --{k} {getattr(c, k)}" for k in ("clutter", "noise", "align") if getattr(c, k))
        lines.append(
            f"    vitrim train --model {c.model} --epochs {c.epochs} --lr {c.lr} --batch-size {c.batch_size}"
            f" --warmup-epochs {c.warmup_epochs} --seed {c.seed}{data} --out {c.out}{extra} {sets}{threads_flag}"
        )
    lines += ["    vitrim eval <run>/last.safetensors --json eval.json", ""]
    lines += ["Cross-attention on a translation task: `vitrim demo translate` (`make demo` runs it next) writes"
              " [runs/translate/report.md](../translate/report.md).", ""]  # fmt: skip
    return "\n".join(lines)


def _provenance(summary: dict[str, Any], names: list[str]) -> str:
    """Where the weights came from: trained by this run, or shipped (and whether they score as when trained)."""
    rows = [summary[n] for n in names]
    threads, seconds = rows[0]["train_threads"], sum(r["train_seconds"] for r in rows)
    if summary["weights"] == "trained":
        return f"Weights: trained by this run ({seconds:.0f} s of training on {threads} thread(s))."
    changed = [f"{n}: {100 * summary[n]['top1_when_trained']:.2f}% when trained" for n in names
               if summary[n]["top1"] != summary[n]["top1_when_trained"]]  # fmt: skip
    return (
        f"Weights: shipped with vitrim, made by `vitrim demo --retrain` (the commands under Reproduce; {seconds:.0f} s"
        f" of training on {threads} thread(s)); top-1 measured now, "
        + ("the same as when they were trained." if not changed else "NOT as when trained: " + "; ".join(changed))
    )


def _literal(value: Any) -> str:
    """A value as ``--set`` parses it back (bare words stay strings)."""
    if isinstance(value, str) and value.isidentifier():
        return value
    text = repr(tuple(value) if isinstance(value, list) else value)
    return f'"{text}"' if any(c in text for c in " '(),") else text
