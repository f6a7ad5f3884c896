"""Video on Qwen2-VL / Qwen2.5-VL / Qwen3-VL before the LLM: keep-all is the unmodified model bit for bit, a drop
equals masking the dropped keys at the full positions, a padded batch of different clips equals each clip alone,
a video method's pick equals its function on the model's own merged embeddings, and image methods run per
temporal patch as on the same pixels given as images."""

from __future__ import annotations

import pytest
import torch

import vitrim.vlm
from tiny_vlms.qwen import BUILDERS, MERGE, PAD
from tiny_vlms.qwen_video import dropped_media, masked_logits, media_tokens, video_batch
from vitrim.vlm.method.evs import evs_keep
from vitrim.vlm.method.vidcom2 import vidcom2_keep

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]

# two prompts: an image and a 3-temporal-patch video; a 2-temporal-patch video of another size, then a second video
MIXED = [
    [[1, 5], ("image", (4, 6)), [7], ("video", (3, 4, 4)), [8, 9]],
    [[1], ("video", (2, 4, 6)), [6, 7], ("video", (4, 4, 4)), [9]],
]


def inputs_for(family: str, prompts: list, seed: int = 0) -> dict:
    return video_batch(prompts, qwen3=family == "qwen3_vl", seed=seed)


def video_embeddings(model: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    """Each video's merged embeddings (N, E) from the unmodified model's own get_video_features."""
    with torch.no_grad():
        out = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    return list(out.pooler_output)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method, options", [("evs", {"video_pruning_rate": 0.0}), ("random", {"keep": 1.0})])
def test_keep_all_on_videos_is_the_unmodified_model_bit_for_bit(family: str, method: str, options: dict) -> None:
    model = BUILDERS[family]()
    inputs = inputs_for(family, MIXED)
    with torch.no_grad():
        before = model(**inputs).logits
        vitrim.vlm.apply(model, method, **options)
        after = model(**inputs).logits
    assert torch.equal(after, before)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == media_tokens(inputs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method, options", [("evs", {"video_pruning_rate": 0.5}), ("random", {"keep": 0.5})])
def test_a_drop_on_videos_and_images_equals_masking_at_the_full_positions(
    family: str, method: str, options: dict
) -> None:
    model = BUILDERS[family]()
    inputs = inputs_for(family, MIXED)
    vitrim.vlm.apply(model, method, **options)
    with torch.no_grad():
        pruned = model(**inputs).logits
    kept = vitrim.vlm.last_selection(model)
    dropped = dropped_media(inputs, kept)
    assert bool(dropped.any())
    vitrim.vlm.remove(model)
    with torch.no_grad():
        reference = masked_logits(model, inputs, dropped)
    stays = ~dropped
    width = int(stays.sum(1).max())
    assert pruned.shape[1] == width
    for b in range(stays.shape[0]):
        columns = stays[b].nonzero().flatten()
        valid = inputs["attention_mask"][b, columns].bool()
        short = pruned[b, width - len(columns) :]
        torch.testing.assert_close(short[valid], reference[b, columns][valid], rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method, check", [("evs", evs_keep), ("vidcom2", vidcom2_keep)])
def test_a_video_methods_pick_is_its_function_on_the_models_merged_embeddings(family: str, method, check) -> None:
    model = BUILDERS[family]()
    inputs = inputs_for(family, MIXED)
    embeddings = video_embeddings(model, inputs)
    vitrim.vlm.apply(model, method, video_pruning_rate=0.6)
    with torch.no_grad():
        model(**inputs)
    kept = vitrim.vlm.last_selection(model)
    counts = media_tokens(inputs)
    # reading order: image, video 0, video 1, video 2; the image keeps every token
    assert torch.equal(kept[0], torch.arange(counts[0]))
    for video, (grid, tokens) in enumerate(zip(inputs["video_grid_thw"].tolist(), embeddings, strict=True)):
        t, h, w = grid
        expected = check(tokens.reshape(t, (h // MERGE) * (w // MERGE), -1), 0.6)
        assert torch.equal(kept[1 + video], expected), (video, kept[1 + video], expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_batch_of_different_clips_equals_each_clip_alone(family: str) -> None:
    model = vitrim.vlm.apply(BUILDERS[family](), "evs", video_pruning_rate=0.5)
    inputs = inputs_for(family, MIXED)
    with torch.no_grad():
        together = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        kept = vitrim.vlm.last_selection(model)
        logits = model(**inputs).logits[:, -1]
    item = 0
    for b, prompt in enumerate(MIXED):
        alone = inputs_for(family, [prompt])
        count = len(media_tokens(alone))
        with torch.no_grad():
            tokens = model.generate(**alone, max_new_tokens=4, do_sample=False)
            alone_logits = model(**alone).logits[:, -1]
        assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == [k.tolist() for k in kept[item : item + count]]
        mine, theirs = tokens[0, alone["input_ids"].shape[1] :], together[b, inputs["input_ids"].shape[1] :]
        assert torch.equal(theirs[: len(mine)], mine) and bool((theirs[len(mine) :] == PAD).all())  # after EOS: pad
        torch.testing.assert_close(alone_logits[0], logits[b], rtol=0, atol=1e-10)
        item += count


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_generate_greedy_beams_sampling_and_no_cache_run_on_pruned_videos(family: str) -> None:
    model = BUILDERS[family]()
    inputs = inputs_for(family, [MIXED[1]])
    vitrim.vlm.apply(model, "evs", video_pruning_rate=0.5)
    with torch.no_grad():
        greedy = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        kept = [k.tolist() for k in vitrim.vlm.last_selection(model)]
        uncached = model.generate(**inputs, max_new_tokens=4, do_sample=False, use_cache=False)
        beams = model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=2)
        assert [k.tolist() for k in vitrim.vlm.last_selection(model)][: len(kept)] == kept
        torch.manual_seed(0)
        sampled = model.generate(**inputs, max_new_tokens=4, do_sample=True, top_k=5)
        torch.manual_seed(0)
        sampled_again = model.generate(**inputs, max_new_tokens=4, do_sample=True, top_k=5)
    assert torch.equal(uncached, greedy)
    assert beams.shape == greedy.shape and torch.equal(sampled, sampled_again)
    # the first generated token is the masked reference's argmax at the last position
    dropped = dropped_media(inputs, [torch.tensor(k) for k in kept])
    vitrim.vlm.remove(model)
    with torch.no_grad():
        reference = masked_logits(model, inputs, dropped)[:, -1]
    assert int(greedy[0, inputs["input_ids"].shape[1]]) == int(reference.argmax(-1)[0])
