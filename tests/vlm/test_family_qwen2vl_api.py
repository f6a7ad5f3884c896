"""vitrim.vlm on Qwen2-VL / Qwen2.5-VL through the public interface: apply, generate, last_selection, remove, errors;
and a merged token (ImageSelection.merged) put through the merger into its slot, against a hand-built reference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch
from qwen_reference import masked_reference
from test_family_qwen2vl import THREE, assert_kept_columns_match, dropped_positions, tokens_of

import vitrim.vlm
from tiny_vlms.qwen import BUILDERS, IMAGE, MERGE, VIDEO, batch, one
from vitrim.vlm.families.qwen2vl import Qwen2VLAdapter
from vitrim.vlm.keep import parse_keep
from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence
from vitrim.vlm.stages import pre_llm


def hooks_of(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._forward_hooks_with_kwargs) for m in model.modules()
    )


def test_random_through_apply_generate_last_selection_and_remove() -> None:
    model = BUILDERS["qwen2_5_vl"]()
    inputs = batch(THREE)
    with torch.no_grad():
        before = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert vitrim.vlm.apply(model, "random", keep=2, seed=3) is model
    with torch.no_grad():
        pruned = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    kept = vitrim.vlm.last_selection(model)
    groups = vitrim.vlm.last_selection(model, groups=True)
    assert pruned.shape == before.shape
    assert [len(k) for k in kept] == [2, 2, 2, 2]  # four images in reading order, 2 tokens each
    for k, n, image_groups in zip(kept, tokens_of(inputs), groups, strict=True):
        assert k.dtype == torch.long and torch.equal(k, k.sort().values) and int(k.min()) >= 0 and int(k.max()) < n
        assert [g.tolist() for g in image_groups] == [[i] for i in k.tolist()]
    # the same image alone draws the same tokens (seeded by its own pixels)
    first = {key: value for key, value in batch([THREE[0]]).items()}
    with torch.no_grad():
        model(**first)
    assert torch.equal(vitrim.vlm.last_selection(model)[0], kept[0])
    vitrim.vlm.remove(model)
    assert hooks_of(model) == 0 and not hasattr(model, "_vitrim_vlm")
    with torch.no_grad():
        after = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(after, before)


def test_a_text_only_forward_runs_unchanged_after_apply() -> None:
    model = BUILDERS["qwen2_vl"]()
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        vitrim.vlm.apply(model, "random", keep=2)
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_keep_beyond_an_images_tokens_is_refused_naming_it() -> None:
    model = vitrim.vlm.apply(BUILDERS["qwen2_vl"](), "random", keep=7)  # the image has 6 tokens
    with pytest.raises(ValueError, match="keep=7 is more than the image's 6 tokens"), torch.no_grad():
        model(**one())


def test_a_one_frame_video_is_reduced_as_the_same_picture() -> None:
    """Videos are reduced, not refused nor left whole (tests/vlm/test_family_qwen2vl_video.py): an image method on a
    one-frame video keeps the tokens it keeps of the same pixels given as an image."""
    model = vitrim.vlm.apply(BUILDERS["qwen2_vl"](), "random", keep=2)
    inputs = one()
    video = {
        "input_ids": torch.where(inputs["input_ids"] == IMAGE, VIDEO, inputs["input_ids"]),
        "attention_mask": inputs["attention_mask"],
        "mm_token_type_ids": 2 * inputs["mm_token_type_ids"],
        "pixel_values_videos": inputs["pixel_values"],
        "video_grid_thw": inputs["image_grid_thw"],
    }
    with torch.no_grad():
        model(**inputs)
        as_image = vitrim.vlm.last_selection(model)
        model(**video)
    as_video = vitrim.vlm.last_selection(model)
    assert len(as_video[0]) == 2 and torch.equal(as_video[0], as_image[0])


class MergeTail(Method):
    """A test method: keep the first ``keep - 1`` tokens and one slot (the next) standing for every other token,
    whose features are the mean of theirs."""

    name = "test_merge_tail"
    stage = "pre_llm"
    defaults: ClassVar[Mapping[str, Any]] = {}

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        features = evidence.features[0]  # (N, m²C)
        kept = torch.arange(keep)
        groups = (*tuple(torch.tensor([i]) for i in range(keep - 1)), torch.arange(keep - 1, features.shape[0]))
        merged = features[kept].clone()
        merged[-1] = features[keep - 1 :].mean(0)
        return [ImageSelection(kept=kept, groups=groups, merged=merged)]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_merged_token_is_the_merger_on_the_mean_of_its_patch_states(family: str) -> None:
    """Qwen3-VL: the slot's DeepStack rows are the mean of its group's."""
    model = BUILDERS[family]()  # raster tower order: merged token g is patch rows 4g … 4g+3
    inputs = batch(THREE)
    installation = pre_llm.install(Qwen2VLAdapter(model), MergeTail(), parse_keep(3))
    with torch.no_grad():
        pruned = model(**inputs).logits
    selection = installation.selection()
    installation.remove()
    assert [[g.tolist() for g in s.groups][-1] for s in selection] == [list(range(2, n)) for n in tokens_of(inputs)]

    def write_merged(module, args, kwargs, output):  # the reference: slot 2 of each image <- merger(mean of 2 … N-1)
        states = output.last_hidden_state.reshape(-1, MERGE * MERGE * output.last_hidden_state.shape[-1])
        pooled, start = output.pooler_output.clone(), 0
        deepstack = [rows.clone() for rows in getattr(output, "deepstack_features", None) or []]
        for n in tokens_of(inputs):
            mean = states[start + 2 : start + n].mean(0)
            pooled[start + 2] = module.merger(mean.reshape(MERGE * MERGE, -1))[0]
            for rows in deepstack:
                rows[start + 2] = rows[start + 2 : start + n].mean(0)
            start += n
        output.pooler_output = pooled
        if deepstack:
            output.deepstack_features = deepstack
        return output

    handle = model.model.visual.register_forward_hook(write_merged, with_kwargs=True)
    dropped = dropped_positions(inputs, selection, tokens_of(inputs))
    with torch.no_grad():
        reference = masked_reference(model, inputs, dropped).logits
    handle.remove()
    assert_kept_columns_match(pruned, reference, inputs, dropped)


def test_watch_spans_sees_every_prefill_under_generate_and_direct_calls() -> None:
    """generate encodes the images before the forward (mm_encoder_outputs, no pixel_values): the watch still fires."""
    model = BUILDERS["qwen2_5_vl"]()
    inputs = batch(THREE)
    seen = []
    unwatch = Qwen2VLAdapter(model).watch_spans(seen.append)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
        model(**inputs)
    unwatch()
    assert len(seen) == 2 and hooks_of(model) == 0
    for spans in seen:
        assert torch.equal(spans.is_image, inputs["input_ids"] == IMAGE)
        firsts = spans.token_of == 0
        assert spans.image_of[firsts].tolist() == [0, 1, 2, 3]  # images in reading order
        assert [int((spans.image_of == i).sum()) for i in range(4)] == tokens_of(inputs)


def test_beam_search_prefills_every_beam_like_its_prompt() -> None:
    """generate expands each prompt to its beams after encoding the images once: every beam's prefill is the
    prompt's own pruned prefill, and last_selection stays per image of the prompts."""
    model = BUILDERS["qwen2_5_vl"]()
    inputs = batch(THREE)
    vitrim.vlm.apply(model, "fastervlm", keep=3)
    with torch.no_grad():
        single = model(**inputs).logits[:, -1]  # (3, V)
    selection = [k.tolist() for k in vitrim.vlm.last_selection(model)]
    steps: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: steps.append(out[:, -1]))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=2, num_beams=2, do_sample=False)
    handle.remove()
    assert out.shape[0] == 3
    torch.testing.assert_close(steps[0], single.repeat_interleave(2, dim=0), rtol=0, atol=1e-12)
    assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == selection
