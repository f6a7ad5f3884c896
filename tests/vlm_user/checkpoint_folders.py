"""Tiny random LLaVA-1.5 and Qwen2.5-VL saved as real checkpoint folders with a processor, built offline.

A folder holds what a hub checkpoint holds: ``config.json``, ``model.safetensors`` (``save_pretrained``), a fast
word-level tokenizer built here (words ``w<id>``, so nothing is downloaded), the processor's configs and a chat
template that reads transformers' message format (content: a list of ``{"type": "image"}`` / ``{"type": "text"}``).

LLaVA: a CLIP tower on 16-px crops of 4-px patches (a 4×4 grid, 16 tokens), the processor resizes the shortest
edge to 16 then centre-crops 16×16 (LLaVA-1.5's recipe at 1/21 the size). Qwen2.5-VL: 2-px patches merged 2×2
(one token per 4×4 px of the smart-resized picture), between 64 and 64·64 pixels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

LLAVA_SPECIALS = ["<unk>", "<pad>", "</s>", "<image>", "<s>"]  # ids 0 … 4
LLAVA_CROP, LLAVA_PATCH = 16, 4
LLAVA_TEMPLATE = (
    "{% for message in messages %}USER: {% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image> {% else %}{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
QWEN_SPECIALS = ["<pad>", "<s>", "</s>"]
QWEN_VISION_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # ids 90 … 93
QWEN_PATCH, QWEN_MERGE = 2, 2
QWEN_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ part['text'] }} "
    "{% endif %}{% endfor %}{% endfor %}"
)


def word_tokenizer(specials: list[str], vocab_size: int, template: str, **named: str) -> object:
    """A fast word-level tokenizer: ``specials`` take ids 0…, then ``w<id>`` up to ``vocab_size``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size) if f"w{i}" not in vocab})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token=specials[0], **named)
    tokenizer.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in named.values()]})
    tokenizer.chat_template = template
    return tokenizer


def _spread(model: torch.nn.Module, seed: int) -> None:
    """Random init gives near-uniform attention; spread the weights so selections differ between methods."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)


def save_llava(path: Path, seed: int = 0) -> Path:
    config = transformers.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model", hidden_size=32, intermediate_size=37, num_hidden_layers=3,
            num_attention_heads=4, image_size=LLAVA_CROP, patch_size=LLAVA_PATCH, projection_dim=32,
        ),
        text_config=dict(
            model_type="llama", vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=1,
            bos_token_id=4, eos_token_id=2,
        ),
        image_token_id=3,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _spread(model, seed)
    model.save_pretrained(path)
    tokenizer = word_tokenizer(
        LLAVA_SPECIALS, 99, LLAVA_TEMPLATE, pad_token="<pad>", eos_token="</s>", bos_token="<s>", image_token="<image>"
    )
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": LLAVA_CROP}, crop_size={"height": LLAVA_CROP, "width": LLAVA_CROP}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def save_qwen2_5_vl(path: Path, seed: int = 0) -> Path:
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=96, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=QWEN_PATCH,
            spatial_merge_size=QWEN_MERGE, temporal_patch_size=1, in_channels=3,
            window_size=2 * QWEN_MERGE * QWEN_PATCH, fullatt_block_indexes=[1],
        ),
        image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    _spread(model, seed)
    model.save_pretrained(path)
    specials = QWEN_SPECIALS + [f"w{i}" for i in range(3, 90)] + QWEN_VISION_TOKENS
    tokenizer = word_tokenizer(specials, 96, QWEN_TEMPLATE, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=1, min_pixels=64, max_pixels=64 * 64
    )
    processor = transformers.Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=transformers.Qwen2VLVideoProcessor(
            patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=1
        ),
        chat_template=QWEN_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def save_picture(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """A random RGB PNG of ``width`` × ``height``."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path
