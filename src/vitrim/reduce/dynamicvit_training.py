"""DynamicViT's fine-tuning objective from a dense teacher, the paper's recipe (Rao et al., 2021, Sec. 4.1).

The dense checkpoint initialises the student's backbone (the prediction modules start fresh) and, frozen, serves as
the teacher (``vitrim.train`` loads both). The loss is :class:`vitrim.losses.DynamicViTLoss`
(classification + keep ratio + logit and token distillation). The prediction modules learn at the full learning
rate, the backbone at ``backbone_lr_scale`` × it (0.01 in the paper) and not at all during the first
``freeze_backbone_epochs`` epochs, so the predictors first learn to score tokens of a backbone that does not move
under them.

This is a :class:`vitrim.train.Objective`; ``DynamicViTPruning.training_objective`` hands it to ``vitrim.train``
when a run has a teacher (:func:`vitrim.reduce.training_objective`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.losses import DynamicViTLoss, PrunedOutput

PREDICTOR_PREFIX = "score_predictor."  # the parameters of the prediction modules (the model attribute's name)


class _Detailed(nn.Module):
    """Makes ``forward`` return ``forward_detailed`` (so DDP's forward hooks run on the call the loss needs)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> PrunedOutput:
        return self.model.forward_detailed(images)  # type: ignore[operator]


class DistillObjective:
    """``objective(train_model, images, labels, epoch) -> loss`` for a DynamicViT student and a frozen teacher."""

    def __init__(
        self, teacher: nn.Module, loss: nn.Module, *, backbone_lr_scale: float, freeze_backbone_epochs: int
    ) -> None:
        if not backbone_lr_scale >= 0:
            raise ValueError(f"backbone lr scale must be >= 0, got {backbone_lr_scale!r}")
        if freeze_backbone_epochs < 0:
            raise ValueError(f"freeze backbone epochs must be >= 0, got {freeze_backbone_epochs!r}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.loss = loss
        self.backbone_lr_scale = backbone_lr_scale
        self.freeze_backbone_epochs = freeze_backbone_epochs

    @classmethod
    def from_options(
        cls, teacher: nn.Module, keep_fractions: Sequence[float], label_smoothing: float, options: dict[str, Any]
    ) -> DistillObjective:
        """``keep_fractions``: the student's stages' ρ^s (the ratio targets). ``options``: ``distill`` (keyword
        arguments of DynamicViTLoss, ``vitrim train --distill``), ``backbone_lr_scale``, ``freeze_backbone_epochs``."""
        loss_options: dict[str, Any] = {"keep_ratio": tuple(keep_fractions), "label_smoothing": label_smoothing}
        loss_options.update(options.get("distill", {}))
        return cls(
            teacher,
            DynamicViTLoss(**loss_options),
            backbone_lr_scale=options.get("backbone_lr_scale", 0.01),
            freeze_backbone_epochs=options.get("freeze_backbone_epochs", 1),
        )

    def lr_multiplier(self, name: str) -> float:
        return 1.0 if name.startswith(PREDICTOR_PREFIX) else self.backbone_lr_scale

    def wrap(self, model: nn.Module) -> nn.Module:
        return _Detailed(model)

    def __call__(self, model: nn.Module, images: Tensor, labels: Tensor, epoch: int) -> Tensor:
        student: PrunedOutput = model(images)  # the wrapped student: forward_detailed
        with torch.no_grad():
            teacher = self.teacher.forward_detailed(images)  # type: ignore[operator]
        return self.loss(student, labels, teacher.logits.float(), teacher.tokens.float()).total

    def after_backward(self, model: nn.Module, epoch: int) -> None:
        """While the backbone is frozen, drop its gradients: AdamW skips parameters without one (no decay either)."""
        if epoch < self.freeze_backbone_epochs:
            for name, param in model.named_parameters():
                if not name.startswith(PREDICTOR_PREFIX):
                    param.grad = None
