"""PiToMe against an independent re-implementation of the authors' DeiT forward, on the same weights in float64."""

from __future__ import annotations

import pytest
import torch
from pitome_reference import pitome_forward
from reduce_models import assert_patches_left_per_block, images, tiny
from vit_reference import grid_sources

import vitrim
from vitrim.reduce.pitome import merge_count, pitome_margins, pitome_patches_left


@pytest.mark.parametrize(("ratio", "depth"), [(0.9, 4), (0.8, 4), (0.6, 5)])
def test_matches_the_authors_forward(ratio: float, depth: int) -> None:
    model = tiny(depth=depth).double()
    x = images(batch=3).double()
    sd = model.state_dict()
    with torch.no_grad():
        expected, source = pitome_forward(x, sd, heads=2, depth=depth, ratio=ratio)
        out = vitrim.reduce.apply(model, "pitome", ratio=ratio).forward_detailed(x)
    assert (out.logits - expected).abs().max() <= 1e-10  # float64
    assert out.tokens.shape[1] == source.shape[1]
    assert torch.equal(grid_sources(out.patch_to_token[-1], out.tokens.shape[1] - 1), source[:, 1:])
    sizes = source[:, 1:].sum(-1)
    assert out.token_sizes is not None and torch.equal(out.token_sizes[:, 1:], sizes)
    with torch.no_grad():  # batch 1 merges by one-hot products (fewer calls): the same numbers
        for i in range(3):
            one = model.forward_detailed(x[i : i + 1])
            assert (one.logits - expected[i : i + 1]).abs().max() <= 1e-10
            assert torch.equal(grid_sources(one.patch_to_token[-1], one.tokens.shape[1] - 1), source[i : i + 1, 1:])


def test_counts_margins_and_no_proportional_attention_by_default() -> None:
    assert merge_count(196, 0.9) == 19 and merge_count(16, 1.0) == 0 and merge_count(16, 0.5) == 8
    assert pitome_margins(4) == [0.75, 0.5625, 0.375, 0.1875]
    model = vitrim.reduce.apply(tiny(), "pitome", ratio=0.8, prop_attn=True)
    with torch.no_grad():
        with_bias = model(images())
        vitrim.reduce.remove(model)
        without = vitrim.reduce.apply(model, "pitome", ratio=0.8)(images())
    assert not torch.allclose(with_bias, without)
    with pytest.raises(ValueError, match=r"ratio must be a number in \[0.5, 1\].*0.4"):
        vitrim.reduce.apply(tiny(), "pitome", ratio=0.4)


@pytest.mark.parametrize("ratio", [0.8, (0.5, 0.93, 1.0, 0.77)])
def test_the_patches_left_are_the_count_function_s_on_any_image(ratio: float | tuple[float, ...]) -> None:
    # vitrim.vllm writes pitome_patches_left as an image's placeholders before its tower runs: every image, alone or
    # in a batch, must leave exactly that many after each block (16 patches; by hand for 0.8: 16 - 3, 13 - 2, ...)
    ratios = [ratio] * 4 if isinstance(ratio, float) else list(ratio)
    model = vitrim.reduce.apply(tiny(), "pitome", ratio=ratio)
    if ratio == 0.8:
        assert [pitome_patches_left(16, ratios[: i + 1]) for i in range(4)] == [13, 11, 9, 8]
    assert_patches_left_per_block(model, lambda block: pitome_patches_left(16, ratios[: block + 1]))
