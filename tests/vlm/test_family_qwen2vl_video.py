"""Video on Qwen2-VL / Qwen2.5-VL / Qwen3-VL before the LLM: keep-all is the unmodified model bit for bit, a drop
equals masking the dropped keys at the full positions, a padded batch of different clips equals each clip alone,
a video method's pick equals its function on the model's own merged embeddings, and image methods run per
temporal patch as on the same pixels given as images."""

from __future__ import annotations

import collections

import pytest
import torch

import vitrim.vlm
from tiny_vlms.qwen import BUILDERS, MERGE
from tiny_vlms.qwen_video import (
    assert_batch_equals_each_alone,
    dropped_media,
    masked_decode_logits,
    masked_logits,
    media_tokens,
    video_batch,
)
from vitrim.vlm.evidence.merged_tokens import kept_per_temporal_patch
from vitrim.vlm.method.evs import evs_keep
from vitrim.vlm.method.vidcom2 import vidcom2_keep

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def cases(names: list[str], *options: tuple, default: set) -> list:
    """pytest params of every family (× option), those not in ``default`` marked ``full`` (``make test-all``): the
    default suite runs each check on one or two families, the families taking turns between checks."""
    rows = [(name, *option) for name in names for option in (options or [()])]
    return [
        pytest.param(*row, marks=[] if row[:2] in default or row[:1] in default else [pytest.mark.full]) for row in rows
    ]


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


@pytest.mark.parametrize(
    "family, method, options",
    cases(
        FAMILIES,
        ("evs", {"video_pruning_rate": 0.0}),
        ("random", {"keep": 1.0}),
        default={("qwen2_5_vl", "evs"), ("qwen3_vl", "random")},
    ),
)
def test_keep_all_on_videos_is_the_unmodified_model_bit_for_bit(family: str, method: str, options: dict) -> None:
    model = BUILDERS[family]()
    inputs = inputs_for(family, MIXED)
    with torch.no_grad():
        before = model(**inputs).logits
        vitrim.vlm.apply(model, method, **options)
        after = model(**inputs).logits
    assert torch.equal(after, before)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == media_tokens(inputs)


@pytest.mark.parametrize(
    "family, method, options",
    cases(
        FAMILIES,
        ("evs", {"video_pruning_rate": 0.5}),
        ("random", {"keep": 0.5}),
        default={("qwen3_vl", "evs"), ("qwen2_vl", "random")},
    ),
)
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


@pytest.mark.parametrize(
    "family, method, check",
    cases(
        FAMILIES, ("evs", evs_keep), ("vidcom2", vidcom2_keep), default={("qwen2_5_vl", "evs"), ("qwen3_vl", "vidcom2")}
    ),
)
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


@pytest.mark.parametrize("family", cases(FAMILIES, default={("qwen2_5_vl",)}))
def test_a_padded_batch_of_different_clips_equals_each_clip_alone(family: str) -> None:
    model = vitrim.vlm.apply(BUILDERS[family](), "evs", video_pruning_rate=0.5)
    assert_batch_equals_each_alone(model, MIXED, qwen3=family == "qwen3_vl")


