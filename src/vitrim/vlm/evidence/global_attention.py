"""HiPrune's "global attention" of a Qwen tower block per merged token, on the scale its authors' Qwen2.5-VL code uses.

Their vision attention returns the block's softmax map (H, P, P) over its segments; per block they take the mean
over heads, the sum over queries (the attention each patch receives), the mean over each merged token's m² patches,
then the merged tokens' raster order. :func:`~vitrim.vlm.evidence.merged_tokens.image_evidence` holds the same sums
per head as ``received`` (H, N), summed over the m² patches and divided by the image's P = t·N·m² patches (a mean
over its queries); this module turns that back into the authors' values, whose scale matters: their selection
subtracts 1 from an anchored token's deep score, a shift the size of one query's whole attention.
"""

from __future__ import annotations

from torch import Tensor


def authors_global_attention(received: Tensor) -> Tensor:
    """(N,) float: per merged token, the mean over heads of the attention received summed over the image's queries,
    averaged over the token's m² patches. ``received``: (H, N) in ``ImageEvidence.received``'s convention, where
    ``received · P / m²`` = the per-token sum averaged over its patches and P / m² = N (the image's merged tokens)."""
    return received.mean(0) * received.shape[1]
