"""The pictures' pixels, by hand: kept patches as they are, pruned ones washed out, merged groups tinted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

from vitrim.demos.vlm.pictures import WASH, render_groups
from vitrim.demos.vlm.report import ink_patches


def test_render_groups_keeps_washes_and_tints() -> None:
    pixels = np.zeros((64, 64), dtype=np.float32)
    pixels[0:8, 0:8] = 1.0  # ink in patch 0
    pixels[0:8, 8:16] = 0.5  # half ink in patch 1
    groups = [torch.tensor([0]), torch.tensor([2, 3, 10])]  # patch 0 alone; 2, 3, 10 merged; 1 and the rest pruned
    rgb = render_groups(pixels, groups)
    assert rgb.shape == (64, 64, 3)
    assert np.allclose(rgb[0:8, 0:8], 0.0)  # kept ink stays black
    assert np.allclose(rgb[0:8, 8:16], WASH + (1 - WASH) * 0.5)  # pruned half ink, washed towards white
    tint = rgb[0, 16]
    assert not np.allclose(tint, 1.0) and np.allclose(rgb[0:8, 24:32], tint) and np.allclose(rgb[8:16, 16:24], tint)
    assert np.allclose(rgb[40:48, 40:48], 1.0)  # pruned blank stays white
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 64\)"):
        render_groups(pixels, [torch.tensor([64])])
    with_cls = render_groups(pixels, [torch.zeros(0, dtype=torch.long), *groups])  # VisionZip's [CLS]: no patch
    assert np.array_equal(with_cls, rgb)


def test_ink_patches_marks_the_patches_with_any_ink() -> None:
    pixels = np.zeros((2, 64, 64), dtype=np.float32)
    pixels[0, 7, 7] = 0.1  # patch 0
    pixels[1, 63, 8] = 1.0  # row 7, column 1: patch 57
    ink = ink_patches(pixels)
    assert ink.shape == (2, 64) and ink.sum() == 2 and ink[0, 0] and ink[1, 57]
