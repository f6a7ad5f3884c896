"""Scaled dot-product attention: the textbook formula, one function, every backend.

    P = Q Kᵀ · scale            (…, Lq, Lk)   scale = 1/√E by default
    P = P + mask                mask: −∞ (bool False) where a query may not look, or any float bias
    A_ij = exp(P_ij)·G_ij / Σ_k exp(P_ik)·G_ik      G: DynamicViT keep-policy (all ones without one)
    out = A · V                 (…, Lq, Ev)

Conventions, written once here and tested in ``tests/attention``:

* boolean masks: ``True`` = may attend (torch SDPA's polarity; the textbook's ``mask == 0 → −∞``);
  floating masks are added to the scaled logits. Masks broadcast to ``(…, Lq, Lk)``.
* ``keep_policy``: ``(B, Lk)`` in [0, 1], 1 = key kept (DynamicViT's D̂). G_ij = policy_j, and G_ii = 1 when
  ``Lq == Lk`` (a token always sees itself). Gradients flow into the policy.
* a query row with no allowed key returns zeros, never NaN, forward and backward, in every backend.
* ``is_causal`` is aligned as torch aligns it: query i sees keys 0 … i (top-left), also when Lq ≠ Lk.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Backend = Literal["auto", "math", "fused"]
BACKENDS = ("auto", "math", "fused")


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    keep_policy: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    backend: Backend = "auto",
    no_empty_rows: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention of queries ``q`` over keys ``k`` and values ``v``.

    Args:
        q: (…, Lq, E) queries; heads live in the leading dims, e.g. (B, H, Lq, E).
        k: (…, Lk, E) keys. Leading dims of q, k, v broadcast against each other.
        v: (…, Lk, Ev) values.
        mask: bool (True = may attend) or float (added to the logits), broadcastable to (…, Lq, Lk).
        is_causal: also forbid query i to see keys j > i (top-left aligned, as torch).
        scale: multiplies QKᵀ; default 1/√E.
        keep_policy: (B, Lk) in [0, 1], B the first leading dim of q; 1 = key kept (see module doc).
        dropout_p: probability of dropping an attention weight; pass 0 in evaluation.
        need_weights: also return the attention matrix A.
        backend: "math" (explicit matrix), "fused" (torch's kernel) or "auto" (fused unless the weights are needed
            or the policy needs a gradient, which the fused kernel cannot give). The fused kernel stays the choice
            for short rows too: on the development CPU (2-core EPYC) the explicit matrix made ViT-S forwards at
            batch 1 slower by 1-4 % in paired runs, though a Xeon favoured it (docs/performance.md).
        no_empty_rows: the caller guarantees that every query may attend to at least one key (a finite float mask,
            such as ToMe's log-sizes), so the handling of empty rows is skipped: on the CPU a read of the mask on the
            host, elsewhere a pass over the mask and one over the output (calls that cost time at batch 1).

    Returns:
        out (…, Lq, Ev), and A (…, Lq, Lk) when ``need_weights`` else None. With dropout, A is the matrix that
        was applied (after dropout), so ``out == A @ v`` always holds.
    """
    lead, scale = _validate(q, k, v, mask, is_causal, scale, keep_policy, dropout_p, backend)
    if backend == "fused" and need_weights:
        raise ValueError("backend='fused' cannot return weights (need_weights=True); use backend='math' or 'auto'")
    policy_needs_grad = keep_policy is not None and keep_policy.requires_grad and torch.is_grad_enabled()
    if backend == "fused" and policy_needs_grad:
        raise ValueError("backend='fused' cannot differentiate through keep_policy; use backend='math' or 'auto'")
    Lq, Lk = q.shape[-2], k.shape[-2]
    use_math = backend == "math" or (backend == "auto" and (need_weights or policy_needs_grad))
    allowed, bias = _split_mask(mask, is_causal, Lq, Lk, q.device)
    if use_math:
        return _math_attention(q, k, v, allowed, bias, scale, keep_policy, lead, dropout_p, need_weights, no_empty_rows)
    return _fused_attention(q, k, v, allowed, bias, scale, keep_policy, lead, dropout_p, no_empty_rows), None


def compute_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The textbook form, for people learning from the formula: softmax(QKᵀ/√d + mask) · V.

    Args:
        Q: (…, Lq, d); K: (…, Lk, d); V: (…, Lk, dv).
        mask: 0/1 or bool, broadcastable to (…, Lq, Lk); 0 (False) = masked (−∞ before the softmax).

    Returns:
        (output (…, Lq, dv), attn_weights (…, Lq, Lk)); each row of the weights sums to 1 (0 for a fully masked row).
    """
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a tensor of 0/1 or bool, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("mask must hold only 0 (masked) and 1 (visible) in compute_attention")
            mask = mask != 0
    out, weights = scaled_dot_product_attention(Q, K, V, mask, need_weights=True, backend="math")
    assert weights is not None
    return out, weights


def _validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    keep_policy: Tensor | None,
    dropout_p: float,
    backend: str,
) -> tuple[torch.Size, float]:
    """Check every argument before any compute; return the broadcast leading shape and the scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (…, L, E), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the last dim E: q {tuple(q.shape)} vs k {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must share the length Lk: k {tuple(k.shape)} vs v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    lead = q.shape[:-2]
    try:
        if k.shape[:-2] != lead or v.shape[:-2] != lead:  # torch.broadcast_shapes costs more than the rest here
            lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"leading dims of q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not broadcast"
        ) from None
    Lq, Lk = q.shape[-2], k.shape[-2]
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a bool or float tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"mask must be bool (True = may attend) or floating (added to logits), got {mask.dtype}")
        target = (*lead, Lq, Lk)
        if not _broadcasts_to(mask.shape, target):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (…, Lq, Lk) = {target}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    if keep_policy is not None:
        _validate_policy(keep_policy, q, lead, Lk)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return lead, float(scale)


