"""The digits video model: transformers' own ``Qwen2VLForConditionalGeneration``, small enough to train on 2 CPU cores.

Qwen2-VL's architecture at toy size: its vision tower (a 3-D patch embedding over 2 frames × 4×4 pixels, vision RoPE,
each temporal patch its own attention segment, the 2×2 patch merger into the LLM's width) and its Qwen2 decoder
with M-RoPE (temporal, row, column positions for video tokens), over the word vocabulary of
:mod:`vitrim.demos.video.words`. Every video method of :mod:`vitrim.vlm` sees the real classes.

Files: ``model.safetensors`` and ``config.json`` (the ``Qwen2VLConfig``), written by
:func:`vitrim.demos.vlm.model.save_model` and read, checked as files from anyone, by
:mod:`vitrim.demos.video.run_folder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vitrim.demos.video.data import MERGE, PATCH, TEMPORAL_PATCH
from vitrim.demos.video.words import BOS_ID, EOS_ID, IMAGE_ID, PAD_ID, VIDEO_ID, VISION_END_ID, VISION_START_ID, WORDS
from vitrim.demos.vlm.model import import_transformers

if TYPE_CHECKING:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

# Tower: 3 blocks of width 64; decoder: 4 layers of width 64 (in-LLM methods get a layer K = 2 with layers after it),
# 2 query heads of 32 dimensions sharing one key/value head, as the digits LLaVA's. M-RoPE's sections split a head's
# 16 frequencies 4 / 6 / 6 (temporal, row, column), Qwen2-VL's 16 / 24 / 24 of 64 scaled.
VISION = dict(depth=3, embed_dim=64, num_heads=4, mlp_ratio=2)
TEXT = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)
MROPE_SECTION = [4, 6, 6]


def video_model_config(vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None) -> Qwen2VLConfig:
    """The digits video model's ``Qwen2VLConfig`` (``vision``/``text`` override the tower's and decoder's sizes)."""
    import_transformers()
    from transformers import Qwen2VLConfig

    text_config = {
        "vocab_size": len(WORDS),
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "mrope_section": MROPE_SECTION, "rope_theta": 10000.0},
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        **TEXT,
        **(text or {}),
    }
    vision_config = {
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "in_channels": 3,
        "hidden_size": text_config["hidden_size"],  # the merger's output: the LLM's width
        **VISION,
        **(vision or {}),
    }
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    config.pad_token_id, config.eos_token_id, config.bos_token_id = PAD_ID, EOS_ID, BOS_ID
    return config


def build_model(config: Qwen2VLConfig, seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """A freshly initialised model (seeded), in eval mode, with greedy generation settings."""
    import_transformers()
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD_ID, EOS_ID
    model.generation_config.bos_token_id, model.generation_config.do_sample = BOS_ID, False
    return model
