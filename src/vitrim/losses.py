"""The training losses, written once on the ground floor: soft-label smoothing, distillation and DynamicViT's loss.

Every objective (``vitrim.train``'s cross-entropy, the reducers' objectives in :mod:`vitrim.reduce`) reads its rules
here, so a rule cannot drift between two copies:

* **Smoothing** (:func:`smoothing_for`, :func:`classification_loss`): hard labels (B,) are smoothed by
  ``label_smoothing``; soft targets (B, K) from mixup / cutmix already carry it and are not smoothed again.
* **Distillation** (:func:`distill_logits`, :func:`distill_tokens`): KL of the student's softmax from the teacher's
  ("batchmean", on the logits), and the mean squared gap of the kept patch tokens; the teacher is detached.
* **DynamicViT** (Rao et al., NeurIPS 2021, Sec. 3.4), with the official training defaults:

    L = w_cls · CE(logits, labels)
      + w_ratio · (1/S) Σ_s mean_b (mean_j D_s[b, j] − ρ_s)²                 ratio: each stage keeps ρ_s = ρ^s
      + w_kl · KL(softmax(teacher) ‖ softmax(student))                       "batchmean", on the logits
      + w_tok · mean over kept (b, j) and channels of (t_bj − t'_bj)²        final patch tokens vs the teacher's

D_s (B, P) is stage s's hard decision (``ViTOutput.keep_masks``, training mode); the token term uses the last one
(detached) and is 0 when no token is kept. Defaults w = (1, 2, 0.5, 0.5) as the official ``main.py`` builds
``DistillDiffPruningLoss(..., clf_weight=1.0, ratio_weight=2.0, distill_weight=0.5, mse_token=True)``. The
student's output is anything with ``logits``, ``tokens`` and ``keep_masks`` (:class:`PrunedOutput`): a
``ViTOutput`` of a training-mode ``forward_detailed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch.nn.functional as F
from torch import Tensor, nn


def smoothing_for(labels: Tensor, label_smoothing: float) -> float:
    """The smoothing to apply to ``labels``: none for soft targets (B, K), which mixup already smoothed."""
    return 0.0 if labels.is_floating_point() else label_smoothing


def classification_loss(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean cross-entropy of ``logits`` (B, K) with class indices (B,) smoothed by ``label_smoothing``, or with soft
    targets (B, K) as they are (:func:`smoothing_for`)."""
    return F.cross_entropy(logits, labels, label_smoothing=smoothing_for(labels, label_smoothing))


