"""In-LLM methods alone on prompts with videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision): a video's tokens
are visual tokens, ranked as an image's are, each video on its own.

References written here, no vitrim code: FastV's kept tokens are the top of the last token's attention at layer
K − 1, read from transformers' eager attention (``output_attentions``) on each prompt alone, per image and per video
in reading order; a drop equals the unmodified text stack run layer by layer with the dropped keys masked from
layer K on (Qwen3-VL's DeepStack rows added at every image and video position); keep-all is the unmodified model
bit for bit; a padded batch of different clips equals each prompt alone (``assert_batch_equals_each_alone``).
"""

from __future__ import annotations

import pytest
import torch
from llm_reference import top_k_reference
from test_family_qwen2vl_video import MIXED, cases
from test_in_llm_qwen3_deepstack import masked_deepstack_reference

import vitrim.vlm
from tiny_vlms.llava_onevision import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    image_token_counts,
    mixed_prompt,
    tiny_llava_onevision,
)
from tiny_vlms.qwen import BUILDERS, IMAGE, VIDEO
from tiny_vlms.qwen_video import assert_batch_equals_each_alone, dropped_media, media_tokens, video_batch
from vitrim.vlm.api import STATE_ATTRIBUTE

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
LAYER = 1  # the tiny LLMs have 2 layers: FastV drops before layer 1, reading layer 0's attention
KEEP = 5  # tokens per image and per video (each holds 6 to 16 here)


def item_columns(input_ids: torch.Tensor, tokens: tuple[int, int], counts: list[int]) -> list[torch.Tensor]:
    """Per image and video of the one prompt ``input_ids`` (1, L) in reading order, the columns of its tokens (its
    ``counts[i]`` placeholders; Qwen3-VL's timestamps between temporal patches are not among them)."""
    where = torch.isin(input_ids[0], torch.tensor(tokens)).nonzero().flatten()
    return list(torch.split(where, counts))


def fastv_by_hand(model: torch.nn.Module, inputs: dict, tokens: tuple[int, int], counts: list[int]) -> list[list[int]]:
    """FastV on one prompt: per item, its ``KEEP`` tokens the last token attends to most at layer LAYER − 1 (heads
    averaged; eager attention's own weights), ties to the earlier token."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(**inputs, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    row = attentions[LAYER - 1][0, :, -1].mean(0)  # (L,) the last token's row
    return [top_k_reference(row[columns], KEEP) for columns in item_columns(inputs["input_ids"], tokens, counts)]


@pytest.mark.parametrize("family", cases(FAMILIES, default={("qwen2_5_vl",), ("qwen3_vl",)}))
def test_fastv_keeps_each_videos_top_tokens_of_the_last_tokens_attention(family: str) -> None:
    """vitrim on the padded batch (SDPA), the reference on each prompt alone (eager)."""
    model = BUILDERS[family]()
    inputs = video_batch(MIXED, qwen3=family == "qwen3_vl")
    vitrim.vlm.apply(model, "fastv", keep=KEEP, layer=LAYER)
    with torch.no_grad():
        model(**inputs)
    kept = [k.tolist() for k in vitrim.vlm.last_selection(model)]
    vitrim.vlm.remove(model)
    expected = []
    for prompt in MIXED:
        alone = video_batch([prompt], qwen3=family == "qwen3_vl")
        expected += fastv_by_hand(model, alone, (IMAGE, VIDEO), media_tokens(alone))
    assert len(kept) == 4  # an image and three videos, reading order
    assert kept == expected


def test_fastv_on_llava_onevision_ranks_a_videos_frames_and_newline_with_the_images() -> None:
    """The video's F·P′ + 1 tokens (its newline among them, as an image's newline tokens are among its packed
    tokens) are one item between the two images, ranked by the same row."""
    model = tiny_llava_onevision()
    inputs = mixed_prompt(model)
    counts = image_token_counts(model, inputs["pixel_values"], inputs["image_sizes"])
    counts = [counts[0], 3 * 16 + 1, counts[1]]
    vitrim.vlm.apply(model, "fastv", keep=KEEP, layer=LAYER)
    with torch.no_grad():
        model(**inputs)
    kept = [k.tolist() for k in vitrim.vlm.last_selection(model)]
    vitrim.vlm.remove(model)
    assert kept == fastv_by_hand(model, inputs, (IMAGE_TOKEN, VIDEO_TOKEN), counts)


@pytest.mark.parametrize(
    "family, method",
    cases(FAMILIES, ("fastv",), ("dart",), ("pdrop",), default={("qwen3_vl", "fastv"), ("qwen2_5_vl", "dart")}),
)
def test_a_drop_among_video_tokens_equals_masking_them_from_layer_k(family: str, method: str) -> None:
    """Every kept, real position's logits equal the masked text stack's (≤ 1e-12), Qwen3-VL's DeepStack rows
    following the kept video tokens."""
    model = BUILDERS[family]()
    inputs = video_batch(MIXED, qwen3=family == "qwen3_vl")
    options = {"layers": (1,), "ratios": (0.5,)} if method == "pdrop" else {"layer": LAYER}
    vitrim.vlm.apply(model, method, **options)
    with torch.no_grad():
        pruned = model(**inputs).logits  # (B, L, V) the full layout
    drop = getattr(model, STATE_ATTRIBUTE).installation.drop
    selection = drop.stage_selections()[-1]
    vitrim.vlm.remove(model)
    counts = media_tokens(inputs)
    assert all(0 < len(k) < n for k, n in zip(selection, counts, strict=True))  # every video loses tokens
    kept = ~dropped_media(inputs, selection)
    reference = masked_deepstack_reference(model, inputs, {LAYER: kept})
    compared = inputs["attention_mask"].bool() & kept
    assert (pruned - reference)[compared].abs().max() <= 1e-12


@pytest.mark.parametrize("family", cases(FAMILIES, default={("qwen2_vl",)}))
def test_keep_all_on_videos_is_the_unmodified_model_bit_for_bit(family: str) -> None:
    model = BUILDERS[family]()
    inputs = video_batch(MIXED, qwen3=family == "qwen3_vl")
    with torch.no_grad():
        before = model(**inputs).logits
        vitrim.vlm.apply(model, "fastv", keep=1.0, layer=LAYER)
        after = model(**inputs).logits
    assert torch.equal(after, before)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == media_tokens(inputs)


@pytest.mark.parametrize("family", cases(FAMILIES, default={("qwen2_5_vl",)}))
def test_a_padded_batch_of_different_clips_equals_each_prompt_alone(family: str) -> None:
    """Selections, greedy tokens through generate() (its encoded videos) and last logits."""
    model = vitrim.vlm.apply(BUILDERS[family](), "fastv", keep=0.5, layer=LAYER)
    assert_batch_equals_each_alone(model, MIXED, qwen3=family == "qwen3_vl")


@pytest.mark.full
def test_beams_rank_each_prompts_videos_once() -> None:
    """generate()'s beams repeat a prompt's encoded videos: every beam keeps the prompt's own selection (the in-LLM
    stage reports per row of the expanded batch, for images as for videos)."""
    model = BUILDERS["qwen2_5_vl"]()
    inputs = video_batch(MIXED[:1])
    vitrim.vlm.apply(model, "fastv", keep=KEEP, layer=LAYER)
    with torch.no_grad():
        model(**inputs)
        alone = [k.tolist() for k in vitrim.vlm.last_selection(model)]
        model.generate(**inputs, num_beams=2, max_new_tokens=2, do_sample=False)
    assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == alone * 2
