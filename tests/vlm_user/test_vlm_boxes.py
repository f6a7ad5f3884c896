"""Each LLM image token's pixel box in the ORIGINAL picture, checked by hand computation and against what
transformers' own processors do to a picture whose pixels encode their coordinates."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vitrim.vlm.families.gemma3 import gemma3_boxes
from vitrim.vlm.families.llava import llava_boxes
from vitrim.vlm.families.llava_next import llava_next_boxes
from vitrim.vlm.families.paligemma import paligemma_boxes
from vitrim.vlm.families.qwen2vl import qwen_boxes

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")


def llava_config(patch: int, strategy: str = "default") -> SimpleNamespace:
    return SimpleNamespace(vision_config=SimpleNamespace(patch_size=patch), vision_feature_select_strategy=strategy)


def test_llava_15_crop_by_hand() -> None:
    """LLaVA-1.5-7B's processor (shortest edge 336, centre crop 336, 14-px patches) on a 400×300 picture: resized
    to 448×336, the crop starts at x = (448 − 336) / 2 = 56; one resized pixel is 400/448 original ones."""
    processor = SimpleNamespace(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, do_center_crop=True, do_resize=True
    )
    boxes = llava_boxes(processor, llava_config(14), (300, 400))
    assert boxes.boxes.shape == (576, 4) and boxes.grids == ((24, 24),)
    scale = 400 / 448  # = 300 / 336
    assert boxes.boxes[0].tolist() == pytest.approx([56 * scale, 0.0, 70 * scale, 14 * scale])  # 50, 0, 62.5, 12.5
    assert boxes.boxes[575].tolist() == pytest.approx([(56 + 322) * scale, 322 * scale, 350.0, 300.0])
    assert boxes.boxes[24 * 5 + 7].tolist() == pytest.approx(
        [(56 + 98) * scale, 70 * scale, (56 + 112) * scale, 84 * scale]
    )
    assert (boxes.view == 0).all()


def test_llava_full_strategy_and_padding_by_hand() -> None:
    """``do_pad`` pads a 100×50 (W×H) picture to 100×100 (25 rows above); the "full" strategy puts [CLS] first."""
    processor = SimpleNamespace(
        size={"height": 20, "width": 20}, crop_size=None, do_center_crop=False, do_resize=True, do_pad=True
    )
    boxes = llava_boxes(processor, llava_config(10, "full"), (50, 100))
    assert len(boxes.boxes) == 1 + 4 and boxes.view.tolist() == [-1, 0, 0, 0, 0]
    assert math.isnan(boxes.boxes[0, 0])
    # processed 10 px = 50 original px; the padded square starts 25 px above the picture
    assert boxes.boxes[1].tolist() == pytest.approx([0.0, 0.0, 50.0, 25.0])  # y −25 … 25, clipped to the picture
    assert boxes.boxes[4].tolist() == pytest.approx([50.0, 25.0, 100.0, 50.0])


def test_qwen_resize_by_hand() -> None:
    """Qwen2.5-VL on a 500×300 picture: smart_resize gives 504×308 (22×36 patches of 14 px, 11×18 tokens)."""
    config = SimpleNamespace(vision_config=SimpleNamespace(patch_size=14, spatial_merge_size=2))
    boxes = qwen_boxes(config, torch.tensor([1, 22, 36]), (300, 500))
    assert boxes.grids == ((11, 18),) and len(boxes.boxes) == 198
    sx, sy = 500 / 504, 300 / 308
    assert boxes.boxes[19].tolist() == pytest.approx([28 * sx, 28 * sy, 56 * sx, 56 * sy])  # row 1, column 1
    assert boxes.boxes[197].tolist() == pytest.approx([476 * sx, 280 * sy, 500.0, 300.0])
    with pytest.raises(ValueError, match="frames"):
        qwen_boxes(config, torch.tensor([2, 22, 36]), (300, 500))


def test_llava_next_tiles_by_hand() -> None:
    """16-px tiles of 4-px patches (N = 16), pinpoints 16×32 / 32×16 / 32×32, a 40×10 (W×H) picture: the best
    resolution is 16×32 (H×W), the picture resized to 32×8 and padded by 4 rows above; tile 1 is the left half."""
    config = SimpleNamespace(vision_config=SimpleNamespace(image_size=16, patch_size=4))
    processor = SimpleNamespace(image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])
    token_map = torch.tensor([0, 15, 16 + 0, 16 + 4, 32 + 7, -1])
    boxes = llava_next_boxes(processor, config, token_map, (10, 40))
    assert boxes.views == ("base view", "tiles") and boxes.grids == ((4, 4), (4, 8))
    # base view: the picture squeezed into 16×16, a patch is 10 × 2.5 original px
    assert boxes.boxes[0].tolist() == pytest.approx([0.0, 0.0, 10.0, 2.5])
    assert boxes.boxes[1].tolist() == pytest.approx([30.0, 7.5, 40.0, 10.0])
    # tile 1, patch row 0: canvas rows 0 … 4 are all padding
    assert math.isnan(boxes.boxes[2, 0]) and boxes.view[2] == -1
    # tile 1, patch row 1 col 0: canvas y 4 … 8 -> picture 0 … 5 (8 rows of the resized picture = 10 px)
    assert boxes.boxes[3].tolist() == pytest.approx([0.0, 0.0, 5.0, 5.0])
    # tile 2, patch row 1 col 3: canvas x 28 … 32 -> 35 … 40
    assert boxes.boxes[4].tolist() == pytest.approx([35.0, 0.0, 40.0, 5.0])
    assert math.isnan(boxes.boxes[5, 0]) and boxes.view.tolist() == [0, 0, -1, 1, 1, -1]


def siglip_config(image_size: int, patch: int, tokens: int | None = None) -> SimpleNamespace:
    vision = SimpleNamespace(image_size=image_size, patch_size=patch)
    return SimpleNamespace(vision_config=vision, mm_tokens_per_image=tokens)


def test_paligemma_resize_by_hand() -> None:
    """PaliGemma-3B-224's processor (224×224, 14-px patches: 16×16 tokens) on a 400×300 picture: no crop, the
    picture squeezed to a square, one processed pixel = 400/224 × 300/224 original ones."""
    processor = SimpleNamespace(size={"height": 224, "width": 224}, do_resize=True)
    boxes = paligemma_boxes(processor, siglip_config(224, 14), (300, 400))
    assert boxes.boxes.shape == (256, 4) and boxes.grids == ((16, 16),) and boxes.views == ("image",)
    sx, sy = 400 / 224, 300 / 224
    assert boxes.boxes[0].tolist() == pytest.approx([0.0, 0.0, 14 * sx, 14 * sy])
    assert boxes.boxes[16 * 3 + 5].tolist() == pytest.approx([70 * sx, 42 * sy, 84 * sx, 56 * sy])
    assert boxes.boxes[255].tolist() == pytest.approx([210 * sx, 210 * sy, 400.0, 300.0])
    assert (boxes.view == 0).all()


def test_gemma3_pooled_tokens_and_patches_by_hand() -> None:
    """Gemma-3-4B's processor (896×896, 14-px patches: 64×64 patches pooled 4×4 to 16×16 tokens) on a 500×250
    picture: a token is a 56-px cell of the processed square, 500/896 × 250/896 original px per processed px; the
    tower's patches (``patches=True``) are 14-px cells."""
    processor = SimpleNamespace(size={"height": 896, "width": 896}, do_resize=True)
    config = siglip_config(896, 14, tokens=256)
    boxes = gemma3_boxes(processor, config, (250, 500))
    assert boxes.boxes.shape == (256, 4) and boxes.grids == ((16, 16),)
    sx, sy = 500 / 896, 250 / 896
    assert boxes.boxes[16 * 2 + 7].tolist() == pytest.approx([7 * 56 * sx, 2 * 56 * sy, 8 * 56 * sx, 3 * 56 * sy])
    assert boxes.boxes[255].tolist() == pytest.approx([15 * 56 * sx, 15 * 56 * sy, 500.0, 250.0])
    patches = gemma3_boxes(processor, config, (250, 500), patches=True)
    assert patches.boxes.shape == (4096, 4) and patches.grids == ((64, 64),) and patches.views == ("patches",)
    assert patches.boxes[64 * 9 + 30].tolist() == pytest.approx([30 * 14 * sx, 9 * 14 * sy, 31 * 14 * sx, 10 * 14 * sy])
    # pooled token (r, c) is the union of the patches of rows 4r … 4r+3, columns 4c … 4c+3
    cell = patches.boxes.reshape(16, 4, 16, 4, 4)[2, :, 7, :]  # (4, 4, 4) the 16 patches of token (2, 7)
    assert cell[..., 0].min() == pytest.approx(boxes.boxes[39, 0]) and cell[..., 3].max() == pytest.approx(
        boxes.boxes[39, 3]
    )
    with pytest.raises(ValueError, match="does not pool evenly"):
        gemma3_boxes(processor, siglip_config(896, 14, tokens=25), (250, 500))


