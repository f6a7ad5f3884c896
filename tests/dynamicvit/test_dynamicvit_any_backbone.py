"""DynamicViT as a reducer on any registered ViT: the official forward, checkpoints, save/load, removal, training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_dynamicvit_official import ARCH, assert_matches_official, images, official_state_dict, reference

import vitrim


def dynamicvit_on_deit(**options: object) -> torch.nn.Module:
    return vitrim.create_model("deit_tiny_patch16_224", reducer="dynamicvit", prune_layers=(1, 2, 3), **ARCH, **options)


def test_the_reducer_on_a_deit_equals_the_official_forward() -> None:
    sd = official_state_dict(seed=7)
    model = dynamicvit_on_deit(keep_ratio=0.7).eval()
    model.load_state_dict(sd)  # the official key names: backbone + score_predictor.{i}
    x = images(4, seed=8)
    assert_matches_official(model, sd, x)


def test_official_and_dense_checkpoints_load_through_create_model(tmp_path: Path) -> None:
    sd = official_state_dict(seed=9)
    official = tmp_path / "official.pth"
    torch.save({"model": sd}, official)
    model = dynamicvit_on_deit(checkpoint=official).eval()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    dense = tmp_path / "dense.pth"
    torch.save({"model": {k: v for k, v in sd.items() if not k.startswith("score_predictor.")}}, dense)
    model = dynamicvit_on_deit(checkpoint=dense, keep_ratio=1.0).eval()  # predictors fresh, ρ = 1: the dense DeiT
    x = images(2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(sd, x, training=False, ratio=1.0).logits, atol=1e-5, rtol=1e-5)


def test_rho_one_is_exactly_the_dense_backbone_and_remove_restores_it() -> None:
    torch.manual_seed(0)
    model = vitrim.create_model("vit_small_patch16_224", **ARCH).eval()
    x = images(2)
    with torch.no_grad():
        dense = model(x)
        keys = set(model.state_dict())
        vitrim.reduce.apply(model, "dynamicvit", keep_ratio=1.0)
        assert torch.equal(model(x), dense)
        assert {k.split(".")[0] for k in set(model.state_dict()) - keys} == {"score_predictor"}
        vitrim.reduce.remove(model)
        vitrim.reduce.apply(model, "dynamicvit", keep_ratio=0.5)
        assert [t.shape[1] for t in model.forward_detailed(x).kept_indices] == [8, 4, 2]  # int(16 · 0.5^s)
        vitrim.reduce.remove(model)
    assert set(model.state_dict()) == keys and not hasattr(model, "score_predictor")


def test_save_and_load_model_put_the_reducer_back(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = dynamicvit_on_deit(keep_ratio=0.6).eval()
    loaded = vitrim.load_model(vitrim.save_checkpoint(model, tmp_path / "m.safetensors"))
    x = images(2)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert vitrim.reduce.applied_reducers(loaded) == [
        {"name": "dynamicvit", "layers": [1, 2, 3], "options": {"keep_ratio": 0.6}}
    ]


def test_training_masks_tokens_and_every_predictor_gets_a_gradient() -> None:
    torch.manual_seed(2)
    model = dynamicvit_on_deit(keep_ratio=0.5).train()
    out = model.forward_detailed(images(3))
    assert len(out.keep_masks) == 3 and out.tokens.shape[1] == 17  # masked, not removed
    out.logits.sum().backward()
    for name, param in model.named_parameters():
        if name.startswith("score_predictor."):
            assert param.grad is not None and bool(param.grad.abs().sum() > 0), name


def test_errors() -> None:
    model = dynamicvit_on_deit()
    with pytest.raises(ValueError, match="already has score_predictor"):
        vitrim.reduce.apply(model, "dynamicvit", layers=(0,))
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\]"):
        vitrim.create_model("deit_tiny_patch16_224", reducer="dynamicvit", keep_ratio=1.5, **ARCH)
    with pytest.raises(ValueError, match="pass layers or prune_layers, not both"):
        vitrim.reduce.apply(
            vitrim.create_model("deit_tiny_patch16_224", **ARCH), "dynamicvit", layers=(1,), prune_layers=(2,)
        )
