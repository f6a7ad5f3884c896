"""vitrim reducers inside LLaVA's own CLIP tower: bit for bit the unmodified model when nothing is removed, and the
same tokens as vitrim's own ViT (from_transformers, an independent path: fused qkv, vitrim's Block and attention)
carrying the same reducer on the same weights. Every tower method is swept with its reducer's example options."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vitrim
import vitrim.vlm
from tiny_vlms.llava import batch, pixels, prompt, tiny_llava, transformers
from vitrim.reduce import get_reducer
from vitrim.vlm.method.base import method_class
from vitrim.vlm.stages.tower import TowerMethod, TowerReduction, build_reducers, find_tower

VISION_LAYERS = 5  # vision_feature_layer −2: blocks 0 … 3 reduce, as the reducers' 4-block example models do


def _reducer(name: str) -> str:
    return method_class(name).reducer  # type: ignore[attr-defined,no-any-return]


TOWER_METHODS = sorted(  # one per vitrim reducer (hiprune and flowcut, tower methods of their own, have own tests)
    name for name in vitrim.vlm.methods() if issubclass(method_class(name), TowerMethod) and _reducer(name)
)
DEFAULT_SUITE = ("tome",)  # the rest under `full` (EViT and top-k also run end to end in the keep= test)
SWEEP = [name if name in DEFAULT_SUITE else pytest.param(name, marks=pytest.mark.full) for name in TOWER_METHODS]


@pytest.fixture(scope="module")
def llava() -> torch.nn.Module:
    model = tiny_llava(vision_layers=VISION_LAYERS)
    with torch.no_grad():  # from_transformers builds float32: weights that float32 holds exactly, so both are equal
        for param in model.model.vision_tower.parameters():
            param.copy_(param.float().double())
    return model


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    ids, mask = batch([prompt(3, 4), prompt(5, 2, seed=1)], "left")
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels(2)}


def test_every_reducer_but_the_learned_and_look_ahead_ones_is_a_tower_method() -> None:
    assert {_reducer(n) for n in TOWER_METHODS} == set(vitrim.reduce.list_reducers()) - {"dynamicvit", "mctf"}
    assert "tower_random" in TOWER_METHODS  # "random" is the pre-LLM baseline


@pytest.mark.parametrize("name", SWEEP)
def test_a_reducer_that_removes_nothing_leaves_the_model_bit_for_bit(name: str, llava, inputs) -> None:
    options = dict(get_reducer(_reducer(name)).identity_options)
    if name == "tower_random" and not options:
        options = {"keep_rate": 1.0}
    with torch.no_grad():
        reference = llava(**inputs).logits
        for to_grid in (True, False):  # the tokens back on the grid, or only the tower's tokens into the LLM
            vitrim.vlm.apply(llava, name, to_grid=to_grid, **options)
            try:
                logits = llava(**inputs).logits
            finally:
                vitrim.vlm.remove(llava)
            assert torch.equal(logits, reference), to_grid


def _vitrim_feature_state(hf_tower: torch.nn.Module, reducer: str, options: dict[str, Any], images: torch.Tensor):
    """The independent path: vitrim's own ViT of the same weights, the same reducer, blocks 0 … 3."""
    model = vitrim.from_transformers(hf_tower).double().eval()
    vitrim.reduce.apply(model, reducer, **options)
    state = model.embed(images)
    for block in model.blocks[: VISION_LAYERS - 1]:
        state, _ = block(state)
    return state


@pytest.mark.parametrize("name", SWEEP)
def test_the_tower_gives_vitrim_s_own_tokens_with_the_same_reducer(name: str, llava, inputs) -> None:
    reducer = _reducer(name)
    options = dict(get_reducer(reducer).example_options)
    if name == "tower_random" and not options:
        options = {"keep_rate": 0.5}
    plan = find_tower(llava, -2)
    assert plan.feature_index == VISION_LAYERS - 2 and plan.patches == 16 and plan.num_prefix == 1
    layers = options.pop("layers", get_reducer(reducer).default_layers(plan.feature_index + 1))
    ours = build_reducers(
        reducer, plan.feature_index + 1, has_cls=True, patches=16, num_prefix=1, width=32,
        options={**options, "layers": layers},
    )  # fmt: skip
    reduction = TowerReduction(plan, ours)
    try:
        with torch.no_grad():
            llava.model.vision_tower(inputs["pixel_values"])
        state = reduction.feature_state()
    finally:
        reduction.remove()
    with torch.no_grad():
        tower, images = llava.model.vision_tower, inputs["pixel_values"]
        expected = _vitrim_feature_state(tower, reducer, {**options, "layers": layers}, images)
    assert state is not None and state.tokens.shape == expected.tokens.shape
    assert state.tokens.shape[1] < 17, "the example options must remove tokens"
    torch.testing.assert_close(state.tokens, expected.tokens, rtol=0, atol=1e-12)
    assert torch.equal(state.positions, expected.positions)
    assert len(state.patch_to_token) == len(expected.patch_to_token)
    for ours_map, theirs in zip(state.patch_to_token, expected.patch_to_token):
        assert torch.equal(ours_map, theirs)