SCALE = 3  # pixel value per pixel of distance: pictures up to 85 px


def coordinate_picture(height: int, width: int) -> object:
    """R = 3·x, G = 3·y (pixel indices): a linear picture, which the processors' resize keeps linear inside."""
    from PIL import Image

    assert SCALE * max(height, width) < 256
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([SCALE * x, SCALE * y, np.zeros_like(x)], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb)


def box_centres_seen(pixels: torch.Tensor, cell: int, rows: int, cols: int) -> torch.Tensor:
    """(rows·cols, 2): the mean R/3, G/3 over each cell of the processed frame (3, H, W) — the original x, y
    coordinate (pixel index) the cell's pixels came from, on average."""
    means = torch.nn.functional.avg_pool2d(pixels[None, :2].double(), cell)[0] / SCALE  # (2, rows, cols)
    return means.reshape(2, rows * cols).T


@pytest.mark.parametrize("size", [(30, 40), (40, 26)])
def test_llava_boxes_match_the_processor(size: tuple[int, int]) -> None:
    """The box centre (minus half a pixel: centres of pixel i are at i + 0.5) is where the processed patch's pixels
    came from, per transformers' own CLIPImageProcessor (resize, then centre crop), to within a pixel's blur."""
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, do_rescale=False, do_normalize=False
    )
    pixels = processor(images=[coordinate_picture(*size)], return_tensors="pt")["pixel_values"][0]
    boxes = llava_boxes(processor, llava_config(4), size)
    centres = torch.stack([(boxes.boxes[:, 0] + boxes.boxes[:, 2]) / 2, (boxes.boxes[:, 1] + boxes.boxes[:, 3]) / 2], 1)
    seen = box_centres_seen(pixels, 4, 4, 4)
    inside = ((centres > 3) & (centres < torch.tensor([size[1], size[0]]) - 3)).all(1)  # away from the edges' blur
    assert inside.sum() >= 4
    assert torch.allclose(seen[inside], centres[inside] - 0.5, atol=0.6)


