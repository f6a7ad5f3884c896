"""vitrim reducers inside Gemma 3's SigLIP tower: bit for bit the unmodified model when nothing is removed; with
ToMe, the tower's tokens equal vitrim's own ViT on the same weights (from_transformers); with EViT and top-k, which
rank by the attention each token receives (SigLIP has no [CLS]), they equal a re-implementation written here on
transformers' own layers; the whole model equals the unmodified one whose projector is fed those tokens put back
on the patch grid by hand, in padded batches and under generate()."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tower_reference import fed_the_grid, on_grid, received_ranking, vitrim_tome

import vitrim
import vitrim.vlm
from tiny_vlms.gemma3 import batch, pixels, prompt, tiny_gemma3, token_types
from vitrim.reduce import get_reducer
from vitrim.vlm.method.base import method_class
from vitrim.vlm.stages.tower import TowerMethod

PATCHES = 64  # the tiny tower's 8×8 grid, pooled 2×2 to 16 image tokens
TOL = 1e-12  # float64
# the tower methods made of one vitrim reducer (their example and identity options come from it); HiPrune and FlowCut
# build their own reducers and are tested on SigLIP in test_vlm_tower_hiprune_siglip.py
TOWER_METHODS = sorted(
    name
    for name in vitrim.vlm.methods()
    if issubclass(method_class(name), TowerMethod) and getattr(method_class(name), "reducer", "")
)
DEFAULT_SUITE = ("tome", "evit")
SWEEP = [
    name if name in DEFAULT_SUITE else pytest.param(name, marks=pytest.mark.full)
    for name in TOWER_METHODS
    if name != "diffrate"  # refused on a tower without [CLS]: test_diffrate_is_refused_on_siglip
]


@pytest.fixture(scope="module")
def gemma() -> torch.nn.Module:
    model = tiny_gemma3()
    with torch.no_grad():  # from_transformers builds float32: weights that float32 holds exactly, so both are equal
        for param in model.model.vision_tower.parameters():
            param.copy_(param.float().double())
    return model


@pytest.fixture
def model(gemma: torch.nn.Module):
    yield gemma
    if hasattr(gemma, "_vitrim_vlm"):
        vitrim.vlm.remove(gemma)


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    ids, mask = batch([prompt(3, 4, seed=0), prompt(6, 1, seed=1)], "left")
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels(2), "token_type_ids": token_types(ids)}


def _untouched(model: torch.nn.Module) -> bool:
    layers = model.model.vision_tower.encoder.layers
    projector = model.model.multi_modal_projector
    return (
        not hasattr(model, "_vitrim_vlm")
        and not projector._forward_pre_hooks
        and not any("forward" in layer.__dict__ or layer.self_attn.q_proj._forward_hooks for layer in layers)
    )


def independent(tower: torch.nn.Module, name: str, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        if name == "tome":
            return vitrim_tome(tower, images, r=8)
        return received_ranking(tower, images, keep_rate=0.5, fuse=name == "evit")


OPTIONS = {"tome": {"r": 8}, "evit": {"keep_rate": 0.5}, "topk": {"keep_rate": 0.5}}


@pytest.mark.parametrize("name", SWEEP)
def test_a_reducer_that_removes_nothing_leaves_the_model_bit_for_bit(name: str, model, inputs) -> None:
    options = {k: v for k, v in get_reducer(method_class(name).reducer).identity_options.items() if k != "layers"}
    if name == "tower_random" and not options:
        options = {"keep_rate": 1.0}
    with torch.no_grad():
        reference = model(**inputs).logits
        vitrim.vlm.apply(model, name, **options)
        logits = model(**inputs).logits
        assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == [list(range(PATCHES))] * 2
        vitrim.vlm.remove(model)
    assert torch.equal(logits, reference)
    assert _untouched(model)


@pytest.mark.parametrize("name", ["tome", "evit", pytest.param("topk", marks=pytest.mark.full)])
def test_the_tower_s_tokens_equal_the_independent_path(name: str, model, inputs) -> None:
    tower, images = model.model.vision_tower, inputs["pixel_values"]
    tokens, positions, patch_to_token = independent(tower, name, images)
    captured: list[torch.Tensor] = []
    handle = model.model.multi_modal_projector.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    vitrim.vlm.apply(model, name, **OPTIONS[name])  # its hook, registered after ours, puts them on the grid
    try:
        with torch.no_grad():
            model.get_image_features(images)
        kept, groups = vitrim.vlm.last_selection(model), vitrim.vlm.last_selection(model, groups=True)
    finally:
        handle.remove()
    assert tokens.shape[1] < PATCHES, "the options must remove tokens"
    torch.testing.assert_close(captured[0], tower.post_layernorm(tokens), rtol=0, atol=TOL)
    for image in range(2):  # the selection: the tokens' patches, sorted; each token's group: the patches it stands for
        order = positions[image].argsort()
        assert torch.equal(kept[image], positions[image][order])
        expected_groups = [(patch_to_token[image] == int(j)).nonzero().flatten().tolist() for j in order]
        assert [g.tolist() for g in groups[image]] == expected_groups


@pytest.mark.parametrize("name", ["tome", pytest.param("evit", marks=pytest.mark.full)])
def test_the_model_equals_the_unmodified_one_fed_the_tokens_on_the_grid(name: str, model, inputs) -> None:
    tower = model.model.vision_tower
    tokens, _, patch_to_token = independent(tower, name, inputs["pixel_values"])
    reference, unmodified = fed_the_grid(model, inputs, on_grid(tower, tokens, patch_to_token))
    with torch.no_grad():
        vitrim.vlm.apply(model, name, **OPTIONS[name])
        logits = model(**inputs).logits
        vitrim.vlm.remove(model)
        restored = model(**inputs).logits
    assert logits.shape == unmodified.shape  # every image token still enters the LLM
    assert (logits - unmodified).abs().max() > 1e-3  # the tower's reduction reaches the logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=TOL)
    assert torch.equal(restored, unmodified) and _untouched(model)  # remove gives the model back exactly


@pytest.mark.parametrize("name", ["tome", pytest.param("evit", marks=pytest.mark.full)])
def test_each_sample_of_a_padded_batch_of_three_equals_that_sample_alone(name: str, model) -> None:
    prompts = [prompt(3, 4, seed=0), prompt(7, 1, seed=1), prompt(1, 9, seed=2)]
    images = pixels(3, seed=5)
    ids, mask = batch(prompts, "left")
    vitrim.vlm.apply(model, name, **OPTIONS[name])
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0) * mask  # as generate() numbers a left-padded row
        together = model(
            input_ids=ids,
            pixel_values=images,
            token_type_ids=token_types(ids),
            attention_mask=mask,
            position_ids=positions,
        )
        kept_together = vitrim.vlm.last_selection(model)
        for row, alone_ids in enumerate(prompts):
            alone = model(
                input_ids=alone_ids[None],
                pixel_values=images[row : row + 1],
                token_type_ids=token_types(alone_ids[None]),
            ).logits[0]
            assert torch.equal(vitrim.vlm.last_selection(model)[0], kept_together[row])
            assert (together.logits[row, -len(alone_ids) :] - alone).abs().max() <= TOL


def test_generate_decodes_as_the_unmodified_model_fed_the_tokens_on_the_grid(model, inputs) -> None:
    """generate() encodes the images before its first forward (mm_encoder_outputs): the tower still reduces."""
    tower = model.model.vision_tower
    tokens, _, patch_to_token = independent(tower, "tome", inputs["pixel_values"])
    grid = on_grid(tower, tokens, patch_to_token)
    run: dict[str, Any] = dict(
        inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    handle = model.model.multi_modal_projector.register_forward_pre_hook(lambda m, args: (grid,))
    try:
        reference = model.generate(**run)
    finally:
        handle.remove()
    vitrim.vlm.apply(model, "tome", r=8)
    generated = model.generate(**run)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == [PATCHES - 2 * 8] * 2
    vitrim.vlm.remove(model)
    assert torch.equal(generated.sequences, reference.sequences)
    for step, expected in zip(
        generated.logits, reference.logits, strict=True
    ):  # the prefill's, then each decode step's
        torch.testing.assert_close(step, expected, rtol=0, atol=TOL)
    assert _untouched(model)


def test_keep_counts_the_tower_s_patches_not_the_pooled_image_tokens(model, inputs) -> None:
    """keep=40 is more than Gemma 3's 16 pooled tokens but fewer than its 64 patches: 40 reach the feature layer."""
    for name in ("tome", "evit", "topk"):
        vitrim.vlm.apply(model, name, keep=40)
        with torch.no_grad():
            model(**inputs)
        assert [len(k) for k in vitrim.vlm.last_selection(model)] == [40, 40], name
        vitrim.vlm.remove(model)


