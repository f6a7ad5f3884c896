"""The module-structured official DynamicViT (used for timing) computes vitrim's evaluation logits."""

from __future__ import annotations

import torch
from dynamicvit_official_model import official_dynamicvit_model

import vitrim


def test_official_model_matches_vitrim_in_evaluation() -> None:
    torch.manual_seed(0)
    arch = dict(img_size=64, patch_size=8, embed_dim=48, depth=6, num_heads=3, num_classes=7)
    model = vitrim.create_model("dynamicvit_tiny_patch16_224", keep_ratio=0.6, prune_layers=(1, 3, 4), **arch).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # well-separated keep scores: no near-tie for round-off to flip
    official = official_dynamicvit_model(
        model.state_dict(), depth=6, heads=3, patch=8, pruning_loc=(1, 3, 4), keep_ratio=0.6
    )
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(images), official(images), rtol=0, atol=1e-5)
