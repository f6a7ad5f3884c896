"""Unmerge: a reduced model's final tokens back on the full patch grid, through the recorded provenance.

ToMe's ``unmerge`` idea, for every reducer at once: ``patch_to_token[-1]`` (B, P) says which patch token stands for
each patch of the input's grid after the last reduction (see :mod:`vitrim.reduce.state`), so

    grid[b, p] = tokens[b, num_prefix + patch_to_token[b, p]]      if patch_to_token[b, p] >= 0
    grid[b, p] = 0                                                   if the patch was dropped (−1)

A merged token's features land on every patch it stands for (ToMe, PiToMe, MCTF, PPT pooling); EViT's fused token
lands on every patch it fused; a patch dropped by top-k, DynamicViT or PPT pruning gets zeros (its last-seen
features are not kept by the blocks, and zeros make "dropped" visible in a picture and neutral in a dense head).
Prefix tokens are not part of the grid. Written as one gather over a zero row appended to the tokens, so it exports
(no scatter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def tokens_on_grid(tokens: Tensor, patch_to_token: Sequence[Tensor] | Tensor | None, num_prefix: int) -> Tensor:
    """(B, P, D) patch-grid features from the final ``tokens`` (B, N', D) (prefix first).

    patch_to_token: the last (B, P) map (or the whole list of them, of which the last is used); None or an empty
    list means no reduction ran, so the N' − num_prefix patch tokens are the grid itself, in grid order.
    """
    if isinstance(patch_to_token, Sequence):
        patch_to_token = patch_to_token[-1] if len(patch_to_token) else None
    patches = tokens[:, num_prefix:]  # (B, n, D)
    if patch_to_token is None:
        return patches
    B, n, D = patches.shape
    if patch_to_token.shape[0] != B or int(patch_to_token.max()) >= n:
        raise ValueError(
            f"patch_to_token must be ({B}, P) indices below {n} (the patch tokens after num_prefix={num_prefix}), "
            f"got shape {tuple(patch_to_token.shape)} with max {int(patch_to_token.max())}"
        )
    padded = torch.cat([patches, patches.new_zeros(B, 1, D)], dim=1)  # (B, n + 1, D): row n is the dropped-patch zero
    index = torch.where(patch_to_token < 0, n, patch_to_token)  # (B, P)
    return padded.gather(1, index[..., None].expand(-1, -1, D))  # (B, P, D)
