"""DynamicViTLoss against numbers computed by hand (math, not torch) in the test."""

from __future__ import annotations

import math

import pytest
import torch

import vitrim.losses
from vitrim.losses import DynamicViTLoss
from vitrim.models.vit import ViTOutput


def log_softmax(row: list[float]) -> list[float]:
    m = max(row)
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - lse for v in row]


STUDENT_LOGITS = [[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]]
TEACHER_LOGITS = [[2.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
LABELS = [0, 2]
MASKS = [  # two stages over P = 4 patches
    [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]],
    [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]],
]
# tokens (B, 1 + P, D = 2): [CLS] first; only patches 0 and 3 of image 0 are kept at the end
STUDENT_TOKENS = [
    [[9.0, 9.0], [1.0, 2.0], [50.0, 50.0], [50.0, 50.0], [3.0, 3.0]],
    [[9.0, 9.0], [50.0, 50.0], [50.0, 50.0], [50.0, 50.0], [50.0, 50.0]],
]
TEACHER_TOKENS = [
    [[0.0, 0.0], [0.0, 2.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]],
    [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],
]


def student_output() -> ViTOutput:
    return ViTOutput(
        logits=torch.tensor(STUDENT_LOGITS),
        tokens=torch.tensor(STUDENT_TOKENS),
        keep_masks=[torch.tensor(m) for m in MASKS],
    )


def hand_cls() -> float:
    return -sum(log_softmax(row)[y] for row, y in zip(STUDENT_LOGITS, LABELS)) / 2


def hand_kl() -> float:
    total = 0.0
    for s_row, t_row in zip(STUDENT_LOGITS, TEACHER_LOGITS):
        ls, lt = log_softmax(s_row), log_softmax(t_row)
        total += sum(math.exp(t) * (t - s) for s, t in zip(ls, lt))
    return total / 2  # batchmean


# stage 1 kept 3/4 and 1/4 against 0.5: (0.25² + 0.25²) / 2 = 0.0625
# stage 2 kept 2/4 and 0/4 against 0.25: (0.25² + 0.25²) / 2 = 0.0625; mean over the two stages = 0.0625
HAND_RATIO = 0.0625
# kept tokens: (1, 2) - (0, 2) = (1, 0) and (3, 3) - (1, 1) = (2, 2): (1 + 0 + 4 + 4) / 4 = 2.25
HAND_TOKENS = 2.25


def test_every_part_and_the_total_match_the_hand_computation() -> None:
    parts = DynamicViTLoss(0.5)(
        student_output(), torch.tensor(LABELS), torch.tensor(TEACHER_LOGITS), torch.tensor(TEACHER_TOKENS)
    )
    assert parts.cls.item() == pytest.approx(hand_cls(), rel=1e-6)
    assert parts.ratio.item() == pytest.approx(HAND_RATIO, rel=1e-6)
    assert parts.distill_logits.item() == pytest.approx(hand_kl(), rel=1e-5)
    assert parts.distill_tokens.item() == pytest.approx(HAND_TOKENS, rel=1e-6)
    expected = hand_cls() + 2.0 * HAND_RATIO + 0.5 * hand_kl() + 0.5 * HAND_TOKENS  # the official weights
    assert parts.total.item() == pytest.approx(expected, rel=1e-6)


def test_weights_are_arguments_and_per_stage_targets_are_accepted() -> None:
    loss = DynamicViTLoss([0.75, 0.5], cls_weight=0.0, ratio_weight=1.0, distill_weight=3.0, token_weight=0.0)
    parts = loss(student_output(), torch.tensor(LABELS), torch.tensor(TEACHER_LOGITS), torch.tensor(TEACHER_TOKENS))
    # stage 1: (0² + 0.5²)/2 = 0.125; stage 2: (0² + 0.5²)/2 = 0.125 -> 0.125
    assert parts.ratio.item() == pytest.approx(0.125)
    assert parts.total.item() == pytest.approx(0.125 + 3.0 * hand_kl(), rel=1e-6)


def test_token_term_is_zero_when_nothing_is_kept_and_teacher_terms_are_optional() -> None:
    out = student_output()
    out.keep_masks[-1] = torch.zeros(2, 4)
    parts = DynamicViTLoss(0.5)(out, torch.tensor(LABELS), None, torch.tensor(TEACHER_TOKENS))
    assert parts.distill_tokens.item() == 0.0 and parts.distill_logits.item() == 0.0
    assert torch.isfinite(parts.total)


def test_soft_labels_and_label_smoothing() -> None:
    soft = torch.tensor([[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]])
    parts = DynamicViTLoss(0.5)(student_output(), soft)
    ls0, ls1 = log_softmax(STUDENT_LOGITS[0]), log_softmax(STUDENT_LOGITS[1])
    expected = -(0.25 * ls0[1] + 0.75 * ls0[2] + ls1[0]) / 2
    assert parts.cls.item() == pytest.approx(expected, rel=1e-6)
    eps = 0.3  # smoothing: (1 − ε)·onehot + ε/K
    parts = DynamicViTLoss(0.5, label_smoothing=eps)(student_output(), torch.tensor(LABELS))
    expected = sum(-((1 - eps) * ls[y] + eps / 3 * sum(ls)) for ls, y in ((ls0, LABELS[0]), (ls1, LABELS[1]))) / 2
    assert parts.cls.item() == pytest.approx(expected, rel=1e-6)


def test_ratio_loss_gradient_flows_into_the_masks() -> None:
    masks = [torch.tensor(m, requires_grad=True) for m in MASKS]
    out = ViTOutput(logits=torch.tensor(STUDENT_LOGITS), tokens=torch.tensor(STUDENT_TOKENS), keep_masks=masks)
    DynamicViTLoss(0.5, cls_weight=0.0)(out, torch.tensor(LABELS)).total.backward()
    # d/dm_bj of 2.0 · (1/2 stages) · (1/2 batch) · (mean_j m_bj − ρ_s)² = 2 · 0.25 · 2 · (gap) / 4
    assert masks[0].grad is not None and masks[1].grad is not None
    assert masks[0].grad[0, 0].item() == pytest.approx(2.0 * 0.25 * 2 * 0.25 / 4)
    assert masks[1].grad[1, 0].item() == pytest.approx(2.0 * 0.25 * 2 * -0.25 / 4)


def test_bad_inputs_are_clear_errors() -> None:
    for bad in (0, 1.5, math.nan, [], [0.5, -1.0]):
        with pytest.raises(ValueError, match="keep_ratio must be"):
            DynamicViTLoss(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ratio_weight must be a finite number >= 0, got -1"):
        DynamicViTLoss(0.5, ratio_weight=-1)
    loss = DynamicViTLoss(0.5)
    eval_like = ViTOutput(logits=torch.zeros(2, 3), tokens=torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="keep_masks is empty"):
        loss(eval_like, torch.tensor(LABELS))
    with pytest.raises(ValueError, match="labels must have shape"):
        loss(student_output(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="teacher_logits must have the student's shape"):
        loss(student_output(), torch.tensor(LABELS), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="3 per-stage targets but the output has 2 keep masks"):
        DynamicViTLoss([0.5, 0.25, 0.1])(student_output(), torch.tensor(LABELS))
    assert vitrim.losses.DynamicViTLoss is DynamicViTLoss
