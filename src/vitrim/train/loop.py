"""The training loop: one function, ``train(config)``, for a single process or every rank under ``torchrun``.

Each epoch: re-draw the training placements and the batch order from ``(seed, epoch)``, reseed the RNGs that
dropout and drop-path use from ``(seed, epoch, rank)``, run AdamW steps (warm-up + cosine per step, label
smoothing, gradient clipping, optional bf16 autocast), evaluate on the test split, and on rank 0 write
``metrics.jsonl`` and the checkpoints (atomically; see :mod:`vitrim.train.state`). Because everything random is a
function of ``(seed, epoch, rank)`` and the optimiser and scheduler states are saved, a run resumed after epoch k
ends with exactly the weights and metrics of an uninterrupted run.

``last.pt`` is the commit point of an epoch: it is written last, after the weights and the epoch's metrics line.
Every start (fresh or resumed) first cuts ``metrics.jsonl`` back to the epochs ``last.pt`` holds, so a kill at any
moment loses no finished epoch's line and leaves no line (or torn half-line) of an epoch that will be run again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitrim import reduce
from vitrim.atomic import atomic_write, remove_stale_temps
from vitrim.data import DataSplits, MixupCutmix, build_datasets, dataset_classes
from vitrim.factory import create_model
from vitrim.models.data_config import DataConfig
from vitrim.seeds import epoch_seed
from vitrim.train.config import TrainConfig
from vitrim.train.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    cleanup_distributed,
    setup_distributed,
)
from vitrim.train.evaluate import evaluate
from vitrim.train.loaders import TrainBatches, lockstep, progress_bar, resolve_workers, train_batches
from vitrim.train.objective import CrossEntropyObjective, Objective
from vitrim.train.optim import build_optimizer
from vitrim.train.state import (
    RUN_RECORD,
    capture_rng,
    check_run_record,
    load_training_state,
    restore_rng,
    save_training_state,
    write_run_record,
)
from vitrim.train.teacher import load_teacher, teacher_architecture
from vitrim.untrusted import parse_json
from vitrim.weights.checkpoint import save_checkpoint
from vitrim.weights.formats import read_checkpoint

LAST, BEST, WEIGHTS = "last.pt", "best.safetensors", "last.safetensors"
METRICS = "metrics.jsonl"
LARGE_GRADIENT = 1e4  # a gradient norm above this is clipped with a warning: training is close to diverging


class TrainingDiverged(ValueError):
    """The loss or the gradients became NaN or infinite; the checkpoints of the last finished epoch are kept."""


def _seed_epoch(seed: int, epoch: int, rank: int) -> None:
    """Dropout / drop-path randomness of an epoch depends on (seed, epoch, rank) only, so resuming is exact."""
    value = epoch_seed(seed, epoch, rank)
    torch.manual_seed(value)
    random.seed(value)


def input_spec(model: nn.Module) -> tuple[tuple[int, int], int]:
    """(img_size, in_chans) the model was built for (its ``config``)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "img_size") or not hasattr(config, "in_chans"):
        raise TypeError(f"model {type(model).__name__} has no config.img_size / config.in_chans to size the data")
    height, width = config.img_size
    return (int(height), int(width)), int(config.in_chans)


def model_data_config(model: nn.Module, run: dict[str, Any] | None = None) -> DataConfig:
    """How the model wants its images: ``model.data_config``, else the one its run recorded (a model rebuilt from a
    checkpoint may not carry one), else vitrim's mean/std 0.5 at its size."""
    config = getattr(model, "data_config", None)
    if isinstance(config, DataConfig):
        return config
    if run and "data_config" in run:
        return DataConfig.from_record(run["data_config"], "run.json's 'data_config'")
    img_size, in_chans = input_spec(model)
    return DataConfig().for_input(in_chans, img_size)


def build_data(config: TrainConfig, data_config: DataConfig, info: DistInfo) -> DataSplits:
    digits = config.data == "digits"
    options = dict(clutter=config.clutter, noise=config.noise, align=config.align) if digits else {}
    return build_datasets(
        config.data,
        data_config=data_config,
        augment=None if digits else config.augment(),
        val_data=config.val_data,
        rank=info.rank,
        world_size=info.world_size,
        seed=config.seed,
        test_fraction=config.test_fraction,
        **options,
    )


