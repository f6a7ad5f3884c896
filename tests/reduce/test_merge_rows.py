"""merge_rows: weighted group means, one-hot product at batch 1 and row moves above it, against a loop."""

from __future__ import annotations

import pytest
import torch

from vitrim.reduce.tokens import merge_rows


def loop_merge(x: torch.Tensor, dest: torch.Tensor, num_out: int, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The definition, one output row at a time."""
    out = torch.zeros(x.shape[0], num_out, x.shape[2], dtype=x.dtype)
    totals = torch.zeros(x.shape[0], num_out, dtype=weights.dtype)
    for b in range(x.shape[0]):
        for j in range(num_out):
            members = (dest[b] == j).nonzero().flatten()
            totals[b, j] = weights[b, members].sum()
            out[b, j] = (x[b, members] * weights[b, members, None]).sum(0) / totals[b, j]
    return out, totals


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_merge_rows_matches_the_definition(batch: int, weighted: bool) -> None:
    g = torch.Generator().manual_seed(batch)
    N, num_out, C = 11, 6, 5
    x = torch.randn(batch, N, C, generator=g, dtype=torch.float64)
    # every output row receives its own row first, then the rest land anywhere
    dest = torch.cat(
        [torch.arange(num_out).expand(batch, -1), torch.randint(0, num_out, (batch, N - num_out), generator=g)], 1
    )
    dest = dest.gather(1, torch.rand(batch, N, generator=g).argsort(1))
    weights = torch.randint(1, 5, (batch, N), generator=g).to(torch.float64) if weighted else None
    out, totals = merge_rows(x, dest, num_out, weights)
    expected, expected_totals = loop_merge(
        x, dest, num_out, torch.ones(batch, N, dtype=torch.float64) if weights is None else weights
    )
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(totals, expected_totals, rtol=0, atol=0)
