"""HiPrune in SigLIP towers without [CLS] (PaliGemma, Gemma 3): its global attention is every query's, which needs no
[CLS] (the authors' Qwen2.5-VL code reads it the same way), so it runs there; FlowCut, whose signal is [CLS]'s row
and value, is refused. Against the authors' steps written in the test (pre_llm_reference.hiprune_reference with no
prefix) on transformers' own layers: the kept patches, and the logits of the unmodified model whose projector is
fed the tower's own output with the dropped patches zero (the tower stage's grid on these families), float64, 1e-12;
in a padded batch of three each sample equals itself alone."""

from __future__ import annotations

import pytest
import torch
from pre_llm_reference import hiprune_reference
from tower_reference import fed_the_grid, tower_layers

import vitrim.vlm
from tiny_vlms import gemma3 as tiny_gemma3
from tiny_vlms import paligemma as tiny_paligemma

TOL = 1e-12


@pytest.fixture(scope="module")
def paligemma() -> torch.nn.Module:
    return tiny_paligemma.tiny_paligemma()


@pytest.fixture(scope="module")
def gemma() -> torch.nn.Module:
    return tiny_gemma3.tiny_gemma3()


def paligemma_inputs(side: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    prompts = [tiny_paligemma.prompt(4, seed=0), tiny_paligemma.prompt(9, seed=1), tiny_paligemma.prompt(1, seed=2)]
    ids, mask = tiny_gemma3.batch(prompts, side)
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return prompts, {**inputs, "position_ids": mask.cumsum(-1) * mask, "pixel_values": tiny_paligemma.pixels(3, 4)}


def gemma_inputs() -> dict[str, torch.Tensor]:
    ids, mask = tiny_gemma3.batch([tiny_gemma3.prompt(3, 4, seed=0), tiny_gemma3.prompt(6, 1, seed=1)], "left")
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": tiny_gemma3.pixels(2),
            "token_type_ids": tiny_gemma3.token_types(ids)}  # fmt: skip


def authors_grid(model, images: torch.Tensor, keep: int, alpha: float, object_layer: int):
    """The authors' kept patches (global attention of the object and the last layer, no prefix) and the grid the
    projector then reads: the unmodified tower's output (post-LayerNorm) on the kept patches, zero elsewhere."""
    tower = model.model.vision_tower
    trace = tower_layers(tower, images)
    side = int(trace[0]["output"].shape[1] ** 0.5)
    kept = hiprune_reference(trace[object_layer - 1]["weights"], trace[-1]["weights"], keep, alpha, side, prefix=0)
    output = tower.post_layernorm(trace[-1]["output"])
    grid = torch.zeros_like(output)
    for image, patches in enumerate(kept):
        grid[image, patches] = output[image, patches]
    return kept, grid


@pytest.mark.parametrize(
    ("keep", "alpha", "object_layer"), [(10, 0.5, 1), pytest.param(10, 1.0, 2, marks=pytest.mark.full), (12, 0.5, 3)]
)
def test_paligemma_keeps_the_authors_patches_and_feeds_them_on_the_grid(paligemma, keep, alpha, object_layer) -> None:
    _, inputs = paligemma_inputs("left")
    with torch.no_grad():
        kept_expected, grid = authors_grid(paligemma, inputs["pixel_values"], keep, alpha, object_layer)
        reference, unmodified = fed_the_grid(paligemma, inputs, grid)
        vitrim.vlm.apply(paligemma, "hiprune", keep=keep, alpha=alpha, object_layer=object_layer)
        try:
            logits = paligemma(**inputs).logits
            kept = [k.tolist() for k in vitrim.vlm.last_selection(paligemma)]
        finally:
            vitrim.vlm.remove(paligemma)
    assert kept == kept_expected
    assert (logits - unmodified).abs().max() > 1e-3  # the dropped patches reach the logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=TOL)


def test_paligemma_in_a_padded_batch_each_sample_equals_itself_alone(paligemma) -> None:
    prompts, inputs = paligemma_inputs("right")
    options = {"keep": 10, "alpha": 0.5, "object_layer": 2}
    with torch.no_grad():
        vitrim.vlm.apply(paligemma, "hiprune", **options)
        try:
            logits = paligemma(**inputs).logits
            kept = vitrim.vlm.last_selection(paligemma)
            for row, ids in enumerate(prompts):
                alone = paligemma(input_ids=ids[None], pixel_values=inputs["pixel_values"][row : row + 1],
                                  token_type_ids=torch.zeros_like(ids[None])).logits[0]  # fmt: skip
                assert torch.equal(vitrim.vlm.last_selection(paligemma)[0], kept[row])
                torch.testing.assert_close(logits[row, : len(ids)], alone, rtol=0, atol=TOL)
        finally:
            vitrim.vlm.remove(paligemma)


def test_gemma3_keeps_the_authors_patches_of_its_64_patch_grid_and_pools_them(gemma) -> None:
    inputs = gemma_inputs()
    with torch.no_grad():
        kept_expected, grid = authors_grid(gemma, inputs["pixel_values"], 20, 0.5, 1)  # 2 anchors on the 8×8 grid
        reference, _ = fed_the_grid(gemma, inputs, grid)
        vitrim.vlm.apply(gemma, "hiprune", keep=20, alpha=0.5, object_layer=1)
        try:
            logits = gemma(**inputs).logits
            kept = [k.tolist() for k in vitrim.vlm.last_selection(gemma)]
        finally:
            vitrim.vlm.remove(gemma)
    assert kept == kept_expected
    torch.testing.assert_close(logits, reference, rtol=0, atol=TOL)


@pytest.mark.parametrize("family", ["paligemma", "gemma"])
def test_flowcut_is_refused_on_a_tower_without_cls(family, request) -> None:
    model = request.getfixturevalue(family)
    with pytest.raises(ValueError, match=r"flowcut scores by the \[CLS\] token's attention row and value; this tower"):
        vitrim.vlm.apply(model, "flowcut", keep=8)
    assert not hasattr(model, "_vitrim_vlm")
    assert not any("forward" in layer.__dict__ for layer in model.model.vision_tower.encoder.layers)


def test_paligemma_generate_decodes_as_the_unmodified_model_fed_the_authors_grid(paligemma) -> None:
    _, inputs = paligemma_inputs("left")
    del inputs["position_ids"]  # generate() numbers them itself
    with torch.no_grad():
        _, grid = authors_grid(paligemma, inputs["pixel_values"], 10, 0.5, 2)
    run = dict(inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    handle = paligemma.model.multi_modal_projector.register_forward_pre_hook(lambda m, args: (grid,))
    try:
        reference = paligemma.generate(**run)
    finally:
        handle.remove()
    vitrim.vlm.apply(paligemma, "hiprune", keep=10, alpha=0.5, object_layer=2)
    try:
        generated = paligemma.generate(**run)
    finally:
        vitrim.vlm.remove(paligemma)
    assert torch.equal(generated.sequences, reference.sequences)
    for step, expected in zip(generated.logits, reference.logits, strict=True):
        torch.testing.assert_close(step, expected, rtol=0, atol=TOL)