def _tensorboard(out: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(out / "tensorboard"))


def train(config: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training; returns the last epoch's metrics with ``best_top1`` and ``out``. See module doc."""
    config.validate()
    info = setup_distributed(config.device)
    try:
        result = _train(config, info)
        barrier(info)
        return result
    finally:
        cleanup_distributed()


@dataclass
class _Run:
    """Everything one run trains with, built once (and restored on resume)."""

    model: nn.Module
    train_model: nn.Module  # what the loop calls: the objective's view of the model, DDP-wrapped under torchrun
    objective: Objective
    data: DataSplits
    batches: TrainBatches
    mix: MixupCutmix | None  # mixup / cutmix of each micro-batch, on the device
    optimizer: torch.optim.Optimizer
    scheduler: Any
    record: dict[str, Any]  # the settings as stored next to the checkpoints
    warned: bool = False  # a large gradient norm was reported


def _build(config: TrainConfig, info: DistInfo) -> _Run:
    classes = dataset_classes(config.data)
    overrides = dict(config.overrides)
    teacher = None if config.teacher is None else read_checkpoint(config.teacher)  # read once, used twice
    if teacher is not None:
        overrides = {**teacher_architecture(teacher), **overrides}  # the student is built like its teacher
    torch.manual_seed(config.seed)  # the same initial weights on every rank and in every repeat
    model = create_model(config.model, num_classes=len(classes), **overrides).to(info.device)
    data_config = model_data_config(model)
    data = build_data(config, data_config, info)
    overrides["num_classes"] = data.num_classes
    # "overrides" rebuilds the model (the teacher's architecture included); "set" is what this run was asked for
    record = {
        **config.run_record(), "overrides": overrides, "set": dict(config.overrides), "classes": data.classes,
        "data_config": dataclasses.asdict(data_config),  # the pixels it trained on: eval shows it the same
    }  # fmt: skip
    dense = None if teacher is None else load_teacher(model, teacher)
    # the reducers' own recipe (MCTF: a second pass at a smaller r; DynamicViT with a teacher: distillation)
    objective: Objective | None = reduce.training_objective(
        model, label_smoothing=config.label_smoothing, options=config.objective_options(), teacher=dense
    )
    if objective is None:
        if dense is not None:
            raise ValueError(
                f"--teacher needs a model whose reducers learn from one (DynamicViT), got {config.model!r}"
            )
        if config.mctf:
            raise ValueError(f"--mctf needs a model with MCTF reducers (--set reducer=mctf), got {config.model!r}")
        objective = CrossEntropyObjective(config.label_smoothing)
    train_model = objective.wrap(model)
    if info.enabled:
        ids = [info.device.index] if info.device.type == "cuda" else None
        train_model = nn.parallel.DistributedDataParallel(train_model, device_ids=ids)
    batches = train_batches(
        data.train,
        batch_size=config.batch_size,
        accum_steps=config.accum_steps,
        info=info,
        seed=config.seed,
        workers=resolve_workers(config.workers, config.data),
        source=data.source,
    )
    total_steps = config.epochs * batches.steps
    optimizer, scheduler = build_optimizer(
        model,
        lr=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=min(total_steps, round(config.warmup_epochs * batches.steps)),
        total_steps=total_steps,
        min_lr_factor=config.min_lr_factor,
        lr_multiplier=objective.lr_multiplier,
    )
    augment = None if config.data == "digits" else config.augment()
    mix = None
    if augment is not None and (augment.mixup > 0 or augment.cutmix > 0):
        mix = MixupCutmix(
            data.num_classes, mixup=augment.mixup, cutmix=augment.cutmix, label_smoothing=config.label_smoothing
        )
    return _Run(model, train_model, objective, data, batches, mix, optimizer, scheduler, record)


def _resume(run: _Run, config: TrainConfig, info: DistInfo, out: Path) -> tuple[int, float]:
    """Restore the state of ``out/last.pt``; returns (epochs done, best top-1 so far)."""
    state = load_training_state(out / LAST)
    _check_resumable(check_run_record(state.get("run", {}), f"{str(out / LAST)!r}'s run settings"), config)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])
    return int(state["epoch"]), float(state["best_top1"])


