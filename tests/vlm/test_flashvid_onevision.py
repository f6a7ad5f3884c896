"""FlashVID on LLaVA-OneVision, as its authors run it there (Fanziyang-v/FlashVID, ``flashvid/llava_arch.py`` and
``siglip_encoder.py``, facts only): per frame, the tower's last-layer features through the projector and the last
layer's attention averaged over heads and queries, both pooled by the same bilinear resize to the 14×14 grid (the
tiny model's 4×4), then ``flashvid_compression`` over the video's pooled frames, and ONE newline token after the
video ("one_token"). The reference: the authors' steps written in tests/vlm/test_method_flashvid.py
(``authors_flashvid``) on the unmodified model's own pooled frames and an attention read from transformers' eager
``output_attentions``; no vitrim code."""

from __future__ import annotations

import torch
from test_method_flashvid import OPTIONS, authors_flashvid, llm_input
from torch.nn import functional as F

import vitrim.vlm
from tiny_vlms.llava_onevision import (
    FRAME_TOKENS,
    VIDEO_TOKEN,
    clip,
    mixed_prompt,
    tiny_llava_onevision,
    video_prompts,
)

FRAMES = 6
GRID = 4  # the tiny model's 7×7 patches pooled to 4×4


def authors_attention(model: torch.nn.Module, frames: torch.Tensor) -> torch.Tensor:
    """(F, P′): the last tower layer's attention weights (eager ``output_attentions``), their mean over heads and
    then over queries (their ``attn_weights.mean(1).mean(1)``), resized bilinearly as the frames are."""
    tower = model.model.vision_tower
    tower.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            weights = tower(frames, output_attentions=True).attentions[-1]  # (F, H, p², p²)
    finally:
        tower.set_attn_implementation("sdpa")
    received = weights.mean(1).mean(1)  # (F, p²)
    side = int(received.shape[-1] ** 0.5)
    return F.interpolate(received.view(-1, 1, side, side), size=[GRID, GRID], mode="bilinear").flatten(1)


def authors_on_the_model(model: torch.nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Their (kept indices, embeddings the LLM gets) for one clip ``pixels`` (F, C, H, W)."""
    with torch.no_grad():
        pooled = model.model.get_video_features(pixels[None], return_dict=True).pooler_output[0]  # (F·P′ + 1, E)
    frames = pooled[: FRAMES * FRAME_TOKENS].reshape(FRAMES, FRAME_TOKENS, -1)
    return authors_flashvid(frames, authors_attention(model, pixels), OPTIONS)


def test_the_llm_gets_the_authors_tokens_and_the_newline() -> None:
    model = tiny_llava_onevision()
    pixels = clip(FRAMES, 4, still=(1, 2, 4))  # near copies: tokens join trees across frames
    inputs = video_prompts([pixels], [3])
    kept, values = authors_on_the_model(model, pixels)
    vitrim.vlm.apply(model, "flashvid", **OPTIONS)
    embeds = llm_input(model, inputs)["inputs_embeds"][0]  # after vitrim's pre-hook
    selection = vitrim.vlm.last_selection(model)[0]
    assert selection.tolist() == [*kept.tolist(), FRAMES * FRAME_TOKENS]  # the newline last, always kept
    assert len(kept) < FRAMES * FRAME_TOKENS
    assert any(len(group) > 1 for group in vitrim.vlm.last_selection(model, groups=True)[0])  # trees merged
    columns = (inputs["input_ids"][0] == VIDEO_TOKEN).nonzero().flatten()
    start = int(columns[0])  # the text before the video is kept whole: the video's rows start at the same column
    rows = embeds[start : start + len(selection)]
    torch.testing.assert_close(rows[:-1], values, rtol=0, atol=1e-12)
    torch.testing.assert_close(rows[-1], model.model.image_newline.to(rows.dtype), rtol=0, atol=0)


def test_keep_all_is_the_unmodified_model_bit_for_bit() -> None:
    """An image, a clip, an image: the images whole (a video method), the clip at retention_ratio = expansion = 1."""
    model = tiny_llava_onevision()
    inputs = mixed_prompt(model)
    with torch.no_grad():
        before = model(**inputs).logits
        vitrim.vlm.apply(model, "flashvid", retention_ratio=1.0, expansion=1.0)
        after = model(**inputs).logits
    assert torch.equal(after, before)
