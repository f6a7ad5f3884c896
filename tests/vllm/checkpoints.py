"""Tiny random-weight LLaVA-1.5 and Qwen2.5-VL saved as real checkpoint folders, for vLLM and transformers alike.

A folder holds what a hub checkpoint holds: ``config.json``, ``model.safetensors`` (float32), a fast tokenizer
(``tokenizer.json``: a word-level vocabulary built here, so nothing is downloaded), a chat template and the
processor's configs. vLLM and transformers load the same folder, so their outputs can be compared token for token.

Sizes follow the project's tiny configs (tests/vlm/tiny_llava.py, tests/vlm/qwen_tiny.py), widened where vLLM's CPU
attention needs it (head size 16). Words are ``w5 … w<vocab-1>``; prompts are made of them, so any prompt tokenizes
to one id per word.
"""

from __future__ import annotations

from pathlib import Path

import torch

# a chat template that reads OpenAI-style messages whose content is a string (vLLM puts the image placeholder in it)
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def word_tokenizer(path: Path, specials: list[str], vocab_size: int, **named: str) -> None:
    """A fast word-level tokenizer saved at ``path``: ``specials`` take ids 0…, then ``w<id>`` up to vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=specials[0], **named)
    tokenizer.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in named.values()]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Random init is near-uniform attention; spread the weights so selections and merges matter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)


def save_weights(model: torch.nn.Module, path: Path, hub_names: dict[str, str]) -> None:
    """The config and the weights as the hub lays them out (``hub_names``: module prefix -> the hub's prefix).

    transformers 5 saves its own module names (``model.vision_tower.embeddings…``), which transformers reads back but
    vLLM 0.32 does not; the hub's checkpoints (``vision_tower.vision_model.embeddings…``) both read.
    """
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    tensors = {}
    for name, value in model.state_dict().items():
        prefix = next(p for p in hub_names if name.startswith(p))
        tensors[hub_names[prefix] + name[len(prefix) :]] = value.detach().contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


LLAVA_HUB_NAMES = {
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.language_model.": "language_model.model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "lm_head.": "language_model.lm_head.",
}
LLAVA_SPECIALS = ["<unk>", "<pad>", "</s>", "<image>", "<s>"]  # ids 0 … 4
LLAVA_IMAGE_TOKEN = 3
LLAVA_GRID = 4  # 16 px images, 4 px patches: 16 image tokens


TINY_LLAVA_VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
# head size 32: vLLM's CPU attention has no kernel for 16
TINY_LLAVA_TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def save_llava(
    path: Path,
    seed: int = 0,
    image_size: int = 16,
    patch_size: int = 4,
    vision: dict[str, int] = TINY_LLAVA_VISION,
    text: dict[str, int] = TINY_LLAVA_TEXT,
) -> Path:
    """A LLaVA-1.5 (CLIP tower, feature layer −2, a Llama) with its processor at ``path``; tiny by default (3 tower
    layers, 16 px images of 16 tokens, a 2-layer LLM), larger sizes for benchmarks/vllm_bench.py."""
    import transformers

    config = transformers.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            image_size=image_size,
            patch_size=patch_size,
            projection_dim=32,
            **vision,
        ),
        text_config=dict(
            model_type="llama",
            max_position_embeddings=2048,
            pad_token_id=1,
            bos_token_id=4,
            eos_token_id=2,
            **text,
        ),
        image_token_id=LLAVA_IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    perturb(model, seed)
    save_weights(model, path, LLAVA_HUB_NAMES)
    word_tokenizer(
        path,
        LLAVA_SPECIALS,
        text["vocab_size"],
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        image_token="<image>",
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}, do_center_crop=True
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


QWEN_SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0 … 2; the vision tokens take 90 … 93 (qwen_tiny's ids)
QWEN_VISION_TOKENS = {"<|image_pad|>": 90, "<|video_pad|>": 91, "<|vision_start|>": 92, "<|vision_end|>": 93}
QWEN_PATCH, QWEN_MERGE = 2, 2  # one image token per 4×4 px
QWEN_HUB_NAMES = {
    "model.visual.": "visual.",
    "model.language_model.": "model.",
    "lm_head.": "lm_head.",
}


def save_qwen2_5_vl(path: Path, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL (qwen_tiny's tower: block 0 windowed, block 1 full; a 2-layer LLM) at ``path``."""
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=2,  # head size 32 (vLLM's CPU attention); M-RoPE sections sum to 32 / 2
            num_key_value_heads=1,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [8, 4, 4], "rope_theta": 10000.0},
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=QWEN_PATCH,
            spatial_merge_size=QWEN_MERGE,
            temporal_patch_size=1,
            in_channels=3,
            window_size=2 * QWEN_MERGE * QWEN_PATCH,
            fullatt_block_indexes=[1],
        ),
        image_token_id=90,
        video_token_id=91,
        vision_start_token_id=92,
        vision_end_token_id=93,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    perturb(model, seed)
    save_weights(model, path, QWEN_HUB_NAMES)
    vocab_specials = QWEN_SPECIALS + [f"w{i}" for i in range(3, 90)] + list(QWEN_VISION_TOKENS)
    word_tokenizer(path, vocab_specials, 96, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=1, min_pixels=64, max_pixels=64 * 64
    )
    processor = transformers.Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=transformers.Qwen2VLVideoProcessor(
            patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=1
        ),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path