def _train_epoch(run: _Run, config: TrainConfig, info: DistInfo, epoch: int, show_bar: bool) -> tuple[Tensor, float]:
    """One epoch of optimiser steps; returns (loss × images summed, images) over every rank, and the seconds.

    A step adds up the gradients of ``accum_steps`` micro-batches (each loss divided by their number), so it
    computes the mean gradient of the step's whole batch; DDP all-reduces once, after the last micro-batch.
    """
    _seed_epoch(config.seed, epoch, info.rank)
    run.batches.set_epoch(run.data.train, epoch)
    run.train_model.train()
    accum = config.accum_steps
    bar = progress_bar(run.batches.steps, show_bar, f"epoch {epoch + 1}/{config.epochs}")
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    seen, start, step = 0, time.perf_counter(), 0
    micro_batches = lockstep(run.batches.batches, info, run.batches.steps * accum)
    for index, (images, labels) in enumerate(micro_batches):
        images, labels = images.to(info.device, non_blocking=True), labels.to(info.device, non_blocking=True)
        if run.mix is not None:
            images, labels = run.mix(images, labels)  # labels become soft targets (B, K), label smoothing included
        last = (index + 1) % accum == 0
        no_sync = getattr(run.train_model, "no_sync", None)  # DDP: all-reduce once per step, not per micro-batch
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=config.bf16):
                loss = run.objective(run.train_model, images, labels, epoch)
            where = f"epoch {epoch + 1}, step {step + 1}"
            if not bool(torch.isfinite(loss)):  # before any weight changes: the saved epochs stay good
                raise TrainingDiverged(f"training stopped: the loss is {loss.item()} at {where}; {_kept(config)}")
            (loss / accum).backward()
        loss_sum += loss.detach().double() * len(labels)
        seen += len(labels)
        if not last:
            continue
        _step(run, config, epoch, where)
        step += 1
        if bar is not None:
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{loss.item():.4f}", img_s=f"{seen * info.world_size / elapsed:.0f}")
            bar.update()
    run.optimizer.zero_grad(set_to_none=True)  # a partial step at the end of a stream is dropped
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(seen), device=info.device).double()]), info)
    return totals, seconds


def _step(run: _Run, config: TrainConfig, epoch: int, where: str) -> None:
    """The optimiser step after a step's gradients are in: the objective's hook, clipping, AdamW, the schedule."""
    run.objective.after_backward(run.model, epoch)
    if config.clip_grad is not None:
        norm = float(nn.utils.clip_grad_norm_(run.model.parameters(), config.clip_grad))
        if not math.isfinite(norm):
            raise TrainingDiverged(f"training stopped: the gradient norm is {norm} at {where}; {_kept(config)}")
        if norm > LARGE_GRADIENT and not run.warned:
            run.warned = True  # once a run: the point is to say it, not to flood the log
            warnings.warn(
                f"gradient norm {norm:.3g} at {where} was clipped to {config.clip_grad}; training is close to "
                "diverging (DynamicViT: a dropped token that was an attention sink, see docs/reliability.md)",
                stacklevel=2,
            )
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()


