"""LLaVA-OneVision before the LLM: keep-all is the unmodified model bit for bit (images and videos); each video
method's pick equals a computation written here on the unmodified model's own pooled frames (a frame is one sampled
frame, its pooled grid; the newline token after the last frame always stays); a drop hands the LLM exactly the kept
rows in order (the unmodified LLM fed those rows gives the same logits, and the same greedy tokens); a padded batch
of two clips equals each clip alone; a method the family cannot take is refused in one line."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.nn import functional as F

import vitrim.vlm
from tiny_vlms.llava_onevision import (
    FRAME_TOKENS,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    clip,
    image_token_counts,
    mixed_prompt,
    several_images_prompt,
    tiny_llava_onevision,
    video_prompts,
    video_tokens,
)
from vitrim.vlm.method.vidcom2 import vidcom2_keep

TOL = 1e-12
FRAMES = 4
GRID = 4  # a frame's pooled 4×4 grid


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llava_onevision()


@pytest.fixture(autouse=True)
def _clean(model: torch.nn.Module):
    yield
    if hasattr(model, "_vitrim_vlm"):
        vitrim.vlm.remove(model)


def one_clip(seed: int = 3, before: int = 2) -> dict:
    """A prompt with one 4-frame clip whose frame 2 repeats frame 1 (up to noise)."""
    return video_prompts([clip(FRAMES, seed, still=(2,))], [before])


def frame_tokens(model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """(V, F, P′, E): each video's pooled frame tokens from the unmodified model's own get_video_features."""
    assert "get_video_features" not in model.model.__dict__  # the class's method, not vitrim's wrapper
    with torch.no_grad():
        pooled = model.model.get_video_features(pixels, return_dict=True).pooler_output  # (V, F·P′ + 1, E)
    videos, frames = pixels.shape[:2]
    return pooled[:, : frames * FRAME_TOKENS].reshape(videos, frames, FRAME_TOKENS, -1)


def with_newline(kept: list[int], frames: int) -> list[int]:
    return [*sorted(kept), frames * FRAME_TOKENS]


def evs_by_hand(tokens: torch.Tensor, rate: float) -> list[int]:
    """EVS on (F, P, E): score 1 − cos with the same cell one frame earlier, the first frame above every score,
    the max(P, int(F·P·(1 − rate))) highest kept, ties to the lower raster index."""
    frames, per_frame = tokens.shape[:2]
    scores = {}
    for frame in range(frames):
        for cell in range(per_frame):
            if frame == 0:
                scores[cell] = 3.0  # 1 − cos is at most 2
                continue
            now, before = tokens[frame, cell], tokens[frame - 1, cell]
            scores[frame * per_frame + cell] = float(1 - now @ before / (now.norm() * before.norm()))
    count = max(per_frame, int(frames * per_frame * (1 - rate)))
    return sorted(sorted(scores, key=lambda index: (-scores[index], index))[:count])


def received_by_hand(model: torch.nn.Module, frames: torch.Tensor) -> torch.Tensor:
    """(F, P′): per frame, the attention each patch receives at the tower's last layer (the softmax of its own q/k
    on the layer's normed input, summed over the queries, mean over heads), resized bilinearly as the model pools."""
    tower = model.model.vision_tower
    layer = tower.encoder.layers[-1]
    attention = layer.self_attn
    with torch.no_grad():
        states = tower(frames, output_hidden_states=True).hidden_states[-2]  # (F, p², C): the last layer's input
        normed = layer.layer_norm1(states)
        heads, width = attention.num_heads, attention.head_dim
        query = attention.q_proj(normed).unflatten(-1, (heads, width)).transpose(1, 2)  # (F, H, p², hd)
        key = attention.k_proj(normed).unflatten(-1, (heads, width)).transpose(1, 2)
        received = (query @ key.transpose(-1, -2) * width**-0.5).softmax(-1).sum(-2).mean(1)  # (F, p²)
        side = int(received.shape[-1] ** 0.5)
        return F.interpolate(received.view(-1, 1, side, side), size=[GRID, GRID], mode="bilinear").flatten(1)


