"""FastVID on LLaVA-OneVision, as its authors run it there (LunarShen/FastVID, ``fastvid_llavaonevision/``:
``siglip_encoder.py``'s ``SigLipVisionAbstract``, ``llava_arch.py``'s ``encode_images`` and ``get_attn_2dPool``,
``language_model/modeling_qwen2.py``'s prefill; facts only): each frame's feature layer through a SigLIP checkpoint's
``post_layernorm`` and attention-pooling head (the probe's weights over the patches, resized bilinearly as the frames
are, rank the salient tokens; the pooled vectors segment the clip), then DySeg, salient tokens in every frame and
density-peak anchors merging their frame's or their segment's other tokens. The reference (:func:`authors_fastvid`)
is those steps written here in the authors' batched shape, on the unmodified model's own pooled frames and a tiny
SigLIP head made here (random weights, the tower's sizes, ``vision_use_head=True``); no vitrim code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_method_flashvid import llm_input
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

transformers = pytest.importorskip("transformers")

FRAMES = 8
GRID = 4  # the tiny tower's 7×7 patches pooled to 4×4
STILL = (1, 2, 5)  # near copies: the head's vectors of frames 0-2 and 4-5 agree, so DySeg joins them
# a 3-, a 4- and a 1-frame segment on this clip (asserted below): both merges of DTM, anchors every 2nd frame
OPTIONS = {"retention_ratio": 0.5, "DySeg_c": 2, "DySeg_tau": 0.85, "DTM_p": 2}
ONEVISION = {"retention_ratio": 0.10, "DySeg_c": 8, "DySeg_tau": 0.9, "STPrune_d": 0.4, "DTM_p": 4, "DTM_beta": 0.6}


def tiny_siglip(model: torch.nn.Module, *, head: bool = True) -> torch.nn.Module:
    """A SiglipVisionModel of the tiny tower's sizes, with its pooling head (random weights, seeded)."""
    vision = model.config.vision_config
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size", "patch_size")
    config = transformers.SiglipVisionConfig(**{name: getattr(vision, name) for name in sizes}, vision_use_head=head)
    torch.manual_seed(5)
    return transformers.SiglipVisionModel(config).double().eval()


