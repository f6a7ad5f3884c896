"""The digits VLM: transformers' own ``LlavaForConditionalGeneration``, small enough to train on 2 CPU cores.

LLaVA-1.5's architecture at toy size: a CLIP vision tower (64×64 canvas, 8×8 patches: 64 patch tokens and [CLS]),
the features of its second-to-last layer without [CLS] (``vision_feature_layer=-2``, strategy ``"default"``), a
two-layer GELU projector, and a Llama decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) over the word-level
vocabulary of :mod:`vitrim.demos.vlm.words`. Every method of :mod:`vitrim.vlm` sees the real classes.

Files (a run folder, and the shipped weights): ``model.safetensors`` (float16 when shipped) and ``config.json``
(the ``LlavaConfig``), written here and read, checked as files from anyone, by :mod:`vitrim.demos.vlm.run_folder`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from vitrim.atomic import atomic_write
from vitrim.data.vision import _import_torchvision
from vitrim.demos.vlm.data import CANVAS, PATCH
from vitrim.demos.vlm.words import BOS_ID, EOS_ID, IMAGE_ID, IMAGE_TOKENS, PAD_ID, WORDS
from vitrim.extras import require

if TYPE_CHECKING:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"

# Tower: 4 layers of width 64 (the 4th is not used: LLaVA reads layer -2). Decoder: 4 layers of width 64, so that
# in-LLM methods have a layer K = 2 with layers after it; 2 query heads of 32 dimensions sharing one key/value head:
# with 4 heads of 16 the answer to "where is the seven ?" stayed near 64 % (and with RoPE's theta at 1e6 as well),
# with 2 heads of 32 it reached 77.5 % at the same steps, "which" staying above 95 %.
VISION = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4)
TEXT = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)


def import_transformers() -> None:
    """Make ``import transformers`` work here, or raise the one-line error naming what to install.

    transformers' image utilities import torchvision when it is installed; a torchvision wheel built for another torch
    fails that import, so it is first imported the way vitrim's image pipelines do (:mod:`vitrim.data.vision`).
    """
    with contextlib.suppress(ModuleNotFoundError):  # no torchvision (or Pillow): transformers does without it
        _import_torchvision()
    require("transformers", feature="the digits VLM")


def digits_vlm_config(vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None) -> LlavaConfig:
    """The ``LlavaConfig`` of the digits VLM (``vision``/``text`` override the tower's and the decoder's sizes)."""
    import_transformers()
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision_config = CLIPVisionConfig(
        image_size=CANVAS, patch_size=PATCH, num_channels=3, **{**VISION, **(vision or {})}
    )
    text_config = LlamaConfig(
        vocab_size=len(WORDS),
        max_position_embeddings=256,  # a training conversation (every question of a canvas) is up to ~140
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        **{**TEXT, **(text or {})},
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=IMAGE_ID,
        image_seq_length=IMAGE_TOKENS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    config.pad_token_id, config.eos_token_id, config.bos_token_id = PAD_ID, EOS_ID, BOS_ID
    return config


def build_model(config: LlavaConfig, seed: int = 0) -> LlavaForConditionalGeneration:
    """A freshly initialised model (seeded), in eval mode, with greedy generation settings."""
    import_transformers()
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD_ID, EOS_ID
    model.generation_config.bos_token_id, model.generation_config.do_sample = BOS_ID, False
    return model


def save_model(model: torch.nn.Module, folder: Path, *, float16: bool = False) -> None:
    """Write ``model.safetensors`` and ``config.json`` to ``folder``, each whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = torch.float16 if float16 else torch.float32
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    atomic_write(folder / MODEL_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    text = json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n"  # type: ignore[union-attr, operator]
    atomic_write(folder / CONFIG_FILE, lambda tmp: _write_text(tmp, text))


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)
