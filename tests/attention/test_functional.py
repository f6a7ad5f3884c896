"""vitrim.scaled_dot_product_attention and compute_attention against torch SDPA and a float64 hand computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from attention_reference import reference_attention, softmax_over_subset

import vitrim

BACKENDS = ("math", "fused", "auto")
B, H, L, E = 2, 3, 5, 4
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _qkv(*shape_q: int, Lk: int | None = None, Ev: int | None = None, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    *lead, Lq, e = shape_q
    Lk = Lq if Lk is None else Lk
    Ev = e if Ev is None else Ev
    q = torch.randn(*lead, Lq, e, generator=g, dtype=dtype)
    k = torch.randn(*lead, Lk, e, generator=g, dtype=dtype)
    v = torch.randn(*lead, Lk, Ev, generator=g, dtype=dtype)
    return q, k, v


def _bool_mask(*shape: int, seed: int = 1) -> torch.Tensor:
    """A random boolean mask whose every row keeps key 0, so that torch SDPA has no empty row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(*shape, generator=g) > 0.5
    mask[..., 0] = True
    return mask


def _check(out, ref, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)


def _masks() -> dict[str, tuple[torch.Tensor | None, bool]]:
    g = torch.Generator().manual_seed(2)
    float_mask = torch.randn(B, H, L, L, generator=g)
    float_mask[..., 1, 3] = -math.inf
    return {
        "none": (None, False),
        "bool": (_bool_mask(B, H, L, L), False),
        "float": (float_mask, False),
        "causal": (None, True),
        "causal+bool": (_bool_mask(B, 1, L, L), True),
        "causal+float": (float_mask, True),
        "broadcast_keys": (_bool_mask(L), False),  # (Lk,)
        "broadcast_rows": (_bool_mask(L, 1) | True, False),  # (Lq, 1)
        "broadcast_2d": (_bool_mask(L, L), False),
        "key_padding": (_bool_mask(B, 1, 1, L), False),
        "float_key_bias": (torch.randn(B, 1, 1, L, generator=g), False),
    }


