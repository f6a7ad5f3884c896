"""Tiny random VLMs saved as checkpoint folders (``vitrim.vlm_user.tiny``'s builders, the shipped ones), and a
random picture.

- :func:`save_llava`, :func:`save_llava_next`, :func:`save_qwen2_5_vl`: the folders ``vitrim vlm ask --model``
  reads in tests/vlm_user (transformers' own layout, a chat template over message parts); with
  :func:`save_qwen2_vl`, :func:`save_small_qwen3_vl`, :func:`save_gemma3` and :func:`save_llava_onevision`, one
  folder per family for lmms-eval (tests/eval).
- :func:`save_vllm_llava`, :func:`save_vllm_llava_next`, :func:`save_vllm_qwen2_5_vl` (the library's, what
  ``save_tiny_vlm(..., for_vllm=True)`` writes), :func:`save_vllm_qwen3_vl` and :func:`save_vllm_gemma3`: the folders
  vLLM and transformers load alike in tests/vllm and benchmarks/vllm_bench.py: widened where vLLM's CPU attention needs
  it (head size 32; it has no kernel for 16), the weights under the hub's module names (vLLM 0.32 does not read
  transformers 5's), a chat template that reads OpenAI-style messages whose content is a string (vLLM puts the image
  placeholder in it), untied embeddings. Words are ``w5 … w<vocab-1>``; any prompt made of them tokenizes to one id per
  word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tiny_vlms.spread import spread
from vitrim.vlm_user.tiny import (
    GEMMA_SPECIALS,
    QWEN_SPECIALS,
    QWEN_VISION_TOKENS,
    SERVABLE,
    STRING_CONTENT_TEMPLATE,
    UNTIED,
    save_gemma3,
    save_llava,
    save_llava_next,
    save_paligemma,
    save_qwen2_5_vl,
    save_qwen2_vl,
    save_qwen3_vl,
    save_vllm_llava,
    save_vllm_llava_next,
    save_vllm_qwen2_5_vl,
    word_tokenizer,
)

__all__ = [
    "save_gemma3",
    "save_llava",
    "save_llava_next",
    "save_llava_onevision",
    "save_paligemma",
    "save_picture",
    "save_qwen2_5_vl",
    "save_qwen2_vl",
    "save_small_qwen3_vl",
    "save_vllm_gemma3",
    "save_vllm_llava",
    "save_vllm_llava_next",
    "save_vllm_qwen2_5_vl",
    "save_vllm_qwen3_vl",
]

LLAVA_GRID = 4  # 16 px images, 4 px patches: 16 image tokens

ONEVISION_TEMPLATE = (
    "{% for message in messages %}USER: {% for part in message['content'] %}{% if part['type'] == 'image' %}<image> "
    "{% elif part['type'] == 'video' %}<video> {% else %}{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
ONEVISION_PINPOINTS = [[14, 28], [28, 14], [28, 28]]


def save_llava_onevision(path: Path, seed: int = 0, text: dict[str, Any] | None = None) -> Path:
    """A tiny LLaVA-OneVision and its processor at ``path`` (tests/tiny_vlms/llava_onevision.py's sizes): SigLIP on
    14-px tiles of 2-px patches (49 tokens a tile, anyres pinpoints 14×28, 28×14, 28×28), a video frame resized to
    14×14 and pooled to 4×4 = 16 tokens (a video: F·16 + 1 newline), a 2-layer Qwen2 LLM; ids 3 ``<image>``,
    4 ``<video>``, words ``w6`` … ``w98``; ``text`` overrides the LLM's config (e.g. ``num_hidden_layers``)."""
    import transformers

    config = transformers.LlavaOnevisionConfig(
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, image_size=14, patch_size=2, vision_use_head=False,
        ),
        text_config={
            **dict(
                model_type="qwen2", vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=1,
                eos_token_id=2,
            ),
            **(text or {}),
        },
        image_token_id=3,
        video_token_id=4,
        image_grid_pinpoints=ONEVISION_PINPOINTS,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = spread(transformers.LlavaOnevisionForConditionalGeneration(config).eval())
    model.save_pretrained(path)
    specials = ["<unk>", "<pad>", "</s>", "<image>", "<video>", "<s>"]
    tokenizer = word_tokenizer(
        specials, 99, ONEVISION_TEMPLATE, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
        image_token="<image>", video_token="<video>",
    )  # fmt: skip
    processor = transformers.LlavaOnevisionProcessor(
        image_processor=transformers.LlavaOnevisionImageProcessor(
            size={"height": 14, "width": 14}, image_grid_pinpoints=ONEVISION_PINPOINTS
        ),
        tokenizer=tokenizer,
        video_processor=transformers.LlavaOnevisionVideoProcessor(size={"height": 14, "width": 14}),
        num_image_tokens=49,
        vision_feature_select_strategy="full",
        chat_template=ONEVISION_TEMPLATE,
        image_token="<image>",
        video_token="<video>",
    )
    processor.save_pretrained(path)
    return path


VLLM_QWEN3_TEXT: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
    num_key_value_heads=1, max_position_embeddings=512,
    # interleaved as the real checkpoints ([24, 20, 20] of 64 there); a small θ, so a token's cell moves its logits
    rope_parameters={
        "rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True, "rope_theta": 100.0,
    },
)  # fmt: skip
VLLM_QWEN3_VISION = dict(
    depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
)  # fmt: skip


