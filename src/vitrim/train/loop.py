"""The training loop: one function, ``train(config)``, for a single process or every rank under ``torchrun``.

Each epoch: re-draw the training placements and the batch order from ``(seed, epoch)``, reseed the RNGs that
dropout and drop-path use from ``(seed, epoch, rank)``, run AdamW steps (warm-up + cosine per step, label
smoothing, gradient clipping, optional bf16 autocast), evaluate on the test split, and on rank 0 write
``metrics.jsonl`` and the checkpoints (atomically; see :mod:`vitrim.train.state`). Because everything random is a
function of ``(seed, epoch, rank)`` and the optimiser and scheduler states are saved, a run resumed after epoch k
ends with exactly the weights and metrics of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from vitrim.data import DataSplits, build_datasets, dataset_classes
from vitrim.factory import create_model
from vitrim.models import list_models
from vitrim.train.distributed import (
    DistInfo,
    GlobalBatchSampler,
    all_reduce_sum,
    barrier,
    cleanup_distributed,
    setup_distributed,
)
from vitrim.train.evaluate import evaluate
from vitrim.train.optim import build_optimizer
from vitrim.train.state import (
    capture_rng,
    load_training_state,
    restore_rng,
    save_training_state,
    write_run_record,
)

LAST, BEST, WEIGHTS = "last.pt", "best.safetensors", "last.safetensors"
METRICS = "metrics.jsonl"


@dataclass
class TrainConfig:
    """Settings of one run; ``vitrim train`` fills it from the command line. Defaults suit a small ViT on digits."""

    model: str
    data: str = "digits"
    out: str = "runs/train"
    epochs: int = 10
    overrides: dict[str, Any] = field(default_factory=dict)  # create_model(**overrides), timm's names
    batch_size: int = 64  # global: split over ranks under torchrun
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    min_lr_factor: float = 0.01  # the cosine ends at lr × this
    label_smoothing: float = 0.1
    clip_grad: float | None = 1.0  # max global gradient norm; None: no clipping
    bf16: bool = False
    seed: int = 0
    resume: bool = False
    quiet: bool = False
    device: str = "auto"
    eval_batch_size: int = 256
    test_fraction: float = 0.2
    clutter: int = 0  # digits only: fragments of other digits per image
    noise: float = 0.0  # digits only: std of Gaussian pixel noise
    align: int = 1  # digits only: the digit's corner on multiples of this many pixels
    # DynamicViT fine-tuning from a dense checkpoint (see vitrim.train.distill)
    teacher: str | None = None
    backbone_lr_scale: float = 0.01
    freeze_backbone_epochs: int = 1
    distill: dict[str, Any] = field(default_factory=dict)  # keyword arguments of vitrim.losses.DynamicViTLoss

    def validate(self) -> None:
        """Raise ValueError / FileNotFoundError naming the bad setting, before anything is built."""
        if self.model not in list_models():
            create_model(self.model)  # raises the registry's error, with close matches
        for name in ("epochs", "batch_size", "eval_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name.replace('_', ' ')} must be a positive int, got {value!r}")
        if "num_classes" in self.overrides:
            raise ValueError("num_classes is set from the data's classes; remove it from --set")
        if "keep_ratio" in self.overrides:
            rho = self.overrides["keep_ratio"]
            if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 < rho <= 1:
                raise ValueError(f"keep_ratio must be in (0, 1], got {rho!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(f"clip grad must be positive (or None), got {self.clip_grad!r}")
        if not self.warmup_epochs >= 0:
            raise ValueError(f"warmup epochs must be >= 0, got {self.warmup_epochs!r}")
        if self.data != "digits" and not Path(self.data).is_dir():
            raise FileNotFoundError(f"data folder {self.data!r} does not exist (expected 'digits' or a folder)")
        if self.teacher is not None:
            if not self.model.startswith("dynamicvit_"):
                raise ValueError(f"--teacher needs a dynamicvit_* model, got {self.model!r}")
            if not Path(self.teacher).is_file():
                raise FileNotFoundError(f"teacher checkpoint {self.teacher!r} does not exist")

    def run_record(self) -> dict[str, Any]:
        """The settings as plain JSON-able values (stored with the checkpoints)."""
        return dataclasses.asdict(self)


def _seed_epoch(seed: int, epoch: int, rank: int) -> None:
    """Dropout / drop-path randomness of an epoch depends on (seed, epoch, rank) only, so resuming is exact."""
    value = (seed * 1_000_003 + epoch) * 1_009 + rank
    torch.manual_seed(value)
    random.seed(value)


def input_spec(model: nn.Module) -> tuple[tuple[int, int], int]:
    """(img_size, in_chans) the model was built for (its ``config``)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "img_size") or not hasattr(config, "in_chans"):
        raise TypeError(f"model {type(model).__name__} has no config.img_size / config.in_chans to size the data")
    height, width = config.img_size
    return (int(height), int(width)), int(config.in_chans)


