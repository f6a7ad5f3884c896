"""vitrim.MultiHeadAttention against torch.nn.MultiheadAttention and a hand computation from its own parameters."""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import reference_attention
from torch import nn

import vitrim

B, Lq, Lk, D, H = 2, 5, 7, 8, 2


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _torch_mha(batch_first: bool, kdim: int | None = None, bias: bool = True) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=batch_first, kdim=kdim, vdim=kdim, bias=bias)
    with torch.no_grad():  # torch initialises the biases to 0; make them count
        if mha.in_proj_bias is not None:
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    return mha.eval()


def _padding() -> torch.Tensor:
    key_padding_mask = torch.zeros(B, Lk, dtype=torch.bool)  # torch: True = ignore this key
    key_padding_mask[0, -2:] = True
    key_padding_mask[1, 0] = True
    return key_padding_mask


def _to_torch_layout(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return x if batch_first else x.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_from_torch_self_attention(batch_first, padded):
    theirs = _torch_mha(batch_first)
    ours = vitrim.MultiHeadAttention.from_torch(theirs)
    x = _rand(B, Lk, D)
    kpm = _padding() if padded else None
    xt = _to_torch_layout(x, batch_first)
    expected, expected_weights = theirs(xt, xt, xt, key_padding_mask=kpm, need_weights=True)
    mask = None if kpm is None else ~kpm[:, None, None, :]  # vitrim: True = may attend
    out, weights = ours(x, mask=mask, need_weights=True)
    torch.testing.assert_close(out, _to_torch_layout(expected, batch_first), atol=1e-5, rtol=1e-5)
    assert weights is not None and weights.shape == (B, H, Lk, Lk)
    torch.testing.assert_close(weights.mean(dim=1), expected_weights, atol=1e-6, rtol=1e-5)
    out_fast, none = ours(x, mask=mask)
    assert none is None
    torch.testing.assert_close(out_fast, out, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 6])
def test_from_torch_cross_attention(batch_first, kdim):
    theirs = _torch_mha(batch_first, kdim=kdim)
    ours = vitrim.MultiHeadAttention.from_torch(theirs)
    assert (ours.kv_dim is None) == (kdim is None)
    x, context = _rand(B, Lq, D, seed=1), _rand(B, Lk, kdim or D, seed=2)
    kpm = _padding()
    xt, ct = _to_torch_layout(x, batch_first), _to_torch_layout(context, batch_first)
    expected, expected_weights = theirs(xt, ct, ct, key_padding_mask=kpm)
    out, weights = ours(x, context, mask=~kpm[:, None, None, :], need_weights=True)
    torch.testing.assert_close(out, _to_torch_layout(expected, batch_first), atol=1e-5, rtol=1e-5)
    assert weights is not None and weights.shape == (B, H, Lq, Lk)
    torch.testing.assert_close(weights.mean(dim=1), expected_weights, atol=1e-6, rtol=1e-5)
    assert (weights[0, :, :, -2:] == 0).all()


def test_from_torch_without_bias_and_training_flag():
    theirs = _torch_mha(True, bias=False).train()
    ours = vitrim.MultiHeadAttention.from_torch(theirs)
    assert ours.training and ours.qkv.bias is None and ours.proj.bias is None
    x = _rand(B, Lq, D)
    expected, _ = theirs.eval()(x, x, x)
    torch.testing.assert_close(ours.eval()(x)[0], expected, atol=1e-5, rtol=1e-5)


def test_from_torch_rejects_what_it_cannot_mirror():
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.MultiheadAttention, got Linear"):
        vitrim.MultiHeadAttention.from_torch(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"kdim \(6\) != vdim \(4\)"):
        vitrim.MultiHeadAttention.from_torch(nn.MultiheadAttention(D, H, kdim=6, vdim=4))
    with pytest.raises(ValueError, match="add_bias_kv"):
        vitrim.MultiHeadAttention.from_torch(nn.MultiheadAttention(D, H, add_bias_kv=True))


