"""vitrim's ToMe against independent re-implementations of the authors' timm-patched forward (same weights)."""

from __future__ import annotations

import pytest
import torch
from tome_functional import functional_tome_forward
from tome_official import official_tome_model

import vitrim

ARCH = dict(img_size=64, patch_size=8, embed_dim=48, depth=4, num_heads=3, num_classes=7)


@pytest.mark.parametrize(
    ("name", "distilled"), [("deit_tiny_patch16_224", False), ("deit_tiny_distilled_patch16_224", True)]
)
@pytest.mark.parametrize("r", [5, 40])
def test_tome_logits_match_the_official_forward(name: str, distilled: bool, r: int) -> None:
    torch.manual_seed(0)
    model = vitrim.create_model(name, reducer="tome", r=r, **ARCH).eval()
    with torch.no_grad():  # larger weights than the init, so that the merges are far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    official = official_tome_model(model.state_dict(), depth=4, heads=3, patch=8, r=r)
    assert official.distilled == distilled
    with torch.no_grad():
        expected = official(images)
        functional = functional_tome_forward(
            model.state_dict(), images, depth=4, heads=3, patch=8, r=r, distill_token=distilled
        )
        got = model(images)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(functional, expected, rtol=0, atol=1e-5)
