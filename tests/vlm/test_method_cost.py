"""The contract of a method's cost (``Method.cost`` -> ``MethodCost``): what a bad count is told, and how the model's
parts follow what a method leaves (hand counts on a tiny tower)."""

from __future__ import annotations

import dataclasses

import pytest

from vitrim.vlm.flops import LLAVA_15_7B, VisionTower, prefill_cost
from vitrim.vlm.method import Method
from vitrim.vlm.method.cost import MethodCost


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"own": -1}, r"MethodCost.own=-1: expected an int >= 0"),
        ({"own": 1.5}, r"MethodCost.own=1.5: expected an int >= 0"),
        ({"own": 0, "llm_cuts": ((2, 8), (2, 4))}, r"llm_cuts=\(\(2, 8\), \(2, 4\)\): expected increasing"),
        ({"own": 0, "llm_cuts": ((0, -3),)}, r"expected pairs of ints >= 0"),
        ({"own": 0, "tower_blocks": ((5,),)}, r"tower_blocks=\(\(5,\),\): expected pairs of ints >= 0"),
    ],
)
def test_a_bad_count_is_one_line_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MethodCost(**fields)


def test_the_tokens_entering_the_llm_are_the_cut_at_layer_0() -> None:
    assert MethodCost.before_llm(64, own=7).tokens_entering(576) == 64
    assert MethodCost(own=0, llm_cuts=((2, 64),)).tokens_entering(576) == 576  # FastV: all enter, cut at layer 2


def test_the_base_class_counts_nothing_silently() -> None:
    with pytest.raises(NotImplementedError, match="vlm method 'x' does not count its cost: its file must define"):
        type("X", (Method,), {"name": "x"})().cost(LLAVA_15_7B, 64, text_tokens=94)


# a tower of 2 blocks of width 8 (MLP 16) on a 4×4 grid and [CLS]: feature layer -1, so the feature block is block 1
TINY = dataclasses.replace(
    LLAVA_15_7B, name="tiny", tower=VisionTower("tiny", 8, 2, 8, 2, 2, 16, cls_token=True), projector=((8, 8),)
)


def test_hiprune_s_cut_between_attention_and_mlp_by_hand() -> None:
    # 17 tokens through block 0 and block 1's attention; keep 4: 5 tokens through block 1's MLP
    attention = lambda n: 4 * n * 64 + 2 * n * n * 8  # noqa: E731 - qkv and out (4·n·d²), QKᵀ and A·V (2·n²·d)
    mlp = lambda n: 2 * n * 8 * 16  # noqa: E731
    embed = 16 * 3 * 2 * 2 * 8
    cost = prefill_cost(TINY, "hiprune", 4)
    assert cost.tower == embed + attention(17) + mlp(17) + attention(17) + mlp(5)
    assert cost.method_own == 2 * 17 * 17 * 8  # object layer 9 is past this tower: two blocks' global attention


def test_a_gathering_model_runs_its_projector_on_the_kept_tokens_whatever_the_stage() -> None:
    gathering = dataclasses.replace(LLAVA_15_7B, cut_before_projector=True)
    rows = 1024 * 4096 + 4096 * 4096
    for method in ("random", "tome", "hiprune", "flowcut"):
        assert prefill_cost(gathering, method, 64).projector == 64 * rows, method
    assert prefill_cost(gathering, "fastv", 64).projector == 576 * rows  # every token enters the LLM


def test_flowcut_needs_a_block_before_the_feature_block() -> None:
    with pytest.raises(ValueError, match="flowcut cuts after the blocks before the feature layer's; tiny has none"):
        prefill_cost(dataclasses.replace(TINY, tower=dataclasses.replace(TINY.tower, layers=1)), "flowcut", 4)