def _torch_sdpa(q, k, v, mask, is_causal):
    """torch's SDPA, which refuses attn_mask together with is_causal: fold the causal mask in by hand."""
    if mask is not None and is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask = mask & causal if mask.dtype == torch.bool else mask.masked_fill(~causal, -math.inf)
        is_causal = False
    if mask is not None:  # torch wants at least a 2-D mask
        mask = torch.broadcast_to(
            mask, (*torch.broadcast_shapes(mask.shape[:-2], q.shape[:-2]), q.shape[-2], k.shape[-2])
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(_masks()))
def test_matches_torch_and_float64(kind, backend):
    mask, is_causal = _masks()[kind]
    q, k, v = _qkv(B, H, L, E)
    out, weights = vitrim.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, backend=backend)
    ref_out, ref_weights = reference_attention(q, k, v, mask, is_causal=is_causal)
    assert weights is None
    assert out.shape == (B, H, L, E) and out.dtype == torch.float32
    _check(out, ref_out)
    _check(out, _torch_sdpa(q, k, v, mask, is_causal))
    if backend != "fused":
        out_w, weights = vitrim.scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, backend=backend, need_weights=True
        )
        _check(out_w, ref_out)
        _check(weights, ref_weights)
        _check(weights.sum(-1), torch.ones(B, H, L))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Lq,Lk", [(3, 7), (7, 3), (1, 4)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cross_attention(Lq, Lk, is_causal, backend):
    q, k, v = _qkv(B, H, Lq, E, Lk=Lk, Ev=6)
    out, _ = vitrim.scaled_dot_product_attention(q, k, v, is_causal=is_causal, backend=backend)
    assert out.shape == (B, H, Lq, 6)
    _check(out, reference_attention(q, k, v, is_causal=is_causal)[0])
    _check(out, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal))
    mask = _bool_mask(B, 1, Lq, Lk)
    out, _ = vitrim.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, backend=backend)
    _check(out, reference_attention(q, k, v, mask, is_causal=is_causal)[0])
    _check(out, _torch_sdpa(q, k, v, mask, is_causal))


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims(backend):
    for shape in [(L, E), (B, L, E), (2, 1, 2, L, E)]:
        q, k, v = _qkv(*shape)
        out, _ = vitrim.scaled_dot_product_attention(q, k, v, backend=backend)
        _check(out, reference_attention(q, k, v)[0])
    q, k, v = _qkv(B, H, L, E)  # keys and values shared across heads broadcast against the queries
    out, _ = vitrim.scaled_dot_product_attention(q, k[:, :1], v[:, :1], backend=backend)
    _check(out, reference_attention(q, k[:, :1].expand_as(k), v[:, :1].expand_as(v))[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale(backend):
    q, k, v = _qkv(B, H, L, E)
    out, _ = vitrim.scaled_dot_product_attention(q, k, v, scale=0.3, backend=backend)
    _check(out, reference_attention(q, k, v, scale=0.3)[0])
    _check(out, F.scaled_dot_product_attention(q, k, v, scale=0.3))


def _empty_row_cases() -> dict[str, dict]:
    bool_mask = _bool_mask(B, H, L, L)
    bool_mask[:, :, 2] = False  # query 2 may look nowhere
    float_mask = torch.zeros(B, H, L, L)
    float_mask[0, 1, 3] = -math.inf
    causal_mask = _bool_mask(L, L)
    causal_mask[:, 0] = False  # with is_causal, query 0 could only have seen key 0
    cross = _bool_mask(B, 1, 3, 6)
    cross[1, :, 1] = False
    policy = torch.ones(B, L)
    return {
        "bool": {"mask": bool_mask},
        "float": {"mask": float_mask},
        "causal+mask": {"mask": causal_mask, "is_causal": True},
        "policy+mask": {"mask": bool_mask, "keep_policy": policy},
        "cross": {"mask": cross, "Lq": 3, "Lk": 6},
        "all": {"mask": torch.zeros(B, H, L, L, dtype=torch.bool)},
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(_empty_row_cases()))
def test_fully_masked_rows_are_zero_with_finite_grads(case, backend):
    kwargs = dict(_empty_row_cases()[case])
    Lq, Lk = kwargs.pop("Lq", L), kwargs.pop("Lk", L)
    mask = kwargs.pop("mask")
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, Lq, E, Lk=Lk))
    out, _ = vitrim.scaled_dot_product_attention(q, k, v, mask, backend=backend, **kwargs)
    ref, ref_weights = reference_attention(q.detach(), k.detach(), v.detach(), mask, **kwargs)
    empty = ref_weights.sum(-1) == 0
    assert empty.any(), "the case must contain a row with no allowed key"
    assert torch.isfinite(out).all()
    assert (out[empty] == 0).all()
    _check(out, ref)
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert (q.grad[empty] == 0).all()  # an empty row depends on nothing
    if backend != "fused":
        _, weights = vitrim.scaled_dot_product_attention(q, k, v, mask, backend=backend, need_weights=True, **kwargs)
        assert weights is not None and (weights[empty] == 0).all() and torch.isfinite(weights).all()


# --- keep-policy (DynamicViT) -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_policy", [False, True])
def test_no_keys_gives_zeros(backend, with_policy):
    """Lk = 0: every query row is empty, so the output is zeros of shape (…, Lq, Ev), with and without a policy."""
    q = torch.randn(2, 3, 4, 8, requires_grad=True)
    k, v = torch.randn(2, 3, 0, 8), torch.randn(2, 3, 0, 5)
    policy = torch.ones(2, 0) if with_policy else None
    need = backend != "fused"
    out, weights = vitrim.scaled_dot_product_attention(q, k, v, keep_policy=policy, need_weights=need, backend=backend)
    assert out.shape == (2, 3, 4, 5) and torch.equal(out, torch.zeros(2, 3, 4, 5))
    assert weights is None if not need else weights.shape == (2, 3, 4, 0)
    out.sum().backward()
    assert q.grad is not None and torch.equal(q.grad, torch.zeros_like(q))


