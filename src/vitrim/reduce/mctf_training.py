"""MCTF's fine-tuning objective (Lee et al., CVPR 2024; mlvlab/MCTF ``engine.py``, ``models/deit.py``): token-reduction
consistency.

Every step runs the model twice on the same images: as it is (the student, MCTF's ``r`` in its blocks) and with a
random smaller ``r'`` drawn uniformly from 0 … ``teacher_r`` − 1 (the authors' ``torch.randint(0, r_teacher_max)``;
a fraction below 1 draws hundredths: ``randint(0, 100 · teacher_r) / 100``). The loss is

    L = CE(student) + teacher_weight · CE(teacher pass)
        + consistency_weight · mean over confident images of ‖f_teacher.detach() − f_student‖² / D

where f is the pooled, normalised feature before the head (the final [CLS] token for a [CLS] model, as the authors)
and an image is confident when the student's softmax gives its label more than ``confidence``. The authors'
DeiT-S command: ``r = 16`` on blocks 1–11, teacher_r = 8, weights 1 and 3, confidence 0.4, 30 epochs at
lr × 0.03 of DeiT's (README of mlvlab/MCTF). Both passes run inside one forward of the wrapped module, so DDP sees one
call per step.

This is a :class:`vitrim.train.Objective` (the loop calls it, ``wrap`` and the two hooks); it lives with its
reducer, and ``MCTF.training_objective`` hands it to ``vitrim.train`` (:func:`vitrim.reduce.training_objective`),
so the training package knows no reducer by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.losses import classification_loss
from vitrim.reduce.registry import get_reducer


def mctf_reducers(model: nn.Module) -> list[Any]:
    """The MCTF reducers on the model's blocks (empty if it has none); found by their registered name, since
    :mod:`vitrim.reduce.mctf` imports this module for its objective."""
    mctf = get_reducer("mctf")
    reducers = [getattr(block, "reducer", None) for block in getattr(model, "blocks", ())]
    return [reducer for reducer in reducers if isinstance(reducer, mctf)]


@contextlib.contextmanager
def reduction_strength(model: nn.Module, r: float) -> Iterator[None]:
    """Run the model's MCTF reducers with ``r`` for the duration of the block (restored afterwards)."""
    reducers = mctf_reducers(model)
    saved = [reducer.r for reducer in reducers]
    try:
        for reducer in reducers:
            reducer.r = r
        yield
    finally:
        for reducer, value in zip(reducers, saved):
            reducer.r = value


class _TwoPasses(nn.Module):
    """forward(images) -> ((logits, features) as the model is, (logits, features) at a random smaller r)."""

    def __init__(self, model: nn.Module, teacher_r: float) -> None:
        super().__init__()
        self.model = model
        self.teacher_r = teacher_r

    def _pass(self, images: Tensor) -> tuple[Tensor, Tensor]:
        m = self.model
        state, _ = m.forward_blocks(m.embed(images))  # type: ignore[operator]
        tokens, weights = m.norm(state.tokens), state.patch_weights()  # type: ignore[operator]
        return m.forward_head(tokens, patch_weights=weights), m.forward_head(  # type: ignore[operator]
            tokens, pre_logits=True, patch_weights=weights
        )

    def forward(self, images: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        student = self._pass(images)
        if self.teacher_r >= 1:
            r: float = int(torch.randint(0, int(self.teacher_r), (1,)))
        else:
            r = int(torch.randint(0, int(self.teacher_r * 100), (1,))) / 100
        with reduction_strength(self.model, r):
            teacher = self._pass(images)
        return student, teacher


class MCTFObjective:
    """``objective(train_model, images, labels, epoch) -> loss``: token-reduction consistency (module doc)."""

    def __init__(
        self,
        label_smoothing: float,
        *,
        teacher_r: float = 8,
        teacher_weight: float = 1.0,
        consistency_weight: float = 3.0,
        confidence: float = 0.4,
    ) -> None:
        for name, value in (
            ("teacher_r", teacher_r),
            ("teacher_weight", teacher_weight),
            ("consistency_weight", consistency_weight),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"mctf option {name} must be a number >= 0, got {value!r}")
        if teacher_r < 1 and teacher_r * 100 < 1:
            raise ValueError(
                f"mctf option teacher_r must be >= 0.01 (r' is drawn from 0 … teacher_r), got {teacher_r!r}"
            )
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 <= confidence < 1:
            raise ValueError(f"mctf option confidence must be a number in [0, 1), got {confidence!r}")
        self.label_smoothing = label_smoothing
        self.teacher_r = teacher_r
        self.teacher_weight = teacher_weight
        self.consistency_weight = consistency_weight
        self.confidence = confidence

    @classmethod
    def from_options(cls, label_smoothing: float, options: dict[str, Any]) -> MCTFObjective:
        """From ``TrainConfig.mctf`` (``vitrim train --mctf key=value,…``); unknown keys are named in the error."""
        known = {"teacher_r", "teacher_weight", "consistency_weight", "confidence"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"mctf takes {sorted(known)}, got unknown key(s) {unknown}")
        return cls(label_smoothing, **options)

    def wrap(self, model: nn.Module) -> nn.Module:
        return _TwoPasses(model, self.teacher_r)

    def __call__(self, model: nn.Module, images: Tensor, labels: Tensor, epoch: int) -> Tensor:
        (logits, features), (teacher_logits, teacher_features) = model(images)
        loss = classification_loss(logits, labels, self.label_smoothing)
        loss = loss + self.teacher_weight * classification_loss(teacher_logits, labels, self.label_smoothing)
        with torch.no_grad():
            # (B,) the class the image is most of: soft targets (B, K) come from mixup / cutmix
            target = labels.argmax(dim=1) if labels.is_floating_point() else labels
            confident = (logits.softmax(-1).gather(1, target[:, None])[:, 0] > self.confidence).to(logits.dtype)
        gap = ((teacher_features.detach() - features) ** 2).mean(dim=1)  # (B,)
        consistency = (gap * confident).sum() / confident.sum().clamp_min(1)  # 0 when no image is confident
        return loss + self.consistency_weight * consistency

    def lr_multiplier(self, name: str) -> float:
        return 1.0

    def after_backward(self, model: nn.Module, epoch: int) -> None:
        pass
