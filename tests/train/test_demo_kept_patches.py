"""The demo's diagnostic: fraction of digit (ink) and background patches DynamicViT kept, checked by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vitrim.demos.vision import _kept_digit_patches


class _FixedKeeper(nn.Module):
    """Stands in for a DynamicViT: reports the kept positions it was given."""

    def __init__(self, kept: list[torch.Tensor]) -> None:
        super().__init__()
        self.config = SimpleNamespace(patch_size=8)
        self.kept = kept

    def forward_detailed(self, images: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(kept_indices=self.kept)


def test_kept_digit_patches_by_hand() -> None:
    images = torch.full((2, 1, 16, 16), -1.0)  # background is (0 - 0.5) / 0.5 = -1; a 2x2 grid of 8x8 patches
    images[0, 0, 3, 4] = 0.0  # image 0: ink in patch 0 only
    images[1, 0, 9, 2] = 1.0  # image 1: ink in patch 2 ...
    images[1, 0, 12, 15] = -0.5  # ... and patch 3
    stage1 = torch.tensor([[0, 1, 3], [3, 0, 1]])  # image 0 keeps its digit patch; image 1 one of its two
    stage2 = torch.tensor([[1], [2]])
    kept = _kept_digit_patches(_FixedKeeper([stage1, stage2]), images)
    # 3 digit patches in all (1 + 2), 5 background; stage 1 keeps 1 + 1 digit and 2 + 2 background patches
    assert kept["digit"] == pytest.approx([2 / 3, 1 / 3])
    assert kept["background"] == pytest.approx([4 / 5, 1 / 5])