def test_hard_policy_is_softmax_over_kept_keys_and_self():
    q, k, v = _qkv(B, H, L, E, dtype=torch.float64)
    policy = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 1, 1, 0]], dtype=torch.float64)
    out, weights = vitrim.scaled_dot_product_attention(q, k, v, keep_policy=policy, need_weights=True)
    logits = q @ k.transpose(-2, -1) / math.sqrt(E)
    for b in range(B):
        kept = [j for j in range(L) if policy[b, j] == 1]
        for h in range(H):
            for i in range(L):
                expected = softmax_over_subset(logits[b, h, i], sorted(set(kept) | {i}))
                torch.testing.assert_close(weights[b, h, i], expected)
    torch.testing.assert_close(out, weights @ v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_forms_agree_with_formula(backend):
    q, k, v = _qkv(B, H, L, E)
    soft = torch.tensor([[0.9, 0.1, 0.5, 0.0, 1.0], [0.3, 0.7, 0.2, 1.0, 0.6]])
    hard_bool = soft > 0.4
    for policy in (soft, hard_bool, hard_bool.float(), soft[:1]):
        out, _ = vitrim.scaled_dot_product_attention(q, k, v, keep_policy=policy, backend=backend)
        _check(out, reference_attention(q, k, v, keep_policy=policy)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_with_mask_causal_and_cross(backend):
    q, k, v = _qkv(B, H, L, E)
    policy = torch.tensor([[0.9, 0.0, 0.5, 0.2, 1.0], [0.3, 0.7, 0.0, 1.0, 0.6]])
    mask = _bool_mask(B, 1, L, L)
    for kwargs in ({"is_causal": True}, {"mask": mask}, {"mask": mask, "is_causal": True}):
        out, _ = vitrim.scaled_dot_product_attention(q, k, v, keep_policy=policy, backend=backend, **kwargs)
        mask_arg = kwargs.get("mask")
        _check(
            out, reference_attention(q, k, v, mask_arg, is_causal=kwargs.get("is_causal", False), keep_policy=policy)[0]
        )
    # cross-attention: no diagonal, a key gated to 0 gets no weight from any query
    q, k, v = _qkv(B, H, 3, E, Lk=L)
    out, _ = vitrim.scaled_dot_product_attention(q, k, v, keep_policy=policy, backend=backend)
    _check(out, reference_attention(q, k, v, keep_policy=policy)[0])
    if backend != "fused":
        _, weights = vitrim.scaled_dot_product_attention(
            q, k, v, keep_policy=policy, backend=backend, need_weights=True
        )
        assert (weights[0, :, :, 1] == 0).all() and (weights[1, :, :, 2] == 0).all()


def test_policy_gradient_matches_hand_formula_for_hard_policy():
    """Straight-through training differentiates at a 0/1 policy: dropped keys must still get a gradient."""
    q, k, v = _qkv(B, H, L, E, dtype=torch.float64)
    policy = torch.tensor([[1.0, 0, 1, 0, 1], [0, 1, 1, 1, 0]], dtype=torch.float64, requires_grad=True)
    out, _ = vitrim.scaled_dot_product_attention(q, k, v, keep_policy=policy)
    (grad,) = torch.autograd.grad(out.sin().sum(), policy)
    ref_out, _ = reference_attention(q, k, v, keep_policy=policy)
    (ref_grad,) = torch.autograd.grad(ref_out.sin().sum(), policy)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)
    assert (grad[policy.detach() == 0] != 0).all()


@pytest.mark.parametrize("gap", [20.0, 200.0])
def test_policy_dropped_key_with_large_logit(gap):
    """A dropped key whose logit is far above the kept ones: kept keys must not underflow, gradients stay finite."""
    q = torch.tensor([[[1.0, 0.0], [1.0, 0.5], [0.0, 1.0]]])  # (1, 3, 2)
    k = torch.tensor([[[0.1, 0.0], [0.0, 0.2], [gap * math.sqrt(2), 0.0]]])  # key 2: logit ≈ gap for query 0, 1
    v = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(0))
    policy = torch.tensor([[1.0, 1.0, 0.0]], requires_grad=True)
    out, weights = vitrim.scaled_dot_product_attention(q, k, v, keep_policy=policy, need_weights=True)
    assert weights is not None and torch.isfinite(out).all()
    logits = q @ k.transpose(-2, -1) / math.sqrt(2)
    for i in range(2):
        torch.testing.assert_close(weights[0, i], softmax_over_subset(logits[0, i], [0, 1]))
    (grad,) = torch.autograd.grad(out.sum(), policy)
    assert torch.isfinite(grad).all() and grad[0, 2] != 0
    if gap < 40:  # below the cap the gradient is exact
        policy64 = policy.detach().double().requires_grad_()
        ref_out, _ = reference_attention(q, k, v, keep_policy=policy64)
        (ref_grad,) = torch.autograd.grad(ref_out.sum(), policy64)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-5)