def build_data(config: TrainConfig, img_size: tuple[int, int], in_chans: int) -> DataSplits:
    digits = config.data == "digits"
    options = dict(clutter=config.clutter, noise=config.noise, align=config.align) if digits else {}
    return build_datasets(
        config.data,
        img_size=img_size,
        in_chans=in_chans,
        seed=config.seed,
        test_fraction=config.test_fraction,
        **options,
    )


class CrossEntropyObjective:
    """Plain supervised training: cross-entropy with label smoothing on ``model(images)``."""

    def __init__(self, label_smoothing: float) -> None:
        self.label_smoothing = label_smoothing

    def __call__(self, model: nn.Module, images: Tensor, labels: Tensor, epoch: int) -> Tensor:
        return F.cross_entropy(model(images), labels, label_smoothing=self.label_smoothing)

    def after_backward(self, model: nn.Module, epoch: int) -> None:
        """Hook between backward and the optimiser step (DynamicViT freezes its backbone here)."""


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


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


def _train(config: TrainConfig, info: DistInfo) -> dict[str, Any]:
    out = Path(config.out)
    if config.batch_size % info.world_size:
        raise ValueError(f"batch size {config.batch_size} is not divisible by the world size {info.world_size}")
    if not config.resume and (out / LAST).exists():
        raise ValueError(f"run folder {str(out)!r} already holds {LAST}; pass --resume to continue it or pick --out")
    classes = dataset_classes(config.data)
    overrides = dict(config.overrides)
    if config.teacher is not None:
        from vitrim.train.distill import teacher_architecture

        overrides = {**teacher_architecture(config.teacher), **overrides}  # the student is built like its teacher
    torch.manual_seed(config.seed)  # the same initial weights on every rank and in every repeat
    model = create_model(config.model, num_classes=len(classes), **overrides).to(info.device)
    data = build_data(config, *input_spec(model))
    overrides["num_classes"] = data.num_classes
    run_record = {**config.run_record(), "overrides": overrides, "classes": data.classes}

    objective: Any = CrossEntropyObjective(config.label_smoothing)
    lr_multiplier = None
    if config.teacher is not None:
        from vitrim.train.distill import DistillObjective

        objective = DistillObjective.from_teacher(model, config, info.device)
        lr_multiplier = objective.lr_multiplier
    train_model: nn.Module = objective.wrap(model) if hasattr(objective, "wrap") else model
    if info.enabled:
        ids = [info.device.index] if info.device.type == "cuda" else None
        train_model = nn.parallel.DistributedDataParallel(train_model, device_ids=ids)

    num_train = len(data.train)  # type: ignore[arg-type]
    sampler = GlobalBatchSampler(
        num_train, config.batch_size, rank=info.rank, world_size=info.world_size, seed=config.seed
    )
    steps_per_epoch = len(sampler) // sampler.local_batch
    if steps_per_epoch == 0:
        raise ValueError(f"batch size {config.batch_size} exceeds the {num_train} training images")
    loader = DataLoader(data.train, batch_size=sampler.local_batch, sampler=sampler)
    total_steps = config.epochs * steps_per_epoch
    warmup = min(total_steps, round(config.warmup_epochs * steps_per_epoch))
    optimizer, scheduler = build_optimizer(
        model,
        lr=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=warmup,
        total_steps=total_steps,
        min_lr_factor=config.min_lr_factor,
        lr_multiplier=lr_multiplier,
    )

    start_epoch, best_top1 = 0, -1.0
    if config.resume:
        state = load_training_state(out / LAST)
        _check_resumable(state.get("run", {}), config)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        start_epoch, best_top1 = int(state["epoch"]), float(state["best_top1"])
        if info.is_main:
            _truncate_metrics(out / METRICS, start_epoch)

    if info.is_main:
        write_run_record(out, run_record)
    writer = _tensorboard(out) if info.is_main else None
    show_bar = info.is_main and not config.quiet and sys.stderr.isatty()
    metrics: dict[str, Any] = {}
    for epoch in range(start_epoch, config.epochs):
        _seed_epoch(config.seed, epoch, info.rank)
        data.train.set_epoch(epoch)  # type: ignore[attr-defined]
        sampler.set_epoch(epoch)
        train_model.train()
        bar = _progress(steps_per_epoch, show_bar, f"epoch {epoch + 1}/{config.epochs}")
        loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
        seen, start = 0, time.perf_counter()
        for images, labels in loader:
            images, labels = images.to(info.device, non_blocking=True), labels.to(info.device, non_blocking=True)
            with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=config.bf16):
                loss = objective(train_model, images, labels, epoch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            objective.after_backward(model, epoch)
            if config.clip_grad is not None:
                nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach().double() * len(labels)
            seen += len(labels)
            if bar is not None:
                elapsed = time.perf_counter() - start
                bar.set_postfix(loss=f"{loss.item():.4f}", img_s=f"{seen * info.world_size / elapsed:.0f}")
                bar.update()
        if bar is not None:
            bar.close()
        train_seconds = time.perf_counter() - start
        totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(seen), device=info.device).double()]), info)
        test = evaluate(
            model,
            data.test,
            num_classes=data.num_classes,
            batch_size=config.eval_batch_size,
            info=info,
            bf16=config.bf16,
        )
        metrics = {
            "epoch": epoch + 1,
            "train_loss": (totals[0] / totals[1]).item(),
            "lr": max(scheduler.get_last_lr()),  # the largest group's (DynamicViT: the predictors')
            "train_images_per_s": totals[1].item() / train_seconds,
            **{f"test_{k}": v for k, v in test.items()},
        }
        best_top1 = max(best_top1, metrics["test_top1"])
        if info.is_main:
            _save_epoch(out, model, optimizer, scheduler, epoch, best_top1, metrics, run_record)
            _log(out, metrics, writer, config.quiet)
    if writer is not None:
        writer.close()
    return {**metrics, "best_top1": best_top1, "out": str(out), "rank": info.rank}


