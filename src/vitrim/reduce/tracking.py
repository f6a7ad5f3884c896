"""Which token stands for each patch: the ``patch_to_token`` record that ToMe, EViT and top-k keep up to date.

A reducer describes what it did to the patch tokens with ``dest`` (B, n) long: for each of the n patch tokens that
entered it, the index of the patch token that now stands for it (−1 if dropped). Composing ``dest`` with the previous
(B, P) map gives the new one; one (B, P) map per reduction is appended to ``TokenState.patch_to_token``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitrim.reduce.base import TokenState


def current_patch_to_token(state: TokenState) -> Tensor | None:
    """(B, P) long: the patch token (0 … n−1) standing for each patch of the grid now, −1 if dropped; None if unknown.

    Before any tracked reduction the map is read from ``positions``: patch ``positions[b, j]`` is token j. That needs
    the grid size P: ``state.grid_patches``, or n when no reduction removed a token yet. A reducer that removed tokens
    without tracking them (and no grid size) leaves the map unknown, and tracking stops rather than guessing.
    """
    if state.patch_to_token:
        return state.patch_to_token[-1]
    positions = state.positions  # (B, n)
    B, n = positions.shape
    P = state.grid_patches
    if P is None:
        if state.kept_indices:
            return None
        P = n
    tokens = torch.arange(n, device=positions.device).expand(B, n)
    return torch.full((B, P), -1, dtype=torch.long, device=positions.device).scatter_(1, positions, tokens)


def record_reduction(state: TokenState, dest: Tensor) -> tuple[Tensor, ...]:
    """The state's ``patch_to_token`` with one more map, after a reduction that sent patch token j to ``dest[:, j]``.

    dest: (B, n) long, n = the patch tokens before the reduction; −1 = dropped.
    """
    before = current_patch_to_token(state)  # (B, P)
    if before is None:
        return state.patch_to_token
    after = dest.gather(1, before.clamp_min(0))  # (B, P)
    after = torch.where(before < 0, before, after)  # a patch dropped earlier stays dropped
    return (*state.patch_to_token, after)