def llm_on_rows(
    model: torch.nn.Module,
    inputs: dict,
    kept: list[torch.Tensor],
    merged: list[list[torch.Tensor]] | None = None,
    *,
    original: bool = False,
) -> torch.Tensor:
    """(1, L′, V): the unmodified LLM and head fed, as inputs_embeds, the rows of the unmodified model's LLM input
    (text embeddings, image and video features scattered at their tokens) at the text and the kept media tokens,
    numbered 0 … L′−1 (``original``: each at its unpruned position).

    kept: per image or video in reading order, its kept indices among its tokens, in the order they enter the LLM;
    merged: per item, the groups of ``last_selection(groups=True)`` (raster order of the kept indices); a kept token
    standing for others then holds VisionZip's merge (its own row + the mean of the others')."""
    inner = model.model
    ids = inputs["input_ids"]
    with torch.no_grad():
        embeds = inner.get_input_embeddings()(ids)[0]  # (L, E)
        features = {}
        if "pixel_values" in inputs:
            images = inner.get_image_features(
                inputs["pixel_values"],
                inputs["image_sizes"],
                batch_num_images=inputs.get("batch_num_images"),
                return_dict=True,
            )
            features[IMAGE_TOKEN] = list(images.pooler_output)
        if "pixel_values_videos" in inputs:
            videos = inner.get_video_features(inputs["pixel_values_videos"], return_dict=True)
            features[VIDEO_TOKEN] = list(videos.pooler_output)
        columns: list[int] = []  # the LLM input's rows, as columns of the full input, in order
        taken = dict.fromkeys(features, 0)
        column, item = 0, 0
        while column < ids.shape[1]:
            token = int(ids[0, column])
            if token not in features:
                columns.append(column)
                column += 1
                continue
            rows = features[token][taken[token]].clone()  # (T, E)
            taken[token] += 1
            groups = [] if merged is None else merged[item]
            for slot, group in zip(sorted(kept[item].tolist()), groups, strict=False):
                others = [index for index in group.tolist() if index != slot]
                if others:
                    rows[slot] = features[token][taken[token] - 1][slot] + features[token][taken[token] - 1][
                        others
                    ].mean(0)
            embeds[column : column + len(rows)] = rows
            columns += [column + int(index) for index in kept[item]]
            column, item = column + len(rows), item + 1
        at = torch.tensor(columns)
        positions = at[None] if original else None
        hidden = inner.language_model(inputs_embeds=embeds[at][None], position_ids=positions).last_hidden_state
        return model.lm_head(hidden)


def test_keep_all_is_the_unmodified_model_bit_for_bit(model: torch.nn.Module) -> None:
    """Images and a video in one prompt, a video method keeping all and an image method keeping all."""
    inputs = mixed_prompt(model)
    with torch.no_grad():
        before = model(**inputs).logits
        for method, options in (("evs", {"video_pruning_rate": 0.0}), ("random", {"keep": 1.0})):
            vitrim.vlm.apply(model, method, **options)
            assert torch.equal(model(**inputs).logits, before), method
            counts = [len(kept) for kept in vitrim.vlm.last_selection(model)]
            assert counts == [154, video_tokens(3), 259]  # the images' packed tokens, the video's with its newline
            vitrim.vlm.remove(model)
        assert torch.equal(model(**inputs).logits, before)
    assert not {"get_video_features", "get_image_features"} & set(model.model.__dict__)  # the wrappers are gone


@pytest.mark.parametrize("rate", [0.3, 0.5])
def test_evs_keeps_what_one_minus_cosine_with_the_frame_before_keeps(model: torch.nn.Module, rate: float) -> None:
    inputs = one_clip()
    tokens = frame_tokens(model, inputs["pixel_values_videos"])[0]
    vitrim.vlm.apply(model, "evs", video_pruning_rate=rate)
    with torch.no_grad():
        model(**inputs)
    (kept,) = vitrim.vlm.last_selection(model)
    assert kept.tolist() == with_newline(evs_by_hand(tokens, rate), FRAMES)
    assert not set(range(2 * FRAME_TOKENS, 3 * FRAME_TOKENS)) <= set(kept.tolist())  # the still frame mostly goes


