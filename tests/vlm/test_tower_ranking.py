"""The received-attention row that stands in for [CLS] in a tower without it: equal to the full softmax map
averaged over its queries (log-size bias included, however many query chunks it takes), and handed to PPT as its
[CLS] row exactly (PPT's pruning and pooling branches)."""

from __future__ import annotations

import pytest
import torch

import vitrim.vlm.evidence.attention as evidence_attention
from vitrim.attention import AttentionResult
from vitrim.reduce import TokenState, get_reducer
from vitrim.reduce.state import patch_positions
from vitrim.vlm.method.tower_ranking import ReceivedAttentionRanking, received_attention


def _operands(seed: int = 0, B: int = 2, H: int = 3, N: int = 11, hd: int = 4):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, hd, generator=generator, dtype=torch.float64) for _ in range(3))
    sizes = torch.randint(1, 4, (B, N), generator=generator).double()
    return q, k, v, sizes


@pytest.mark.parametrize("chunk", [256, 4])  # one block of queries, or three and a remainder
@pytest.mark.parametrize("bias_shape", ["none", "batch", "eager"])  # (B, 1, 1, N), or (1, N) at batch 1
def test_received_attention_is_the_full_map_averaged_over_queries(chunk, bias_shape, monkeypatch) -> None:
    monkeypatch.setattr(evidence_attention, "QUERY_CHUNK", chunk)
    q, k, _, sizes = _operands()
    if bias_shape == "eager":
        q, k, sizes = q[:1], k[:1], sizes[:1]
    bias = {"none": None, "batch": sizes.log()[:, None, None, :], "eager": sizes.log()}[bias_shape]
    logits = torch.einsum("bhic,bhjc->bhij", q, k) * 0.5
    full = (logits if bias is None else logits + bias.reshape(bias.shape[0], 1, 1, -1)).softmax(-1)  # (B, H, N, N)
    expected = full.sum(dim=2) / q.shape[2]  # column sums over the queries
    got = received_attention(q, k, 0.5, bias)
    assert got.shape == (q.shape[0], q.shape[1], 1, q.shape[2])
    torch.testing.assert_close(got[:, :, 0], expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)), rtol=0, atol=1e-13)


@pytest.mark.parametrize("threshold", [0.0, 1.0])  # var < 0 never: prune; var < 1 always: pool
def test_ppt_gets_the_received_row_as_its_cls_row(threshold: float) -> None:
    q, k, v, _ = _operands(seed=1)
    B, H, N, hd = q.shape
    x = torch.randn(B, N, H * hd, dtype=torch.float64)
    state = TokenState(x, 0, patch_positions(B, N, x.device), grid_patches=N)
    attention = AttentionResult(out=x, weights=None, q=q, k=k, scale=0.5, v=v)
    ppt = get_reducer("ppt")(r=3, threshold=threshold)
    by_hand = (torch.einsum("bhic,bhjc->bhij", q, k) * 0.5).softmax(-1).mean(dim=2, keepdim=True)  # (B, H, 1, N)
    expected = ppt.after_attention(state, AttentionResult(out=x, weights=by_hand, q=q, k=k, scale=0.5, v=v))
    got = ReceivedAttentionRanking(ppt).after_attention(state, attention)
    assert got.tokens.shape == (B, N - 3, H * hd)
    torch.testing.assert_close(got.tokens, expected.tokens, rtol=0, atol=1e-14)
    assert torch.equal(got.positions, expected.positions)