def authors_head(siglip: torch.nn.Module, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Their ``SigLipVisionAbstract``: (F, p², D) -> the probe's attention over the patches, mean over heads and
    resized bilinearly to the pooled grid (``get_attn_2dPool``), (F, P′); and the head's pooled vectors (F, D).
    The attention weights written out here (q from the probe, k from the patches, per head), not read from torch's
    ``MultiheadAttention``."""
    vision = getattr(siglip, "vision_model", siglip)  # transformers < 5.20 nests the tower one level deeper
    normed = vision.post_layernorm(states)
    head = vision.head
    attention = head.attention
    width, heads = normed.shape[-1], attention.num_heads
    w_q, w_k, _ = attention.in_proj_weight.chunk(3)
    b_q, b_k, _ = attention.in_proj_bias.chunk(3)
    query = (head.probe[0] @ w_q.T + b_q).view(heads, width // heads)  # (H, hd)
    keys = (normed @ w_k.T + b_k).view(len(normed), -1, heads, width // heads)  # (F, p², H, hd)
    weights = torch.einsum("hd,fphd->fhp", query, keys) / (width // heads) ** 0.5
    received = weights.softmax(-1).mean(1)  # (F, p²)
    side = int(received.shape[-1] ** 0.5)
    salience = F.interpolate(received.view(-1, 1, side, side), size=[GRID, GRID], mode="bilinear").flatten(1)
    return salience, head(normed)


def merge_into(tokens: torch.Tensor, targets: torch.Tensor, pool: torch.Tensor, beta: float) -> torch.Tensor:
    """Their DTM in their batched shape: ``pool`` (B, m, E) each to its most cosine-similar of ``targets`` (B, a, E)."""
    unit = pool / pool.norm(dim=-1, keepdim=True)
    goal = targets / targets.norm(dim=-1, keepdim=True)
    similarity = torch.bmm(unit, goal.transpose(1, 2))
    one_hot = torch.zeros_like(similarity).scatter_(2, similarity.argmax(2, keepdim=True), 1)
    weight = (1 / (one_hot.sum(1)[..., None] + 1)).clamp(min=beta)
    mean = torch.bmm(one_hot.transpose(1, 2), pool) / one_hot.sum(1).clamp(min=1)[..., None]
    return weight * targets + (1 - weight) * mean


def authors_fastvid(
    video: torch.Tensor, salience: torch.Tensor, vectors: torch.Tensor, options: dict
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Their prefill on one video's pooled tokens ``video`` (F, P′, E): (kept indices, their embeddings, DySeg's
    segment sizes). Where their code raises (fewer than ``DySeg_c`` frames; no anchor budgeted) what vitrim does:
    the ``DySeg_c`` − 1 lowest of what there is; no merge."""
    frames, per_frame, width = video.shape
    rows = torch.arange(frames)[:, None]
    unit = vectors / vectors.norm(dim=1, keepdim=True)
    similarity = (unit[:-1] * unit[1:]).sum(1)
    lowest = torch.topk(similarity, min(options["DySeg_c"] - 1, frames - 1), largest=False).indices
    cuts = torch.unique(torch.cat([lowest, (similarity < options["DySeg_tau"]).nonzero()[:, 0]])).sort().values
    bounds = F.pad(cuts, (1, 1), value=-1)
    bounds[-1] = frames - 1
    sizes = bounds.diff().tolist()
    retain = int(per_frame * options["retention_ratio"])
    salient_count = retain - int(retain * options["STPrune_d"])
    context = retain - salient_count
    shares = torch.zeros(frames, dtype=torch.long)
    offset = 0
    for size in sizes:
        mask = torch.arange(size - 1, -1, -1) % options["DTM_p"] == 0
        shares[offset : offset + size][mask] = context * size // ((size + options["DTM_p"] - 1) // options["DTM_p"])
        offset += size
    salient = torch.topk(salience, salient_count, dim=1).indices  # (F, s)
    kept = [(salient + rows * per_frame).flatten()]
    values = [video[rows, salient].reshape(-1, width)]
    others = torch.ones(frames, per_frame, dtype=torch.bool).scatter_(1, salient, False)
    filtered = torch.arange(per_frame).expand(frames, -1)[others].view(frames, -1)  # (F, P′ − s)
    pool = video[rows, filtered]
    global_index = filtered + rows * per_frame
    distance = torch.cdist(pool, pool) / width**0.5
    density = (-(torch.topk(distance, 4, dim=-1, largest=False).values ** 2).mean(-1)).exp()
    denser = (density[:, None, :] > density[:, :, None]).to(distance.dtype)
    far = distance.flatten(1).max(-1).values[:, None, None]
    score = (distance * denser + far * (1 - denser)).min(-1).values * density  # (F, P′ − s)
    if context:  # (their code raises on no anchor at all: a frame of under 3 budgeted tokens; vitrim keeps none)
        picked = torch.topk(score, context, dim=-1).indices  # one-frame merges: every frame, then the context frames
        merged = merge_into(video, pool[rows, picked], pool, options["DTM_beta"])
        own = shares == context
        kept.append(global_index[rows, picked][own].flatten())
        values.append(merged[own].reshape(-1, width))
    start = 0
    for size in sizes:  # segment merges: the frames whose share is larger, over the whole segment's pool
        segment = slice(start, start + size)
        targets = shares[segment] > context
        if size > 1 and targets.any():
            count = int(shares[segment][-1])
            chosen = torch.topk(score[segment][targets], count, dim=-1).indices
            frame_pool = pool[segment][targets]
            anchors = frame_pool[torch.arange(len(frame_pool))[:, None], chosen]
            segment_pool = pool[segment].reshape(1, -1, width).expand(len(anchors), -1, -1)
            kept.append(global_index[segment][targets][torch.arange(len(chosen))[:, None], chosen].flatten())
            values.append(merge_into(video, anchors, segment_pool, options["DTM_beta"]).reshape(-1, width))
        start += size
    indices = torch.cat(kept)
    order = indices.argsort()
    return indices[order], torch.cat(values)[order], sizes


def authors_on_the_model(
    model: torch.nn.Module, siglip: torch.nn.Module, pixels: torch.Tensor, options: dict
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Theirs for one clip ``pixels`` (F, C, H, W), on the unmodified model's pooled frames and feature layer."""
    with torch.no_grad():
        pooled = model.model.get_video_features(pixels[None], return_dict=True).pooler_output[0]  # (F·P′ + 1, E)
        states = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1]  # (F, p², D)
        salience, vectors = authors_head(siglip, states)
        frames = pooled[: len(pixels) * FRAME_TOKENS].reshape(len(pixels), FRAME_TOKENS, -1)
        return authors_fastvid(frames, salience, vectors, options)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llava_onevision()


@pytest.fixture(scope="module")
def siglip(model: torch.nn.Module) -> torch.nn.Module:
    return tiny_siglip(model)


@pytest.mark.parametrize("given", [OPTIONS, {}], ids=["options", "onevision-defaults"])
def test_the_llm_gets_the_authors_tokens_at_their_positions(model, siglip, given: dict) -> None:
    pixels = clip(FRAMES, 4, still=STILL)
    inputs = video_prompts([pixels], [3])
    kept, values, sizes = authors_on_the_model(model, siglip, pixels, ONEVISION | given)
    vitrim.vlm.apply(model, "fastvid", siglip=siglip, **given)
    try:
        seen = llm_input(model, inputs)
        selection = vitrim.vlm.last_selection(model)[0]
        merged = [group for group in vitrim.vlm.last_selection(model, groups=True)[0] if len(group) > 1]
    finally:
        vitrim.vlm.remove(model)
    if given:
        assert sorted(sizes) == [1, 3, 4] and merged  # both DTM merges ran, and tokens merged
    else:
        assert len(kept) == FRAMES  # int(16 · 0.10) = 1 token a frame, salient, no anchor
    assert selection.tolist() == [*kept.tolist(), FRAMES * FRAME_TOKENS]  # the newline last, always kept
    start = int((inputs["input_ids"][0] == VIDEO_TOKEN).nonzero()[0])  # the text before the video is kept whole
    rows = seen["inputs_embeds"][0][start : start + len(selection)]
    torch.testing.assert_close(rows[:-1], values, rtol=0, atol=1e-12)
    torch.testing.assert_close(rows[-1], model.model.image_newline.to(rows.dtype), rtol=0, atol=0)
    positions = seen["position_ids"].reshape(-1)[start : start + len(selection)]  # the authors' kept indices
    assert positions.tolist() == [start + index for index in selection.tolist()]


def test_a_batch_of_two_clips_equals_each_alone_with_the_head_from_a_folder(model, siglip, tmp_path: Path) -> None:
    clips = [clip(FRAMES, 4, still=STILL), clip(FRAMES, 9, still=(3, 4))]
    batch = video_prompts(clips, [5, 2])  # left-padded to one length
    folder = tmp_path / "siglip"  # laid out as the hub's google/siglip-so400m-patch14-384: a whole SiglipModel
    text = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, vocab_size=50)
    whole = transformers.SiglipModel(transformers.SiglipConfig(vision_config=siglip.config.to_dict(), text_config=text))
    whole.vision_model.load_state_dict(getattr(siglip, "vision_model", siglip).state_dict())
    whole.double().save_pretrained(folder)

    def run(inputs: dict) -> torch.Tensor:  # each row's positions from its first real token, as generate() counts
        positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            return model(**inputs, position_ids=positions).logits[:, -1]

    vitrim.vlm.apply(model, "fastvid", siglip=str(folder), **OPTIONS)  # loaded from the folder, offline
    try:
        together = run(batch)
        kept_together = [k.tolist() for k in vitrim.vlm.last_selection(model)]
        alone, kept_alone = [], []
        for pixels, before in zip(clips, [5, 2], strict=True):
            alone.append(run(video_prompts([pixels], [before]))[0])
            kept_alone += [k.tolist() for k in vitrim.vlm.last_selection(model)]
    finally:
        vitrim.vlm.remove(model)
    assert kept_together == kept_alone and kept_together[0] != kept_together[1]
    assert kept_together[0] == [*authors_on_the_model(model, siglip, clips[0], ONEVISION | OPTIONS)[0].tolist(), 128]
    torch.testing.assert_close(together, torch.stack(alone), rtol=0, atol=1e-10)