def distill_logits(logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(softmax(teacher) ‖ softmax(student)) of logits (B, K), "batchmean"; the teacher gets no gradient."""
    return F.kl_div(
        F.log_softmax(logits, dim=-1), F.log_softmax(teacher_logits.detach(), dim=-1), reduction="batchmean",
        log_target=True,
    )  # fmt: skip


def distill_tokens(tokens: Tensor, teacher_tokens: Tensor, kept: Tensor) -> Tensor:
    """Mean over kept (b, j) and channels of the squared gap of the last P patch tokens of ``tokens`` (B, . + P, D)
    and ``teacher_tokens`` (B, . + P, D), ``kept`` (B, P) bool; 0 when nothing is kept. The teacher is detached."""
    P = kept.shape[1]
    if not bool(kept.any()):
        return tokens.new_zeros(())
    diff = tokens[:, -P:][kept] - teacher_tokens[:, -P:].detach()[kept]  # (kept, D)
    return diff.pow(2).mean()


class PrunedOutput(Protocol):
    """What the loss reads of a student's forward (``vitrim.models.ViTOutput`` has it)."""

    logits: Tensor  # (B, K)
    tokens: Tensor  # (B, prefix + P, D), grid order in training mode
    keep_masks: list[Tensor]  # S x (B, P), 1 = kept


@dataclass
class DynamicViTLossParts:
    """The total (to backpropagate) and its weighted parts' raw values (unweighted scalars, for logging)."""

    total: Tensor
    cls: Tensor
    ratio: Tensor
    distill_logits: Tensor
    distill_tokens: Tensor


class DynamicViTLoss(nn.Module):
    """Cross-entropy + keep-ratio loss + logit and token distillation (see module doc).

    Args:
        keep_ratio: ρ (stage s targets ρ^s), or one target per stage.
        cls_weight, ratio_weight, distill_weight, token_weight: the weights of the four parts (0 turns one off).
        label_smoothing: passed to the cross-entropy with hard labels.
    """

    def __init__(
        self,
        keep_ratio: float | Sequence[float] = 0.7,
        *,
        cls_weight: float = 1.0,
        ratio_weight: float = 2.0,
        distill_weight: float = 0.5,
        token_weight: float = 0.5,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        ratios = [keep_ratio] if isinstance(keep_ratio, (int, float)) else list(keep_ratio)
        if not ratios or any(
            isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and 0 < r <= 1)
            for r in ratios
        ):
            raise ValueError(
                f"keep_ratio must be a number in (0, 1] or a non-empty sequence of them, got {keep_ratio!r}"
            )
        self.keep_ratio: float | tuple[float, ...] = (
            float(keep_ratio) if isinstance(keep_ratio, (int, float)) else tuple(float(r) for r in ratios)
        )
        for name, value in (
            ("cls_weight", cls_weight),
            ("ratio_weight", ratio_weight),
            ("distill_weight", distill_weight),
            ("token_weight", token_weight),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        self.cls_weight, self.ratio_weight = float(cls_weight), float(ratio_weight)
        self.distill_weight, self.token_weight = float(distill_weight), float(token_weight)
        self.label_smoothing = label_smoothing

    def targets(self, num_stages: int) -> list[float]:
        """The kept fraction each stage is pushed towards: ρ^s, or the given per-stage list."""
        if isinstance(self.keep_ratio, float):
            return [self.keep_ratio**s for s in range(1, num_stages + 1)]
        if len(self.keep_ratio) != num_stages:
            raise ValueError(
                f"keep_ratio gives {len(self.keep_ratio)} per-stage targets but the output has {num_stages} keep masks"
            )
        return list(self.keep_ratio)

    def forward(
        self,
        student: PrunedOutput,
        labels: Tensor,
        teacher_logits: Tensor | None = None,
        teacher_tokens: Tensor | None = None,
    ) -> DynamicViTLossParts:
        """Compute the loss.

        Args:
            student: a training-mode ``forward_detailed`` output: logits (B, K), tokens (B, prefix + P, D) in grid
                order, keep_masks S × (B, P).
            labels: (B,) class indices, or (B, K) class probabilities (mixup / cutmix / soft labels).
            teacher_logits: (B, K) or None (no logit distillation).
            teacher_tokens: (B, prefix' + P, D) the teacher's final tokens (after its norm), or None; the last P are
                its patch tokens, so a distilled teacher with 2 prefix tokens works.

        Returns:
            :class:`DynamicViTLossParts`; ``total`` carries the gradient.
        """
        logits, masks = student.logits, student.keep_masks
        if not masks:
            raise ValueError(
                "student.keep_masks is empty: pass a training-mode forward_detailed output of a DynamicViT"
            )
        B, P = masks[-1].shape
        if logits.dim() != 2 or logits.shape[0] != B:
            raise ValueError(f"student.logits must have shape ({B}, num_classes), got {tuple(logits.shape)}")
        zero = logits.new_zeros(())

        if labels.dtype.is_floating_point:
            if labels.shape != logits.shape:
                raise ValueError(
                    f"soft labels must have the logits' shape {tuple(logits.shape)}, got {tuple(labels.shape)}"
                )
        elif labels.shape != (B,):
            raise ValueError(f"labels must have shape ({B},) (class indices) or ({B}, K), got {tuple(labels.shape)}")
        cls = classification_loss(logits, labels, self.label_smoothing)

        ratio = zero
        for mask, target in zip(masks, self.targets(len(masks))):
            ratio = ratio + ((mask.mean(dim=1) - target) ** 2).mean()
        ratio = ratio / len(masks)

        kl = zero
        if teacher_logits is not None:
            if teacher_logits.shape != logits.shape:
                raise ValueError(
                    f"teacher_logits must have the student's shape {tuple(logits.shape)}, "
                    f"got {tuple(teacher_logits.shape)}"
                )
            kl = distill_logits(logits, teacher_logits)

        token_gap = zero
        if teacher_tokens is not None:
            tokens = student.tokens
            if tokens.dim() != 3 or tokens.shape[0] != B or tokens.shape[1] < P:
                raise ValueError(
                    f"student.tokens must be (B, prefix + P, D) = ({B}, prefix + {P}, D) in grid order "
                    f"(training mode), "
                    f"got {tuple(tokens.shape)}"
                )
            if teacher_tokens.dim() != 3 or teacher_tokens.shape[0] != B or teacher_tokens.shape[1] < P:
                raise ValueError(f"teacher_tokens must be ({B}, prefix + {P}, D), got {tuple(teacher_tokens.shape)}")
            if teacher_tokens.shape[-1] != tokens.shape[-1]:
                raise ValueError(
                    f"teacher_tokens width {teacher_tokens.shape[-1]} differs from the student's {tokens.shape[-1]}"
                )
            token_gap = distill_tokens(tokens, teacher_tokens, masks[-1].detach() > 0.5)

        total = (
            self.cls_weight * cls + self.ratio_weight * ratio + self.distill_weight * kl + self.token_weight * token_gap
        )
        return DynamicViTLossParts(total, cls, ratio, kl, token_gap)

    def extra_repr(self) -> str:
        return (
            f"keep_ratio={self.keep_ratio}, cls_weight={self.cls_weight}, ratio_weight={self.ratio_weight}, "
            f"distill_weight={self.distill_weight}, token_weight={self.token_weight}"
        )
