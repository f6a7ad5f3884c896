"""Unmerge: final tokens back on the patch grid, against a hand computation and on real reduced models."""

from __future__ import annotations

import pytest
import torch
from reduce_models import images, tiny

import vitrim
from vitrim.reduce.unmerge import tokens_on_grid


def test_tokens_on_grid_by_hand() -> None:
    # one [CLS] + 3 patch tokens; 5 patches: patches 0 and 3 merged into token 1, patch 2 dropped
    tokens = torch.tensor([[[9.0, 9.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])  # (1, 4, 2)
    patch_to_token = torch.tensor([[1, 0, -1, 1, 2]])
    expected = torch.tensor([[[3.0, 4.0], [1.0, 2.0], [0.0, 0.0], [3.0, 4.0], [5.0, 6.0]]])
    assert torch.equal(tokens_on_grid(tokens, patch_to_token, 1), expected)
    assert torch.equal(tokens_on_grid(tokens, [patch_to_token.flip(1), patch_to_token], 1), expected)
    assert torch.equal(tokens_on_grid(tokens, [], 1), tokens[:, 1:])
    with pytest.raises(ValueError, match="indices below 3"):
        tokens_on_grid(tokens, patch_to_token + 1, 1)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("tome", {"r": 3}),
        ("mctf", {"r": 2}),
        ("evit", {"keep_rate": 0.5, "layers": (1, 3)}),
        ("topk", {"keep_rate": 0.5}),
    ],
)
@pytest.mark.parametrize("distilled", [False, True])
def test_tokens_on_grid_of_a_reduced_model(name: str, options: dict[str, object], distilled: bool) -> None:
    model = vitrim.reduce.apply(tiny(distilled=distilled), name, **options)
    p = 2 if distilled else 1
    with torch.no_grad():
        out = model.forward_detailed(images())
    grid = out.tokens_on_grid()  # (B, P, D)
    assert grid.shape == (2, 16, 32)
    last = out.patch_to_token[-1]
    for b in range(2):
        for patch in range(16):
            t = int(last[b, patch])
            expected = torch.zeros(32) if t < 0 else out.tokens[b, p + t]
            assert torch.equal(grid[b, patch], expected)


def test_tokens_on_grid_of_a_dense_model_is_its_patch_tokens() -> None:
    with torch.no_grad():
        out = tiny(distilled=True).forward_detailed(images())
    assert torch.equal(out.tokens_on_grid(), out.tokens[:, 2:])