def test_qwen_boxes_match_the_processor() -> None:
    """Qwen2VLImageProcessor's smart_resize on a 37×23 picture, read back through its patch layout."""
    processor = transformers.Qwen2VLImageProcessor(
        patch_size=2, merge_size=2, temporal_patch_size=1, min_pixels=64, max_pixels=64 * 64,
        do_rescale=False, do_normalize=False,
    )  # fmt: skip
    out = processor(images=[coordinate_picture(23, 37)], return_tensors="pt")
    _, grid_h, grid_w = out["image_grid_thw"][0].tolist()
    # pixel_values: one row per patch, in merge-block order (rows of 2×2 blocks), channels × 2 × 2 inside
    patches = out["pixel_values"].reshape(grid_h // 2, grid_w // 2, 2, 2, 3, 2, 2)
    frame = patches.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, grid_h * 2, grid_w * 2)
    config = SimpleNamespace(vision_config=SimpleNamespace(patch_size=2, spatial_merge_size=2))
    boxes = qwen_boxes(config, out["image_grid_thw"][0], (23, 37))
    centres = torch.stack([(boxes.boxes[:, 0] + boxes.boxes[:, 2]) / 2, (boxes.boxes[:, 1] + boxes.boxes[:, 3]) / 2], 1)
    seen = box_centres_seen(frame, 4, grid_h // 2, grid_w // 2)
    inside = ((centres > 3) & (centres < torch.tensor([37, 23]) - 3)).all(1)
    assert inside.sum() >= 10
    assert torch.allclose(seen[inside], centres[inside] - 0.5, atol=0.6)


@pytest.mark.parametrize("size", [(20, 80), (60, 44)])
def test_llava_next_boxes_match_the_model_and_processor(size: tuple[int, int]) -> None:
    """A tiny LLaVA-NeXT's own packing (unpadding included, at 80×20) and LlavaNextImageProcessor's tiles: each
    packed token's box centre is where its tile patch's pixels came from."""
    from vitrim.viz.vlm_boxes import vlm_token_boxes
    from vitrim.vlm.families import find_family

    pinpoints = [[16, 32], [32, 16], [32, 32]]
    config = transformers.LlavaNextConfig(
        vision_config=dict(
            model_type="clip_vision_model", hidden_size=32, intermediate_size=37, num_hidden_layers=1,
            num_attention_heads=4, image_size=16, patch_size=4,
        ),
        text_config=dict(
            model_type="llama", vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2,
        ),
        image_token_id=3, vision_feature_layer=-1, vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
    )  # fmt: skip
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, image_grid_pinpoints=pinpoints,
        do_rescale=False, do_normalize=False,
    )  # fmt: skip
    out = image_processor(images=[coordinate_picture(*size)], return_tensors="pt")
    (boxes,) = vlm_token_boxes(model, SimpleNamespace(image_processor=image_processor), dict(out), [size])
    (token_map,) = find_family(model).token_maps(out["image_sizes"])
    tiles = out["pixel_values"][0]  # (tiles, 3, 16, 16)
    seen = {tile: box_centres_seen(tiles[tile], 4, 4, 4) for tile in range(len(tiles))}
    placed = 0
    for position, number in enumerate(token_map.tolist()):
        if number < 0:
            assert boxes.view[position] == -1
            continue
        tile, token = divmod(number, 16)
        assert boxes.view[position] == (0 if tile == 0 else 1) or math.isnan(boxes.boxes[position, 0])
        x0, y0, x1, y1 = boxes.boxes[position].tolist()
        if math.isnan(x0):
            continue
        centre = torch.tensor([(x0 + x1) / 2, (y0 + y1) / 2], dtype=torch.float64)
        if (centre < 3).any() or centre[0] > size[1] - 3 or centre[1] > size[0] - 3 or (x1 - x0) < 3 or (y1 - y0) < 3:
            continue  # the edges' blur, and patches half in the padding
        placed += 1
        assert torch.allclose(seen[tile][token], centre - 0.5, atol=0.75), (position, number)
    assert placed >= 6