def _validate_policy(keep_policy: Tensor, q: Tensor, lead: torch.Size, Lk: int) -> None:
    if not isinstance(keep_policy, Tensor):
        raise TypeError(f"keep_policy must be a tensor of shape (B, Lk), got {type(keep_policy).__name__}")
    if keep_policy.dtype != torch.bool and not keep_policy.is_floating_point():
        raise TypeError(f"keep_policy must be bool or floating in [0, 1], got dtype {keep_policy.dtype}")
    if len(lead) == 0:
        raise ValueError(f"keep_policy needs a batch dim: q must be (B, …, Lq, E), got shape {tuple(q.shape)}")
    B = lead[0]
    if keep_policy.dim() != 2 or keep_policy.shape[1] != Lk or keep_policy.shape[0] not in (1, B):
        raise ValueError(f"keep_policy must have shape (B, Lk) = ({B}, {Lk}), got {tuple(keep_policy.shape)}")
    # The value check reads the tensor on the host: free on CPU in eager mode, a graph break under torch.compile /
    # torch.export and a device sync on an accelerator, where it is skipped (the policies vitrim makes are in range).
    if keep_policy.is_floating_point() and keep_policy.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = (keep_policy < 0) | (keep_policy > 1) | keep_policy.isnan()
        if bool(bad.any()):
            raise ValueError(
                f"keep_policy must lie in [0, 1]; got values from {keep_policy.min().item():.8g} "
                f"to {keep_policy.max().item():.8g}"
            )