def test_gradcheck_through_q_k_v_and_policy():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 4, 3, dtype=torch.float64))
    policy = torch.tensor([[0.2, 0.8, 0.5, 0.35]], dtype=torch.float64, requires_grad=True)
    mask = _bool_mask(1, 1, 4, 4)

    def f(q, k, v, policy):
        return vitrim.scaled_dot_product_attention(q, k, v, mask, keep_policy=policy, need_weights=True)

    assert torch.autograd.gradcheck(f, (q, k, v, policy))
    cross_q = torch.randn(1, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, p: vitrim.scaled_dot_product_attention(q, k, v, keep_policy=p)[0], (cross_q, k, v, policy)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_each_backend(backend):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 4, 3, dtype=torch.float64))
    mask = _bool_mask(1, 1, 4, 4)
    mask[0, 0, 2] = False  # an empty row too

    def f(q, k, v):
        return vitrim.scaled_dot_product_attention(q, k, v, mask, is_causal=True, backend=backend)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


# --- precision, dropout ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_against_float32(backend):
    q, k, v = _qkv(B, H, 8, 16)
    mask = _bool_mask(B, 1, 8, 8)
    expected, _ = vitrim.scaled_dot_product_attention(q, k, v, mask, backend="math")
    out, _ = vitrim.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    if backend != "fused":
        _, weights = vitrim.scaled_dot_product_attention(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, keep_policy=torch.ones(B, 8), need_weights=True
        )
        assert weights is not None and weights.dtype == torch.bfloat16
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(B, H, 8), atol=2e-2, rtol=0)


def test_dropout_returns_the_applied_weights():
    q, k, v = _qkv(B, H, 6, E)
    torch.manual_seed(0)
    out, weights = vitrim.scaled_dot_product_attention(q, k, v, dropout_p=0.5, need_weights=True)
    plain, plain_weights = vitrim.scaled_dot_product_attention(q, k, v, need_weights=True)
    assert weights is not None and plain_weights is not None
    assert not torch.allclose(out, plain)
    torch.testing.assert_close(out, weights @ v)
    dropped = weights == 0
    assert dropped.any() and not dropped.all()
    torch.testing.assert_close(weights[~dropped], plain_weights[~dropped] / 0.5)  # survivors rescaled by 1/(1-p)
    fused, _ = vitrim.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="fused")
    assert not torch.allclose(fused, plain)


def test_dropout_zero_is_deterministic():
    q, k, v = _qkv(B, H, 6, E)
    a, _ = vitrim.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
    b, _ = vitrim.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
    assert torch.equal(a, b)


# --- compute_attention (textbook form) ---------------------------------------------------------------------------


def test_compute_attention_textbook():
    Q, K, V = _qkv(4, 8)
    mask = torch.ones(4, 4).tril()  # 1 = visible
    out, weights = vitrim.compute_attention(Q, K, V, mask)
    logits = (Q.double() @ K.double().T) / math.sqrt(8)
    expected_weights = torch.softmax(logits.masked_fill(mask == 0, -math.inf), dim=-1)
    _check(weights, expected_weights)
    _check(out, expected_weights @ V.double())
    out_bool, weights_bool = vitrim.compute_attention(Q, K, V, mask.bool())
    torch.testing.assert_close(out_bool, out)
    torch.testing.assert_close(weights_bool, weights)
    out_none, weights_none = vitrim.compute_attention(Q, K, V)
    _check(weights_none, torch.softmax(logits, dim=-1))
    _check(out_none, torch.softmax(logits, dim=-1) @ V.double())


def test_compute_attention_rejects_non_binary_mask():
    Q, K, V = _qkv(4, 8)
    with pytest.raises(ValueError, match=r"mask must hold only 0 \(masked\) and 1"):
        vitrim.compute_attention(Q, K, V, torch.full((4, 4), 0.5))
    with pytest.raises(TypeError, match="mask must be a tensor"):
        vitrim.compute_attention(Q, K, V, [[1, 0]])  # type: ignore[arg-type]


# --- bad input ---------------------------------------------------------------------------------------------------

