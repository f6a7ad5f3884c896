"""DynamicViT fine-tuning from a dense run: the backbone starts as the teacher, is frozen first, learns at 0.01x."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitrim.train import TrainConfig, train
from vitrim.train.state import load_training_state

TINY_VIT = dict(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=2, num_heads=2)


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dense")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before conftest's per-test one
    train(TrainConfig(model="vit_tiny_patch16_224", out=str(out), epochs=1, overrides=TINY_VIT, quiet=True))
    torch.set_num_threads(before)
    return out


def student_config(teacher: Path, out: Path, *, keep_ratio: float, freeze_backbone_epochs: int) -> TrainConfig:
    """One epoch of DynamicViT distilled from ``teacher`` (the dense run's weights)."""
    return TrainConfig(
        model="dynamicvit_tiny_patch16_224", out=str(out), epochs=1, teacher=str(teacher),
        overrides={"keep_ratio": keep_ratio}, freeze_backbone_epochs=freeze_backbone_epochs, quiet=True,
        batch_size=128,
    )  # fmt: skip


def test_student_starts_from_teacher_and_the_backbone_stays_frozen(dense_run: Path, tmp_path: Path) -> None:
    teacher = dense_run / "last.safetensors"
    config = student_config(teacher, tmp_path, keep_ratio=0.7, freeze_backbone_epochs=1)
    result = train(config)
    assert 0.0 <= result["test_top1"] <= 1.0
    dense, student = load_file(teacher), load_file(tmp_path / "last.safetensors")
    predictors = [k for k in student if k.startswith("score_predictor.")]
    assert predictors and set(student) - set(predictors) == set(dense)  # built like its teacher (from its config)
    for key in dense:
        assert torch.equal(student[key], dense[key]), f"{key} moved while the backbone was frozen"
    state = load_training_state(tmp_path / "last.pt")
    scales = sorted(group["lr_scale"] for group in state["optimizer"]["param_groups"])
    assert set(scales) == {0.01, 1.0}


def test_backbone_learns_slowly_after_the_freeze(dense_run: Path, tmp_path: Path) -> None:
    teacher = dense_run / "last.safetensors"
    config = student_config(teacher, tmp_path, keep_ratio=0.5, freeze_backbone_epochs=0)
    train(config)
    dense, student = load_file(teacher), load_file(tmp_path / "last.safetensors")
    moved = [k for k in dense if not torch.equal(student[k], dense[k])]
    assert "blocks.0.attn.qkv.weight" in moved