def _broadcasts_to(shape: torch.Size, target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _split_mask(
    mask: Tensor | None, is_causal: bool, Lq: int, Lk: int, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Return (allowed, bias): a bool mask (True = may attend) and a float mask to add, either may be None."""
    allowed: Tensor | None = None
    bias: Tensor | None = None
    if mask is not None:
        if mask.dim() < 2:  # a (Lk,) or scalar mask: give it a row dim, which torch's kernel requires
            mask = mask.reshape(*([1] * (2 - mask.dim())), *mask.shape)
        if mask.dtype == torch.bool:
            allowed = mask
        else:
            bias = mask
    if is_causal:
        causal = torch.ones(Lq, Lk, dtype=torch.bool, device=device).tril()
        allowed = causal if allowed is None else allowed & causal
    return allowed, bias


def _policy_gate(keep_policy: Tensor, ndim: int, Lq: int, Lk: int, dtype: torch.dtype) -> Tensor:
    """G of shape (B, 1, …, Lq or 1, Lk): policy_j off the diagonal, 1 on it (when Lq == Lk)."""
    policy = keep_policy.to(dtype)
    gate = policy.view(policy.shape[0], *([1] * (ndim - 3)), 1, Lk)  # (B, 1, …, 1, Lk): ndim dims in all
    if Lq == Lk:
        eye = torch.eye(Lq, dtype=dtype, device=policy.device)
        gate = gate + (1.0 - gate) * eye  # G_ii = 1, differentiable in the policy
    return gate


def _open_mask(
    allowed: Tensor | None, bias: Tensor | None, no_empty_rows: bool = False
) -> tuple[Tensor | None, Tensor | None]:
    """The mask a kernel can take without 0/0, and the rows that must come out as zeros (none if ``no_empty_rows``).

    Returns (attn_mask, empty_rows): attn_mask is bool (True = may attend) or float (added to the logits), with every
    row that allows no key opened (all True / all 0) so that no kernel divides 0 by 0; empty_rows (…, Lq or 1, 1)
    bool marks those rows, whose output :func:`_zero_empty_rows` sets to 0. Both are computed on the mask, before
    any broadcast against the logits, so they cost O(mask), not O(Lq·Lk) per head.
    """
    if no_empty_rows:
        if allowed is not None and bias is not None:
            return bias.masked_fill(~allowed, float("-inf")), None
        return (bias if allowed is None else allowed), None
    if bias is not None:
        if allowed is not None:
            bias = bias.masked_fill(~allowed, float("-inf"))
        elif _is_eager_cpu(bias) and not bool(torch.isneginf(bias).any()):
            return bias, None  # no −∞ at all (e.g. ToMe's log-sizes): nothing to open (one op instead of four)
        empty_rows = torch.isneginf(bias).all(dim=-1, keepdim=True)
        return bias.masked_fill(empty_rows, 0.0), empty_rows
    if allowed is not None:
        empty_rows = ~allowed.any(dim=-1, keepdim=True)
        return allowed | empty_rows, empty_rows
    return None, None


def _zero_empty_rows(t: Tensor, empty_rows: Tensor | None) -> Tensor:
    """``t`` (…, Lq, ·) with the rows of queries that may see no key set to 0 (the convention at the top).

    Branch-free under torch.compile / torch.export and on accelerators (a Python test of a tensor would break the
    graph or wait for the device; there the fill is fused or costs a fraction of the kernel). In eager mode on CPU,
    reading a few bools costs nothing while a fill of the whole output costs a pass over it (measured 5-10 % of the
    attention kernel at batch 32), so the fill runs only when some row is empty.
    """
    if empty_rows is None:
        return t
    if _is_eager_cpu(t) and not bool(empty_rows.any()):
        return t
    return t.masked_fill(empty_rows, 0.0)


def _is_eager_cpu(t: Tensor) -> bool:
    """True where reading a tensor's value on the host is free: eager mode (no graph to break) on CPU (no sync)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    scale: float,
    keep_policy: Tensor | None,
    lead: torch.Size,
    dropout_p: float,
    need_weights: bool,
    no_empty_rows: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The explicit matrix: logits, mask, softmax (float32 for half inputs), weights · V.

    Without a policy the mask is opened as for the fused kernel (:func:`_open_mask`), so an empty row costs one fill
    of its output row (or of its weights, when they are returned), never a pass over the whole logits.
    """
    Lq, Lk = q.shape[-2], k.shape[-2]
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    logits = (q * scale) @ k.transpose(-2, -1)  # (…, Lq, Lk)
    empty_rows: Tensor | None = None
    if keep_policy is None:
        attn_mask, empty_rows = _open_mask(allowed, bias, no_empty_rows)
        # In place where shapes and dtypes allow: the logits are a fresh product that nothing else holds (matmul
        # saves q and k for backward, not its output).
        in_place = attn_mask is not None and _broadcasts_to(attn_mask.shape, logits.shape)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            logits = (
                logits.masked_fill_(~attn_mask, float("-inf"))
                if in_place
                else logits.masked_fill(~attn_mask, float("-inf"))
            )
        elif attn_mask is not None:
            logits = logits.add_(attn_mask) if in_place and attn_mask.dtype == logits.dtype else logits + attn_mask
        weights = torch.softmax(logits, dim=-1, dtype=acc)
        if need_weights:
            weights = _zero_empty_rows(weights, empty_rows)
            empty_rows = None  # the weights carry the zeros into the output
    else:
        if bias is not None:
            logits = logits + bias
        gate = _policy_gate(keep_policy, len(lead) + 2, Lq, Lk, acc)
        weights = _gated_softmax(logits.to(acc), allowed, gate)  # empty rows come out as zeros
    weights = weights.to(q.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    out = _zero_empty_rows(weights @ v, empty_rows)  # (…, Lq, Ev)
    return out, (weights if need_weights else None)


def _gated_softmax(logits: Tensor, allowed: Tensor | None, gate: Tensor) -> Tensor:
    """exp(P_ij)·G_ij / Σ_k exp(P_ik)·G_ik, written out so that gradients reach the gate G.

    A key gated to exactly 0 gets no weight but must still get a gradient (straight-through training asks how
    much re-admitting it would help), so only masked keys are set to −∞. The row is shifted by the maximum over
    keys that can receive weight, so a dropped key with a huge logit cannot make the kept keys underflow; the
    shifted logits are capped so that exp of such a dropped key cannot overflow (its gradient is then clipped).
    """
    if logits.shape[-1] == 0:  # no keys (Lk = 0): every row is empty, its weights are zeros (amax needs a key)
        return logits * gate
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        row_max = logits.masked_fill(gate <= 0, float("-inf")).amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty row: exp(-inf)=0
    cap = 0.5 * math.log(torch.finfo(logits.dtype).max)  # exp(cap)² still fits; kept keys are ≤ 0 after the shift
    weights = torch.exp((logits - row_max).clamp(max=cap)) * gate
    denom = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(denom > 0, denom, torch.ones_like(denom))  # an empty row stays 0, not 0/0


def _fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    scale: float,
    keep_policy: Tensor | None,
    lead: torch.Size,
    dropout_p: float,
    no_empty_rows: bool = False,
) -> Tensor:
    """torch's fused kernel. A constant policy becomes the additive bias log G (exact: exp(P + log G) = exp(P)·G)."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    ndim = len(lead) + 2
    if keep_policy is not None:
        log_gate = _policy_gate(keep_policy.detach(), ndim, Lq, Lk, q.dtype).log()
        bias = log_gate if bias is None else bias + log_gate
    attn_mask, empty_rows = _open_mask(allowed, bias, no_empty_rows and keep_policy is None)
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
        attn_mask = attn_mask.to(q.dtype)
    if q.shape[:-2] != lead or k.shape[:-2] != lead or v.shape[:-2] != lead:
        q, k, v = (t.expand(*lead, *t.shape[-2:]) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
    return _zero_empty_rows(out, empty_rows)
