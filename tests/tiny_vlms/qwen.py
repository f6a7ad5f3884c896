"""Tiny float64 Qwen2-VL and Qwen2.5-VL instances built from a config alone, and prompts with images for them.

Sizes follow transformers' own tests (hidden 32, 4 heads / 2 KV heads, mrope_section [2, 1, 1]) with a 96-token
vocabulary and 2-pixel patches so an image is a few dozen patches. The Qwen2.5 tower has a window of 2×2 merged
tokens (``window_size = 2 · merge · patch = 8`` px) and full attention in its last block only, so its first block is
windowed and grids of 4×6 patches (2×3 merged tokens) make windows of different sizes.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

IMAGE, VIDEO, VISION_START, VISION_END, PAD = 90, 91, 92, 93, 0
MERGE = 2
PATCH = 2
CHANNELS = 3

TEXT = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
)
TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END
)


def qwen2_vl(seed: int = 0, text: dict | None = None) -> torch.nn.Module:
    """A tiny Qwen2VLForConditionalGeneration in float64 on SDPA (2 vision blocks of width 16, 2 heads); ``text``:
    options of the LLM's config over :data:`TEXT` (a sliding window, its ``layer_types``)."""
    config = transformers.Qwen2VLConfig(
        text_config=TEXT | (text or {}),
        vision_config=dict(
            depth=2,
            embed_dim=16,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=1,
            in_channels=CHANNELS,
        ),
        **TOKENS,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2VLForConditionalGeneration(config).double().eval()


def qwen2_5_vl(seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen2_5_VLForConditionalGeneration in float64 on SDPA: block 0 windowed, block 1 full attention."""
    config = transformers.Qwen2_5_VLConfig(
        text_config=TEXT,
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=24,
            num_heads=2,
            out_hidden_size=32,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=1,
            in_channels=CHANNELS,
            window_size=2 * MERGE * PATCH,
            fullatt_block_indexes=[1],
        ),
        **TOKENS,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).double().eval()


QWEN3_TOWER = dict(  # the Qwen3-VL towers' common sizes (depth, temporal patch and DeepStack taps: per builder)
    hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=PATCH, spatial_merge_size=MERGE,
    in_channels=CHANNELS, num_position_embeddings=16,
)  # fmt: skip


def qwen3_vl(seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen3VLForConditionalGeneration in float64 on SDPA: 3 vision blocks, DeepStack after blocks 0 and 1."""
    text = {**TEXT, "head_dim": 8, "rope_parameters": {**TEXT["rope_parameters"], "mrope_interleaved": True}}
    config = transformers.Qwen3VLConfig(
        text_config=text,
        vision_config=QWEN3_TOWER | dict(depth=3, temporal_patch_size=1, deepstack_visual_indexes=[0, 1]),
        **TOKENS,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3VLForConditionalGeneration(config).double().eval()


def qwen3_vl_8b_layout(seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen3VLForConditionalGeneration laid out as Qwen/Qwen3-VL-8B-Instruct's config is, float64 on SDPA.

    The 8B: a 27-block tower with DeepStack taps after blocks 8, 16 and 24, added to the LLM's layers 0, 1 and 2;
    a 36-layer LLM with 32 heads on 8 KV heads (GQA groups of 4), interleaved M-RoPE (section [24, 20, 20] of 64),
    temporal patches of 2 frames. Here: 4 tower blocks tapped after 0, 1 and 2 (three taps, the last block feeding
    the merger only), a 4-layer LLM (FastV's and DART's default layer 2 is at the last tap), 4 heads on 1 KV head,
    section [2, 1, 1] of 4, temporal patches of 2 (an image is its frame twice: ``batch(..., temporal=2)``)."""
    text = {
        **TEXT,
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "rope_parameters": {**TEXT["rope_parameters"], "mrope_interleaved": True, "rope_theta": 5_000_000.0},
    }
    config = transformers.Qwen3VLConfig(
        text_config=text,
        vision_config=QWEN3_TOWER | dict(depth=4, temporal_patch_size=2, deepstack_visual_indexes=[0, 1, 2]),
        **TOKENS,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3VLForConditionalGeneration(config).double().eval()


BUILDERS = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl}


def prompt(texts: list[list[int]], grids: list[tuple[int, int]]) -> list[int]:
    """Token ids: text pieces with an image (vision_start, its merged tokens, vision_end) between consecutive ones."""
    ids = list(texts[0])
    for (h, w), text in zip(grids, texts[1:]):
        ids += [VISION_START] + [IMAGE] * ((h // MERGE) * (w // MERGE)) + [VISION_END] + list(text)
    return ids


def batch(
    prompts: list[tuple[list[list[int]], list[tuple[int, int]]]], seed: int = 0, side: str = "left", temporal: int = 1
) -> dict:
    """Processor-like inputs for several prompts, padded on ``side``: input_ids, attention_mask, mm_token_type_ids,
    pixel_values (patches of every image in reading order), image_grid_thw. Pixels are drawn per image from ``seed``;
    ``temporal``: the tower's temporal patch size (a patch holds that many frames, an image repeating its own)."""
    rows = [prompt(texts, grids) for texts, grids in prompts]
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), PAD)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for b, row in enumerate(rows):
        span = slice(length - len(row), length) if side == "left" else slice(0, len(row))
        ids[b, span] = torch.tensor(row)
        mask[b, span] = 1
    grids = [grid for _, image_grids in prompts for grid in image_grids]
    generator = torch.Generator().manual_seed(seed)
    pixels = [
        torch.randn(h * w, CHANNELS, 1, PATCH * PATCH, generator=generator, dtype=torch.float64) for h, w in grids
    ]
    pixels = [
        image.expand(-1, -1, temporal, -1).reshape(h * w, -1) for image, (h, w) in zip(pixels, grids, strict=True)
    ]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": (ids == IMAGE).int(),
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.tensor([[1, h, w] for h, w in grids]),
    }


def one(texts: list[list[int]] | None = None, grids: list[tuple[int, int]] | None = None, seed: int = 0) -> dict:
    """One prompt: text, a 4×6-patch image (6 merged tokens), text."""
    return batch([(texts or [[1, 5, 6], [7, 8, 9]], grids or [(4, 6)])], seed=seed)


def each_alone(prompts: list[tuple[list[list[int]], list[tuple[int, int]]]], inputs: dict) -> list[tuple[dict, slice]]:
    """Per prompt of ``inputs`` (``batch(prompts, ...)``): its inputs alone (unpadded, its own patches of ``inputs``)
    and the slice of the batch's images (reading order) that are its own."""
    alone, first_image, first_patch = [], 0, 0
    for one_prompt in prompts:
        one = batch([one_prompt])
        patches = sum(h * w for h, w in one_prompt[1])
        one["pixel_values"] = inputs["pixel_values"][first_patch : first_patch + patches]
        alone.append((one, slice(first_image, first_image + len(one_prompt[1]))))
        first_image, first_patch = first_image + len(one_prompt[1]), first_patch + patches
    return alone


def assert_batch_is_each_alone(model: torch.nn.Module, prompts: list, inputs: dict, atol: float = 1e-10) -> None:
    """``model`` (a vitrim.vlm method applied) on the batch ``inputs`` (``batch(prompts, ...)``) keeps, per image, what
    it keeps on each prompt alone, and gives each prompt's last-token logits (to ``atol``)."""
    import vitrim.vlm

    def kept() -> list[list[int]]:
        return [indices.tolist() for indices in vitrim.vlm.last_selection(model)]

    together = model(**inputs).logits[:, -1]
    kept_together = kept()
    for sample, (alone_inputs, images) in enumerate(each_alone(prompts, inputs)):
        alone = model(**alone_inputs).logits[0, -1]
        assert kept_together[images] == kept(), sample
        torch.testing.assert_close(together[sample], alone, rtol=0, atol=atol)