def test_vidcom2_and_temporal_downsample_pick_on_the_pooled_frames(model: torch.nn.Module) -> None:
    """vidcom2: its function (checked against vLLM's in tests/vllm) on the unmodified model's pooled frames;
    temporal_downsample: every stride-th frame whole."""
    inputs = one_clip()
    tokens = frame_tokens(model, inputs["pixel_values_videos"])[0]
    vitrim.vlm.apply(model, "vidcom2", video_pruning_rate=0.6)
    with torch.no_grad():
        model(**inputs)
    assert vitrim.vlm.last_selection(model)[0].tolist() == with_newline(vidcom2_keep(tokens, 0.6).tolist(), FRAMES)
    vitrim.vlm.remove(model)
    vitrim.vlm.apply(model, "temporal_downsample", stride=3)
    with torch.no_grad():
        model(**inputs)
    frames_kept = [0, 3]
    expected = [f * FRAME_TOKENS + cell for f in frames_kept for cell in range(FRAME_TOKENS)]
    assert vitrim.vlm.last_selection(model)[0].tolist() == with_newline(expected, FRAMES)


def test_an_image_method_selects_each_frame_by_its_pooled_received_attention(model: torch.nn.Module) -> None:
    """fastervlm per frame: keep= counts a frame's pooled tokens; the ranking is the received attention computed
    here from the tower's last layer, resized as the model pools the frame."""
    inputs = one_clip()
    scores = received_by_hand(model, inputs["pixel_values_videos"][0])  # (F, P′)
    vitrim.vlm.apply(model, "fastervlm", keep=5)
    with torch.no_grad():
        model(**inputs)
    expected = [
        frame * FRAME_TOKENS + int(cell)
        for frame in range(FRAMES)
        for cell in torch.sort(scores[frame], descending=True, stable=True).indices[:5]
    ]
    assert vitrim.vlm.last_selection(model)[0].tolist() == with_newline(expected, FRAMES)


@pytest.mark.parametrize(
    "method, options, prompt",
    [
        ("evs", {"video_pruning_rate": 0.5}, "mixed"),
        ("random", {"keep": 0.5, "positions": "authors"}, "mixed"),
        ("fastervlm", {"keep": 3}, "clip"),
        ("random", {"keep": 25}, "images"),
    ],
)
def test_the_llm_sees_exactly_the_kept_rows_in_order(
    model: torch.nn.Module, method: str, options: dict, prompt: str
) -> None:
    """A video method leaves the images whole; an image method reduces the images per tile and the video per
    frame; the newline tokens stay. The LLM's logits equal the unmodified LLM's on the kept rows."""
    inputs = {"mixed": mixed_prompt, "clip": lambda model: one_clip(), "images": lambda model: several_images_prompt()}[
        prompt
    ](model)
    vitrim.vlm.apply(model, method, **options)
    with torch.no_grad():
        logits = model(**inputs).logits
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    if prompt != "images":
        video = kept[1] if prompt == "mixed" else kept[0]
        frames = inputs["pixel_values_videos"].shape[1]
        assert int(video[-1]) == frames * FRAME_TOKENS  # the newline
        assert len(video) < video_tokens(frames)
    else:  # each image: its base view's 49 tokens, then its newline
        assert [int(image[-1]) for image in kept] == [49, 49] and [len(image) for image in kept] == [26, 26]
    reference = llm_on_rows(model, inputs, kept)
    assert logits.shape == reference.shape
    assert torch.allclose(logits, reference, atol=TOL, rtol=0)


