"""AdamW with parameter groups (no decay on biases, norms, tokens; per-group learning-rate multipliers) and a
warm-up + cosine schedule stepped once per optimiser step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


class WarmupCosine:
    """Learning-rate factor of step ``t``: linear warm-up to 1 over ``warmup_steps``, then cosine to ``min_factor``.

    A callable object (not a lambda) so that ``LambdaLR.state_dict`` saves its settings with the run.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_factor: float = 0.01) -> None:
        if total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {total_steps!r}")
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps!r}")
        self.warmup_steps, self.total_steps, self.min_factor = warmup_steps, total_steps, float(min_factor)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


def _no_decay(name: str, param: nn.Parameter, skip: set[str]) -> bool:
    return param.ndim <= 1 or name in skip or name.endswith(".bias")


def param_groups(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    lr_multiplier: Callable[[str], float] | None = None,
) -> list[dict]:
    """AdamW groups: decayed / not decayed (1-D params, biases, ``model.no_weight_decay()``) × learning-rate multiplier.

    ``lr_multiplier(name) -> float`` scales the learning rate of a parameter (DynamicViT: backbone 0.01×); each
    group carries its multiplier as ``lr_scale`` so it survives a resume.
    """
    no_weight_decay = getattr(model, "no_weight_decay", None)
    skip = set(no_weight_decay()) if callable(no_weight_decay) else set()
    groups: dict[tuple[bool, float], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = not _no_decay(name, param, skip)
        scale = 1.0 if lr_multiplier is None else float(lr_multiplier(name))
        group = groups.setdefault(
            (decay, scale),
            {"params": [], "weight_decay": weight_decay if decay else 0.0, "lr": lr * scale, "lr_scale": scale},
        )
        group["params"].append(param)
    return list(groups.values())


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_factor: float = 0.01,
    lr_multiplier: Callable[[str], float] | None = None,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over :func:`param_groups` and its warm-up + cosine :class:`~torch.optim.lr_scheduler.LambdaLR`."""
    if not lr > 0:
        raise ValueError(f"learning rate must be positive, got {lr!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight decay must be >= 0, got {weight_decay!r}")
    groups = param_groups(model, lr=lr, weight_decay=weight_decay, lr_multiplier=lr_multiplier)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_factor))
    return optimizer, scheduler