@pytest.mark.parametrize(
    ("name", "options", "error", "message"),
    [
        ("tome", {"r": 2, "to_grid": False}, ValueError, r"to_grid=False is not possible on Gemma3ForConditional"),
        ("tome", {"r": 2, "to_grid": "yes"}, TypeError, r"to_grid='yes' must be True, False or None"),
        ("tome", {"keep": 65}, ValueError, r"keep=65 is more than the image's 64 tokens"),
        ("diffrate", {"prune_kept": 40, "merge_kept": 30}, ValueError, r"'diffrate' ranks .* this tower \(SigLIP\)"),
        ("tome", {"r": 2, "layers": (2,)}, ValueError, r"layers must be block indices in \[0, 2\), got \(2,\)"),
    ],
)
def test_options_that_cannot_apply_fail_at_apply_and_leave_the_model(name, options, error, message, model) -> None:
    with pytest.raises(error, match=message):
        vitrim.vlm.apply(model, name, **options)
    assert _untouched(model)


def test_keep_on_a_family_the_tower_does_not_handle_names_the_method_and_the_class() -> None:
    from tiny_vlms.qwen import qwen2_vl

    model = qwen2_vl()
    with pytest.raises(TypeError, match=r"tower method 'evit' runs on .*; Qwen2VLForConditionalGeneration is not"):
        vitrim.vlm.apply(model, "evit", keep=4)
    assert not hasattr(model, "_vitrim_vlm")


