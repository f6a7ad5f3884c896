"""Tiny random VLM checkpoint folders with a processor, made offline: try ``vitrim vlm ask --model`` and
:func:`vitrim.vlm_user.ask` without downloading a real checkpoint (and test them).

A folder holds what a hub checkpoint holds: ``config.json``, ``model.safetensors`` (``save_pretrained``), a fast
word-level tokenizer built here (words ``w<id>``; nothing is downloaded), the processor's configs and a chat
template in transformers' message format (content: a list of ``{"type": "image"}`` / ``{"type": "text"}``). The
weights are random: the answers are random words.

LLaVA-1.5: a CLIP tower on 16-px crops of 4-px patches (a 4×4 grid, 16 tokens); the processor resizes the shortest
edge to 16 and centre-crops 16×16 (LLaVA-1.5's recipe at 1/21 the size). Qwen2.5-VL: 2-px patches merged 2×2 (one
token per 4×4 px of the smart-resized picture), between 64 and 64·64 pixels. Gemma 3: 32-px images of 2-px
patches, a 16×16 patch grid pooled 4×4 to 16 tokens (the real checkpoints' pooling, at 1/28 the size), pan-and-scan
off as in the hub's configs. PaliGemma: 16-px images of 4-px patches, one token per patch (16).

The same builders make the folders vLLM serves (``save_tiny_vlm(..., for_vllm=True)``, vitrim's vLLM tests and
benchmark): other sizes (``vision=``, ``text=``, ``options=``: merged into the configs' arguments), a chat template
whose message content is a string (``chat_template=``) and the weights under the hub's module names
(``weights="hub"``), which transformers reads too but vLLM needs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from vitrim.extras import require

LLAVA_SPECIALS = ["<unk>", "<pad>", "</s>", "<image>", "<s>"]  # ids 0 … 4
LLAVA_CROP, LLAVA_PATCH = 16, 4
LLAVA_IMAGE_TOKEN: dict[str, Any] = {"image_token_id": 3}  # transformers 5's name (its typing still says _index)
LLAVA_TEMPLATE = (
    "{% for message in messages %}USER: {% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image> {% else %}{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
QWEN_SPECIALS = ["<pad>", "<s>", "</s>"]
QWEN_VISION_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # ids 90 … 93
QWEN_PATCH, QWEN_MERGE = 2, 2
# a clip's pixels (all frames) between these: a tiny clip is read at its own size, not resized to the released
# checkpoints' 100k-pixel minimum (thousands of tokens)
QWEN_VIDEO_PIXELS = {"shortest_edge": 64, "longest_edge": 64 * 64 * 16}
# Qwen3-VL's processors normalize images and videos alike (mean = std = 0.5 per channel), and vLLM normalizes both
# with the image processor's values (``mm_device_do_normalize``): a folder whose two differ gets other video pixels
QWEN3_NORMALIZE: dict[str, Any] = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
QWEN_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|> {% else %}{{ part['text'] }} "
    "{% endif %}{% endfor %}{% endfor %}"
)


def word_tokenizer(specials: list[str], vocab_size: int, template: str, **named: str) -> Any:
    """A fast word-level tokenizer: ``specials`` take ids 0…, then ``w<id>`` up to ``vocab_size``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size) if f"w{i}" not in vocab})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[0]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token=specials[0], **named)
    tokenizer.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in named.values()]})
    tokenizer.chat_template = template
    return tokenizer