def test_selection_and_groups_describe_the_tokens_entering_the_projector(llava, inputs) -> None:
    with torch.no_grad():
        vitrim.vlm.apply(llava, "tome", r=2, to_grid=True)
        try:
            llava(**inputs)
            kept = vitrim.vlm.last_selection(llava)
            groups = vitrim.vlm.last_selection(llava, groups=True)
        finally:
            vitrim.vlm.remove(llava)
    for image_kept, image_groups in zip(kept, groups):
        assert len(image_kept) == 16 - 2 * 4  # r = 2 in each of the 4 blocks up to the feature layer
        assert torch.equal(image_kept, image_kept.sort().values)
        assert all(int(k) in g.tolist() for k, g in zip(image_kept, image_groups))
        assert sorted(torch.cat(image_groups).tolist()) == list(range(16))  # ToMe merges, drops nothing


def test_keep_spreads_a_count_based_reducer_to_exactly_keep(llava, inputs) -> None:
    with torch.no_grad():
        for name, to_grid in (("tome", True), ("evit", True), ("topk", False)):
            vitrim.vlm.apply(llava, name, keep=6, to_grid=to_grid)
            try:
                logits = llava(**inputs).logits
                assert [len(k) for k in vitrim.vlm.last_selection(llava)] == [6, 6], name
            finally:
                vitrim.vlm.remove(llava)
            # to_grid=False: 10 of each image's 16 image positions left the LLM input
            assert logits.shape[1] == inputs["input_ids"].shape[1] - (0 if to_grid else 10), name


def test_tome_merges_earlier_where_an_even_spread_would_leave_more_than_keep(llava, inputs) -> None:
    # 16 patches, 4 blocks: an even spread 16 -> 13 -> 9 -> 6 -> 2 asks the last block to merge 4 of 6 (at most 3
    # can be: it would leave 3); 16 -> 13 -> 8 -> 4 -> 2 merges at most half in each
    vitrim.vlm.apply(llava, "tome", keep=2, to_grid=True)
    try:
        with torch.no_grad():
            llava(**inputs)
        assert [len(k) for k in vitrim.vlm.last_selection(llava)] == [2, 2]
    finally:
        vitrim.vlm.remove(llava)
    # with 2 blocks, 16 patches cannot become fewer than 16 / 2 / 2 = 4
    with pytest.raises(ValueError, match=r"keep=3: ToMe merges at most half .* leaves at least 4 of the 16 patches"):
        build_reducers("tome", 2, has_cls=True, patches=16, num_prefix=1, width=32, options={}, keep=3)
    assert len(build_reducers("tome", 2, has_cls=True, patches=16, num_prefix=1, width=32, options={}, keep=4)) == 2


def test_generate_runs_unchanged_with_a_cheaper_tower(llava, inputs) -> None:
    vitrim.vlm.apply(llava, "tome", r=2, to_grid=True)
    try:
        out = llava.generate(**inputs, max_new_tokens=3, do_sample=False)
    finally:
        vitrim.vlm.remove(llava)
    assert out.shape == (2, inputs["input_ids"].shape[1] + 3)
    layers = llava.model.vision_tower.encoder.layers
    assert not any("forward" in layer.__dict__ for layer in layers)  # remove() took the instance attributes off


@pytest.mark.parametrize(
    ("name", "options", "error", "message"),
    [
        ("tome", {"r": 2, "ratio": 0.5}, ValueError, "unknown option 'ratio' for vlm method 'tome'"),
        ("pitome", {"keep": 6, "to_grid": True}, ValueError, "keep= needs a count-based reducer"),
        ("tome", {"keep": 6, "layers": (0,), "to_grid": True}, ValueError, "pass keep= or layers=, not both"),
        ("tome", {"keep": 17, "to_grid": True}, ValueError, "keep=17 is more than the image's 16 tokens"),
    ],
)
def test_bad_options_fail_at_apply_and_leave_the_model(name, options, error, message, llava) -> None:
    with pytest.raises(error, match=message):
        vitrim.vlm.apply(llava, name, **options)
    assert not any("forward" in layer.__dict__ for layer in llava.model.vision_tower.encoder.layers)
    assert not hasattr(llava, "_vitrim_vlm")


