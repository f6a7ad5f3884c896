"""vitrim.vlm's pre-LLM methods on Qwen2-VL / Qwen2.5-VL: the [CLS]-based ones rank by the attention each merged
token receives at the tower's last block (a hand computation here), and every dropping method is exact against the
full model with the dropped keys masked out; VisionZip's merged tokens reach the LLM through generate."""

from __future__ import annotations

import pytest
import torch
from qwen_reference import masked_reference, received_by_hand
from test_family_qwen2vl import THREE, assert_kept_columns_match, dropped_positions, tokens_of
from test_family_qwen2vl_vision import tower_run, tower_to_raster

import vitrim.vlm
from tiny_vlms.qwen import BUILDERS, MERGE, batch


def hand_scores(model: torch.nn.Module, inputs: dict, grids: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Per image, (N,): the attention each merged token receives at the last block, averaged over heads."""
    visual = model.model.visual
    seen, _, _ = tower_run(model, inputs, len(visual.blocks) - 1)
    window = 2 if hasattr(visual, "fullatt_block_indexes") else None
    theta = visual.config.rope_parameters["rope_theta"]
    scores = []
    for (h, w), block_input in zip(grids, tower_to_raster(seen["block_input"], grids, window), strict=True):
        with torch.no_grad():
            received, _ = received_by_hand(visual.blocks[-1], block_input, h, w, MERGE, theta, None)
        scores.append(received.mean(0))
    return scores


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_fastervlm_keeps_the_tokens_receiving_the_most_attention(family: str) -> None:
    model = BUILDERS[family]()
    inputs = batch(THREE)
    grids = [grid for _, image_grids in THREE for grid in image_grids]
    expected = [torch.sort(torch.argsort(-s, stable=True)[:3]).values for s in hand_scores(model, inputs, grids)]
    vitrim.vlm.apply(model, "fastervlm", keep=3)
    with torch.no_grad():
        model(**inputs)
    kept = vitrim.vlm.last_selection(model)
    assert [k.tolist() for k in kept] == [e.tolist() for e in expected]


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("fastervlm", {}),
        ("vispruner", {}),
        ("divprune", {}),
        pytest.param("random", {}, marks=pytest.mark.full),
        pytest.param("scope", {}, marks=pytest.mark.full),
        pytest.param("cdpruner", {"theta": 0}, marks=pytest.mark.full),
    ],
)
def test_dropping_methods_are_exact_against_the_masked_full_model(method: str, options: dict) -> None:
    model = BUILDERS["qwen2_5_vl"]()
    inputs = batch(THREE)
    vitrim.vlm.apply(model, method, keep=3, **options)
    with torch.no_grad():
        pruned = model(**inputs).logits
    groups = vitrim.vlm.last_selection(model, groups=True)
    assert all(len(g) == 1 for image in groups for g in image)  # no merging
    selection = [type("S", (), {"kept": k})() for k in vitrim.vlm.last_selection(model)]
    vitrim.vlm.remove(model)
    dropped = dropped_positions(inputs, selection, tokens_of(inputs))
    assert int(dropped.sum()) == sum(n - 3 for n in tokens_of(inputs))
    with torch.no_grad():
        reference = masked_reference(model, inputs, dropped).logits
    assert_kept_columns_match(pruned, reference, inputs, dropped)


def test_visionzip_dominant_by_received_attention_and_its_merged_tokens_through_generate() -> None:
    model = BUILDERS["qwen2_vl"]()
    inputs = batch(THREE)
    grids = [grid for _, image_grids in THREE for grid in image_grids]
    scores = hand_scores(model, inputs, grids)
    vitrim.vlm.apply(model, "visionzip", keep=4, contextual=1)  # 3 dominant + 1 contextual per image
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (3, inputs["input_ids"].shape[1] + 3)
    for image, (groups, n, s) in enumerate(
        zip(vitrim.vlm.last_selection(model, groups=True), tokens_of(inputs), scores)
    ):
        assert len(groups) == 4
        assert sorted(torch.cat(groups).tolist()) == list(range(n)), image  # every token stands somewhere, once
        singles = {int(g) for g in groups if len(g) == 1}
        dominant = set(torch.argsort(-s, stable=True)[:3].tolist())
        assert dominant <= singles


@pytest.mark.full
def test_a_bfloat16_model_generates_after_apply() -> None:
    model = BUILDERS["qwen2_5_vl"]().to(torch.bfloat16)
    inputs = batch(THREE)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    vitrim.vlm.apply(model, "visionzip", keep=4, contextual=1)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (3, inputs["input_ids"].shape[1] + 3)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == [4, 4, 4, 4]


@pytest.mark.parametrize(
    ("family", "method", "options"),
    [
        ("qwen2_5_vl", "fastv", {"layer": 1, "keep": 0.5}),
        pytest.param("qwen2_vl", "dart", {"layer": 1, "keep": 0.5}, marks=pytest.mark.full),
        pytest.param("qwen3_vl", "pdrop", {"layers": (1,), "ratios": (0.5,)}, marks=pytest.mark.full),
    ],
)
def test_in_llm_methods_find_qwens_image_tokens_under_generate(family: str, method: str, options: dict) -> None:
    """The in-LLM stage reads the family's spans (images arrive as mm_encoder_outputs under generate)."""
    model = BUILDERS[family]()
    inputs = batch(THREE)
    vitrim.vlm.apply(model, method, **options)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (3, inputs["input_ids"].shape[1] + 3)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == [n // 2 for n in tokens_of(inputs)]