@pytest.mark.parametrize("family", cases(FAMILIES, default={("qwen2_5_vl",)}))
def test_generate_on_pruned_videos_decodes_at_the_unmodified_models_positions(family: str) -> None:
    """generate()'s first two steps (the LM head's float64 rows) equal the masked model's prefill and its decode
    step at the unmodified model's next position; use_cache=False gives the same tokens."""
    model = BUILDERS[family]()
    inputs = inputs_for(family, MIXED)
    vitrim.vlm.apply(model, "evs", video_pruning_rate=0.5)
    steps: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: steps.append(out[:, -1]))
    with torch.no_grad():
        greedy = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    handle.remove()
    kept = vitrim.vlm.last_selection(model)
    with torch.no_grad():
        uncached = model.generate(**inputs, max_new_tokens=3, do_sample=False, use_cache=False)
    assert torch.equal(uncached, greedy)
    dropped = dropped_media(inputs, kept)
    new_tokens = greedy[:, inputs["input_ids"].shape[1] :]
    vitrim.vlm.remove(model)
    with torch.no_grad():
        first = masked_logits(model, inputs, dropped)[:, -1]
        second = masked_decode_logits(model, inputs, dropped, new_tokens[:, :1])[:, -1]
    torch.testing.assert_close(steps[0], first, rtol=0, atol=1e-12)
    torch.testing.assert_close(steps[1], second, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", cases(["qwen2_5_vl", "qwen3_vl"], default={("qwen3_vl",)}))
def test_beams_and_sampling_run_on_pruned_videos_with_the_same_selection(family: str) -> None:
    model = BUILDERS[family]()
    inputs = inputs_for(family, [MIXED[1]])
    vitrim.vlm.apply(model, "vidcom2", video_pruning_rate=0.5)
    with torch.no_grad():
        greedy = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        kept = [k.tolist() for k in vitrim.vlm.last_selection(model)]
        beams = model.generate(**inputs, max_new_tokens=3, do_sample=False, num_beams=2, num_return_sequences=2)
        beam_kept = [k.tolist() for k in vitrim.vlm.last_selection(model)]
        torch.manual_seed(0)
        sampled = model.generate(**inputs, max_new_tokens=3, do_sample=True, top_k=5)
        torch.manual_seed(0)
        sampled_again = model.generate(**inputs, max_new_tokens=3, do_sample=True, top_k=5)
    assert beams.shape[0] == 2 and beam_kept == kept  # one entry per video of the prompt, as greedy reports
    assert torch.equal(sampled, sampled_again) and sampled.shape == greedy.shape


def test_a_video_methods_selection_reads_per_temporal_patch() -> None:
    model = vitrim.vlm.apply(BUILDERS["qwen2_vl"](), "temporal_downsample", stride=2)
    inputs = inputs_for("qwen2_vl", [[[1], ("video", (5, 4, 6)), [7]]])
    with torch.no_grad():
        model(**inputs)
    (kept,) = vitrim.vlm.last_selection(model)
    per_patch = kept_per_temporal_patch(kept, (5, 4, 6), MERGE)
    assert [p.tolist() for p in per_patch] == [list(range(6)), [], list(range(6)), [], list(range(6))]
    evs = vitrim.vlm.apply(BUILDERS["qwen2_vl"](), "evs", video_pruning_rate=0.5)
    with torch.no_grad():
        evs(**inputs)
    (kept,) = vitrim.vlm.last_selection(evs)
    per_patch = kept_per_temporal_patch(kept, (5, 4, 6), MERGE)
    assert per_patch[0].tolist() == list(range(6)) and sum(map(len, per_patch)) == max(6, int(30 * 0.5)) == len(kept)


@pytest.mark.parametrize("family", cases(FAMILIES, default={("qwen2_vl",), ("qwen3_vl",)}))
def test_an_image_method_on_a_video_selects_each_temporal_patch_as_that_picture(family: str) -> None:
    """VisionZip per temporal patch (the baselines' practice): each temporal patch is its own attention segment in
    the tower, so it selects and merges exactly as on the same pixels given as an image."""
    model = vitrim.vlm.apply(BUILDERS[family](), "visionzip", keep=3, dominant=2, contextual=1)
    video = inputs_for(family, [[[1, 5], ("video", (3, 4, 6)), [7, 8]]])
    frames = video["pixel_values_videos"].chunk(3)
    pictures = video_batch([[[1, 5], ("image", (4, 6)), ("image", (4, 6)), ("image", (4, 6)), [7, 8]]])
    pictures["pixel_values"] = torch.cat(frames)
    with torch.no_grad():
        model(**video)
        (kept,) = vitrim.vlm.last_selection(model)
        (groups,) = vitrim.vlm.last_selection(model, groups=True)
        model(**pictures)
    as_images = vitrim.vlm.last_selection(model)
    image_groups = vitrim.vlm.last_selection(model, groups=True)
    per_patch = kept_per_temporal_patch(kept, (3, 4, 6), MERGE)
    assert [p.tolist() for p in per_patch] == [k.tolist() for k in as_images]
    assert [g.tolist() for g in groups] == [(g + 6 * f).tolist() for f, gs in enumerate(image_groups) for g in gs]


def test_video_methods_and_videos_are_refused_where_they_cannot_run() -> None:
    from tiny_vlms.llava import tiny_llava

    with pytest.raises(TypeError, match=r"^vlm method 'evs' reduces videos; vitrim.vlm takes no video on Llava"):
        vitrim.vlm.apply(tiny_llava(), "evs")
    model = BUILDERS["qwen2_vl"]()
    with pytest.raises(ValueError, match=r"^keep=0.5: vlm method 'vidcom2' reduces videos and decides its own count"):
        vitrim.vlm.apply(model, "vidcom2", keep=0.5)
    with pytest.raises(ValueError, match=r"^video_pruning_rate=1.0 must be a float in \[0, 1\)"):
        vitrim.vlm.apply(model, "evs", video_pruning_rate=1.0)
    with pytest.raises(ValueError, match=r"^stride=0 must be an int >= 1"):
        vitrim.vlm.apply(model, "temporal_downsample", stride=0)
    assert not hasattr(model, "_vitrim_vlm")


def test_method_info_says_which_methods_reduce_videos_only() -> None:
    """``method_info(name).video`` is True exactly for the methods an image-only model refuses as video methods."""
    from tiny_vlms.llava import tiny_llava

    model, video_methods = tiny_llava(), []
    for name in vitrim.vlm.methods():
        try:
            vitrim.vlm.apply(model, name)
        except TypeError as err:
            if "reduces videos" in str(err):
                video_methods.append(name)
        except ValueError:  # a method that needs options of its own here (none of them a video method)
            pass
        else:
            vitrim.vlm.remove(model)
    assert video_methods == [name for name in vitrim.vlm.methods() if vitrim.vlm.method_info(name).video]
    assert video_methods == ["evs", "fastvid", "flashvid", "temporal_downsample", "vidcom2"]


@pytest.mark.parametrize(
    "method, options",
    [("fastvid", {}), ("visionzip", {"keep": 2}), ("hiprune", {"keep": 0.5, "object_layer": 1})],
)
def test_the_scoring_taps_read_each_blocks_own_qkv_instead_of_computing_it_again(method: str, options: dict) -> None:
    """With a method that reads the tower's attention (FastVID's mean queries, VisionZip's received map, HiPrune's
    two blocks), every block's ``qkv`` runs as often as in the unmodified model: the taps take q and k from the
    block's own output (``ScoringTap``'s projection), not from a second product on its input."""
    model = BUILDERS["qwen2_5_vl"]()
    inputs = inputs_for("qwen2_5_vl", MIXED)
    calls: collections.Counter = collections.Counter()
    for index, block in enumerate(model.model.visual.blocks):
        block.attn.qkv.register_forward_hook(lambda module, args, output, index=index: calls.update([index]))
    with torch.no_grad():
        model(**inputs)
    unmodified = dict(calls)
    calls.clear()
    vitrim.vlm.apply(model, method, **options)
    with torch.no_grad():
        model(**inputs)
    assert vitrim.vlm.last_selection(model)  # the method ran and selected
    assert dict(calls) == unmodified
