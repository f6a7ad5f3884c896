"""vitrim reducers inside PaliGemma's SigLIP tower (the only stage vitrim.vlm runs on PaliGemma): bit for bit the
unmodified model when nothing is removed; with ToMe (and EViT by received attention) the whole model equals the
unmodified one whose projector is fed the independent path's tokens put back on the patch grid by hand, alone, in a
padded batch of three and under generate(); the stages it does not run are refused at apply."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tower_reference import fed_the_grid, on_grid, received_ranking, vitrim_tome

import vitrim.vlm
from tiny_vlms.gemma3 import batch
from tiny_vlms.paligemma import IMAGE_TOKENS, pixels, prompt, tiny_paligemma

TOL = 1e-12  # float64
OPTIONS = {"tome": {"r": 2}, "evit": {"keep_rate": 0.5}}


@pytest.fixture(scope="module")
def paligemma() -> torch.nn.Module:
    model = tiny_paligemma()
    with torch.no_grad():  # from_transformers builds float32: weights that float32 holds exactly, so both are equal
        for param in model.model.vision_tower.parameters():
            param.copy_(param.float().double())
    return model


@pytest.fixture
def model(paligemma: torch.nn.Module):
    yield paligemma
    if hasattr(paligemma, "_vitrim_vlm"):
        vitrim.vlm.remove(paligemma)


def padded(side: str = "left") -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Three prompts of different lengths, padded: the ids, mask, token types (all prefix) and 1-indexed positions
    (PaliGemma numbers positions from 1, as its generate() does)."""
    prompts = [prompt(4, seed=0), prompt(9, seed=1), prompt(1, seed=2)]
    ids, mask = batch(prompts, side)
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return prompts, {**inputs, "position_ids": mask.cumsum(-1) * mask, "pixel_values": pixels(3, seed=4)}


def _untouched(model: torch.nn.Module) -> bool:
    layers = model.model.vision_tower.encoder.layers
    return (
        not hasattr(model, "_vitrim_vlm")
        and not model.model.multi_modal_projector._forward_pre_hooks
        and not any("forward" in layer.__dict__ for layer in layers)
    )


def grid_reference(model: torch.nn.Module, name: str, images: torch.Tensor) -> torch.Tensor:
    tower = model.model.vision_tower
    with torch.no_grad():
        if name == "tome":
            tokens, _, patch_to_token = vitrim_tome(tower, images, r=2)
        else:
            tokens, _, patch_to_token = received_ranking(tower, images, keep_rate=0.5, fuse=True)
        return on_grid(tower, tokens, patch_to_token)


@pytest.mark.parametrize(("name", "options"), [("tome", {"r": 0}), ("evit", {"keep_rate": 1.0})])
def test_a_reducer_that_removes_nothing_leaves_the_model_bit_for_bit(name, options, model) -> None:
    _, inputs = padded()
    with torch.no_grad():
        reference = model(**inputs).logits
        vitrim.vlm.apply(model, name, **options)
        logits = model(**inputs).logits
        vitrim.vlm.remove(model)
    assert torch.equal(logits, reference)
    assert _untouched(model)


@pytest.mark.parametrize("name", ["tome", pytest.param("evit", marks=pytest.mark.full)])
def test_the_model_equals_the_unmodified_one_fed_the_tokens_on_the_grid(name: str, model) -> None:
    prompts, inputs = padded()
    reference, unmodified = fed_the_grid(model, inputs, grid_reference(model, name, inputs["pixel_values"]))
    with torch.no_grad():
        vitrim.vlm.apply(model, name, **OPTIONS[name])
        logits = model(**inputs).logits
        kept = vitrim.vlm.last_selection(model)
        assert (logits - unmodified).abs().max() > 1e-3  # the tower's reduction reaches the logits
        torch.testing.assert_close(logits, reference, rtol=0, atol=TOL)
        for row, alone_ids in enumerate(prompts):  # each sample of the padded batch equals that sample alone
            alone = model(
                input_ids=alone_ids[None],
                pixel_values=inputs["pixel_values"][row : row + 1],
                token_type_ids=torch.zeros_like(alone_ids[None]),
            ).logits[0]
            assert torch.equal(vitrim.vlm.last_selection(model)[0], kept[row])
            assert (logits[row, -len(alone_ids) :] - alone).abs().max() <= TOL
    assert [len(k) for k in kept] == ([IMAGE_TOKENS - 3 * 2] * 3 if name == "tome" else [len(kept[0])] * 3)


def test_generate_decodes_as_the_unmodified_model_fed_the_tokens_on_the_grid(model) -> None:
    _, inputs = padded()
    del inputs["position_ids"]  # generate() numbers them itself
    grid = grid_reference(model, "tome", inputs["pixel_values"])
    run: dict[str, Any] = dict(
        inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    handle = model.model.multi_modal_projector.register_forward_pre_hook(lambda m, args: (grid,))
    try:
        reference = model.generate(**run)
    finally:
        handle.remove()
    vitrim.vlm.apply(model, "tome", r=2)
    generated = model.generate(**run)
    vitrim.vlm.remove(model)
    assert torch.equal(generated.sequences, reference.sequences)
    for step, expected in zip(generated.logits, reference.logits, strict=True):
        torch.testing.assert_close(step, expected, rtol=0, atol=TOL)
    assert _untouched(model)


@pytest.mark.parametrize(
    ("name", "options", "error", "message"),
    [
        ("fastervlm", {"keep": 4}, TypeError, r"'fastervlm' cuts at stage 'pre_llm'; on PaliGemmaForConditional"),
        ("fastv", {"keep": 4}, TypeError, r"'fastv' cuts at stage 'in_llm'; on PaliGemmaForConditionalGeneration"),
        ("tome", {"r": 2, "to_grid": False}, ValueError, r"to_grid=False is not possible on PaliGemmaForConditional"),
        ("tome", {"keep": 17}, ValueError, r"keep=17 is more than the image's 16 tokens"),
    ],
)
def test_what_cannot_apply_fails_at_apply_and_leaves_the_model(name, options, error, message, model) -> None:
    with pytest.raises(error, match=message):
        vitrim.vlm.apply(model, name, **options)
    assert _untouched(model)


def test_the_adapter_s_own_seams_refuse_the_other_stages_too(model) -> None:
    """apply refuses first; a stage module reaching the adapter directly is refused there as well."""
    from vitrim.vlm.families import find_family
    from vitrim.vlm.keep import KeepSpec
    from vitrim.vlm.method.base import method_class
    from vitrim.vlm.stages import pre_llm

    adapter = find_family(model)
    assert adapter.tokens_per_image() == model.config.text_config.num_image_tokens == IMAGE_TOKENS
    with pytest.raises(TypeError, match="does not cut before the LLM on PaliGemmaForConditionalGeneration"):
        pre_llm.install(adapter, method_class("random")(), KeepSpec(count=4))
    with pytest.raises(TypeError, match="does not cut inside the LLM on PaliGemmaForConditionalGeneration"):
        adapter.watch_spans(lambda spans: None)
    assert _untouched(model)
