"""Tiny random LLaVA-1.5 instances built from a config alone (transformers' own tests use such sizes), float64.

The tower is CLIP with a 4×4 grid (16 image tokens per image, [CLS] dropped, ``vision_feature_layer=-2``), the LLM
a 2-layer Llama. Token ids: 0 unused, 1 pad, 3 the image token; prompts use ids 5 … 98.
"""

from __future__ import annotations

import pytest
import torch

from tiny_vlms.spread import spread

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 3
PAD = 1
GRID_TOKENS = 16  # (16 px / 4 px)²


# the tower and the LLM, shared with tiny_vlms.llava_next
CLIP_TOWER = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    image_size=16,
    patch_size=4,
)
LLAMA = dict(
    model_type="llama", vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD,
)  # fmt: skip


def tiny_llava(attn: str = "sdpa", seed: int = 0, vision_layers: int = 3, text: dict | None = None) -> torch.nn.Module:
    """``text``: options of the LLM's config over these (another ``model_type``, a ``sliding_window``)."""
    config = transformers.LlavaConfig(
        vision_config=CLIP_TOWER | dict(num_hidden_layers=vision_layers, projection_dim=32),
        text_config=LLAMA | dict(max_position_embeddings=512) | (text or {}),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return spread(transformers.LlavaForConditionalGeneration(config).double().eval())


def prompt(num_text_before: int, num_text_after: int, images: int = 1, seed: int = 0) -> torch.Tensor:
    """(L,) ids: text, then per image GRID_TOKENS image tokens followed by two text tokens, then text."""
    generator = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(5, 99, (n,), generator=generator)  # noqa: E731
    parts = [text(num_text_before)]
    for _ in range(images):
        parts += [torch.full((GRID_TOKENS,), IMAGE_TOKEN), text(2)]
    parts.append(text(num_text_after))
    return torch.cat(parts)


def pixels(num_images: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_images, 3, 16, 16, generator=generator, dtype=torch.float64)


def batch(prompts: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ``prompts`` to one length on ``side`` ("left" or "right"): (input_ids, attention_mask), each (B, L)."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), PAD)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, p in enumerate(prompts):
        cols = slice(length - len(p), length) if side == "left" else slice(0, len(p))
        ids[row, cols] = p
        mask[row, cols] = 1
    return ids, mask
