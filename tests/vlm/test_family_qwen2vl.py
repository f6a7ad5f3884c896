"""Qwen2-VL / Qwen2.5-VL before the LLM: exact against the unmodified model with the dropped keys masked out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch
from hf_cache import cache_kw, cache_of
from qwen_reference import masked_decode, masked_reference

from tiny_vlms.qwen import BUILDERS, IMAGE, batch, one
from vitrim.vlm.families.qwen2vl import Qwen2VLAdapter
from vitrim.vlm.keep import parse_keep
from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence
from vitrim.vlm.stages import pre_llm

THREE = [  # different prompt lengths, image sizes and image counts; the same keep (a fraction) for each
    ([[1, 5], [7, 8, 9]], [(4, 6)]),
    ([[1, 5, 6, 3, 4, 5], [7], [8, 9]], [(6, 4), (4, 4)]),
    ([[1], [7, 8, 9, 10]], [(4, 8)]),
]


class TopReceived(Method):
    """A test method: the ``keep`` tokens receiving the most attention (summed over heads), ties to the lower index."""

    name = "test_top_received"
    stage = "pre_llm"
    needs_cls_attention = True
    defaults: ClassVar[Mapping[str, Any]] = {}

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        assert evidence.cls_attention is not None
        out = []
        for scores in evidence.cls_attention.sum(1):  # (N,) per image
            kept = torch.sort(torch.argsort(-scores, stable=True)[:keep]).values
            out.append(ImageSelection(kept=kept, groups=tuple(kept[:, None].unbind(0))))
        return out


def install(model: torch.nn.Module, keep: float | int):
    return pre_llm.install(Qwen2VLAdapter(model), TopReceived(), parse_keep(keep))


def dropped_positions(inputs: dict, selection: list[ImageSelection], tokens: list[int]) -> torch.Tensor:
    """(B, L) bool: the image positions not kept, images in reading order, tokens in order of position."""
    dropped = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    image = 0
    for b, row in enumerate(inputs["input_ids"]):
        where = (row == IMAGE).nonzero().flatten().tolist()
        while where:
            mine, where = where[: tokens[image]], where[tokens[image] :]
            kept = set(selection[image].kept.tolist())
            for index, column in enumerate(mine):
                dropped[b, column] = index not in kept
            image += 1
    return dropped


def tokens_of(inputs: dict) -> list[int]:
    return (inputs["image_grid_thw"].prod(-1) // 4).tolist()


def assert_kept_columns_match(
    pruned: torch.Tensor, reference: torch.Tensor, inputs: dict, dropped: torch.Tensor, side: str = "left"
) -> None:
    """The shortened logits (B, L', V) against the reference's (B, L, V) at every valid column that stays.

    The shortened input holds, per sample, the columns that stay (text, padding, kept image tokens) in order,
    right-aligned in a left-padded batch, left-aligned in a right-padded one (vitrim.vlm.stages.sequence)."""
    stays = ~dropped  # (B, L)
    width = int(stays.sum(1).max())
    assert pruned.shape[1] == width
    for b in range(stays.shape[0]):
        columns = stays[b].nonzero().flatten()
        valid = inputs["attention_mask"][b, columns].bool()
        short = pruned[b, width - len(columns) :] if side == "left" else pruned[b, : len(columns)]
        torch.testing.assert_close(short[valid], reference[b, columns][valid], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "family",
    [pytest.param("qwen2_vl", marks=pytest.mark.full), "qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.full)],
)
def test_keep_all_is_the_unmodified_model_bit_for_bit(family: str) -> None:
    model = BUILDERS[family]()
    inputs = batch(THREE)
    steps: list[torch.Tensor] = []  # every generate step's LM-head output, float64
    handle = model.lm_head.register_forward_hook(lambda module, args, out: steps.append(out))
    with torch.no_grad():
        before = model(**inputs).logits
        generated_before = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        installation = install(model, 1.0)
        after = model(**inputs).logits
        generated_after = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        installation.remove()
    handle.remove()
    assert torch.equal(before, after) and torch.equal(generated_before, generated_after)
    assert all(torch.equal(a, b) for a, b in zip(steps[1:4], steps[5:8], strict=True))  # the generate steps
    assert [s.kept.tolist() for s in installation.selection()] == [list(range(n)) for n in tokens_of(inputs)]


WITH_TEXT_ONLY = [THREE[0], ([[1, 5, 6, 7, 8, 9, 10, 11, 12]], []), THREE[2]]  # the middle sample has no image


@pytest.mark.parametrize(
    ("family", "prompts", "side"),
    [
        ("qwen2_vl", THREE, "left"),
        ("qwen2_5_vl", THREE, "left"),
        ("qwen2_5_vl", WITH_TEXT_ONLY, "right"),
        ("qwen3_vl", THREE, "left"),
        pytest.param("qwen3_vl", WITH_TEXT_ONLY, "right", marks=pytest.mark.full),
    ],
)
def test_dropping_equals_the_full_model_with_those_keys_masked(family: str, prompts: list, side: str) -> None:
    model = BUILDERS[family]()
    inputs = batch(prompts, side=side)
    installation = install(model, 0.5)
    with torch.no_grad():
        pruned = model(**inputs)
    selection = installation.selection()
    installation.remove()
    dropped = dropped_positions(inputs, selection, tokens_of(inputs))
    assert dropped.sum() == sum(n - n // 2 for n in tokens_of(inputs))  # keep 0.5 of even counts
    with torch.no_grad():
        reference = masked_reference(model, inputs, dropped).logits
    assert_kept_columns_match(pruned.logits, reference, inputs, dropped, side)


@pytest.mark.full
def test_the_reference_is_the_unmodified_model_when_nothing_is_masked() -> None:
    model = BUILDERS["qwen2_5_vl"]()
    inputs = batch(THREE)
    nothing = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    with torch.no_grad():
        own = model(**inputs).logits
        reference = masked_reference(model, inputs, nothing).logits
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(reference[valid], own[valid], rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    ("family", "padded"),
    [
        ("qwen2_vl", False),
        pytest.param("qwen2_5_vl", False, marks=pytest.mark.full),
        ("qwen2_5_vl", True),
        pytest.param("qwen3_vl", True, marks=pytest.mark.full),
    ],
)
def test_a_decode_step_after_a_pruned_prefill_equals_the_masked_full_cache(family: str, padded: bool) -> None:
    """Unpadded, no mask: the model's own decode positions (tokens in the cache + rope_deltas) are right after the
    rope_deltas fix. Padded: the caller's mask (unpruned layout) is mapped onto the cache. (transformers 5.24's
    unmodified Qwen fails on a decode step given a mask and no position_ids; generate passes them.)"""
    model = BUILDERS[family]()
    inputs = batch(THREE) if padded else one()
    installation = install(model, 0.5)
    with torch.no_grad():
        prefill = model(**inputs, use_cache=True)
        next_tokens = prefill.logits[:, -1:].argmax(-1)  # (B, 1)
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(next_tokens)], dim=1)  # the caller's layout
        step_inputs = {"attention_mask": mask} if padded else {}
        step = model(input_ids=next_tokens, **cache_kw(cache_of(prefill)), use_cache=True, **step_inputs).logits
    selection = installation.selection()
    installation.remove()
    dropped = dropped_positions(inputs, selection, tokens_of(inputs))
    with torch.no_grad():
        expected = masked_decode(model, inputs, dropped, next_tokens)
    torch.testing.assert_close(step, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "family",
    [pytest.param("qwen2_vl", marks=pytest.mark.full), "qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.full)],
)
def test_generate_runs_unchanged_and_matches_the_reference_steps(family: str) -> None:
    model = BUILDERS[family]()
    inputs = batch(THREE)
    installation = install(model, 0.5)
    steps: list[torch.Tensor] = []  # the LM head's float64 output at each step (generate's own logits are float32)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: steps.append(out[:, -1]))
    with torch.no_grad():
        sequences = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    handle.remove()
    selection = installation.selection()
    installation.remove()
    dropped = dropped_positions(inputs, selection, tokens_of(inputs))
    new_tokens = sequences[:, inputs["input_ids"].shape[1] :]  # (B, 3)
    assert new_tokens.shape == (3, 3) and len(steps) == 3
    with torch.no_grad():
        first = masked_reference(model, inputs, dropped).logits[:, -1]
        second = masked_decode(model, inputs, dropped, new_tokens[:, :1])[:, -1]
    torch.testing.assert_close(steps[0], first, rtol=0, atol=1e-12)
    torch.testing.assert_close(steps[1], second, rtol=0, atol=1e-12)
    assert torch.equal(new_tokens[:, 0], first.argmax(-1)) and torch.equal(new_tokens[:, 1], second.argmax(-1))


@pytest.mark.parametrize(
    "family",
    [pytest.param("qwen2_vl", marks=pytest.mark.full), "qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.full)],
)
def test_each_sample_of_a_padded_batch_equals_that_sample_alone(family: str) -> None:
    model = BUILDERS[family]()
    inputs = batch(THREE)
    installation = install(model, 0.5)
    with torch.no_grad():
        together = model(**inputs).logits
        together_selection = installation.selection()
        alone, alone_selection = [], []
        patches = inputs["image_grid_thw"].prod(-1).tolist()
        pixel_rows = list(inputs["pixel_values"].split(patches))
        first_image = 0
        for b in range(3):
            valid = inputs["attention_mask"][b].bool()
            ids = inputs["input_ids"][b : b + 1, valid]
            count = int((ids == IMAGE).sum() > 0) and len(THREE[b][1])
            images = slice(first_image, first_image + count)
            first_image += count
            single = {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "mm_token_type_ids": (ids == IMAGE).int(),
                "pixel_values": torch.cat(pixel_rows[images]),
                "image_grid_thw": inputs["image_grid_thw"][images],
            }
            alone.append(model(**single).logits[0])
            alone_selection += installation.selection()
    installation.remove()
    assert [s.kept.tolist() for s in together_selection] == [s.kept.tolist() for s in alone_selection]
    for b, logits in enumerate(alone):
        torch.testing.assert_close(together[b, together.shape[1] - logits.shape[0] :], logits, rtol=0, atol=1e-12)


@pytest.mark.full
def test_remove_restores_the_model_exactly() -> None:
    model = BUILDERS["qwen2_5_vl"]()
    inputs = batch(THREE)
    modules = [model.model, model.model.visual, model.model.language_model, *model.model.visual.blocks.modules()]
    hooks_before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in modules]
    with torch.no_grad():
        before = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        rope_deltas = model.model.rope_deltas.clone()
        installation = install(model, 2)
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert not torch.equal(model.model.rope_deltas, rope_deltas)  # the pruned prefill corrected them
        installation.remove()
        after = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in modules] == hooks_before
    assert torch.equal(before, after)
    assert torch.equal(model.model.rope_deltas, rope_deltas)
