"""Density-peak clustering (DPC-kNN, Du et al. 2016) as the video methods use it to pick anchor tokens: each token's
local density from its k nearest, its distance to the nearest denser token, and the peaks of their product.

FastVID picks its anchors this way (k = 4); FlashVID clusters the tokens its temporal merging leaves
(k = min(clusters, 7)) and assigns every token to its nearest peak. Both authors' codes compute the same
quantities, written here once from their description (not copied).
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_distances(tokens: Tensor) -> Tensor:
    """(n, n) ‖xᵢ − xⱼ‖ / √E of ``tokens`` (n, E), in float32 at least (a half-precision model's tokens too)."""
    work = torch.promote_types(tokens.dtype, torch.float32)
    return torch.cdist(tokens[None].to(work), tokens[None].to(work))[0] / tokens.shape[-1] ** 0.5


def peak_scores(distance: Tensor, neighbours: int) -> Tensor:
    """(n,) ρ·δ from the pairwise ``distance`` (n, n): density ρᵢ = exp(−mean of the squared distances to its
    ``neighbours`` nearest, itself included), δᵢ = the distance to the nearest token of higher density (the largest
    distance of all where none is denser). No random tie-break (both authors add a 1e-6 ``torch.rand`` jitter)."""
    nearest = torch.topk(distance, min(neighbours, len(distance)), dim=-1, largest=False).values
    density = torch.exp(-(nearest**2).mean(-1))  # (n,)
    higher = density[None, :] > density[:, None]  # [i, j]: j is denser than i
    parent = torch.where(higher, distance, distance.max()).min(-1).values
    return parent * density


def density_peaks(tokens: Tensor, count: int, neighbours: int) -> Tensor:
    """Sorted (count,) indices of the ``count`` density peaks among ``tokens`` (n, E) (:func:`peak_scores`)."""
    return torch.topk(peak_scores(token_distances(tokens), neighbours), count).indices.sort().values