def qwen_tokenizer(chat_template: str) -> Any:
    """The tiny Qwen folders' tokenizer: ids 0 … 2 specials, ``w3`` … ``w89``, the vision tokens 90 … 93."""
    specials = QWEN_SPECIALS + [f"w{i}" for i in range(3, 90)] + QWEN_VISION_TOKENS
    return word_tokenizer(specials, 96, chat_template, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _spread(model: torch.nn.Module, seed: int) -> None:
    """Random init gives near-uniform attention; spread the weights so selections differ between methods."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)


def _save_model(model_class: Any, config: Any, path: Path, seed: int) -> None:
    """``model_class(config)`` drawn from ``seed``, spread (:func:`_spread`) and saved at ``path``."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _spread(model, seed)
    model.save_pretrained(path)


Weights = Literal["transformers", "hub"]
# module prefix in transformers 5 -> the hub checkpoints' (what vLLM reads; transformers reads both)
LLAVA_HUB_NAMES = {
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.language_model.": "language_model.model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "lm_head.": "language_model.lm_head.",
}
LLAVA_NEXT_HUB_NAMES = LLAVA_HUB_NAMES | {"model.image_newline": "image_newline"}
GEMMA3_HUB_NAMES = {
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.language_model.": "language_model.model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "lm_head.": "language_model.lm_head.",
}
QWEN_HUB_NAMES = {"model.visual.": "visual.", "model.language_model.": "model.", "lm_head.": "lm_head."}


def _save_weights(model: Any, path: Path, weights: Weights, hub_names: dict[str, str]) -> None:
    """The config and weights at ``path``: transformers' own ``save_pretrained``, or (``"hub"``) ``config.json`` and
    ``model.safetensors`` under the hub's module names, as the published checkpoints lay them out."""
    if weights == "transformers":
        model.save_pretrained(path)
        return
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    tensors = {}
    saved = set()
    for name, value in model.state_dict().items():
        if value.data_ptr() in saved:  # a tied weight (Gemma 3's lm_head is its embeddings): once, as the hub has it
            continue
        saved.add(value.data_ptr())
        prefix = next(p for p in hub_names if name.startswith(p))
        tensors[hub_names[prefix] + name[len(prefix) :]] = value.detach().contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


LLAVA_VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4)
LLAVA_TEXT: dict[str, Any] = dict(
    vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


def save_llava(
    path: Path,
    seed: int = 0,
    image_size: int = LLAVA_CROP,
    patch_size: int = LLAVA_PATCH,
    vision: dict[str, Any] = LLAVA_VISION,
    text: dict[str, Any] = LLAVA_TEXT,
    options: dict[str, Any] | None = None,
    chat_template: str = LLAVA_TEMPLATE,
    weights: Weights = "transformers",
) -> Path:
    """A tiny LLaVA-1.5 (``LlavaForConditionalGeneration``: a CLIP tower of ``image_size`` px crops of
    ``patch_size`` px patches read at its layer −2, a Llama) and its processor at ``path``. ``vision`` and ``text``:
    the sizes of the tower and the LLM (default 3 layers of width 32, 2 layers of width 32); ``options``: more
    arguments of ``LlavaConfig``; the rest as in the module docstring."""
    import transformers

    config = transformers.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model", **vision, image_size=image_size, patch_size=patch_size, projection_dim=32
        ),
        text_config=dict(model_type="llama", **text, pad_token_id=1, bos_token_id=4, eos_token_id=2),
        **LLAVA_IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        **(options or {}),
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _spread(model, seed)
    _save_weights(model, path, weights, LLAVA_HUB_NAMES)
    tokenizer = word_tokenizer(
        LLAVA_SPECIALS,
        text["vocab_size"],
        chat_template,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        image_token="<image>",
    )
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=chat_template,
    )
    processor.save_pretrained(path)
    return path


QWEN_TEXT: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
)  # fmt: skip
QWEN_VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32)


@dataclass(frozen=True)
class QwenGeometry:
    """How a Qwen2.5-VL folder cuts pixels into tokens (tower and processors). The default is the tiny folders'
    (2-px patches, one frame per temporal patch, windows of 2×2 merged tokens, block 1 attending globally, at most
    64·64 image pixels); benchmarks/vllm_bench.py asks for the released checkpoints' layout at a smaller width."""

    patch: int = QWEN_PATCH
    temporal_patch: int = 1
    window: int = 2 * QWEN_MERGE * QWEN_PATCH  # px (the released checkpoints: 112, 8×8 patches of 14 px)
    full_attention_blocks: tuple[int, ...] = (1,)
    max_pixels: int = 64 * 64  # of one image, after smart resizing
    video_pixels: tuple[int, int] = (QWEN_VIDEO_PIXELS["shortest_edge"], QWEN_VIDEO_PIXELS["longest_edge"])