def _by_hand(mha: vitrim.MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head attention from the module's parameters: project, split heads, attend in float64, concat, project."""
    hd = D // H
    if mha.kv_dim is None:
        w_q, w_k, w_v = mha.qkv.weight.chunk(3)
        b_q, b_k, b_v = mha.qkv.bias.chunk(3)
    else:
        w_q, b_q = mha.q.weight, mha.q.bias
        (w_k, w_v), (b_k, b_v) = mha.kv.weight.chunk(2), mha.kv.bias.chunk(2)
    context = x if context is None else context
    heads = []
    for h in range(H):
        rows = slice(h * hd, (h + 1) * hd)
        q = x @ w_q[rows].T + b_q[rows]
        k = context @ w_k[rows].T + b_k[rows]
        v = context @ w_v[rows].T + b_v[rows]
        if not isinstance(mha.q_norm, nn.Identity):
            q = nn.functional.layer_norm(q, (hd,), mha.q_norm.weight, mha.q_norm.bias, eps=1e-6)
            k = nn.functional.layer_norm(k, (hd,), mha.k_norm.weight, mha.k_norm.bias, eps=1e-6)
        heads.append(reference_attention(q, k, v)[0])
    return torch.cat(heads, dim=-1).float() @ mha.proj.weight.T + mha.proj.bias


def test_qk_norm_matches_hand_computation():
    torch.manual_seed(0)
    mha = vitrim.MultiHeadAttention(D, H, qk_norm=True).eval()
    with torch.no_grad():
        for norm in (mha.q_norm, mha.k_norm):
            norm.weight.normal_()
            norm.bias.normal_()
    x = _rand(B, Lq, D) * 3
    out, _ = mha(x)
    with torch.no_grad():
        torch.testing.assert_close(out, _by_hand(mha, x), atol=1e-5, rtol=1e-5)
    plain = vitrim.MultiHeadAttention(D, H).eval()
    plain.load_state_dict({k: v for k, v in mha.state_dict().items() if "norm" not in k})
    assert not torch.allclose(plain(x)[0], out)


def test_cross_attention_with_kv_dim():
    torch.manual_seed(0)
    mha = vitrim.MultiHeadAttention(D, H, kv_dim=6).eval()
    assert {name for name, _ in mha.named_parameters()} == {
        "q.weight",
        "q.bias",
        "kv.weight",
        "kv.bias",
        "proj.weight",
        "proj.bias",
    }
    x, context = _rand(B, Lq, D), _rand(B, Lk, 6, seed=1)
    out, weights = mha(x, context, need_weights=True)
    assert out.shape == (B, Lq, D) and weights is not None and weights.shape == (B, H, Lq, Lk)
    with torch.no_grad():
        torch.testing.assert_close(out, _by_hand(mha, x, context), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"context .* is required"):
        mha(x)
    with pytest.raises(ValueError, match=r"context must have shape \(2, Lk, 6\), got \(2, 7, 8\)"):
        mha(x, _rand(B, Lk, D))


def test_per_head_weights_and_need_weights_does_not_change_output():
    mha = vitrim.MultiHeadAttention(D, H).eval()
    x = _rand(B, Lq, D)
    out, none = mha(x)
    out_w, weights = mha(x, need_weights=True)
    assert none is None and weights is not None
    assert weights.shape == (B, H, Lq, Lq)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, Lq))
    torch.testing.assert_close(out_w, out, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(out, _by_hand(mha, x), atol=1e-5, rtol=1e-5)


def test_keep_policy_gradient_reaches_the_policy():
    mha = vitrim.MultiHeadAttention(D, H).eval()
    x = _rand(B, Lq, D)
    policy = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0]], requires_grad=True)
    out, weights = mha(x, keep_policy=policy, need_weights=True)
    assert weights is not None and (weights[0, :, 0, 1] == 0).all()
    out.square().sum().backward()
    assert policy.grad is not None and torch.isfinite(policy.grad).all() and (policy.grad[policy == 0] != 0).all()


def test_dropout_only_in_training():
    mha = vitrim.MultiHeadAttention(D, H, attn_drop=0.5, proj_drop=0.2)
    x = _rand(B, Lq, D)
    mha.eval()
    a, _ = mha(x)
    b, _ = mha(x)
    assert torch.equal(a, b)
    mha.train()
    torch.manual_seed(0)
    c, _ = mha(x)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dim": 10, "num_heads": 3}, "dim 10 is not divisible by num_heads 3"),
        ({"dim": 0, "num_heads": 1}, "dim must be a positive int, got 0"),
        ({"dim": 8, "num_heads": 0}, "num_heads must be a positive int, got 0"),
        ({"dim": 8, "num_heads": 2, "kv_dim": -1}, "kv_dim must be a positive int or None, got -1"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vitrim.MultiHeadAttention(**kwargs)


def test_bad_input_shape():
    mha = vitrim.MultiHeadAttention(D, H)
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, 8\), got \(5, 8\)"):
        mha(_rand(Lq, D))


def test_default_scale_is_per_head():
    """The logits are scaled by 1/√(head width), not 1/√D."""
    mha = vitrim.MultiHeadAttention(D, H).eval()
    x = _rand(1, Lq, D)
    q, k, _ = mha.project_qkv(x)
    _, weights = mha(x, need_weights=True)
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // H), dim=-1)
    torch.testing.assert_close(weights, expected)