@pytest.mark.parametrize("size", [(30, 40), (40, 26)])
def test_paligemma_and_gemma3_boxes_match_their_processors(size: tuple[int, int]) -> None:
    """SiglipImageProcessor (bicubic) and Gemma3ImageProcessor (bilinear) squeeze the picture to the square frame:
    each box's centre is where its patch's (PaliGemma) or pooled cell's (Gemma 3) pixels came from."""
    siglip = transformers.SiglipImageProcessor(size={"height": 16, "width": 16}, do_rescale=False, do_normalize=False)
    frame = siglip(images=[coordinate_picture(*size)], return_tensors="pt")["pixel_values"][0]
    gemma = transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32}, do_rescale=False, do_normalize=False)
    gemma_frame = gemma(images=[coordinate_picture(*size)], return_tensors="pt")["pixel_values"][0]
    for boxes, pixels, cell, side in (
        (paligemma_boxes(siglip, siglip_config(16, 4), size), frame, 4, 4),
        (gemma3_boxes(gemma, siglip_config(32, 2, tokens=16), size), gemma_frame, 8, 4),  # 16×16 patches pooled 4×4
        (gemma3_boxes(gemma, siglip_config(32, 2, tokens=16), size, patches=True), gemma_frame, 2, 16),
    ):
        x, y = (boxes.boxes[:, 0] + boxes.boxes[:, 2]) / 2, (boxes.boxes[:, 1] + boxes.boxes[:, 3]) / 2
        centres = torch.stack([x, y], 1)
        seen = box_centres_seen(pixels, cell, side, side)
        inside = ((centres > 3) & (centres < torch.tensor([size[1], size[0]]) - 3)).all(1)
        assert inside.sum() >= 4
        assert torch.allclose(seen[inside], centres[inside] - 0.5, atol=0.75)