_q, _k, _v = _qkv(B, H, L, E)


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((torch.randn(E), _k, _v), {}, ValueError, r"q must have at least 2 dims .*got shape \(4,\)"),
        ((_q, torch.randn(E), _v), {}, ValueError, r"k must have at least 2 dims .*got shape \(4,\)"),
        ((_q, _k, torch.randn(E)), {}, ValueError, r"v must have at least 2 dims"),
        ((_q, torch.randn(B, H, L, E + 1), _v), {}, ValueError, r"q and k must share the last dim E: q \(2, 3, 5, 4\)"),
        ((_q, _k, torch.randn(B, H, L + 1, E)), {}, ValueError, r"k and v must share the length Lk: k \(2, 3, 5, 4\)"),
        (
            (_q, _k, _v, torch.ones(L, L + 1, dtype=torch.bool)),
            {},
            ValueError,
            r"mask of shape \(5, 6\) does not broadcast",
        ),
        ((_q, _k, _v, torch.ones(3, 1, L, L, dtype=torch.bool)), {}, ValueError, r"mask of shape \(3, 1, 5, 5\)"),
        ((_q, _k, _v, torch.ones(L, L, dtype=torch.int64)), {}, TypeError, r"mask must be bool .* got torch.int64"),
        (
            (_q, _k, _v),
            {"keep_policy": torch.ones(B, L + 1)},
            ValueError,
            r"keep_policy must have shape \(B, Lk\) = \(2, 5\), got \(2, 6\)",
        ),
        ((_q, _k, _v), {"keep_policy": torch.ones(3, L)}, ValueError, r"keep_policy must have shape .* got \(3, 5\)"),
        (
            (_q, _k, _v),
            {"keep_policy": torch.full((B, L), 1.5)},
            ValueError,
            r"keep_policy must lie in \[0, 1\]; .*1\.5",
        ),
        ((_q, _k, _v), {"keep_policy": torch.full((B, L), -0.1)}, ValueError, r"keep_policy must lie in \[0, 1\]"),
        ((_q, _k, _v), {"keep_policy": torch.full((B, L), math.nan)}, ValueError, r"keep_policy must lie in \[0, 1\]"),
        (
            (_q, _k, _v),
            {"keep_policy": torch.ones(B, L, dtype=torch.int64)},
            TypeError,
            r"keep_policy must be bool or floating",
        ),
        ((_q, _k, _v), {"scale": 0.0}, ValueError, r"scale must be a finite positive number, got 0.0"),
        ((_q, _k, _v), {"scale": -1.0}, ValueError, r"scale must be a finite positive number, got -1.0"),
        ((_q, _k, _v), {"scale": math.inf}, ValueError, r"scale .* got inf"),
        ((_q, _k, _v), {"scale": math.nan}, ValueError, r"scale .* got nan"),
        ((_q, _k, _v), {"backend": "flash"}, ValueError, r"backend must be one of .*got 'flash'"),
        ((_q, _k, _v), {"dropout_p": 1.0}, ValueError, r"dropout_p must be a number in \[0, 1\), got 1.0"),
        ((_q, _k, _v), {"dropout_p": -0.1}, ValueError, r"dropout_p .* got -0.1"),
        (
            (_q, _k, _v),
            {"backend": "fused", "need_weights": True},
            ValueError,
            r"backend='fused' cannot return weights",
        ),
        ((_q.int(), _k, _v), {}, TypeError, r"q must be floating point, got dtype torch.int32"),
        ((_q, _k.double(), _v), {}, TypeError, r"q, k, v must share a dtype"),
        (("q", _k, _v), {}, TypeError, r"q must be a torch.Tensor, got str"),
    ],
)
def test_bad_input_names_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        vitrim.scaled_dot_product_attention(*args, **kwargs)


def test_fused_refuses_policy_gradient():
    policy = torch.full((B, L), 0.5, requires_grad=True)
    with pytest.raises(ValueError, match=r"backend='fused' cannot differentiate through keep_policy"):
        vitrim.scaled_dot_product_attention(_q, _k, _v, keep_policy=policy, backend="fused")


def test_validation_happens_before_compute(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("computed before validating")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fail)
    monkeypatch.setattr(torch, "softmax", fail)
    with pytest.raises(ValueError, match="dropout_p"):
        vitrim.scaled_dot_product_attention(_q, _k, _v, dropout_p=2.0)
