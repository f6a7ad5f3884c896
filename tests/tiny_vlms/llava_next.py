"""A tiny random LLaVA-NeXT built from a config alone, float64, and one prompt with two images of different tile
grids for it (the LLM side is tiny_vlms.llava's: token ids, a 2-layer Llama)."""

from __future__ import annotations

import torch

from tiny_vlms.llava import CLIP_TOWER, IMAGE_TOKEN, LLAMA, transformers
from tiny_vlms.spread import spread

SIZES = torch.tensor([[20, 40], [30, 30]])  # 1×2 grid (3 tiles, 16 + 4·8 + 4 tokens), 2×2 grid (5 tiles, 16 + 8·8 + 8)
TOKENS = [52, 88]


PINPOINTS = [[16, 32], [32, 16], [32, 32]]


def tiny_llava_next(pinpoints: list[list[int]] | None = None, attn: str = "sdpa") -> torch.nn.Module:
    """A tiny LlavaNextForConditionalGeneration in float64 (CLIP 16-px tiles of 4-px patches, a 2-layer Llama);
    ``pinpoints``: its anyres resolutions (height, width) instead of :data:`PINPOINTS` (the same weights)."""
    config = transformers.LlavaNextConfig(
        vision_config=CLIP_TOWER | dict(num_hidden_layers=3),
        text_config=LLAMA,
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=PINPOINTS if pinpoints is None else pinpoints,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    return spread(transformers.LlavaNextForConditionalGeneration(config).double().eval())


def inputs() -> dict[str, torch.Tensor]:
    """One prompt: 2 text tokens, the 1×2-grid image, a text token, the 2×2-grid image, 2 text tokens (batch of 1)."""
    ids = torch.tensor([[5, 6] + [IMAGE_TOKEN] * TOKENS[0] + [7] + [IMAGE_TOKEN] * TOKENS[1] + [8, 9]])
    pv = torch.randn(2, 5, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "pixel_values": pv, "image_sizes": SIZES}
