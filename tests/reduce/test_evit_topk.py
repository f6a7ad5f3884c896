"""EViT and top-k: the [CLS] row, the kept and fused tokens by hand, token counts, bookkeeping, [CLS] preserved."""

from __future__ import annotations

import math

import pytest
import torch
from evit_reference import evit_forward
from reduce_models import attention_info, images, peaky_float64, states_per_block, tiny

import vitrim
from vitrim.attention import AttentionResult
from vitrim.reduce import TokenState
from vitrim.reduce.cls_ranking import cls_attention, num_keep
from vitrim.reduce.evit import EViT
from vitrim.reduce.topk import TopK


def random_block(B: int = 2, H: int = 3, N: int = 11, hd: int = 4, seed: int = 0) -> tuple[TokenState, AttentionResult]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, 6, generator=g, dtype=torch.float64)
    q = torch.randn(B, H, N, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, N, hd, generator=g, dtype=torch.float64)
    positions = torch.stack([torch.randperm(N - 1, generator=g) for _ in range(B)])  # a shuffled earlier history
    state = TokenState(x, 1, positions, grid_patches=N - 1)
    return state, attention_info(q, k, scale=hd**-0.5)


def hand_cls_attention(info: AttentionResult, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, N): softmax(q_0 · kᵀ · scale + bias) written out, exp / sum."""
    logits = torch.einsum("bhd,bhnd->bhn", info.q[:, :, 0], info.k) * info.scale
    if bias is not None:
        logits = logits + bias
    e = (logits - logits.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def test_cls_row_matches_hand_softmax_with_size_bias_and_policy() -> None:
    state, info = random_block()
    assert state.tokens.shape[1] == 11
    sizes = torch.tensor([1.0, 2, 1, 3, 1, 1, 4, 1, 1, 2, 1], dtype=torch.float64).expand(2, -1)
    bias = sizes.log()[:, None, None, :]
    policy = torch.ones(2, 11, dtype=torch.float64)
    policy[:, 3] = 0.0
    info = attention_info(info.q, info.k, None, bias, policy, info.scale)
    expected = hand_cls_attention(info, bias[:, :, 0])
    expected = expected * policy[:, None]  # a dropped key gets no weight: renormalise over the others
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(cls_attention(info), expected, rtol=1e-12, atol=1e-12)


def test_cls_row_reuses_weights_when_the_block_returned_them() -> None:
    _, info = random_block()
    weights = torch.rand(2, 3, 11, 11, dtype=torch.float64)
    info = attention_info(info.q, info.k, weights, scale=info.scale)
    assert torch.equal(cls_attention(info), weights[:, :, 0])


@pytest.mark.parametrize("keep_rate", [0.3, 0.7, 0.85])
def test_evit_keeps_top_tokens_and_fuses_the_rest_by_attention(keep_rate: float) -> None:
    state, info = random_block()
    n = 10
    k = math.ceil(keep_rate * n)  # EViT's evit.py: math.ceil(keep_rate * (N - 1))
    out = EViT(keep_rate).after_attention(state, info)
    scores = hand_cls_attention(info).mean(1)[:, 1:]  # (B, n)
    for s in range(2):
        ranked = sorted(range(n), key=lambda i: -float(scores[s, i]))
        kept, fused = ranked[:k], ranked[k:]
        patches = state.tokens[s, 1:]
        expected = torch.cat(
            [
                state.tokens[s, :1],
                patches[kept],
                sum(scores[s, i] * patches[i] for i in fused)[None],  # type: ignore[index]
            ]
        )
        torch.testing.assert_close(out.tokens[s], expected, rtol=1e-12, atol=1e-12)
        assert out.kept_indices[-1][s].tolist() == state.positions[s, kept].tolist()
        assert out.positions[s].tolist() == [*state.positions[s, kept].tolist(), int(state.positions[s, fused[0]])]
        patch_to_token = out.patch_to_token[-1][s]
        for j, i in enumerate(kept):
            assert patch_to_token[state.positions[s, i]] == j
        assert patch_to_token[state.positions[s, fused]].tolist() == [k] * len(fused)


def test_topk_keeps_top_tokens_and_drops_the_rest() -> None:
    state, info = random_block(seed=5)
    out = TopK(0.5).after_attention(state, info)
    scores = hand_cls_attention(info).mean(1)[:, 1:]
    for s in range(2):
        kept = sorted(range(10), key=lambda i: -float(scores[s, i]))[:5]
        torch.testing.assert_close(out.tokens[s, 1:], state.tokens[s, 1:][kept], rtol=0, atol=0)
        assert out.kept_indices[-1][s].tolist() == state.positions[s, kept].tolist()
        dropped = sorted(set(range(10)) - set(kept))
        assert out.patch_to_token[-1][s, state.positions[s, dropped]].tolist() == [-1] * 5


def test_num_keep_is_the_authors_ceil_in_floats() -> None:
    """EViT's evit.py: left_tokens = math.ceil(keep_rate * (N - 1)), N - 1 = every token but [CLS]."""
    assert num_keep(196, 0.7) == 138  # ceil(137.2)
    assert num_keep(139, 0.7) == 98 and num_keep(99, 0.7) == 70  # DeiT-S 0.7 with fusion: 140/100/72 with [CLS]
    assert num_keep(138, 0.7) == 97 and num_keep(97, 0.7) == 68  # top-k: 139/98/69
    assert num_keep(100, 0.07) == 8  # 0.07 * 100 = 7.000000000000001 in floats, as the authors' code computes it
    assert num_keep(100, 0.29) == 29  # 28.999999999999996
    assert num_keep(10, 0.01) == 1
    assert num_keep(10, 1.0) == 10


