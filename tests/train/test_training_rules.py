"""The training rules written once (vitrim.losses, vitrim.seeds): the seeds every sampler draws from, the smoothing
rule every objective applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vitrim.losses import classification_loss, distill_logits, distill_tokens
from vitrim.seeds import epoch_seed


def test_epoch_seed_is_the_formula_the_samplers_used() -> None:
    # hand-written: the order shared by every rank, a rank's stream, a worker's stream of one rank
    assert epoch_seed(5, 3) == 5 * 1_000_003 + 3
    assert epoch_seed(5, 3, 2) == (5 * 1_000_003 + 3) * 1_009 + 2
    assert epoch_seed(5, 3, 2, 7) == ((5 * 1_000_003 + 3) * 1_009 + 2) * 1_009 + 7
    seeds = {epoch_seed(s, e, r, w) for s in range(3) for e in range(4) for r in range(3) for w in range(3)}
    assert len(seeds) == 3 * 4 * 3 * 3  # distinct tuples, distinct seeds
    with pytest.raises(ValueError, match="worker=1 needs the rank"):
        epoch_seed(0, 0, worker=1)


def test_the_seed_formula_is_written_once() -> None:
    """Every training loop and sampler derives its seeds through epoch_seed; a copy of its multiplier would drift from
    it (the digits VLM's training re-typed it until issue 45). ``reduce/random_keep.py`` uses the same prime as a
    hash salt of (seed, block, N), no epoch seed, and is not a copy."""
    package = Path(epoch_seed.__code__.co_filename).parent
    trainers = ("train", "data", "vlm_demo", "translate")
    copies = [str(path.relative_to(package)) for folder in trainers for path in (package / folder).rglob("*.py")
              if "1_000_003" in path.read_text() or "1000003" in path.read_text()]  # fmt: skip
    assert not copies, copies


def test_smoothing_applies_to_hard_labels_only() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 5), torch.tensor([0, 3, 1, 4])
    log_p = logits.log_softmax(-1)
    smoothed = 0.9 * F.one_hot(labels, 5) + 0.1 / 5  # (B, K) the smoothed targets, by hand
    expected = -(smoothed * log_p).sum(-1).mean()
    assert torch.allclose(classification_loss(logits, labels, 0.1), expected, atol=1e-6)
    # soft targets (mixup) carry their smoothing already: the same targets as probabilities are not smoothed again
    assert torch.allclose(classification_loss(logits, smoothed, 0.1), expected, atol=1e-6)


def test_distillation_terms_against_their_formulas() -> None:
    torch.manual_seed(1)
    student, teacher = torch.randn(3, 4), torch.randn(3, 4)
    p = teacher.softmax(-1)
    expected = (p * (p.log() - student.log_softmax(-1))).sum() / 3
    assert torch.allclose(distill_logits(student, teacher), expected, atol=1e-6)
    tokens, theirs = torch.randn(2, 1 + 3, 6), torch.randn(2, 2 + 3, 6)
    kept = torch.tensor([[True, False, True], [False, False, True]])
    gaps = [(tokens[b, 1 + j] - theirs[b, 2 + j]).pow(2).mean() for b in range(2) for j in range(3) if kept[b, j]]
    assert torch.allclose(distill_tokens(tokens, theirs, kept), torch.stack(gaps).mean(), atol=1e-6)
    assert distill_tokens(tokens, theirs, torch.zeros(2, 3, dtype=torch.bool)) == 0
