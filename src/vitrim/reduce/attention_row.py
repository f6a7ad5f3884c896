"""The [CLS] row of a block's attention matrix, without ever building the other N − 1 rows.

EViT and top-k rank patch tokens by how much the [CLS] query attends to them. When the block ran the fused kernel
the matrix was never formed, so the row is recomputed from the block's own q and k with the same attention function,
scale, float bias (ToMe's log-size) and keep-policy: one query against N keys, O(N) instead of O(N²). When the caller
asked for the weights anyway (``need_weights=True``), their first row is reused.
"""

from __future__ import annotations

from torch import Tensor

from vitrim.attention import scaled_dot_product_attention
from vitrim.reduce.base import AttentionInfo


def cls_attention(info: AttentionInfo) -> Tensor:
    """(B, H, N): softmax attention of query 0 ([CLS]) over all N keys, per head, as the block computed it.

    Semantics are :func:`vitrim.scaled_dot_product_attention`'s: logits q·kᵀ·scale + ``info.mask``, keys gated by
    ``info.keep_policy`` (the [CLS] key's own policy entry is 1 by the TokenState convention, so G_00 = 1 holds as in
    the full matrix). With attention dropout in training, the reused weights are the dropped-out ones.
    """
    if info.weights is not None:
        return info.weights[:, :, 0]  # (B, H, N)
    q = info.q[:, :, :1]  # (B, H, 1, hd)
    # v = k: the output is not used, and k already has the right shape; the cost is one (1 × N) product per head.
    _, weights = scaled_dot_product_attention(
        q, info.k, info.k, info.mask, scale=info.scale, keep_policy=info.keep_policy, need_weights=True
    )
    assert weights is not None
    return weights[:, :, 0]  # (B, H, N)


def cls_attention_to_patches(info: AttentionInfo, num_prefix: int) -> Tensor:
    """(B, N − num_prefix): the [CLS] row averaged over heads, restricted to the patch tokens (EViT's score)."""
    if num_prefix < 1:
        raise ValueError("ranking tokens by [CLS] attention needs a [CLS] token (num_prefix >= 1), got num_prefix=0")
    return cls_attention(info)[:, :, num_prefix:].mean(dim=1)