@pytest.mark.full
@pytest.mark.parametrize("name", [name for name in TOWER_METHODS if name != "diffrate"])
def test_every_tower_method_reduces_and_each_sample_of_a_padded_batch_equals_itself_alone(name: str, model) -> None:
    options = {k: v for k, v in get_reducer(method_class(name).reducer).example_options.items() if k != "layers"}
    options = options or {"keep_rate": 0.5}  # the random baseline's example is its defaults
    prompts = [prompt(3, 4, seed=0), prompt(7, 1, seed=1), prompt(1, 9, seed=2)]
    images = pixels(3, seed=5)
    ids, mask = batch(prompts, "right")
    vitrim.vlm.apply(model, name, **options)
    with torch.no_grad():
        together = model(input_ids=ids, pixel_values=images, token_type_ids=token_types(ids), attention_mask=mask)
        kept_together = vitrim.vlm.last_selection(model)
        assert all(len(kept) < PATCHES for kept in kept_together), "the example options must remove tokens"
        for row, alone_ids in enumerate(prompts):
            alone = model(
                input_ids=alone_ids[None],
                pixel_values=images[row : row + 1],
                token_type_ids=token_types(alone_ids[None]),
            ).logits[0]
            assert torch.equal(vitrim.vlm.last_selection(model)[0], kept_together[row])
            assert (together.logits[row, : len(alone_ids)] - alone).abs().max() <= TOL
