"""Evaluate a classifier on a dataset: top-1, top-5, cross-entropy, per-class accuracy, images/s (DDP-aware)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vitrim.train.distributed import DistInfo, GlobalBatchSampler, all_reduce_sum


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    *,
    num_classes: int,
    batch_size: int = 256,
    info: DistInfo | None = None,
    bf16: bool = False,
) -> dict[str, Any]:
    """Metrics of ``model`` on every sample of ``dataset`` (each rank takes a share; sums are all-reduced).

    Returns ``top1``, ``top5`` (top-min(5, C)), ``loss`` (plain cross-entropy, no smoothing) as fractions / means,
    ``per_class`` (accuracy of each class, None for a class with no sample), ``num_samples`` and ``images_per_s``
    (this process's model time only, data loading excluded).
    """
    info = info or DistInfo()
    was_training = model.training
    model.eval()
    sampler = GlobalBatchSampler(
        len(dataset),  # type: ignore[arg-type]
        batch_size * info.world_size,
        rank=info.rank,
        world_size=info.world_size,
        shuffle=False,
        drop_last=False,
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    k = min(5, num_classes)
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    top_k = torch.zeros((), dtype=torch.float64, device=info.device)
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=info.device)  # (true, predicted)
    seconds, seen = 0.0, 0
    for images, labels in loader:
        images, labels = images.to(info.device), labels.to(info.device)
        start = time.perf_counter()
        with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(images)  # (B, C)
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        seconds += time.perf_counter() - start
        seen += len(labels)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").double()
        top_k += (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum()
        confusion.index_put_((labels, logits.argmax(dim=1)), torch.ones_like(labels, dtype=torch.float64), True)
    totals = all_reduce_sum(torch.cat([loss_sum[None], top_k[None], confusion.flatten()]), info).cpu()
    loss_sum, top_k, confusion = totals[0], totals[1], totals[2:].view(num_classes, num_classes)
    n = confusion.sum().item()
    model.train(was_training)
    if n == 0:
        raise ValueError("evaluation dataset is empty")
    per_class_n = confusion.sum(dim=1)
    per_class = [(confusion[c, c] / per_class_n[c]).item() if per_class_n[c] > 0 else None for c in range(num_classes)]
    return {
        "top1": (confusion.diagonal().sum() / n).item(),
        "top5": (top_k / n).item(),
        "loss": (loss_sum / n).item(),
        "per_class": per_class,
        "num_samples": int(n),
        "images_per_s": seen / seconds if seconds > 0 else float("nan"),
    }