def test_visionzip_per_frame_merges_pooled_tokens_as_its_authors_merge(model: torch.nn.Module) -> None:
    """Per frame 4 dominant tokens and 2 contextual ones, each target + the mean of what it absorbs, written into
    its slot; at the unpruned positions (positions="original") the LLM's logits are the unmodified LLM's on those
    rows."""
    inputs = one_clip()
    vitrim.vlm.apply(model, "visionzip", keep=6, dominant=4, contextual=2, positions="original")
    with torch.no_grad():
        logits = model(**inputs).logits
    kept, groups = vitrim.vlm.last_selection(model), vitrim.vlm.last_selection(model, groups=True)
    vitrim.vlm.remove(model)
    assert len(kept[0]) == FRAMES * 6 + 1
    assert any(len(group) > 1 for group in groups[0])  # something was merged
    reference = llm_on_rows(model, inputs, kept, merged=groups, original=True)
    assert torch.allclose(logits, reference, atol=TOL, rtol=0)


def test_visionzip_per_frame_hands_the_llm_its_authors_order(model: torch.nn.Module) -> None:
    """positions="authors": each frame's dominant tokens (the 4 most attended, computed here) in raster order, then
    its contextual targets in raster order, frame after frame, then the newline, numbered 0 … L′−1."""
    inputs = one_clip()
    scores = received_by_hand(model, inputs["pixel_values_videos"][0])  # (F, P′)
    vitrim.vlm.apply(model, "visionzip", keep=6, dominant=4, contextual=2)
    with torch.no_grad():
        logits = model(**inputs).logits
    kept, groups = vitrim.vlm.last_selection(model), vitrim.vlm.last_selection(model, groups=True)
    vitrim.vlm.remove(model)
    order = []
    for frame in range(FRAMES):
        dominant = {
            frame * FRAME_TOKENS + int(c) for c in torch.sort(scores[frame], descending=True, stable=True)[1][:4]
        }
        own = [int(k) for k in kept[0] if int(k) // FRAME_TOKENS == frame]
        assert dominant <= set(own)
        order += sorted(dominant) + sorted(set(own) - dominant)
    order.append(FRAMES * FRAME_TOKENS)
    reference = llm_on_rows(model, inputs, [torch.tensor(order)], merged=groups)
    assert torch.allclose(logits, reference, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "method, options",
    [
        ("evs", {"video_pruning_rate": 0.5}),
        ("random", {"keep": 0.25}),
        ("fastv", {"keep": 0.5, "layer": 1}),
        ("flashvid", {"retention_ratio": 0.5, "min_segment_num": 2}),
    ],
)
def test_a_padded_batch_of_two_clips_equals_each_clip_alone(model: torch.nn.Module, method: str, options: dict) -> None:
    """Left padding, each row's positions counted from its first real token (as generate() counts them)."""
    clips = [clip(FRAMES, 7, still=(1,)), clip(FRAMES, 8, still=(3,))]

    def run(inputs: dict) -> torch.Tensor:
        positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return model(**inputs, position_ids=positions).logits[:, -1]

    vitrim.vlm.apply(model, method, **options)
    with torch.no_grad():
        batch = run(video_prompts(clips, [2, 6]))
        together = vitrim.vlm.last_selection(model)
        alone, selections = [], []
        for pixels, before in zip(clips, [2, 6], strict=True):
            alone.append(run(video_prompts([pixels], [before]))[0])
            selections += vitrim.vlm.last_selection(model)
    assert [k.tolist() for k in together] == [k.tolist() for k in selections]
    assert together[0].tolist() != together[1].tolist()
    assert torch.allclose(batch, torch.stack(alone), atol=1e-10, rtol=0)


def test_generate_greedy_gives_the_unmodified_llm_s_tokens_on_the_kept_rows(model: torch.nn.Module) -> None:
    """keep-all: the unmodified model's tokens; evs: the tokens a greedy loop of the unmodified LLM on the kept
    rows gives (no cache), one new token per step."""
    inputs = one_clip()
    steps = 3
    with torch.no_grad():
        unmodified = model.generate(**inputs, max_new_tokens=steps, do_sample=False)
        vitrim.vlm.apply(model, "evs", video_pruning_rate=0.0)
        assert torch.equal(model.generate(**inputs, max_new_tokens=steps, do_sample=False), unmodified)
        vitrim.vlm.remove(model)
        vitrim.vlm.apply(model, "evs", video_pruning_rate=0.5)
        out = model.generate(**inputs, max_new_tokens=steps, do_sample=False)
        kept = vitrim.vlm.last_selection(model)
        vitrim.vlm.remove(model)
        assert out.shape == (1, inputs["input_ids"].shape[1] + steps)
        assert torch.equal(out[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])
        tokens = []
        ids = inputs["input_ids"]
        for _ in range(steps):  # the prompt grows by the greedy token; the LLM reads the kept rows and the text
            prompt = {**inputs, "input_ids": torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype)], 1)}
            tokens.append(int(llm_on_rows(model, prompt, kept)[0, -1].argmax()))
    assert out[0, -steps:].tolist() == tokens