def test_keep_all_is_the_unmodified_model_bit_for_bit(model, siglip) -> None:
    """An image, a clip, an image: the images whole (a video method), the clip's every token kept (r = 1, every
    frame its own segment, an anchor's least weight 1: each anchor stands for itself)."""
    inputs = mixed_prompt(model)
    with torch.no_grad():
        before = model(**inputs).logits
        vitrim.vlm.apply(model, "fastvid", siglip=siglip, retention_ratio=1.0, DySeg_tau=2.0, DTM_beta=1.0)
        try:
            after = model(**inputs).logits
        finally:
            vitrim.vlm.remove(model)
    assert torch.equal(after, before)


def test_no_head_is_refused_in_one_line(model, siglip, tmp_path: Path) -> None:
    inputs = video_prompts([clip(3, 1)], [2])
    cases = [
        ({"siglip": tiny_siglip(model, head=False)}, r"fastvid siglip=.* has no attention-pooling head; expected a "),
        ({"siglip": str(tmp_path / "missing")}, r"fastvid siglip='.*missing' could not be loaded \(.*\); expected a "),
        ({"siglip": siglip, "DySeg_ignore": 0.9}, r"DySeg_ignore=0.9 .* LLaVA-OneVision form has no sub-segments"),
    ]
    for options, message in cases:
        vitrim.vlm.apply(model, "fastvid", **options)
        try:
            with pytest.raises(ValueError, match=message) as caught:
                model(**inputs)
            assert "\n" not in str(caught.value)
        finally:
            vitrim.vlm.remove(model)
    with pytest.raises(ValueError, match=r"siglip=3 for vlm method 'fastvid' must be a hub name, a folder or a Sig"):
        vitrim.vlm.apply(model, "fastvid", siglip=3)
