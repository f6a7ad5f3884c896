"""A tiny CLIP with its text tower and tokenizer, saved as a folder: CDPruner's ``relevance="clip"`` offline
(tests/vlm/test_cdpruner_clip.py, tests/vllm/test_cdpruner.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers


def clip_tokenizer() -> Any:
    """A CLIP tokenizer of one token per character, no merges: printable ASCII (which byte-level BPE maps to itself),
    each also as a word end (``</w>``), and CLIP's two specials."""
    chars = [chr(code) for code in range(33, 127)]
    vocab = {token: i for i, token in enumerate([*chars, *(c + "</w>" for c in chars)])}
    vocab |= {"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1}
    return transformers.CLIPTokenizer(vocab=vocab, merges=[])


def tiny_clip(vision: dict[str, Any], projection: int, segment: int, seed: int) -> tuple[Any, Any]:
    """(a random ``CLIPModel``, its tokenizer): the vision tower of config ``vision`` (a LLaVA's tower, whose feature
    layer its post-LayerNorm and projection read), a 2-layer text tower of ``segment`` positions, both projecting to
    ``projection``."""
    tokenizer = clip_tokenizer()
    config = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=segment, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id, projection_dim=projection,
        ),
        vision_config=vision | dict(projection_dim=projection),
        projection_dim=projection,  # in each tower's config too, as a released CLIP's (the towers load alone)
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.CLIPModel(config).eval(), tokenizer


def save_tiny_clip(folder: Path, model: Any, tokenizer: Any) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
