"""The token-reduction interface every Block understands: a token state, and a reducer that changes it.

A reducer sits inside a Block and sees the tokens either before attention (``stage = "pre"``: DynamicViT scores
the tokens that enter the block) or between attention and MLP (``stage = "mid"``: ToMe, EViT, top-k, which use
what attention just computed). It returns a new :class:`TokenState`; nothing is mutated in place and nothing is
shared between calls, so a model with reducers stays a plain function of its input.

Conventions (owned here):

* ``tokens`` (B, N, D): the first ``num_prefix`` tokens are [CLS] (and DeiT's distillation token); reducers never
  drop, merge or score them.
* ``positions`` (B, N - num_prefix) long: for every patch token, its absolute position 0 … P−1 in the full patch
  grid of the input image (for a merged token, the position of the token it was merged into).
* ``sizes`` (B, N) float or None: how many patches each token stands for (ToMe); None means all ones. When present
  the Block adds log(size) to the attention logits (proportional attention).
* ``keep_policy`` (B, N) float or None: DynamicViT's training-time decisions, 1 = kept; prefix entries are 1. Every
  attention call receives it; tokens are masked, not removed.
* ``grid_patches``: P, the number of patches in the input image's full grid (set by the model's ``embed``; None
  when unknown). Reducers that keep a fraction of the image (DynamicViT: int(P · ρ^s)) count from it.
* ``kept_indices``: one (B, k) long tensor per reduction that removed tokens, absolute patch positions, in the order
  the tokens now stand; ``keep_masks``: one (B, P) tensor per training-time decision (1 = kept) over the full grid.
* ``patch_to_token``: one (B, P) long tensor per reduction by a reducer that tracks merges (ToMe, EViT, top-k):
  for every patch of the full grid, the index (0 … N'−num_prefix−1) of the patch token that stands for it after that
  reduction, −1 for a patch that was dropped. Merged regions are drawn from it without any bookkeeping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenState:
    """Tokens flowing through the blocks, with what reducers need to know about them (see module doc)."""

    tokens: Tensor
    num_prefix: int
    positions: Tensor
    sizes: Tensor | None = None
    keep_policy: Tensor | None = None
    kept_indices: tuple[Tensor, ...] = ()
    keep_masks: tuple[Tensor, ...] = ()
    grid_patches: int | None = None
    patch_to_token: tuple[Tensor, ...] = ()

    def replace(self, **changes: object) -> TokenState:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def attention_bias(self) -> Tensor | None:
        """(B, 1, 1, N) float mask adding log(size) to the logits (proportional attention), or None."""
        if self.sizes is None:
            return None
        return self.sizes.log()[:, None, None, :].to(self.tokens.dtype)

    def patch_weights(self) -> Tensor | None:
        """(B, N - num_prefix) weight of each patch token in a mean over patches (sizes × policy), or None."""
        weights = None
        if self.sizes is not None:
            weights = self.sizes[:, self.num_prefix :]
        if self.keep_policy is not None:
            policy = self.keep_policy[:, self.num_prefix :].to(self.tokens.dtype)
            weights = policy if weights is None else weights * policy
        return weights


@dataclass(frozen=True)
class AttentionInfo:
    """What a Block's attention computed, for reducers placed after it.

    q, k: (B, H, N, hd) queries and keys after any qk-norm; weights: (B, H, N, N) when the caller asked for them;
    mask: the float bias that attention received (proportional attention), or None; scale: the logit scale.
    """

    q: Tensor
    k: Tensor
    weights: Tensor | None
    mask: Tensor | None
    keep_policy: Tensor | None
    scale: float


class Reducer:
    """Base class of token reducers. Subclasses set the class attributes and implement ``__call__``.

    A reducer is a plain object, not an ``nn.Module``: it holds settings, not parameters (a learned reducer such
    as DynamicViT's keeps a reference to modules that the model owns), so attaching one never changes a state dict.
    """

    stage: ClassVar[Literal["pre", "mid"]] = "mid"
    needs_attention: ClassVar[bool] = False  # ask the Block for q and k (an AttentionInfo) when "mid"

    def __call__(self, state: TokenState, info: AttentionInfo | None) -> TokenState:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


def patch_positions(batch: int, num_patches: int, device: torch.device) -> Tensor:
    """(B, P) absolute positions 0 … P−1 of a full grid."""
    return torch.arange(num_patches, device=device).expand(batch, num_patches)