def test_a_method_the_family_cannot_take_is_refused_in_one_line(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="keep=") as caught:
        vitrim.vlm.apply(model, "evs", keep=8)
    assert "\n" not in str(caught.value)
    vitrim.vlm.apply(model, "cdpruner", keep=0.5)  # reads the prompt: images only
    with pytest.raises(ValueError, match="on images only") as caught, torch.no_grad():
        model(**one_clip())
    assert "\n" not in str(caught.value)
    vitrim.vlm.remove(model)
    several_layers = tiny_llava_onevision()
    several_layers.config.vision_feature_layer = [-1, -2]
    with pytest.raises(ValueError, match="vision_feature_layer=") as caught:
        vitrim.vlm.apply(several_layers, "fastervlm", keep=4)
    assert "\n" not in str(caught.value) and not hasattr(several_layers, "_vitrim_vlm")


def test_generate_reads_the_image_call_of_its_own_prompt(model: torch.nn.Module) -> None:
    """generate() encodes the images before its first forward and drops image_sizes and batch_num_images from it:
    a prompt of several images (one tile each) and then a prompt of one tiled image each keep what a forward keeps."""
    for inputs in (several_images_prompt(), mixed_prompt(model)):
        vitrim.vlm.apply(model, "random", keep=10)
        with torch.no_grad():
            model(**inputs)
            by_forward = [k.tolist() for k in vitrim.vlm.last_selection(model)]
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == by_forward
        assert out.shape == (1, inputs["input_ids"].shape[1] + 2)
        vitrim.vlm.remove(model)


