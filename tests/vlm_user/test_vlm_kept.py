"""The kept-token picture on the user's picture: dropped tokens washed out, merged groups tinted, the rest as is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitrim.viz.vlm_boxes import Affine, TokenBoxes, grid_boxes
from vitrim.viz.vlm_kept import group_colour, plot_vlm_kept, render_vlm_kept, token_groups

pytest.importorskip("matplotlib")


def two_by_two(height: int = 4, width: int = 6) -> TokenBoxes:
    """A 2×2 token grid over a picture of height × width (each token a quarter)."""
    boxes = grid_boxes(2, 2, 1.0, Affine(width / 2, 0.0), Affine(height / 2, 0.0), (height, width))
    return TokenBoxes(boxes, torch.zeros(4, dtype=torch.long), ("image",), ((2, 2),), (height, width))


def test_render_by_hand() -> None:
    rgb = np.random.default_rng(0).random((4, 6, 3)).astype(np.float32)
    groups = [torch.tensor([0]), torch.tensor([1, 2])]  # token 0 alone, 1 and 2 merged, 3 dropped
    (panel,) = render_vlm_kept(rgb, two_by_two(), groups, wash=0.7, tint=0.45)
    np.testing.assert_allclose(panel[:2, :3], rgb[:2, :3])  # token 0: top left
    np.testing.assert_allclose(panel[:2, 3:], 0.45 * group_colour(1) + 0.55 * rgb[:2, 3:], rtol=1e-6)
    np.testing.assert_allclose(panel[2:, :3], 0.45 * group_colour(1) + 0.55 * rgb[2:, :3], rtol=1e-6)
    np.testing.assert_allclose(panel[2:, 3:], 0.7 + 0.3 * rgb[2:, 3:], rtol=1e-6)  # token 3: bottom right


def test_token_groups_and_bad_groups() -> None:
    boxes = two_by_two()
    assert token_groups(boxes, [torch.tensor([3]), torch.tensor([0, 1])]).tolist() == [1, 1, -1, 0]
    with pytest.raises(ValueError, match="outside the picture's 4 tokens"):
        token_groups(boxes, [torch.tensor([4])])
    with pytest.raises(ValueError, match="another group already holds"):
        token_groups(boxes, [torch.tensor([1]), torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="the boxes are for 4x6"):
        render_vlm_kept(np.zeros((5, 6, 3), dtype=np.float32), boxes, [])


def test_plot_titles_count_the_tokens() -> None:
    fig = plot_vlm_kept(np.zeros((4, 6, 3), dtype=np.uint8), two_by_two(), [torch.tensor([0]), torch.tensor([1, 2])])
    (ax,) = fig.axes
    assert ax.get_title() == "image (2x2): 3 of 4 tokens in"
    assert "2 LLM tokens stand for 3 of 4 image tokens" in fig._suptitle.get_text()
    assert len(ax.patches) == 2  # the merged group's two boxes outlined


def test_pixels_of_no_token_are_greyed() -> None:
    """A 2×2 grid over the left 4 columns of a 4×6 picture: columns 4, 5 belong to no token."""
    rgb = np.random.default_rng(1).random((4, 6, 3)).astype(np.float32)
    boxes = grid_boxes(2, 2, 1.0, Affine(2.0, 0.0), Affine(2.0, 0.0), (4, 6))
    narrow = TokenBoxes(boxes, torch.zeros(4, dtype=torch.long), ("image",), ((2, 2),), (4, 6))
    (panel,) = render_vlm_kept(
        rgb, narrow, [torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), torch.tensor([3])]
    )
    np.testing.assert_allclose(panel[:, :4], rgb[:, :4])
    np.testing.assert_allclose(panel[:, 4:], 0.25 + 0.5 * rgb[:, 4:], rtol=1e-6)
