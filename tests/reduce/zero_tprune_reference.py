"""Zero-TPrune's forward written from the paper (Wang, Dedhia & Jha, CVPR 2024; no code was released), one image at a
time with Python lists, on the plain ViT of vit_reference. Shares no vitrim code.

In a pruning block, after the attention residual, for each image and head h: the attention matrix A_h (row = query)
is a graph; Weighted PageRank starts from 1/N on every token and repeats s(x_j) ← Σ_i A_h(x_i, x_j) s(x_i). The
head scores are combined per token (root mean square, or mean), [CLS] set aside. Of the n patch tokens, k =
ceil(keep_rate · n) stay: r = n − k go, r_S = min(floor(share · r), k) of them by similarity, the rest by importance
(the lowest first). The m survivors, by importance, split into the best floor(m / 2) and the others; each of the
others scores its largest cosine similarity (keys averaged over heads) to the best group; the r_S highest go. The
kept tokens: best group in importance order, then the remaining others in importance order.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from vit_reference import BlockIO, vit_forward


def _page_rank(attn: Tensor, iterations: int) -> Tensor:
    """attn (H, N, N) -> (H, N): per head, s_j ← Σ_i attn[h, i, j] s_i from uniform."""
    H, N, _ = attn.shape
    s = torch.full((H, N), 1.0 / N, dtype=attn.dtype)
    for _ in range(iterations):
        s = torch.einsum("hij,hi->hj", attn, s)
    return s


def _keep_one(attn: Tensor, keys: Tensor, k: int, share: float, iterations: int, how: str) -> list[int]:
    """Patch-token indices (0-based, [CLS] excluded) kept for one image."""
    s = _page_rank(attn, iterations)
    score = s.pow(2).mean(0).sqrt() if how == "eir" else s.mean(0)
    score = score[1:].tolist()
    n = len(score)
    r = n - k
    r_s = min(math.floor(share * r), k)
    ranked = sorted(range(n), key=lambda j: -score[j])
    survivors = ranked[: n - (r - r_s)]
    if r_s == 0:
        return survivors
    m = len(survivors)
    best, others = survivors[: m // 2], survivors[m // 2 :]
    key = keys.mean(0)[1:]  # (n, hd)

    def cos(a: int, b: int) -> float:
        return float(key[a] @ key[b] / (key[a].norm() * key[b].norm()))

    redundancy = {j: max(cos(j, b) for b in best) for j in others}
    dropped = set(sorted(others, key=lambda j: -redundancy[j])[:r_s])
    return best + [j for j in others if j not in dropped]


def zero_tprune_forward(
    images: Tensor,
    sd: dict[str, Tensor],
    heads: int,
    depth: int,
    keep_rates: dict[int, float],
    share: float = 0.5,
    iterations: int = 30,
    how: str = "eir",
) -> tuple[Tensor, list[Tensor]]:
    """-> logits, and for each pruning block the kept patch positions (B, k) in the order they stand."""
    kept_positions: list[Tensor] = []

    def hook(io: BlockIO) -> BlockIO:
        rate = keep_rates.get(io.i, 1.0)
        n = io.x.shape[1] - 1
        k = min(n, math.ceil(rate * n)) if rate < 1 else n
        if k >= n:
            return io
        rows = []
        for b in range(io.x.shape[0]):
            kept = _keep_one(io.attn[b], io.k[b], k, share, iterations, how)
            rows.append([0] + [j + 1 for j in kept])
        index = torch.tensor(rows)
        io.x = torch.stack([io.x[b, index[b]] for b in range(len(rows))])
        io.source = torch.stack([io.source[b, index[b]] for b in range(len(rows))])
        kept_positions.append(io.source[:, 1:].argmax(-1))
        return io

    logits, _ = vit_forward(images, sd, heads, depth, hook, prop_attn=False)
    return logits, kept_positions