def test_an_image_whose_grid_transformers_shrinks_keeps_all_or_is_refused_in_one_line() -> None:
    """A 4×4 grid of crops (16 tiles' worth, over anyres_max_9's nine) is resized bilinearly by transformers."""
    model = tiny_llava_onevision()
    model.config.image_grid_pinpoints = [[56, 56]]
    pixel_values = torch.randn(1, 17, 3, 14, 14, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    sizes = torch.tensor([[50, 50]])
    (count,) = image_token_counts(model, pixel_values, sizes)
    inputs = {"input_ids": torch.tensor([[5] + [IMAGE_TOKEN] * count + [6]]), "pixel_values": pixel_values}
    inputs["image_sizes"] = sizes
    with torch.no_grad():
        before = model(**inputs).logits
        vitrim.vlm.apply(model, "random", keep=1.0)
        assert torch.equal(model(**inputs).logits, before)
        vitrim.vlm.remove(model)
        vitrim.vlm.apply(model, "random", keep=0.5)
        with pytest.raises(ValueError, match="shrinks the tile grid") as caught:
            model(**inputs)
    assert "\n" not in str(caught.value)


def test_inside_the_llm_a_video_is_ranked_alone_or_after_a_video_method(model: torch.nn.Module) -> None:
    """The in-LLM stage alone ranks every image and video (its F·P′ + 1 tokens, the newline among them); stacked after
    a pre-LLM video method it ranks among the video's tokens that entered the LLM (docs/video.md). Which tokens
    FastV keeps is checked against eager attention in tests/vlm/test_in_llm_video.py."""
    inputs = mixed_prompt(model)
    vitrim.vlm.apply(model, "fastv", keep=0.5, layer=1)
    with torch.no_grad():
        model(**inputs)
    assert [len(kept) for kept in vitrim.vlm.last_selection(model)] == [154 // 2, round(49 / 2), round(259 / 2)]
    vitrim.vlm.remove(model)
    vitrim.vlm.apply(model, "evs", video_pruning_rate=0.5)
    vitrim.vlm.apply(model, "flashvid_llm", layer=1)
    with torch.no_grad():
        model(**inputs)
    before, inside = vitrim.vlm.last_selection(model, stage="pre_llm"), vitrim.vlm.last_selection(model)
    assert [len(kept) for kept in before] == [154, 24 + 1, 259]  # evs: 24 of 48 frame tokens and the newline
    assert set(inside[1].tolist()) < set(before[1].tolist())  # the video's ranked among what evs kept


def test_two_videos_in_one_prompt_are_each_picked_on_their_own_frames(model: torch.nn.Module) -> None:
    clips = torch.stack([clip(FRAMES, 1), clip(FRAMES, 2, still=(1, 2))])
    ids = [5, 6] + [VIDEO_TOKEN] * video_tokens(FRAMES) + [7] + [VIDEO_TOKEN] * video_tokens(FRAMES) + [8]
    inputs = {"input_ids": torch.tensor([ids]), "pixel_values_videos": clips}
    tokens = frame_tokens(model, clips)
    vitrim.vlm.apply(model, "evs", video_pruning_rate=0.5)
    with torch.no_grad():
        logits = model(**inputs).logits
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    assert [k.tolist() for k in kept] == [with_newline(evs_by_hand(tokens[v], 0.5), FRAMES) for v in range(2)]
    assert torch.allclose(logits, llm_on_rows(model, inputs, kept), atol=TOL, rtol=0)


@pytest.mark.full
def test_beams_and_no_cache_keep_all_and_pruned(model: torch.nn.Module) -> None:
    """Keep-all under beam search is the unmodified model's; a pruned greedy run gives the same tokens with and
    without the cache."""
    inputs = mixed_prompt(model)
    greedy = {"max_new_tokens": 3, "do_sample": False}
    with torch.no_grad():
        unmodified = model.generate(**inputs, num_beams=2, **greedy)
        vitrim.vlm.apply(model, "evs", video_pruning_rate=0.0)
        assert torch.equal(model.generate(**inputs, num_beams=2, **greedy), unmodified)
        vitrim.vlm.remove(model)
        vitrim.vlm.apply(model, "visionzip", keep=6, dominant=4, contextual=2)
        cached = model.generate(**inputs, **greedy)
        assert torch.equal(model.generate(**inputs, use_cache=False, **greedy), cached)


def test_the_scoring_tap_reads_the_layers_own_q_and_k_instead_of_computing_them_again(
    model: torch.nn.Module,
) -> None:
    """With a method that reads the tower's attention (VisionZip per frame), every SigLIP layer's ``q_proj`` and
    ``k_proj`` run as often as in the unmodified model: the tap takes the scoring layer's own outputs
    (``ScoringTap``'s projections), not a second product on its input."""
    calls: collections.Counter = collections.Counter()
    handles = [
        getattr(layer.self_attn, name).register_forward_hook(
            lambda module, args, output, key=(index, name): calls.update([key])
        )
        for index, layer in enumerate(model.model.vision_tower.encoder.layers)
        for name in ("q_proj", "k_proj")
    ]
    try:
        inputs = one_clip()
        with torch.no_grad():
            model(**inputs)
        unmodified = dict(calls)
        calls.clear()
        vitrim.vlm.apply(model, "visionzip", keep=6, dominant=4, contextual=2)
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    assert len(vitrim.vlm.last_selection(model)[0]) == FRAMES * 6 + 1  # the method ran (and the newline stayed)
    assert dict(calls) == unmodified