def save_qwen2_5_vl(
    path: Path,
    seed: int = 0,
    vision: dict[str, Any] = QWEN_VISION,
    text: dict[str, Any] = QWEN_TEXT,
    options: dict[str, Any] | None = None,
    chat_template: str = QWEN_TEMPLATE,
    weights: Weights = "transformers",
    geometry: QwenGeometry = QwenGeometry(),
) -> Path:
    """A tiny Qwen2.5-VL (tower: block 0 windowed, block 1 full; a 2-layer LLM) and its processor at ``path``.
    ``vision``, ``text``: the sizes of the tower and the LLM (its vocabulary is 96: the vision tokens are 90 … 93);
    ``options``: more arguments of ``Qwen2_5_VLConfig``; ``geometry``: patches, windows and pixel bounds; the rest
    as in the module docstring."""
    import transformers

    g = geometry
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(**text, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=dict(
            **vision, patch_size=g.patch, spatial_merge_size=QWEN_MERGE, temporal_patch_size=g.temporal_patch,
            in_channels=3, window_size=g.window, fullatt_block_indexes=list(g.full_attention_blocks),
        ),
        image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
        **(options or {}),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    _spread(model, seed)
    _save_weights(model, path, weights, QWEN_HUB_NAMES)
    tokenizer = qwen_tokenizer(chat_template)
    sizes: dict[str, Any] = dict(patch_size=g.patch, merge_size=QWEN_MERGE, temporal_patch_size=g.temporal_patch)
    image_processor = transformers.Qwen2VLImageProcessor(**sizes, min_pixels=64, max_pixels=g.max_pixels)
    shortest, longest = g.video_pixels
    processor = transformers.Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=transformers.Qwen2VLVideoProcessor(
            **sizes, size={"shortest_edge": shortest, "longest_edge": longest}
        ),
        chat_template=chat_template,
    )
    processor.save_pretrained(path)
    return path


def save_qwen2_vl(path: Path, seed: int = 0) -> Path:
    """A tiny Qwen2-VL (a 2-block tower of width 16 attending globally, a plain MLP merger; the 2-layer LLM of
    :func:`save_qwen2_5_vl`) and its processor at ``path``; tokens and pixel bounds as :func:`save_qwen2_5_vl`'s."""
    import transformers

    config = transformers.Qwen2VLConfig(
        text_config=dict(**QWEN_TEXT, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=dict(
            depth=2, embed_dim=16, hidden_size=QWEN_TEXT["hidden_size"], num_heads=2, mlp_ratio=2,
            patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE, temporal_patch_size=1, in_channels=3,
        ),
        image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
    )  # fmt: skip
    _save_model(transformers.Qwen2VLForConditionalGeneration, config, path, seed)
    tokenizer = qwen_tokenizer(QWEN_TEMPLATE)
    sizes: dict[str, Any] = dict(patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=1)
    processor = transformers.Qwen2VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(**sizes, min_pixels=64, max_pixels=64 * 64),
        tokenizer=tokenizer,
        video_processor=transformers.Qwen2VLVideoProcessor(**sizes, size=QWEN_VIDEO_PIXELS),
        chat_template=QWEN_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def save_qwen3_vl(
    path: Path,
    seed: int,
    vision: dict[str, Any],
    text: dict[str, Any],
    chat_template: str = QWEN_TEMPLATE,
) -> Path:
    """A tiny Qwen3-VL and its processor at ``path``, laid out as Qwen/Qwen3-VL-*-Instruct: DeepStack taps
    (``vision["deepstack_visual_indexes"]``), interleaved M-RoPE (``text["rope_parameters"]``), temporal patches of
    2 frames (an image is its frame twice), learned position embeddings interpolated to the grid. 2-px patches
    merged 2×2 and the tokens of :func:`save_qwen2_5_vl` (vocabulary 96, vision tokens 90 … 93); transformers 5's
    module names are the hub checkpoints' here (``model.visual.``, ``model.language_model.``, ``lm_head.``)."""
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=dict(**text, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=dict(
            **vision, patch_size=QWEN_PATCH, spatial_merge_size=QWEN_MERGE, temporal_patch_size=2, in_channels=3,
        ),
        image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
        tie_word_embeddings=False,
    )  # fmt: skip
    _save_model(transformers.Qwen3VLForConditionalGeneration, config, path, seed)
    tokenizer = qwen_tokenizer(chat_template)
    sizes: dict[str, Any] = dict(patch_size=QWEN_PATCH, merge_size=QWEN_MERGE, temporal_patch_size=2)
    processor = transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(
            **sizes, **QWEN3_NORMALIZE, min_pixels=64, max_pixels=64 * 64
        ),
        tokenizer=tokenizer,
        video_processor=transformers.Qwen3VLVideoProcessor(**sizes, **QWEN3_NORMALIZE, size=QWEN_VIDEO_PIXELS),
        chat_template=chat_template,
    )
    processor.save_pretrained(path)
    return path


