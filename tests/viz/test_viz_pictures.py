"""Kept-token pictures and attention-map grids: the drawn masks, the pixels, and PNGs rendered headless."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch

import vitrim
from vitrim.viz import (
    cls_attention_grid,
    figure_to_rgb,
    kept_masks,
    model_attention_grid,
    plot_attention_maps,
    plot_kept_tokens,
    plot_rollout,
    positions_to_token_index,
    render_kept_tokens,
    save_figure,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def render_png(fig) -> bytes:
    buffer = io.BytesIO()
    save_figure(fig, buffer)
    return buffer.getvalue()


def test_kept_masks_mark_exactly_the_kept_indices():
    kept = [torch.tensor([[0, 5, 7, 10, 15, 3], [1, 2, 3, 4, 5, 6]]), torch.tensor([[15, 0, 7], [6, 5, 4]])]
    masks = kept_masks(kept, (4, 4), sample=0)
    assert masks.shape == (2, 4, 4) and masks.dtype == bool
    for stage, indices in enumerate(kept):
        expected = np.zeros(16, dtype=bool)
        for position in indices[0].tolist():
            expected[position] = True
        np.testing.assert_array_equal(masks[stage].ravel(), expected)
    assert kept_masks(kept, (4, 4), sample=1)[1].ravel().nonzero()[0].tolist() == [4, 5, 6]
    assert masks[0, 1, 1] and masks[0, 0, 3] and not masks[0, 0, 1]  # position 5 = row 1, column 1; 3 = row 0, col 3


def test_kept_masks_reject_bad_indices():
    with pytest.raises(ValueError, match="outside the 2x2 grid"):
        kept_masks([torch.tensor([[0, 4]])], (2, 2))
    with pytest.raises(ValueError, match="repeats a position"):
        kept_masks([torch.tensor([[1, 1]])], (2, 2))
    with pytest.raises(ValueError, match="sample 3 is out of range"):
        kept_masks([torch.tensor([[1]])], (2, 2), sample=3)
    with pytest.raises(ValueError, match="non-empty list"):
        kept_masks([], (2, 2))


def test_render_keeps_kept_pixels_and_washes_out_pruned_ones():
    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, 8, 8, generator=g)  # (C, H, W); grid 2x2 of 4x4-pixel patches
    image[0, 0, 0], image[1, 0, 1] = 0.0, 1.0  # so the min-max display scaling is the identity
    masks = kept_masks([torch.tensor([[0, 3]])], (2, 2))  # keep top-left and bottom-right
    panels = render_kept_tokens(image, masks, wash=0.75)
    assert panels.shape == (1, 8, 8, 3)
    rgb = image.permute(1, 2, 0).numpy()
    np.testing.assert_allclose(panels[0, :4, :4], rgb[:4, :4], atol=1e-6)  # kept: untouched
    np.testing.assert_allclose(panels[0, 4:, 4:], rgb[4:, 4:], atol=1e-6)
    np.testing.assert_allclose(panels[0, :4, 4:], 0.75 + 0.25 * rgb[:4, 4:], atol=1e-6)  # pruned: towards white
    np.testing.assert_allclose(panels[0, 4:, :4], 0.75 + 0.25 * rgb[4:, :4], atol=1e-6)


def test_kept_token_figure_draws_the_masks_and_renders_a_png():
    image = torch.zeros(1, 16, 16)  # black: a kept patch stays black, a washed one turns light grey
    image[0, 0, 0] = 1.0
    kept = [torch.tensor([[0, 1, 2, 3, 5, 10]]), torch.tensor([[0, 5]])]
    fig, masks = plot_kept_tokens(image, kept, (4, 4))
    np.testing.assert_array_equal(masks, kept_masks(kept, (4, 4)))
    pixels = figure_to_rgb(fig)  # (H, W, 3) uint8 as Agg drew it
    assert pixels.shape[2] == 3 and pixels.std() > 0
    width, height = png_size(render_png(fig))
    assert (height, width) == pixels.shape[:2]
    # the last panel: patch 5 (kept, black) and patch 6 (washed: 0.75 white) sit in panel 3 of 3
    stage2 = fig.axes[2]
    x0, y0, x1, y1 = stage2.get_window_extent().extents  # display pixels, origin bottom-left
    top = pixels.shape[0]

    def patch_centre(position):  # row, column of the centre of a 4x4 grid cell, in figure pixels
        r, c = divmod(position, 4)
        return int(top - (y1 - (r + 0.5) * (y1 - y0) / 4)), int(x0 + (c + 0.5) * (x1 - x0) / 4)

    kept_pixel = pixels[patch_centre(5)]
    washed_pixel = pixels[patch_centre(6)]
    assert kept_pixel.max() <= 5  # black, untouched
    assert np.all(np.abs(washed_pixel.astype(int) - round(0.75 * 255)) <= 3)  # 0.75·white + 0.25·black


def test_cls_attention_grid_scatters_pruned_blocks_to_their_positions():
    # 1 [CLS] + 4 patches on a 2x2 grid; block 1 saw [CLS] and patches 3, 1 (in that order)
    a0 = torch.softmax(torch.randn(1, 2, 5, 5), -1)
    a1 = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    index1 = positions_to_token_index(torch.tensor([[3, 1]]))
    maps = cls_attention_grid([a0, a1], (2, 2), token_indices=[None, index1])
    assert maps.shape == (1, 2, 2, 2, 2)
    for head in range(2):
        for position in range(4):
            r, c = divmod(position, 2)
            assert maps[0, 0, head, r, c] == a0[0, head, 0, 1 + position]
        assert maps[0, 1, head, 1, 1] == a1[0, head, 0, 1]  # patch 3 came first
        assert maps[0, 1, head, 0, 1] == a1[0, head, 0, 2]  # patch 1 second
        assert torch.isnan(maps[0, 1, head, 0, 0]) and torch.isnan(maps[0, 1, head, 1, 0])  # never seen: empty


def test_cls_attention_grid_needs_indices_for_a_pruned_block():
    with pytest.raises(ValueError, match="pass token_indices"):
        cls_attention_grid([torch.rand(1, 1, 3, 3)], (2, 2))


def test_model_attention_maps_use_the_images_own_grid():
    torch.manual_seed(0)
    model = vitrim.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3
    ).eval()
    image = torch.randn(3, 16, 32)  # not the model's 32x32: a 2x4 grid
    maps, logits = model_attention_grid(model, image)
    assert maps.shape == (2, 2, 2, 4) and logits.shape == (3,)
    with torch.no_grad():
        weights = model.forward_detailed(image[None], need_weights=True).attentions
    torch.testing.assert_close(maps[1, 0].reshape(-1), weights[1][0, 0, 0, 1:])
    fig = plot_attention_maps(image, maps)
    width, height = png_size(render_png(fig))
    assert width > 100 and height > 100


def test_dynamicvit_attention_maps_leave_pruned_patches_empty():
    torch.manual_seed(0)
    model = vitrim.create_model(
        "dynamicvit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=3
    ).eval()
    image = torch.randn(3, 16, 16)
    maps, _ = model_attention_grid(model, image)  # (4 blocks, 2 heads, 4, 4)
    with torch.no_grad():
        kept = model.forward_detailed(image[None]).kept_indices
    assert not torch.isnan(maps[0]).any()
    for block, stage in ((1, 0), (2, 1), (3, 2)):  # pruning before blocks 1, 2, 3 (depth 4)
        seen = torch.zeros(16, dtype=torch.bool)
        seen[kept[stage][0]] = True
        np.testing.assert_array_equal(~torch.isnan(maps[block, 0]).reshape(-1).numpy(), seen.numpy())
    fig = plot_attention_maps(image, maps)
    assert png_size(render_png(fig))[0] > 100


def test_rollout_figure_renders_a_png():
    fig = plot_rollout(torch.rand(1, 16, 16), torch.rand(4, 4), title="rollout")
    width, height = png_size(render_png(fig))
    assert width > 100 and height > 100
    with pytest.raises(ValueError, match="relevance must be \\(gh, gw\\)"):
        plot_rollout(torch.rand(1, 16, 16), torch.rand(16))


@pytest.mark.parametrize(
    ("spec", "options", "reduction"),
    [
        ("tome", dict(r=4), 2),  # merges after attention in every block: block 3 sees what block 2 left
        ("evit", dict(keep_rate=0.5, layers=(1, 2)), 1),  # fuses in blocks 1 and 2: block 3 sees the second
    ],
)
def test_merged_tokens_are_drawn_on_every_patch_they_stand_for(spec, options, reduction):
    import vitrim.reduce

    torch.manual_seed(0)
    model = vitrim.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2, num_classes=3
    ).eval()
    vitrim.reduce.apply(model, spec, **options)
    image = torch.randn(3, 32, 32)
    maps, _ = model_attention_grid(model, image)  # (4, 2, 4, 4)
    with torch.no_grad():
        out = model.forward_detailed(image[None], need_weights=True)
    assert not torch.isnan(maps).any()  # merging drops no patch: every one is drawn
    last = out.attentions[3]
    tracking = out.patch_to_token[reduction][0]  # (P,) the token that stands for each patch
    assert last.shape[-1] == 1 + int(tracking.max()) + 1
    for head in range(2):
        for position in range(16):
            r, c = divmod(position, 4)
            assert maps[-1, head, r, c] == last[0, head, 0, 1 + int(tracking[position])]