def save_vllm_qwen3_vl(path: Path, seed: int = 0, timestamps: bool = False, layers: int = 2) -> Path:
    """A tiny Qwen3-VL for vLLM at ``path``: 3 tower blocks with DeepStack taps after blocks 0 and 1 (added to the
    LLM's layers 0 and 1), a ``layers``-layer LLM of head size 32, temporal patches of 2 frames.

    timestamps: the tokenizer reads the digits 0 … 9 (ids 80 … 89, in place of ``w80`` … ``w89``), so each temporal
    patch's timestamp text (``<2.5 seconds>``) reaches the LLM as its own ids; otherwise every timestamp is the same
    two unknown words (the rest of one stays unknown either way)."""
    text = {**VLLM_QWEN3_TEXT, "num_hidden_layers": layers}
    folder = save_qwen3_vl(path, seed, VLLM_QWEN3_VISION, text, chat_template=STRING_CONTENT_TEMPLATE)
    if timestamps:
        specials = QWEN_SPECIALS + [f"w{i}" for i in range(3, 80)] + [str(d) for d in range(10)] + QWEN_VISION_TOKENS
        word_tokenizer(
            specials, 96, STRING_CONTENT_TEMPLATE, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
        ).save_pretrained(folder)
    return folder


SMALL_QWEN3_VISION = dict(
    depth=3, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
)  # fmt: skip
SMALL_QWEN3_TEXT: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
    num_key_value_heads=2, max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True, "rope_theta": 1e4},
)  # fmt: skip


def save_small_qwen3_vl(path: Path, seed: int = 0) -> Path:
    """A tiny Qwen3-VL for transformers at ``path``, the sizes of ``tiny_vlms.qwen.qwen3_vl`` (3 tower blocks with
    DeepStack taps after blocks 0 and 1, a 2-layer LLM of head size 8), temporal patches of 2 frames."""
    return save_qwen3_vl(path, seed, SMALL_QWEN3_VISION, SMALL_QWEN3_TEXT)


VLLM_GEMMA3_VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
VLLM_GEMMA3_WINDOW = 8  # shorter than the prompts, so the window binds (the checkpoints: 1024 of 131072 positions)
VLLM_GEMMA3_TEXT: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=512, pad_token_id=0,
    eos_token_id=1, bos_token_id=2, sliding_window=VLLM_GEMMA3_WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    # small θ, so a token moved by one position changes the logits (the checkpoints: 10^4 local, 10^6 global)
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    **UNTIED,
)  # fmt: skip
# Gemma 3's processor writes "\n\n" around each image, and vLLM's Gemma 3 processor merges newline runs by their ids
GEMMA3_NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]


def save_vllm_gemma3(path: Path, seed: int = 0) -> Path:
    """A tiny Gemma 3 for vLLM at ``path``: a 2-layer SigLIP on 32-px images (16×16 patches pooled 4×4 to 16
    tokens, the checkpoints' pooling), a 2-layer LLM of head size 32 (one sliding-window layer of window 8, one
    full), the newline tokens Gemma 3's processors write around an image (ids 124 … 127); the weights under the
    hub's names, the embeddings untied (tied, the tiny LLM repeats its prompt's last token whatever it sees)."""
    words = [f"w{i}" for i in range(len(GEMMA_SPECIALS), 124)]
    return save_gemma3(
        path,
        seed,
        VLLM_GEMMA3_VISION,
        VLLM_GEMMA3_TEXT,
        specials=GEMMA_SPECIALS + words + GEMMA3_NEWLINES,
        **SERVABLE,
    )


def save_picture(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """A random RGB PNG of ``width`` × ``height``."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path
