"""Property-based tests: random shapes, masks, causality and policies; every backend against the float64 formula."""

from __future__ import annotations

import pytest
import torch
from attention_reference import reference_attention
from hypothesis import given, settings
from hypothesis import strategies as st

import vitrim

SETTINGS = settings(max_examples=30, deadline=None)


@st.composite
def attention_inputs(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    Lq, Lk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    E, Ev = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(*lead, Lq, E, generator=g)
    k = torch.randn(*lead, Lk, E, generator=g)
    v = torch.randn(*lead, Lk, Ev, generator=g)
    # a mask of any broadcastable shape: each dim of (…, Lq, Lk) kept or set to 1, leading dims possibly dropped
    full = (*lead, Lq, Lk)
    shape = tuple(n if draw(st.booleans()) else 1 for n in full)[draw(st.integers(0, len(lead))) :]
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    density = draw(st.floats(0.0, 1.0))
    if kind == "bool":
        mask = torch.rand(shape, generator=g) < density  # density 0 closes every row
    elif kind == "float":
        mask = torch.randn(shape, generator=g).masked_fill(torch.rand(shape, generator=g) > density, float("-inf"))
    else:
        mask = None
    is_causal = draw(st.booleans())
    policy = None
    if lead and draw(st.booleans()):
        policy = torch.rand(lead[0], Lk, generator=g)
        if draw(st.booleans()):
            policy = policy > 0.5
    return q, k, v, mask, is_causal, policy


@SETTINGS
@given(attention_inputs())
def test_every_backend_matches_the_formula(inputs):
    q, k, v, mask, is_causal, policy = inputs
    ref_out, ref_weights = reference_attention(q, k, v, mask, is_causal=is_causal, keep_policy=policy)
    for backend in ("math", "fused", "auto"):
        out, _ = vitrim.scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, keep_policy=policy, backend=backend
        )
        assert out.shape == ref_out.shape
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    out, weights = vitrim.scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, keep_policy=policy, need_weights=True
    )
    assert weights is not None
    torch.testing.assert_close(weights.double(), ref_weights, atol=1e-5, rtol=1e-5)
    row_sums = weights.sum(-1)
    assert torch.all(((row_sums - 1).abs() < 1e-5) | (row_sums == 0))  # each row sums to 1, or is an empty row


@SETTINGS
@given(attention_inputs())
def test_gradients_are_finite_and_empty_rows_get_none(inputs):
    q, k, v, mask, is_causal, policy = inputs
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if policy is not None and policy.is_floating_point():
        policy = policy.clone().requires_grad_()
    for backend in ("math", "auto") if policy is not None and policy.requires_grad else ("math", "fused", "auto"):
        grads = torch.autograd.grad(
            vitrim.scaled_dot_product_attention(
                q, k, v, mask, is_causal=is_causal, keep_policy=policy, backend=backend
            )[0]
            .square()
            .sum(),
            [t for t in (q, k, v, policy) if t is not None and t.requires_grad],
        )
        assert all(torch.isfinite(g).all() for g in grads)
        _, ref_weights = reference_attention(q.detach(), k.detach(), v.detach(), mask, is_causal=is_causal)
        empty = (ref_weights.sum(-1) == 0).expand(grads[0].shape[:-1])
        assert (grads[0][empty] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64])
@SETTINGS
@given(attention_inputs())
def test_math_and_fused_agree_in_float64(dtype, inputs):
    q, k, v, mask, is_causal, policy = inputs
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    math_out, _ = vitrim.scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, keep_policy=policy, backend="math"
    )
    fused_out, _ = vitrim.scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, keep_policy=policy, backend="fused"
    )
    torch.testing.assert_close(math_out, fused_out, atol=1e-10, rtol=1e-10)
