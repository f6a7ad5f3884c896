"""The token state that flows through the blocks, and every convention about it (owned here).

* ``tokens`` (B, N, D): the first ``num_prefix`` tokens are prefix tokens ([CLS], DeiT's distillation token,
  registers); reducers never drop, merge or score them.
* ``positions`` (B, N - num_prefix) long: for every patch token, its absolute position 0 … P−1 in the full patch
  grid of the input image (for a merged token, the position of the token it was merged into). None when nobody
  needs them: provenance is not recorded (``record`` False) and no RoPE rotates by them.
* ``sizes`` (B, N) float or None: how many patches each token stands for (ToMe); None means all ones. When present
  and ``size_bias`` is True the Block adds log(size) to the attention logits (proportional attention; ToMe's
  ``prop_attn=False`` keeps the sizes for merging and pooling but turns the bias off).
* ``fused`` (B, N − num_prefix) bool or None: True for an EViT fused token (it stands for patches that were not
  kept). Its ``positions`` entry is the most attentive fused patch (a real position, for RoPE); when a later stage
  keeps it, ``kept_indices`` lists −1 for it, since no patch of its own was kept.
* ``keep_policy`` (B, N) float or None: DynamicViT's training-time decisions, 1 = kept; prefix entries are 1. Every
  attention call receives it; tokens are masked, not removed.
* ``grid_patches``: P, the number of patches in the input image's full grid (set by the model's ``embed``; None
  when unknown). Reducers that keep a fraction of the image (DynamicViT: int(P · ρ^s)) count from it.
* ``rope`` (P, 2·hd) or None: the rotary table of the input's full grid (:mod:`vitrim.attention.rotary`); every
  Block rotates the q and k of its patch tokens by the rows of their ``positions``, so a kept or merged token keeps
  the phase of its absolute position.
* ``training``: the model's mode, set by the model's ``embed``; reducers that behave differently in training
  (DynamicViT masks instead of gathering) read it here.
* ``kept_indices``: one (B, k) long tensor per reduction that removed tokens, absolute patch positions, in the order
  the tokens now stand (−1 for a kept EViT fused token); ``keep_masks``: one (B, P) tensor per training-time
  decision (1 = kept) over the full grid.
* ``patch_to_token``: one (B, P) long tensor per reduction that changed which tokens exist: for every patch of the
  full grid, the index (0 … N'−num_prefix−1) of the patch token that stands for it after that reduction, −1 for a
  patch that was dropped. Merged regions are drawn from it without any bookkeeping.
* ``record``: whether provenance is recorded at all (``kept_indices``, ``keep_masks``, ``patch_to_token``,
  ``block_positions``, ``block_patch_to_token``, EViT's ``fused`` flags, and ``positions`` when no RoPE needs them).
  ``model.forward_detailed`` and direct ``model.embed`` callers (pictures, rollout) get it; ``model(images)`` does not,
  so plain inference makes no bookkeeping calls (at batch 1 on a GPU each call costs host time, not FLOPs).
* ``trace``: False once a reducer was told not to trace sources (ToMe's ``trace_source=False``): from then on no
  ``patch_to_token`` map is recorded (pictures of such a model refuse rather than guess).
* ``block_positions`` / ``block_patch_to_token``: provenance recorded by each Block as its attention runs: the
  ``positions`` of the tokens that block's attention saw, and the ``patch_to_token`` map in force then (None before
  any tracked reduction). Pictures and rollout zip them with the block's attention map; nothing is inferred.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenState:
    """Tokens flowing through the blocks, with what reducers need to know about them (see module doc)."""

    tokens: Tensor
    num_prefix: int
    positions: Tensor | None
    sizes: Tensor | None = None
    size_bias: bool = True
    fused: Tensor | None = None
    keep_policy: Tensor | None = None
    kept_indices: tuple[Tensor, ...] = ()
    keep_masks: tuple[Tensor, ...] = ()
    grid_patches: int | None = None
    patch_to_token: tuple[Tensor, ...] = ()
    rope: Tensor | None = None
    training: bool = False
    record: bool = True
    trace: bool = True
    block_positions: tuple[Tensor, ...] = ()
    block_patch_to_token: tuple[Tensor | None, ...] = ()

    def replace(self, **changes: object) -> TokenState:
        """A copy with some fields changed (unknown names raise TypeError, as ``dataclasses.replace`` does).

        Blocks call this several times per forward; copying the instance dict is a few times cheaper than
        ``dataclasses.replace``, which re-runs ``__init__`` field by field (measurable at batch 1). Under
        ``torch.compile`` the cost is paid once, at tracing, and ``dataclasses.replace`` is what every dynamo
        traces (torch 2.11's cannot trace the ``__dict__`` copy: a graph break per block).
        """
        if torch.compiler.is_compiling():
            return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        unknown = [name for name in changes if name not in _FIELD_NAMES]
        if unknown:
            raise TypeError(f"TokenState has no field(s) {sorted(unknown)}")
        new = object.__new__(TokenState)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    @property
    def num_patch_tokens(self) -> int:
        """n: the tokens after the prefix."""
        return self.tokens.shape[1] - self.num_prefix

    def attention_bias(self) -> Tensor | None:
        """(B, 1, 1, N) float mask adding log(size) to the logits (proportional attention), or None. At batch 1 in
        eager mode it is (1, N), which broadcasts over (1, H, N, N) the same way (one call fewer per block).

        Finite wherever sizes are positive, and a prefix token's size is always 1 (a GAP model's tokens have sizes
        of at least 1): it never closes every key of a row. Made once per ``sizes`` tensor: blocks after a reduction
        that did not change the sizes reuse it.
        """
        sizes = self.sizes
        if sizes is None or not self.size_bias:
            return None
        memo = self.__dict__.get("_bias")
        if memo is not None and memo[0] is sizes:
            return memo[1]
        bias = sizes.log()  # (B, N)
        if sizes.shape[0] != 1 or torch.compiler.is_compiling():
            bias = bias.view(sizes.shape[0], 1, 1, sizes.shape[1])
        if bias.dtype != self.tokens.dtype:
            bias = bias.to(self.tokens.dtype)
        if not torch.compiler.is_compiling():
            self.__dict__["_bias"] = (sizes, bias)  # a cache, not a field: copies made by replace() carry it along
        return bias

    def rotary(self) -> Tensor | None:
        """(B, 1, n, 2·hd) rotary rows of the patch tokens (by their absolute positions), or None without RoPE."""
        if self.rope is None or self.positions is None:
            return None
        return self.rope[self.positions].unsqueeze(1)

    def patch_weights(self) -> Tensor | None:
        """(B, N - num_prefix) weight of each patch token in a mean over patches (sizes × policy), or None."""
        weights = None
        if self.sizes is not None:
            weights = self.sizes[:, self.num_prefix :]
        if self.keep_policy is not None:
            policy = self.keep_policy[:, self.num_prefix :].to(self.tokens.dtype)
            weights = policy if weights is None else weights * policy
        return weights

    def record_block(self) -> TokenState:
        """This state with the provenance of one more block's attention appended (see module doc); itself when
        provenance is not recorded."""
        if not self.record or self.positions is None:
            return self
        return self.replace(
            block_positions=(*self.block_positions, self.positions),
            block_patch_to_token=(
                *self.block_patch_to_token,
                self.patch_to_token[-1] if self.patch_to_token and self.trace else None,
            ),
        )


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(TokenState))


def patch_positions(batch: int, num_patches: int, device: torch.device) -> Tensor:
    """(B, P) absolute positions 0 … P−1 of a full grid."""
    return torch.arange(num_patches, device=device).expand(batch, num_patches)
