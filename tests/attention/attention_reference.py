"""A float64 attention written straight from the formula, independent of vitrim's code.

    A_ij = exp(P_ij)·G_ij / Σ_k exp(P_ik)·G_ik,  P = scale · Q Kᵀ (+ float mask),  out = A V

G is 1 where a query may look and 0 elsewhere (bool mask, causal), times the keep-policy with G_ii = 1 when
Lq == Lk. No max-subtraction: test inputs are small, and exp(−∞) = 0 closes masked keys exactly. A row whose
denominator is 0 (no allowed key) is all zeros.
"""

from __future__ import annotations

import torch
from torch import Tensor


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    keep_policy: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    q, k, v = q.double(), k.double(), v.double()
    Lq, Lk, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = E**-0.5 if scale is None else scale
    P = torch.einsum("...ie,...je->...ij", q, k) * scale  # (…, Lq, Lk)
    G = torch.ones(Lq, Lk, dtype=torch.float64)
    if mask is not None:
        if mask.dtype == torch.bool:
            G = G * mask.double()
        else:
            P = P + mask.double()
    if is_causal:
        # query i sees keys 0 … i, counted from the top-left corner (torch's alignment), also when Lq != Lk
        G = G * torch.ones(Lq, Lk, dtype=torch.float64).tril()
    if keep_policy is not None:
        policy = keep_policy.double().reshape(keep_policy.shape[0], *([1] * (P.dim() - 3)), 1, Lk)
        if Lq == Lk:
            policy = torch.where(torch.eye(Lq, dtype=torch.bool), torch.ones((), dtype=torch.float64), policy)
        G = G * policy
    numer = torch.exp(P) * G
    denom = numer.sum(dim=-1, keepdim=True)
    A = numer / torch.where(denom > 0, denom, torch.ones_like(denom))
    return A @ v, A


def softmax_over_subset(logits_row: Tensor, keys: list[int]) -> Tensor:
    """Softmax of one row of logits over the listed keys only; the other keys get exactly 0."""
    out = torch.zeros_like(logits_row)
    out[keys] = torch.softmax(logits_row[keys], dim=-1)
    return out