def test_fewer_tokens_enter_the_llm_as_the_masked_full_model_with_vitrim_s_tokens(llava, inputs) -> None:
    """LLaVA's default: only the tower's tokens enter the LLM, at their positions' slots with the original position
    ids. Reference: the unmodified model fed vitrim's own tower tokens in those slots, every other image slot's key
    masked out (the same as dropping it, positions unchanged)."""
    options = {"r": 2, "layers": (0, 1, 2, 3)}
    with torch.no_grad():
        expected = _vitrim_feature_state(llava.model.vision_tower, "tome", options, inputs["pixel_values"])
        slots = torch.zeros(2, 16, 32, dtype=torch.float64)
        for image in range(2):
            slots[image, expected.positions[image]] = expected.tokens[image, 1:]
        handle = llava.model.multi_modal_projector.register_forward_pre_hook(lambda module, args: (slots,))
        mask = inputs["attention_mask"].clone()
        for row in range(2):
            image_columns = (inputs["input_ids"][row] == 3).nonzero().flatten()
            dropped = torch.ones(16, dtype=torch.bool)
            dropped[expected.positions[row]] = False
            mask[row, image_columns[dropped]] = 0
        try:
            reference = llava(**{**inputs, "attention_mask": mask}).logits[:, -1]
        finally:
            handle.remove()
        vitrim.vlm.apply(llava, "tome", r=2)
        try:
            logits = llava(**inputs).logits[:, -1]
            kept = vitrim.vlm.last_selection(llava)
        finally:
            vitrim.vlm.remove(llava)
    assert [k.tolist() for k in kept] == [p.sort().values.tolist() for p in expected.positions]
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-10)


def test_a_siglip_tower_gives_vitrim_s_own_tokens_with_tome() -> None:
    """Gemma 3's and PaliGemma's tower: SigLIP, no [CLS]; the same seam on its encoder layers."""
    from vitrim.vlm.stages.tower import TowerPlan

    config = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                                             num_attention_heads=4, image_size=16, patch_size=4)  # fmt: skip
    torch.manual_seed(0)
    siglip = transformers.SiglipVisionModel(config).double().eval()
    with torch.no_grad():
        for param in siglip.parameters():
            param.copy_((param + torch.randn_like(param) * 0.2).float().double())
    images = pixels(2)
    plan = TowerPlan(siglip.encoder.layers, num_prefix=0, patches=16, feature_index=2)
    with torch.no_grad():
        reference = siglip(images).last_hidden_state
        for r, expect_equal in ((0, True), (2, False)):
            reduction = TowerReduction(plan, build_reducers("tome", 3, has_cls=False, patches=16, num_prefix=0,
                                                            width=32, options={"r": r}))  # fmt: skip
            try:
                out = siglip(images).last_hidden_state
                state = reduction.feature_state()
            finally:
                reduction.remove()
            assert torch.equal(out, reference) == expect_equal
        model = vitrim.from_transformers(siglip).double().eval()
        vitrim.reduce.apply(model, "tome", r=2)
        expected = model.embed(images)
        for block in model.blocks:
            expected, _ = block(expected)
    assert state is not None and state.tokens.shape == (2, 10, 32)
    torch.testing.assert_close(state.tokens, expected.tokens, rtol=0, atol=1e-12)
    assert torch.equal(state.positions, expected.positions)


@pytest.mark.parametrize(
    ("builder", "name", "options"),
    [("qwen2_vl", "tome", {"r": 2}), ("qwen3_vl", "topk", {"keep": 8}), ("qwen3_vl", "flowcut", {"keep": 8})],
)
def test_qwen_s_tower_is_refused_at_apply_with_the_reason(builder: str, name: str, options: dict) -> None:
    """Qwen packs its images into one sequence and merges 2×2 patch groups (Qwen3-VL also at its DeepStack taps):
    one line says so, and where the methods that do run on it are."""
    from tiny_vlms import qwen as qwen_tiny

    model = getattr(qwen_tiny, builder)()
    with pytest.raises(
        TypeError,
        match=r"runs on LLaVA-1\.5 .*ConditionalGeneration is not handled there: its tower "
        r"packs every image .*DeepStack mergers .*use a pre-LLM or in-LLM method",
    ):
        vitrim.vlm.apply(model, name, **options)
    assert not hasattr(model, "_vitrim_vlm")