def _save_epoch(
    out: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    epoch: int,
    best_top1: float,
    metrics: dict[str, Any],
    run_record: dict[str, Any],
) -> None:
    """Weights first, resume state last: if a crash interrupts, last.pt still points at a consistent epoch."""
    from vitrim.checkpoint import save_checkpoint

    save_checkpoint(model, out / WEIGHTS)
    if metrics["test_top1"] >= best_top1:
        save_checkpoint(model, out / BEST)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch + 1,  # epochs completed
        "best_top1": best_top1,
        "rng": capture_rng(),
        "sampler": {"seed": run_record["seed"], "epoch": epoch + 1},
        "metrics": {k: v for k, v in metrics.items() if k != "test_per_class"},
        "run": run_record,
    }
    save_training_state(out / LAST, state)


def _log(out: Path, metrics: dict[str, Any], writer: Any, quiet: bool) -> None:
    with open(out / METRICS, "a") as f:
        f.write(json.dumps(metrics) + "\n")
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
    """Drop metric lines of epochs after the checkpoint (written before a crash, about to be redone)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["epoch"] <= epochs_done]
        path.write_text("".join(line + "\n" for line in lines))


_MUST_MATCH = ("model", "data", "epochs", "batch_size", "lr", "weight_decay", "warmup_epochs", "seed", "teacher")


def _check_resumable(saved: dict[str, Any], config: TrainConfig) -> None:
    """A resume must continue the same run: the settings that shape the trajectory must not change."""
    now = config.run_record()
    changed = [k for k in _MUST_MATCH if k in saved and saved[k] != now[k]]
    saved_overrides = {k: v for k, v in saved.get("overrides", {}).items() if k != "num_classes"}
    if json.loads(json.dumps(config.overrides)) != saved_overrides:
        changed.append("overrides")
    if changed:
        details = ", ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in changed)
        raise ValueError(f"cannot resume: settings differ from the saved run ({details})")
