"""A tiny random LLaVA-OneVision built from a config alone, float64: a SigLIP tower on 14-px tiles of 2-px patches
(a 7×7 grid, 49 tokens per tile; a video frame pooled bilinearly to ⌈7/2⌉² = 4×4 = 16 tokens, the odd-to-even ratio
of the real 27×27 → 14×14), a 2-layer Qwen2 LLM, and prompts with images and videos for it.

Token ids: 0 unused, 1 pad, 3 the image token, 4 the video token; prompts use ids 5 … 98. The token counts come
from the unmodified model's own ``get_image_features`` (transformers' packing), not from a formula of the tests.
"""

from __future__ import annotations

import pytest
import torch

from tiny_vlms.spread import spread

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 3
VIDEO_TOKEN = 4
PAD = 1
FRAME_TOKENS = 16  # the pooled 4×4 grid of one frame
TILE = 14
SIZES = torch.tensor([[20, 40], [30, 30]])  # a 1×2 grid of crops (3 tiles) and a 2×2 grid (5 tiles)


def tiny_llava_onevision(seed: int = 0) -> torch.nn.Module:
    """A tiny LlavaOnevisionForConditionalGeneration in float64 (SigLIP, "full" strategy, last layer, as released)."""
    config = transformers.LlavaOnevisionConfig(
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, image_size=TILE, patch_size=2, vision_use_head=False,
        ),
        text_config=dict(
            model_type="qwen2", vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=PAD,
        ),
        image_token_index=IMAGE_TOKEN,
        video_token_index=VIDEO_TOKEN,
        image_grid_pinpoints=[[14, 28], [28, 14], [28, 28]],
    )  # fmt: skip
    torch.manual_seed(seed)
    return spread(transformers.LlavaOnevisionForConditionalGeneration(config).double().eval())


def video_tokens(frames: int) -> int:
    """LLM tokens of a video of ``frames`` frames: the pooled grids, then one newline token."""
    return frames * FRAME_TOKENS + 1


def clip(frames: int, seed: int, *, still: tuple[int, ...] = ()) -> torch.Tensor:
    """(frames, 3, 14, 14) float64 pixels; a frame in ``still`` repeats the one before it (up to 1e-3 noise), so
    time-reading methods have something to drop."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(frames, 3, TILE, TILE, generator=generator, dtype=torch.float64)
    for frame in still:
        pixels[frame] = pixels[frame - 1] + 1e-3 * torch.randn(3, TILE, TILE, generator=generator, dtype=torch.float64)
    return pixels


def text(count: int, seed: int) -> list[int]:
    return torch.randint(5, 99, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def video_prompts(clips: list[torch.Tensor], before: list[int], after: list[int] | None = None) -> dict:
    """One prompt per clip (``before[i]`` text tokens, the video, ``after[i]`` text tokens; the text drawn from
    its length, so a prompt is the same alone or in a batch), left-padded to one length: ``input_ids``,
    ``attention_mask``, ``pixel_values_videos`` (B, F, 3, 14, 14)."""
    after = after or [3] * len(clips)
    rows = [
        text(b, 100 + b) + [VIDEO_TOKEN] * video_tokens(len(c)) + text(a, 200 + a)
        for c, b, a in zip(clips, before, after, strict=True)
    ]
    return {**pad(rows), "pixel_values_videos": torch.stack(clips)}


def pad(rows: list[list[int]]) -> dict:
    """``rows`` left-padded with PAD: input_ids and attention_mask (B, L)."""
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), PAD)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, length - len(row) :] = torch.tensor(row)
        mask[index, length - len(row) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def image_token_counts(model: torch.nn.Module, pixel_values: torch.Tensor, sizes: torch.Tensor) -> list[int]:
    """LLM tokens of each image, as the unmodified model packs them."""
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, sizes, return_dict=True)
    return [len(image) for image in out.pooler_output]


def mixed_prompt(model: torch.nn.Module, frames: int = 3) -> dict:
    """One prompt: text, the 1×2-grid image, text, a clip of ``frames`` frames (the second repeating the first),
    text, the 2×2-grid image, text (batch of 1)."""
    pixel_values = torch.randn(2, 5, 3, TILE, TILE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    counts = image_token_counts(model, pixel_values, SIZES)
    ids = (
        text(2, 0) + [IMAGE_TOKEN] * counts[0] + text(1, 1) + [VIDEO_TOKEN] * video_tokens(frames) + text(2, 2)
        + [IMAGE_TOKEN] * counts[1] + text(2, 3)
    )  # fmt: skip
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "pixel_values": pixel_values,
        "image_sizes": SIZES,
        "pixel_values_videos": clip(frames, 5, still=(1,))[None],
    }


def several_images_prompt() -> dict:
    """One prompt with two images (``batch_num_images`` [2]: each its base view only, one tile, then one newline:
    49 + 1 tokens) and no video."""
    pixel_values = torch.randn(2, 1, 3, TILE, TILE, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ids = text(2, 4) + [IMAGE_TOKEN] * 50 + text(1, 5) + [IMAGE_TOKEN] * 50 + text(2, 6)
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "pixel_values": pixel_values,
        "image_sizes": SIZES,
        "batch_num_images": torch.tensor([2]),
    }
