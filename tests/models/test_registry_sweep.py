"""Every registered model, shrunk to a tiny size: forward, backward, gradients, and the detailed forward agree.

Written for any model anyone registers: the tiny overrides come from the model's family (its name's prefix), and
the checks that need ViT features (``forward_detailed``) run on every model that has them.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import vitrim

VIT_TINY: dict[str, Any] = dict(embed_dim=32, depth=2, num_heads=2, img_size=32, num_classes=5)
# family (name prefix) -> tiny overrides; the first matching prefix wins, "" matches every ViT-like name
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "cnn_": dict(widths=(8, 16), img_size=32, num_classes=5),
    "dynamicvit_": dict(VIT_TINY, depth=4),  # room for three pruning stages (before blocks 1, 2, 3)
    "": VIT_TINY,
}
MODELS = vitrim.list_models()
B = 2


def tiny_overrides(name: str) -> dict[str, Any]:
    overrides = dict(next(v for prefix, v in FAMILY_OVERRIDES.items() if name.startswith(prefix)))
    if "patch" in name and "img_size" in overrides and not name.startswith("cnn_"):
        # keep the model's own patch size: a 2x2 grid (64 px for patch 32, 28 px for patch 14)
        overrides["img_size"] = 2 * int(re.search(r"patch(\d+)", name).group(1))  # type: ignore[union-attr]
    return overrides


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return vitrim.create_model(name, **tiny_overrides(name))


def images_for(model: nn.Module, seed: int = 1) -> torch.Tensor:
    config = model.config  # type: ignore[attr-defined]
    height, width = config.img_size
    return torch.randn(B, config.in_chans, height, width, generator=torch.Generator().manual_seed(seed))


def test_the_registry_is_swept() -> None:
    assert len(MODELS) >= 12 and "vit_base_patch16_224" in MODELS and "deit_tiny_distilled_patch16_224" in MODELS


@pytest.mark.parametrize("name", MODELS)
def test_forward_backward_every_parameter_gets_a_gradient(name: str) -> None:
    model = build(name).train()
    x = images_for(model)
    logits = model(x)
    assert logits.shape == (B, 5) and torch.isfinite(logits).all()
    # a loss that depends on every logit, so every path to the output is exercised
    (logits * torch.arange(1, 6, dtype=logits.dtype)).sum().backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{name}: {param_name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{name}: {param_name} has a non-finite gradient"
        assert param.grad.abs().sum() > 0, f"{name}: {param_name} got an all-zero gradient"


@pytest.mark.parametrize("name", MODELS)
def test_eval_is_deterministic_and_forward_detailed_agrees(name: str) -> None:
    model = build(name).eval()
    x = images_for(model)
    with torch.no_grad():
        logits, again = model(x), model(x)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(again, logits, rtol=0, atol=0)
    if not hasattr(model, "forward_detailed"):
        return  # not a ViT (e.g. the CNN baseline): nothing more to compare
    with torch.no_grad():
        plain = model.forward_detailed(x)
        detailed = model.forward_detailed(x, need_weights=True)
    torch.testing.assert_close(plain.logits, logits, rtol=0, atol=1e-6)
    assert plain.attentions == []
    # the weights come from the explicit math path, the plain pass from the fused one: same numbers
    torch.testing.assert_close(detailed.logits, plain.logits, rtol=0, atol=1e-6)
    config = model.config
    heads = config.num_heads
    full = config.num_prefix + (x.shape[-2] // config.patch_size) * (x.shape[-1] // config.patch_size)
    reduces = any(block.reducer is not None for block in model.blocks)
    assert len(detailed.attentions) == config.depth
    for i, weights in enumerate(detailed.attentions):
        n = weights.shape[-1]
        assert weights.shape == (B, heads, n, n), f"block {i}: {tuple(weights.shape)}"
        assert n == full or (reduces and config.num_prefix < n <= full), f"block {i} saw {n} of {full} tokens"
        torch.testing.assert_close(weights.sum(-1), torch.ones(B, heads, n), rtol=0, atol=1e-5)
        assert (weights >= 0).all()


@pytest.mark.parametrize(
    ("name", "count"),
    # timm.create_model(name).num_parameters(), as timm's model cards list them
    [("vit_tiny_patch16_224", 5_717_416), ("deit_tiny_distilled_patch16_224", 5_910_800)],
)
def test_default_sizes_have_timms_parameter_count(name: str, count: int) -> None:
    model = vitrim.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == count
