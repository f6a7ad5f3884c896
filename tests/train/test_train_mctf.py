"""MCTF's fine-tuning recipe: the loss of one step against a hand computation, and a run through ``vitrim train``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vitrim
from vitrim.reduce.mctf_training import MCTFObjective, reduction_strength
from vitrim.train import TrainConfig, train

TINY = dict(img_size=32, patch_size=4, in_chans=1, embed_dim=16, depth=3, num_heads=2, num_classes=10)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return vitrim.create_model("vit_tiny_patch16_224", reducer="mctf", r=8, **TINY)


def test_one_step_equals_the_recipe_by_hand() -> None:
    model, images = _model(), torch.randn(6, 1, 32, 32, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    objective = MCTFObjective(0.1, teacher_r=8, confidence=0.1)
    torch.manual_seed(5)
    loss = objective(objective.wrap(model), images, labels, 0)
    torch.manual_seed(5)
    r_teacher = int(torch.randint(0, 8, (1,)))

    def run(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        vitrim.reduce.remove(model)
        vitrim.reduce.apply(model, "mctf", r=r)
        out = model.forward_detailed(images)
        return out.logits, out.tokens[:, 0]  # a [CLS] model: the feature is the final, normalised [CLS]

    (logits, f), (t_logits, t_f) = run(8), run(r_teacher)
    confident = logits.softmax(-1)[torch.arange(6), labels] > 0.1
    assert 0 < int(confident.sum()) < 6  # the mask selects some images, not all
    consistency = ((t_f - f) ** 2).mean(1)[confident].mean()
    expected = F.cross_entropy(logits, labels, label_smoothing=0.1) + F.cross_entropy(
        t_logits, labels, label_smoothing=0.1
    )
    torch.testing.assert_close(loss, expected + 3.0 * consistency)


def test_both_passes_train_and_the_teacher_r_is_restored() -> None:
    model = _model()
    x = torch.randn(2, 1, 32, 32)
    wrapped = MCTFObjective(0.0).wrap(model)
    (_, f), (_, t_f) = wrapped(x)
    assert f.requires_grad and t_f.requires_grad  # the teacher pass trains through its own cross-entropy
    with reduction_strength(model, 3):
        assert {block.reducer.r for block in model.blocks[1:]} == {3}
    assert {block.reducer.r for block in model.blocks[1:]} == {8}  # restored


def test_vitrim_train_runs_the_recipe_and_refuses_it_without_mctf(tmp_path: Path) -> None:
    base = dict(model="vit_tiny_patch16_224", epochs=1, batch_size=64, quiet=True, warmup_epochs=0)
    overrides = {**TINY, "reducer": "mctf", "r": 8}
    del overrides["num_classes"]
    result = train(TrainConfig(out=str(tmp_path / "mctf"), overrides=overrides, mctf={"teacher_r": 4}, **base))
    metrics = [json.loads(line) for line in (tmp_path / "mctf" / "metrics.jsonl").read_text().splitlines()]
    assert result["test_top1"] > 0.1 and metrics[-1]["train_loss"] > 0  # trained (10 classes: chance is 0.1)
    with pytest.raises(ValueError, match=r"--mctf needs a model with MCTF reducers"):
        dense = {k: v for k, v in overrides.items() if k not in ("reducer", "r")}
        train(TrainConfig(out=str(tmp_path / "dense"), overrides=dense, mctf={"teacher_r": 4}, **base))
    with pytest.raises(ValueError, match=r"^mctf takes .* unknown key\(s\) \['weight'\]"):  # the CLI: --mctf
        train(TrainConfig(out=str(tmp_path / "bad"), overrides=overrides, mctf={"weight": 1}, **base))
