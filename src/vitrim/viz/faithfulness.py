"""Does a relevance map explain? Deletion and insertion curves (Petsiuk et al. 2018), and rank agreement of maps.

For one image, a method orders the P patches most relevant first. Then

* **deletion**: remove the patches in that order, k at a time, and after each step read the softmax probability of
  the explained class; a faithful map makes it fall fast: lower area is better;
* **insertion**: start from the image with every patch removed and put the patches back in that order; a faithful
  map makes it rise fast: higher area is better.

"Remove" means, always: every pixel of the patch is set to ``fill``, one value per channel in the model's input space
(default: the per-channel mean of the images given, i.e. the mean of the data set when they are a sample of it; for
the bundled digits, mid-grey between ink and background). The area under a curve is the trapezoid rule over the
fraction of patches removed (or inserted), 0 … 1, so it is the mean probability along the curve. The explained
class is the model's prediction on the intact image (the default target of every relevance method).

A **random** order is the baseline: the mean over ``random_orders`` permutations drawn per image.

Methods (:data:`ATTRIBUTIONS`): ``chefer``, ``attnlrp``, ``rollout`` (:func:`vitrim.viz.relevance`), and two gradient
baselines from captum, summed over each patch's pixels and channels: ``gradient_x_input`` and
``integrated_gradients`` (32 steps from the all-removed image, the same ``fill``).

Agreement of two maps: :func:`spearman`, the Spearman rank correlation (Pearson correlation of the ranks, tied
values sharing their mean rank) over a chosen subset of patches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn

from vitrim.extras import require
from vitrim.viz.maps import model_config
from vitrim.viz.relevance import Method, relevance

ATTRIBUTIONS = ("chefer", "attnlrp", "rollout", "gradient_x_input", "integrated_gradients", "random")


def patch_attribution(
    model: nn.Module, images: Tensor, method: str, target: Tensor, fill: Tensor, *, seed: int = 0
) -> Tensor:
    """(B, P) score of every patch (higher = more relevant) by ``method`` (module doc), for classes ``target`` (B,)."""
    config = model_config(model)
    B = images.shape[0]
    gh, gw = images.shape[-2] // config.patch_size, images.shape[-1] // config.patch_size
    if method in ("chefer", "attnlrp", "rollout"):
        return relevance(model, images, target, method=cast(Method, method)).reshape(B, gh * gw)
    if method == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.rand(B, gh * gw, generator=g)
    if method not in ATTRIBUTIONS:
        raise ValueError(f"method must be one of {ATTRIBUTIONS}, got {method!r}")
    require("captum", feature=f"the {method} baseline")
    from captum.attr import InputXGradient, IntegratedGradients

    was_training = model.training
    model.eval()
    try:
        if method == "gradient_x_input":
            pixels = InputXGradient(model).attribute(images.clone().requires_grad_(True), target=target)
        else:
            baseline = _filled(images, fill)
            pixels = IntegratedGradients(model).attribute(images, baselines=baseline, target=target, n_steps=32)
    finally:
        model.train(was_training)
    p = config.patch_size
    per_patch = pixels.detach().sum(1).unfold(1, p, p).unfold(2, p, p).sum((-1, -2))  # (B, gh, gw)
    return per_patch.reshape(B, gh * gw)


def _filled(images: Tensor, fill: Tensor) -> Tensor:
    return fill.to(images).view(1, -1, 1, 1).expand_as(images).clone()


def perturbation_curves(
    model: nn.Module, images: Tensor, order: Tensor, target: Tensor, fill: Tensor, step: int = 1
) -> tuple[Tensor, Tensor]:
    """Deletion and insertion curves (module doc): two (B, S + 1) tensors of the target's probability, S steps.

    Args:
        images: (B, C, H, W); order: (B, P) patch indices, most relevant first; target: (B,); fill: (C,).
        step: patches removed (inserted) per step; S = ⌈P / step⌉.
    """
    config = model_config(model)
    p = config.patch_size
    B, _, H, W = images.shape
    gh, gw = H // p, W // p
    P = gh * gw
    if order.shape != (B, P):
        raise ValueError(f"order must be ({B}, {P}) patch indices, got {tuple(order.shape)}")
    filled = _filled(images, fill)
    counts = [min(P, k * step) for k in range(math.ceil(P / step) + 1)]
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(P).expand(B, P))  # (B, P): position in the order
    deletion, insertion = [], []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for k in counts:
                first_k = (rank < k).reshape(B, 1, gh, 1, gw, 1).expand(B, 1, gh, p, gw, p).reshape(B, 1, H, W)
                deleted = torch.where(first_k, filled, images)
                inserted = torch.where(first_k, images, filled)
                probs = model(torch.cat([deleted, inserted])).softmax(-1)  # (2B, classes)
                chosen = probs.gather(1, torch.cat([target, target])[:, None])[:, 0]
                deletion.append(chosen[:B])
                insertion.append(chosen[B:])
    finally:
        model.train(was_training)
    return torch.stack(deletion, dim=1), torch.stack(insertion, dim=1)


def area_under(curve: Tensor) -> Tensor:
    """(B, S + 1) -> (B,) trapezoid area over the fraction 0 … 1 (the mean height of the curve)."""
    return torch.trapezoid(curve, dx=1.0 / (curve.shape[1] - 1), dim=1)


@dataclass
class Faithfulness:
    """Per method: mean deletion and insertion areas over the images, and the mean curves (S + 1,)."""

    deletion_auc: dict[str, float] = field(default_factory=dict)
    insertion_auc: dict[str, float] = field(default_factory=dict)
    deletion_curve: dict[str, list[float]] = field(default_factory=dict)
    insertion_curve: dict[str, list[float]] = field(default_factory=dict)
    maps: dict[str, Tensor] = field(default_factory=dict)  # (B, P) the scores each method gave

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in ("deletion_auc", "insertion_auc", "deletion_curve", "insertion_curve")}


def faithfulness(
    model: nn.Module,
    images: Tensor,
    methods: Sequence[str] = ATTRIBUTIONS,
    *,
    fill: Tensor | None = None,
    random_orders: int = 5,
    step: int = 1,
    batch_size: int = 64,
) -> Faithfulness:
    """Deletion and insertion areas of every method on ``images`` (B, C, H, W) (module doc).

    ``fill`` (C,) is what a removed patch becomes (default: the per-channel mean of ``images``). The explained class
    is the model's prediction on each intact image.
    """
    bad = [m for m in methods if m not in ATTRIBUTIONS]
    if bad or not methods:
        raise ValueError(f"methods must be a non-empty subset of {ATTRIBUTIONS}, got {list(methods)}")
    if fill is None:
        fill = images.mean(dim=(0, 2, 3))
    result = Faithfulness()
    for method in methods:
        deletions, insertions, maps = [], [], []
        for start in range(0, images.shape[0], batch_size):
            chunk = images[start : start + batch_size]
            with torch.no_grad():
                target = model.eval()(chunk).argmax(-1)
            seeds = range(random_orders) if method == "random" else (0,)
            for seed in seeds:
                scores = patch_attribution(model, chunk, method, target, fill, seed=1000 * seed + start)
                order = torch.sort(scores, dim=1, descending=True, stable=True).indices
                deletion, insertion = perturbation_curves(model, chunk, order, target, fill, step)
                deletions.append(deletion)
                insertions.append(insertion)
                if seed == 0:
                    maps.append(scores)
        deletion, insertion = torch.cat(deletions), torch.cat(insertions)
        result.deletion_auc[method] = float(area_under(deletion).mean())
        result.insertion_auc[method] = float(area_under(insertion).mean())
        result.deletion_curve[method] = deletion.mean(0).tolist()
        result.insertion_curve[method] = insertion.mean(0).tolist()
        result.maps[method] = torch.cat(maps)
    return result


def average_ranks(x: Tensor) -> Tensor:
    """(n,) -> (n,) ranks 1 … n, tied values sharing their mean rank."""
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(1, x.numel() + 1, dtype=torch.float64)
    values, inverse = torch.unique(x, return_inverse=True)
    sums = torch.zeros(values.numel(), dtype=torch.float64).scatter_add_(0, inverse, ranks)
    counts = torch.zeros(values.numel(), dtype=torch.float64).scatter_add_(0, inverse, torch.ones_like(ranks))
    return (sums / counts)[inverse]


def spearman(a: Tensor, b: Tensor, mask: Tensor | None = None) -> Tensor:
    """(B, P) twice -> (B,) Spearman rank correlation per row, over the entries where ``mask`` (B, P) is True.

    NaN for a row with fewer than two entries or constant ranks.
    """
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"a and b must be (B, P) of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    out = torch.full((a.shape[0],), float("nan"), dtype=torch.float64)
    for i in range(a.shape[0]):
        keep = torch.ones(a.shape[1], dtype=torch.bool) if mask is None else mask[i].bool().cpu()
        if int(keep.sum()) < 2:
            continue
        ra, rb = average_ranks(a[i].cpu()[keep]), average_ranks(b[i].cpu()[keep])
        ra, rb = ra - ra.mean(), rb - rb.mean()
        denominator = float(ra.norm() * rb.norm())
        if denominator > 0:
            out[i] = float((ra * rb).sum()) / denominator
    return out
