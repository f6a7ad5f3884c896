"""What training minimises: an objective is called on each batch and may shape the model it trains.

``vitrim.train`` runs any :class:`Objective`: plain cross-entropy (:class:`CrossEntropyObjective`),
or the objective a model's reducers bring (``Reducer.training_objective``): DynamicViT's distillation from a teacher
(:mod:`vitrim.reduce.dynamicvit_training`) and MCTF's consistency (:mod:`vitrim.reduce.mctf_training`) live with
their reducers. An objective is a protocol: one in a lower package need not import this module.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from vitrim.losses import classification_loss


class Objective(Protocol):
    """The loss of one batch, and the hooks the loop calls around it."""

    def __call__(self, model: nn.Module, images: Tensor, labels: Tensor, epoch: int) -> Tensor:
        """The scalar loss of ``images`` (B, C, H, W) with ``labels`` (B,) or soft targets (B, K) (mixup, cutmix)."""
        ...

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the loop calls (and DDP wraps): the model, or a view of it that returns what the loss needs."""
        ...

    def lr_multiplier(self, name: str) -> float:
        """Learning-rate multiplier of parameter ``name`` (1 for all, unless parts learn at another rate)."""
        ...

    def after_backward(self, model: nn.Module, epoch: int) -> None:
        """Hook between backward and the optimiser step (DynamicViT freezes its backbone here)."""
        ...


class CrossEntropyObjective:
    """Plain supervised training: cross-entropy with label smoothing on ``model(images)``.

    ``labels`` are class indices (B,) or, after mixup / cutmix, targets (B, K) that already carry the smoothing.
    """

    def __init__(self, label_smoothing: float) -> None:
        self.label_smoothing = label_smoothing

    def __call__(self, model: nn.Module, images: Tensor, labels: Tensor, epoch: int) -> Tensor:
        return classification_loss(model(images), labels, self.label_smoothing)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def lr_multiplier(self, name: str) -> float:
        return 1.0

    def after_backward(self, model: nn.Module, epoch: int) -> None:
        pass
