"""Tiny random PaliGemma instances built from a config alone (transformers' own tests use such sizes), float64.

The tower is SigLIP (no [CLS]) on 16-px images with 4-px patches: a 4×4 grid, each patch one image token (16 per
image), projected by one linear map. The LLM is a 2-layer Gemma attending both ways over the image and the prompt.
Token ids: 0 unused, 1 pad, 2 begin-of-sequence, 3 the image token; prompts use ids 6 … 98.
"""

from __future__ import annotations

import pytest
import torch

from tiny_vlms.spread import spread

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 3
PAD = 1
BOS = 2
IMAGE_TOKENS = 16  # the tower's 4×4 patch grid


def tiny_paligemma(seed: int = 0) -> torch.nn.Module:
    config = transformers.PaliGemmaConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=16,
            patch_size=4,
            vision_use_head=False,
        ),
        text_config=dict(
            model_type="gemma",
            vocab_size=99,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            pad_token_id=PAD,
        ),
        image_token_index=IMAGE_TOKEN,
        projection_dim=32,
        hidden_size=32,
        vocab_size=99,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return spread(transformers.PaliGemmaForConditionalGeneration(config).double().eval())


def prompt(num_text: int, seed: int = 0) -> torch.Tensor:
    """(L,) ids as PaliGemma's processor lays them out: the image tokens, begin-of-sequence, the prompt."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(6, 99, (num_text,), generator=generator)
    return torch.cat([torch.full((IMAGE_TOKENS,), IMAGE_TOKEN), torch.tensor([BOS]), text])


def pixels(num_images: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_images, 3, 16, 16, generator=generator, dtype=torch.float64)
