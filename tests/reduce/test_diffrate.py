"""DiffRate's prune-then-merge block against an independent re-implementation of the authors' evaluation forward,
on the same weights in float64; counts, identity settings and errors."""

from __future__ import annotations

import pytest
import torch
from diffrate_reference import diffrate_forward
from reduce_models import images, tiny
from vit_reference import grid_sources

import vitrim


@pytest.mark.parametrize(
    ("prune_kept", "merge_kept"),
    [
        ([17, 15, 12, 9], [17, 13, 10, 8]),  # prune and merge in blocks 1-3
        ([16, 16, 11, 6], [14, 16, 8, 6]),  # merge only in block 0, prune only in block 1, both later
        ([17, 17, 9, 9], [12, 10, 9, 3]),  # merges alone, then a prune, then a deep merge
    ],
)
def test_matches_the_authors_forward(prune_kept: list[int], merge_kept: list[int]) -> None:
    model = tiny().double()
    x = images(batch=3).double()
    expected, source, counts = diffrate_forward(x, model.state_dict(), 2, 4, prune_kept, merge_kept)
    with torch.no_grad():
        out = vitrim.reduce.apply(model, "diffrate", prune_kept=prune_kept, merge_kept=merge_kept).forward_detailed(x)
    assert (out.logits - expected).abs().max() <= 1e-10
    assert [p.shape[1] + 1 for p in out.block_positions[1:]] + [out.tokens.shape[1]] == counts
    assert torch.equal(grid_sources(out.patch_to_token[-1], out.tokens.shape[1] - 1), source[:, 1:])
    for i in range(3):  # batch 1 merges by one-hot products (fewer calls): the same numbers
        with torch.no_grad():
            one = model.forward_detailed(x[i : i + 1])
        assert (one.logits - expected[i : i + 1]).abs().max() <= 1e-10
        assert torch.equal(grid_sources(one.patch_to_token[-1], one.tokens.shape[1] - 1), source[i : i + 1, 1:])
        torch.testing.assert_close(one.token_sizes, out.token_sizes[i : i + 1], rtol=1e-12, atol=1e-12)


def test_counts_and_identity() -> None:
    model = tiny()
    x = images()
    with torch.no_grad():
        dense = model(x)
        vitrim.reduce.apply(model, "diffrate", prune_kept=17, merge_kept=17)
        assert torch.equal(model(x), dense)
        vitrim.reduce.remove(model)
        out = vitrim.reduce.apply(
            model, "diffrate", prune_kept=[17, 13, 13, 5], merge_kept=[15, 13, 9, 9]
        ).forward_detailed(x)
    # tokens after each block: min(before, prune, merge) = 15, 13, 9, 5
    assert [p.shape[1] + 1 for p in out.block_positions[1:]] + [out.tokens.shape[1]] == [15, 13, 9, 5]
    assert out.token_sizes is not None and out.token_sizes.shape == (2, 5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prune_kept": 0, "merge_kept": 5}, r"prune_kept must be an int >= 1.*0"),
        ({"prune_kept": 5, "merge_kept": 2.5}, r"merge_kept must be an int >= 1.*2\.5"),
        ({"prune_kept": [5, 5], "merge_kept": 5}, r"prune_kept must be one value or one per reducing block \(4"),
        ({"prune_kept": 5}, r"reducer 'diffrate' needs option\(s\) \['merge_kept'\]"),
    ],
)
def test_bad_options_raise_clear_errors(options: dict[str, object], message: str) -> None:
    model = tiny()
    with pytest.raises(ValueError, match=message):
        vitrim.reduce.apply(model, "diffrate", **options)
    assert all(block.reducer is None for block in model.blocks)