def _train(config: TrainConfig, info: DistInfo) -> dict[str, Any]:
    out = Path(config.out)
    if config.batch_size % info.world_size:
        raise ValueError(f"batch size {config.batch_size} is not divisible by the world size {info.world_size}")
    if not config.resume and (out / LAST).exists():
        raise ValueError(f"run folder {str(out)!r} already holds {LAST}; pass --resume to continue it or pick --out")
    run = _build(config, info)
    start_epoch, best_top1 = _resume(run, config, info, out) if config.resume else (0, -1.0)
    if info.is_main:  # a run killed mid-write (SIGKILL) left a torn temporary file; the file it was replacing is whole
        remove_stale_temps(out, (LAST, BEST, WEIGHTS, RUN_RECORD, METRICS))
        _truncate_metrics(out / METRICS, start_epoch)
        write_run_record(out, run.record)
    writer = _tensorboard(out) if info.is_main else None
    show_bar = info.is_main and not config.quiet and sys.stderr.isatty()
    metrics: dict[str, Any] = {}
    for epoch in range(start_epoch, config.epochs):
        totals, seconds = _train_epoch(run, config, info, epoch, show_bar)
        test = evaluate(
            run.model,
            run.data.test,
            num_classes=run.data.num_classes,
            batch_size=config.eval_batch_size,
            info=info,
            bf16=config.bf16,
            workers=run.batches.workers,
            source=run.data.source,
            progress=show_bar,
        )
        metrics = {
            "epoch": epoch + 1,
            "train_loss": (totals[0] / totals[1]).item(),
            "lr": max(run.scheduler.get_last_lr()),  # the largest group's (DynamicViT: the predictors')
            "train_images_per_s": totals[1].item() / seconds,
            **{f"test_{k}": v for k, v in test.items()},
        }
        best_top1 = max(best_top1, metrics["test_top1"])
        if info.is_main:
            _save_epoch(out, run, epoch, best_top1, metrics)
            _report(metrics, writer, config.quiet)
    if writer is not None:
        writer.close()
    return {**metrics, "best_top1": best_top1, "out": str(out), "rank": info.rank}


def _kept(config: TrainConfig) -> str:
    return f"the checkpoints of the last finished epoch in {config.out!r} are kept (lower --lr, or --clip-grad)"


def _save_epoch(out: Path, run: _Run, epoch: int, best_top1: float, metrics: dict[str, Any]) -> None:
    """Weights and the metrics line first, resume state last: if a crash interrupts, last.pt still points at a
    consistent epoch, and the next start cuts the metrics back to it (see module doc)."""
    save_checkpoint(run.model, out / WEIGHTS)
    if metrics["test_top1"] >= best_top1:
        save_checkpoint(run.model, out / BEST)
    with open(out / METRICS, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "epoch": epoch + 1,  # epochs completed
        "best_top1": best_top1,
        "rng": capture_rng(),
        "sampler": {"seed": run.record["seed"], "epoch": epoch + 1},
        "metrics": {k: v for k, v in metrics.items() if k != "test_per_class"},
        "run": run.record,
    }
    save_training_state(out / LAST, state)


def _report(metrics: dict[str, Any], writer: Any, quiet: bool) -> None:
    if writer is not None:
        for key, value in metrics.items():
            if isinstance(value, float):
                writer.add_scalar(key, value, metrics["epoch"])
    if not quiet:
        print(
            f"epoch {metrics['epoch']}: train loss {metrics['train_loss']:.4f}  test top-1 {metrics['test_top1']:.4f}"
            f"  test loss {metrics['test_loss']:.4f}  {metrics['train_images_per_s']:.0f} img/s",
            flush=True,
        )


def _truncate_metrics(path: Path, epochs_done: int) -> None:
    """Keep the metric lines of the first ``epochs_done`` epochs (those ``last.pt`` holds); drop the lines of later
    epochs, written before a crash and about to be run again, and a line torn by a kill mid-append."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            epoch = parse_json(line, str(path))["epoch"]
        except (ValueError, TypeError, KeyError):  # torn by a kill: only the last line of an unfinished epoch can be
            continue
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch <= epochs_done:
            kept.append(line + "\n")

    def write(tmp: Path) -> None:
        tmp.write_text("".join(kept))

    atomic_write(path, write)


_MUST_MATCH = ("model", "data", "epochs", "batch_size", "lr", "weight_decay", "warmup_epochs", "seed", "teacher")


def _check_resumable(saved: dict[str, Any], config: TrainConfig) -> None:
    """A resume must continue the same run: the settings that shape the trajectory must not change."""
    now = config.run_record()
    changed = [k for k in _MUST_MATCH if k in saved and saved[k] != now[k]]
    saved_overrides = {k: v for k, v in saved.get("set", saved.get("overrides", {})).items() if k != "num_classes"}
    if json.loads(json.dumps(config.overrides)) != json.loads(json.dumps(saved_overrides)):
        changed.append("overrides")
    if changed:
        details = ", ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in changed)
        raise ValueError(f"cannot resume: settings differ from the saved run ({details})")
