"""Tiny random Gemma 3 instances built from a config alone (transformers' own tests use such sizes), float64.

The tower is SigLIP (no [CLS]) on 16-px images with 2-px patches: an 8×8 patch grid, average-pooled 2×2 by the
projector to ``mm_tokens_per_image`` = 16 image tokens per image (a 4×4 grid). The LLM is a 4-layer Gemma 3 with
sliding-window layers (window 8, shorter than the prompts, so the window binds) and full layers alternating.
Token ids: 0 unused, 1 pad, 3 the image token, 4 begin-of-image; prompts use ids 6 … 98.
"""

from __future__ import annotations

import pytest
import torch

from tiny_vlms.llava import batch as batch  # the same pad id: one padding for both families
from tiny_vlms.spread import spread

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 3
BOI = 4
PAD = 1  # as tiny_vlms.llava's (its batch() pads with it)
GRID_TOKENS = 16  # the projector's pooled 4×4 grid
WINDOW = 8


ALTERNATING = ("sliding_attention", "full_attention") * 2
REAL_PATTERN = ("sliding_attention",) * 5 + ("full_attention",)  # Gemma 3's checkpoints: 5 sliding layers, 1 full


def tiny_gemma3(
    attn: str = "sdpa", seed: int = 0, image_size: int = 16, layer_types: tuple[str, ...] = ALTERNATING
) -> torch.nn.Module:
    """``image_size`` 32: a 16×16 patch grid pooled 4×4 to the same 16 image tokens, the ratio of the real checkpoints
    (896-px images of 14-px patches: 64×64 patches pooled 4×4 to 256 tokens). ``layer_types``: the LLM's layers
    (:data:`REAL_PATTERN`: the checkpoints' five sliding-window layers to one full one)."""
    config = transformers.Gemma3Config(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=image_size,
            patch_size=2,
            vision_use_head=False,
        ),
        text_config=dict(
            model_type="gemma3_text",
            vocab_size=99,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=len(layer_types),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            sliding_window=WINDOW,
            layer_types=list(layer_types),
            pad_token_id=PAD,
        ),
        mm_tokens_per_image=GRID_TOKENS,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=BOI,
        eoi_token_index=5,
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return spread(transformers.Gemma3ForConditionalGeneration(config).double().eval())


def prompt(num_text_before: int, num_text_after: int, images: int = 1, seed: int = 0) -> torch.Tensor:
    """(L,) ids: text, then per image begin-of-image + GRID_TOKENS image tokens + two text tokens, then text."""
    generator = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(6, 99, (n,), generator=generator)  # noqa: E731
    parts = [text(num_text_before)]
    for _ in range(images):
        parts += [torch.tensor([BOI]), torch.full((GRID_TOKENS,), IMAGE_TOKEN), text(2)]
    parts.append(text(num_text_after))
    return torch.cat(parts)


def pixels(num_images: int, seed: int = 0, size: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_images, 3, size, size, generator=generator, dtype=torch.float64)


def token_types(ids: torch.Tensor) -> torch.Tensor:
    """What Gemma 3's processor returns as ``token_type_ids``: 1 at image tokens, 0 elsewhere."""
    return (ids == IMAGE_TOKEN).long()
