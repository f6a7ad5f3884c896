"""Evaluate a classifier on a dataset: top-1, top-5, cross-entropy, per-class accuracy, images/s (DDP-aware)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from vitrim.train.distributed import DistInfo, all_reduce_sum
from vitrim.train.loaders import eval_batches, progress_bar


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    *,
    num_classes: int,
    batch_size: int = 256,
    info: DistInfo | None = None,
    bf16: bool = False,
    workers: int = 0,
    source: str = "the evaluation data",
    progress: bool = False,
) -> dict[str, Any]:
    """Metrics of ``model`` on every sample of ``dataset`` (each rank takes a share; sums are all-reduced).

    Returns ``top1``, ``top5`` (top-min(5, C)), ``loss`` (plain cross-entropy, no smoothing) as fractions / means,
    ``per_class`` (accuracy of each class, None for a class with no sample), ``num_samples`` (readable samples),
    ``num_skipped`` (unreadable files, left out), ``images_per_s`` (end to end: reading, decoding and the model, the
    wall clock of the whole pass over all ranks' images) and ``model_images_per_s`` (this process's model time
    only). ``workers`` DataLoader processes decode files; ``progress`` shows a bar.
    """
    info = info or DistInfo()
    was_training = model.training
    model.eval()
    batches = eval_batches(dataset, batch_size=batch_size, info=info, workers=workers, source=source)
    k = min(5, num_classes)
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    top_k = torch.zeros((), dtype=torch.float64, device=info.device)
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=info.device)  # (true, predicted)
    bar = progress_bar(len(batches), progress, "eval")
    model_seconds, seen, start = 0.0, 0, time.perf_counter()
    for images, labels in batches:
        if int(labels.min()) < 0 or int(labels.max()) >= num_classes:  # on the CPU still: no device sync
            raise ValueError(f"{source} has label {int(labels.max())} but the model predicts {num_classes} classes")
        images, labels = images.to(info.device, non_blocking=True), labels.to(info.device, non_blocking=True)
        begin = time.perf_counter()
        with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(images)  # (B, C)
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        model_seconds += time.perf_counter() - begin
        seen += len(labels)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").double()
        top_k += (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum()
        confusion.index_put_((labels, logits.argmax(dim=1)), torch.ones_like(labels, dtype=torch.float64), True)
        if bar is not None:
            bar.set_postfix(img_s=f"{seen * info.world_size / (time.perf_counter() - start):.0f}")
            bar.update()
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - start
    skipped = torch.tensor([float(batches.num_skipped)], dtype=torch.float64, device=info.device)
    totals = all_reduce_sum(torch.cat([loss_sum[None], top_k[None], skipped, confusion.flatten()]), info).cpu()
    loss_sum, top_k, num_skipped = totals[0], totals[1], int(totals[2])
    num_skipped += int(getattr(dataset, "num_unlisted", 0))  # files a folder's listing left out: the same on every rank
    confusion = totals[3:].view(num_classes, num_classes)
    n = confusion.sum().item()
    model.train(was_training)
    if n == 0:
        raise ValueError(f"{source} has no readable sample to evaluate")
    per_class_n = confusion.sum(dim=1)
    per_class = [(confusion[c, c] / per_class_n[c]).item() if per_class_n[c] > 0 else None for c in range(num_classes)]
    return {
        "top1": (confusion.diagonal().sum() / n).item(),
        "top5": (top_k / n).item(),
        "loss": (loss_sum / n).item(),
        "per_class": per_class,
        "num_samples": int(n),
        "num_skipped": num_skipped,
        "images_per_s": n / wall if wall > 0 else float("nan"),
        "model_images_per_s": seen / model_seconds if model_seconds > 0 else float("nan"),
    }