@pytest.mark.parametrize("method", ["evit", "topk"])
@pytest.mark.parametrize("distilled", [False, True])
def test_token_counts_per_layer(method: str, distilled: bool) -> None:
    model = vitrim.reduce.apply(tiny(distilled=distilled), method, keep_rate=0.6, layers=(1, 2))
    p = 2 if distilled else 1
    n, expected = 16, []
    for layer in range(4):
        expected.append(p + n)
        if layer in (1, 2):
            n = math.ceil(0.6 * n) + (method == "evit")  # k kept, plus one fused token for EViT
    with torch.no_grad():
        out = model.forward_detailed(images(), need_weights=True)
    assert [a.shape[-1] for a in out.attentions] == expected
    assert out.tokens.shape[1] == p + n
    assert [t.shape[1] for t in out.kept_indices] == [10, 6 if method == "topk" else 7]  # ceil(0.6 n)


@pytest.mark.parametrize("method", ["evit", "topk"])
@pytest.mark.parametrize("distilled", [False, True])
def test_prefix_outputs_of_the_first_reducing_block_equal_the_dense_model(method: str, distilled: bool) -> None:
    dense = tiny(distilled=distilled)
    x = images()
    p = 2 if distilled else 1
    with torch.no_grad():
        expected = states_per_block(dense, x)[1].tokens[:, :p]
        reduced = states_per_block(vitrim.reduce.apply(dense, method, keep_rate=0.5, layers=(1,)), x)[1]
    assert reduced.tokens.shape[1] == p + 8 + (method == "evit")
    torch.testing.assert_close(reduced.tokens[:, :p], expected, rtol=0, atol=1e-6)


def test_evit_after_tome_carries_sizes_into_the_fused_token() -> None:
    model = vitrim.reduce.apply(tiny(), "tome", r=[3, 0, 0, 0])
    vitrim.reduce.apply(model, "evit", keep_rate=0.5, layers=(2,))
    with torch.no_grad():
        out = model.forward_detailed(images())
    assert out.token_sizes is not None
    torch.testing.assert_close(out.token_sizes.sum(1), torch.full((2,), 17.0))
    assert out.tokens.shape[1] == 1 + 7 + 1  # 16 - 3 = 13 patches, keep ceil(6.5) = 7, fuse 6
    assert bool((out.patch_to_token[-1] >= 0).all()) and int(out.patch_to_token[-1].max()) == 7


def test_keep_rate_errors() -> None:
    for bad in (0, 0.0, 1.5, -0.1, "0.7", True, float("nan")):
        with pytest.raises(ValueError, match="keep_rate must be a number in"):
            EViT(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="keep_rate must be a number in"):
            TopK(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("keep_rate", [0.7, 0.5])
@pytest.mark.parametrize("method", ["evit", "topk"])
def test_agrees_with_the_authors_forward(method: str, keep_rate: float) -> None:
    """EViT with fuse_token (method 'evit') and without ('topk'), float64, same weights: same logits and counts."""
    model = peaky_float64("deit_tiny_patch16_224", seed=3)
    sd = model.state_dict()
    vitrim.reduce.apply(model, method, keep_rate=keep_rate, layers=(1, 2, 3))
    x = torch.randn(3, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    rates = dict.fromkeys((1, 2, 3), keep_rate)
    with torch.no_grad():
        expected, counts = evit_forward(sd, x, depth=4, heads=2, patch=8, keep_rates=rates, fuse=method == "evit")
        out = model.forward_detailed(x)
    torch.testing.assert_close(out.logits, expected, rtol=1e-10, atol=1e-10)
    assert out.tokens.shape[1] == counts[-1]


def test_a_kept_fused_token_is_listed_as_minus_one_and_drawn_as_no_kept_patch() -> None:
    torch.manual_seed(5)
    model = vitrim.reduce.apply(tiny(), "evit", keep_rate=0.9, layers=(1, 2, 3))  # fused tokens are often kept
    with torch.no_grad():
        out = model.forward_detailed(images(batch=8))
    later = torch.cat([k for k in out.kept_indices[1:]], dim=1)
    assert bool((later == -1).any())  # some later stage kept an earlier stage's fused token
    for kept in out.kept_indices:
        real = kept[kept >= 0]
        assert bool((real < 16).all())
    from vitrim.viz import kept_masks

    masks = kept_masks(out.kept_indices, (4, 4), sample=int((later == -1).any(1).nonzero()[0]))
    assert masks.shape == (3, 4, 4)  # −1 is skipped, not an error and not a kept patch
