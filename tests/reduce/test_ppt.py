"""PPT against an independent re-implementation of the authors' DeiT forward, on the same weights in float64."""

from __future__ import annotations

import pytest
import torch
from ppt_reference import ppt_forward
from reduce_models import assert_patches_left_per_block, images, tiny
from vit_reference import grid_sources

import vitrim
from vitrim.reduce.ppt import ppt_patches_left


@pytest.mark.parametrize(
    ("r", "layers", "threshold", "expect"),
    [
        (4, (1, 2), 0.0, "prune"),  # threshold 0: every image prunes
        (3, (0, 2, 3), 1.0, "pool"),  # threshold 1: every image pools
        (4, (1, 2, 3), "median", "mixed"),  # the median variance of block 1: some images pool, some prune
    ],
)
def test_matches_the_authors_forward(r: int, layers: tuple[int, ...], threshold: object, expect: str) -> None:
    model = tiny().double()
    x = images(batch=6).double()
    sd = model.state_dict()
    with torch.no_grad():
        if threshold == "median":
            threshold = _median_variance(x, sd, layers[0])
        expected, source, decisions = ppt_forward(x, sd, 2, 4, r, list(layers), float(threshold))
        out = vitrim.reduce.apply(model, "ppt", r=r, layers=layers, threshold=threshold).forward_detailed(x)
    first = decisions[0]
    assert {"prune": not first.any(), "pool": first.all(), "mixed": 0 < first.sum() < 6}[expect]
    assert (out.logits - expected).abs().max() <= 1e-10  # float64
    assert torch.equal(grid_sources(out.patch_to_token[-1], out.tokens.shape[1] - 1), source[:, 1:])
    with torch.no_grad():  # batch 1 merges by one-hot products (fewer calls): the same numbers
        for i in range(6):
            one = model.forward_detailed(x[i : i + 1])
            assert (one.logits - expected[i : i + 1]).abs().max() <= 1e-10
            assert torch.equal(grid_sources(one.patch_to_token[-1], one.tokens.shape[1] - 1), source[i : i + 1, 1:])


def _median_variance(x: torch.Tensor, sd: dict[str, torch.Tensor], layer: int) -> float:
    import vit_reference

    variances: list[torch.Tensor] = []

    def hook(io: vit_reference.BlockIO) -> vit_reference.BlockIO:
        if io.i == layer:
            B, N, C = io.x.shape
            v_norm = io.v.transpose(1, 2).reshape(B, N, C).norm(dim=-1)
            sig = (io.attn[:, :, 0].sum(1) * v_norm)[:, 1:]
            variances.append((sig / sig.sum(1, keepdim=True)).var(1))
        return io

    vit_reference.vit_forward(x, sd, 2, 4, hook, prop_attn=True)
    return float(variances[0].median()) + 1e-12


def test_count_is_capped_and_zero_is_dense() -> None:
    model = vitrim.reduce.apply(tiny(), "ppt", r=100, layers=(0,))
    with torch.no_grad():
        out = model.forward_detailed(images())
    assert out.tokens.shape[1] == 1 + 8
    with pytest.raises(ValueError, match=r"r must be an int >= 0.*-1"):
        vitrim.reduce.apply(tiny(), "ppt", r=-1)


@pytest.mark.parametrize("threshold", [0.0, 1.0, 7e-5])  # every image prunes, every image pools, the default
@pytest.mark.parametrize("r", [4, (3, 9, 1, 5)])
def test_the_patches_left_are_the_count_function_s_on_any_image(threshold: float, r: int | tuple[int, ...]) -> None:
    # vitrim.vllm writes ppt_patches_left as an image's placeholders before its tower runs: pruning and pooling must
    # leave the same count on every image (16 patches; by hand for r = 4: 12, 8, then 4 and 2, capped at half)
    rs = [r] * 4 if isinstance(r, int) else list(r)
    model = vitrim.reduce.apply(tiny(), "ppt", r=r, layers=(0, 1, 2, 3), threshold=threshold)
    if r == 4:
        assert [ppt_patches_left(16, rs[: i + 1]) for i in range(4)] == [12, 8, 4, 2]
    assert_patches_left_per_block(model, lambda block: ppt_patches_left(16, rs[: block + 1]))