def save_llava_next(
    path: Path,
    seed: int = 0,
    vision: dict[str, Any] = LLAVA_VISION,
    text: dict[str, Any] = LLAVA_TEXT,
    options: dict[str, Any] | None = None,
    chat_template: str = LLAVA_TEMPLATE,
    weights: Weights = "transformers",
) -> Path:
    """A tiny LLaVA-NeXT (anyres: 16-px tiles of 16 tokens, pinpoints 16×32, 32×16, 32×32) and its processor;
    ``vision``, ``text``, ``options``, ``chat_template`` and ``weights`` as :func:`save_llava`'s."""
    import transformers

    pinpoints = [[16, 32], [32, 16], [32, 32]]
    config = transformers.LlavaNextConfig(
        vision_config=dict(
            model_type="clip_vision_model", **vision, image_size=LLAVA_CROP, patch_size=LLAVA_PATCH,
        ),
        text_config=dict(model_type="llama", **text, pad_token_id=1, bos_token_id=4, eos_token_id=2),
        **LLAVA_IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
        **(options or {}),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    _spread(model, seed)
    _save_weights(model, path, weights, LLAVA_NEXT_HUB_NAMES)
    tokenizer = word_tokenizer(
        LLAVA_SPECIALS,
        text["vocab_size"],
        chat_template,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        image_token="<image>",
    )
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": LLAVA_CROP},
        crop_size={"height": LLAVA_CROP, "width": LLAVA_CROP},
        image_grid_pinpoints=pinpoints,
    )
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=chat_template,
    )
    processor.save_pretrained(path)
    return path


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_IMAGE = {"boi": 4, "eoi": 5, "image": 6}  # the ids of the specials above
GEMMA3_SIZE, GEMMA3_PATCH, GEMMA3_TOKENS = 32, 2, 16
GEMMA3_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image> {% else %}{{ part['text'] }} {% endif %}{% endfor %}"
    "{% endfor %}"
)
PALIGEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<image>", "<unk>"]  # ids 0 … 4
PALIGEMMA_SIZE, PALIGEMMA_PATCH = 16, 4
GEMMA_TEXT: dict[str, Any] = dict(
    vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip


GEMMA3_VISION: dict[str, Any] = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
GEMMA3_LLM: dict[str, Any] = dict(GEMMA_TEXT, sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def save_gemma3(
    path: Path,
    seed: int = 0,
    vision: dict[str, Any] = GEMMA3_VISION,
    text: dict[str, Any] = GEMMA3_LLM,
    specials: list[str] = GEMMA_SPECIALS,
    chat_template: str = GEMMA3_TEMPLATE,
    options: dict[str, Any] | None = None,
    weights: Weights = "transformers",
) -> Path:
    """A tiny Gemma 3 (``Gemma3ForConditionalGeneration``: SigLIP pooled 4×4, a 2-layer LLM) and its processor at
    ``path``. ``vision`` and ``text``: the sizes of the tower and the LLM; ``specials``: the tokenizer's first ids
    (:data:`GEMMA_SPECIALS` first, then any other whole tokens it must know); ``options``: more arguments of
    ``Gemma3Config``; the rest as in the module docstring."""
    import transformers

    config = transformers.Gemma3Config(
        vision_config=dict(
            model_type="siglip_vision_model", **vision, image_size=GEMMA3_SIZE, patch_size=GEMMA3_PATCH,
            vision_use_head=False,
        ),
        text_config=dict(model_type="gemma3_text", **text),
        mm_tokens_per_image=GEMMA3_TOKENS, image_token_index=GEMMA_IMAGE["image"], boi_token_index=GEMMA_IMAGE["boi"],
        eoi_token_index=GEMMA_IMAGE["eoi"], **(options or {}),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _spread(model, seed)
    _save_weights(model, path, weights, GEMMA3_HUB_NAMES)
    tokenizer = word_tokenizer(
        specials, text["vocab_size"], chat_template, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>",
    )  # fmt: skip
    image_processor = transformers.Gemma3ImageProcessor(
        size={"height": GEMMA3_SIZE, "width": GEMMA3_SIZE}, do_pan_and_scan=False
    )
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template,
        image_seq_length=GEMMA3_TOKENS,
    )  # fmt: skip
    processor.save_pretrained(path)
    return path


def save_paligemma(path: Path, seed: int = 0) -> Path:
    """A tiny PaliGemma (``PaliGemmaForConditionalGeneration``: SigLIP, a 2-layer Gemma) and its processor."""
    import transformers

    config = transformers.PaliGemmaConfig(
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=32, intermediate_size=37, num_hidden_layers=3,
            num_attention_heads=4, image_size=PALIGEMMA_SIZE, patch_size=PALIGEMMA_PATCH, vision_use_head=False,
        ),
        text_config=dict(model_type="gemma", **GEMMA_TEXT),
        image_token_index=3, projection_dim=32, hidden_size=32, vocab_size=99,
    )  # fmt: skip
    _save_model(transformers.PaliGemmaForConditionalGeneration, config, path, seed)
    tokenizer = word_tokenizer(
        PALIGEMMA_SPECIALS, 99, "", pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", image_token="<image>"
    )
    tokenizer.chat_template = None  # PaliGemma's processor takes the prompt as it is (the image tokens first)
    image_processor = transformers.SiglipImageProcessor(size={"height": PALIGEMMA_SIZE, "width": PALIGEMMA_SIZE})
    image_processor.image_seq_length = (PALIGEMMA_SIZE // PALIGEMMA_PATCH) ** 2  # type: ignore[attr-defined]
    processor = transformers.PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    processor.save_pretrained(path)
    return path


TINY: dict[str, Callable[[Path, int], Path]] = {
    "llava": save_llava,
    "llava_next": save_llava_next,
    "qwen2_5_vl": save_qwen2_5_vl,
    "gemma3": save_gemma3,
    "paligemma": save_paligemma,
}

# Servable by vLLM (``for_vllm=True``): vLLM's CPU attention has no kernel for head size 8 or 16 (the LLMs here are
# widened to head size 32), vLLM 0.32 reads the hub's module names, not transformers 5's, and its chat front end
# hands the template each message's content as a string (the image placeholder already in it).
STRING_CONTENT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
UNTIED = {"tie_word_embeddings": False}
VLLM_LLAVA_VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
VLLM_LLAVA_TEXT = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip
VLLM_QWEN_TEXT: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=2,  # head size 32; M-RoPE's sections sum to 32 / 2
    num_key_value_heads=1, max_position_embeddings=512,
    # θ = 10: a token moved to its neighbour's cell changes the logits (at 10000 the h, w sections barely turn)
    rope_parameters={"rope_type": "default", "mrope_section": [8, 4, 4], "rope_theta": 10.0},
    **UNTIED,
)  # fmt: skip
VLLM_QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
SERVABLE: dict[str, Any] = dict(options=UNTIED, chat_template=STRING_CONTENT_TEMPLATE, weights="hub")  # the builders'


def save_vllm_llava(
    path: Path,
    seed: int = 0,
    image_size: int = LLAVA_CROP,
    patch_size: int = LLAVA_PATCH,
    vision: dict[str, Any] = VLLM_LLAVA_VISION,
    text: dict[str, Any] = VLLM_LLAVA_TEXT,
) -> Path:
    """A LLaVA-1.5 that vLLM serves on a CPU, at ``path``: tiny by default (3 tower layers, 16 px images of 16
    tokens, a 2-layer LLM of head size 32), other sizes for a benchmark."""
    return save_llava(
        path,
        seed,
        image_size,
        patch_size,
        vision,
        {"max_position_embeddings": 2048, **text},
        **SERVABLE,
    )


def save_vllm_llava_next(path: Path, seed: int = 0) -> Path:
    """A tiny LLaVA-NeXT that vLLM serves on a CPU, at ``path``: LLaVA's widened sizes (a 3-layer CLIP on 16-px tiles
    of 16 tokens, a 2-layer LLM of head size 32), anyres pinpoints 16×32, 32×16, 32×32, the hub's names
    (``image_newline`` too)."""
    return save_llava_next(
        path,
        seed,
        VLLM_LLAVA_VISION,
        {"max_position_embeddings": 2048, **VLLM_LLAVA_TEXT},
        **SERVABLE,
    )


def save_vllm_qwen2_5_vl(path: Path, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL that vLLM serves on a CPU, at ``path`` (tower: block 0 windowed, block 1 full; a 2-layer LLM
    of head size 32)."""
    return save_qwen2_5_vl(
        path,
        seed,
        VLLM_QWEN_VISION,
        VLLM_QWEN_TEXT,
        **SERVABLE,
    )


TINY_FOR_VLLM = {"llava": save_vllm_llava, "llava_next": save_vllm_llava_next, "qwen2_5_vl": save_vllm_qwen2_5_vl}


def save_tiny_vlm(path: str | Path, family: str = "llava", seed: int = 0, for_vllm: bool = False) -> Path:
    """A tiny random ``family`` (one of :data:`TINY`) checkpoint folder at ``path``; returns the path. ``for_vllm``:
    one that vLLM serves on a CPU as well as transformers loads it (:data:`TINY_FOR_VLLM`: LLaVA-1.5, LLaVA-NeXT,
    Qwen2.5-VL)."""
    require("transformers", feature="vitrim.vlm_user's tiny checkpoints")
    builders = TINY_FOR_VLLM if for_vllm else TINY
    if family not in builders:
        what = "family (for_vllm=True)" if for_vllm else "family"
        raise ValueError(f"{what} must be one of {', '.join(builders)}, got {family!r}")
    from vitrim.vlm_user.load import import_vision_backend

    import_vision_backend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole or not at all: built in a temporary sibling, then moved in; a builder that fails (a missing
    # torchvision, a full disk) leaves no half folder for `vlm ask --model` to misread
    building = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        builders[family](building, seed)
        path.mkdir(exist_ok=True)
        for file in sorted(building.iterdir()):
            os.replace(file, path / file.name)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return path
