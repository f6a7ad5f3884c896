"""Attention rollout (Abnar & Zuidema, 2020): how much each input token flows into each output token.

For every block b, with attention weights A_b (B, H, N_b, N_b):

    F_b = fuse(A_b over heads)                    mean, max or min                        (B, N_b, N_b)
    F_b[lowest links] = 0                         optional, ``discard_ratio`` (see below)
    Â_b = rownorm(F_b + I)                        the residual path: half attention, half identity
    R = Â_L · … · Â_2 · Â_1                       (B, N, N); row i: where token i's information came from

``R[:, 0, num_prefix:]`` is the usual [CLS] relevance of every patch.

Discarding (the semantics of jacobgil/vit-explain, the common implementation, with its batch bug fixed): per
sample, the ``floor(discard_ratio · N_b²)`` smallest entries of the flattened fused map are set to 0, except
entries in the prefix rows and columns ([CLS] row 0 and column 0, and DeiT's distillation token), which are never
dropped. The count is taken over the whole map, so slightly fewer than that fraction go when some of the smallest
entries sit in a prefix row or column. Rows are re-normalised afterwards, so every row of every Â_b and of R sums
to 1.

Pruned models (DynamicViT at inference): block b sees only N_b ≤ N tokens. ``token_index`` (B, N_b) long says,
for each token the block saw, its index in the original N tokens (prefix tokens 0 … num_prefix−1, the patch at
absolute grid position p at num_prefix + p). The accumulator keeps R as (B, N, N) over *original* tokens: for
each block it takes the rows of the tokens that block saw, multiplies them by Â_b and writes them back,

    R[idx_b] = Â_b · R[idx_b]

so a dropped token's row stays what it was when it was last seen (still a distribution that sums to 1), and the
columns always refer to the original tokens. For a dense model every ``token_index`` is None and this is the
plain product. Merged tokens (ToMe) are followed through the token they were merged into; what was merged in is
not credited (an approximation, documented rather than hidden).

Memory: the accumulator holds one (B, N, N) matrix and one block's map at a time; feed it block by block
(:func:`attention_rollout_model`) to never hold every block's maps at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from vitrim.models.vit import VisionTransformer

HeadFusion = Literal["mean", "max", "min"]
HEAD_FUSIONS = ("mean", "max", "min")


def _check_options(head_fusion: str, discard_ratio: float, num_prefix: int) -> None:
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    if isinstance(discard_ratio, bool) or not isinstance(discard_ratio, (int, float)) or not 0 <= discard_ratio < 1:
        raise ValueError(f"discard_ratio must be a number in [0, 1), got {discard_ratio!r}")
    if isinstance(num_prefix, bool) or not isinstance(num_prefix, int) or num_prefix < 0:
        raise ValueError(f"num_prefix must be an int >= 0, got {num_prefix!r}")


def fuse_heads(attention: Tensor, head_fusion: HeadFusion = "mean") -> Tensor:
    """(B, H, N, N) -> (B, N, N): the mean, max or min over heads."""
    if head_fusion == "mean":
        return attention.mean(dim=1)
    if head_fusion == "max":
        return attention.amax(dim=1)
    if head_fusion == "min":
        return attention.amin(dim=1)
    raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")


def rollout_step(fused: Tensor, discard_ratio: float = 0.0, num_prefix: int = 1) -> Tensor:
    """One block's Â = rownorm(F + I) after discarding the weakest links (module doc). (B, N, N) -> (B, N, N)."""
    B, N, _ = fused.shape
    fused = fused.float()
    num_drop = int(discard_ratio * N * N)
    if num_drop > 0:
        flat = fused.reshape(B, N * N).clone()
        _, lowest = flat.topk(num_drop, dim=-1, largest=False)  # (B, num_drop) flat indices
        row, col = lowest // N, lowest % N
        drop = (row >= num_prefix) & (col >= num_prefix)  # never the [CLS] (prefix) rows and columns
        flat.scatter_(1, lowest, torch.where(drop, 0.0, flat.gather(1, lowest)))
        fused = flat.reshape(B, N, N)
    a = fused + torch.eye(N, device=fused.device, dtype=fused.dtype)  # the residual path
    return a / a.sum(dim=-1, keepdim=True)  # diagonal >= 1, so never 0 / 0


class Rollout:
    """Accumulates attention rollout one block at a time; holds one (B, N, N) matrix (module doc).

    Args:
        head_fusion: how to merge the heads of one block: "mean", "max" or "min".
        discard_ratio: fraction in [0, 1) of the weakest links to drop in every block (module doc).
        num_prefix: prefix tokens ([CLS], distillation) whose links are never dropped.
        num_tokens: N, the original token count. Needed only if the first block fed already saw fewer tokens.
    """

    def __init__(
        self,
        head_fusion: HeadFusion = "mean",
        discard_ratio: float = 0.0,
        num_prefix: int = 1,
        num_tokens: int | None = None,
    ) -> None:
        _check_options(head_fusion, discard_ratio, num_prefix)
        if num_tokens is not None and (
            isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0
        ):
            raise ValueError(f"num_tokens must be a positive int or None, got {num_tokens!r}")
        self.head_fusion: HeadFusion = head_fusion
        self.discard_ratio = float(discard_ratio)
        self.num_prefix = num_prefix
        self.num_tokens = num_tokens
        self._result: Tensor | None = None
        self.num_blocks = 0

    def update(self, attention: Tensor, token_index: Tensor | None = None) -> None:
        """Fold in one block's attention (B, H, N_b, N_b); ``token_index`` (B, N_b) long, or None for all N tokens."""
        if not isinstance(attention, Tensor):
            raise TypeError(f"attention must be a torch.Tensor (B, H, N, N), got {type(attention).__name__}")
        if attention.dim() != 4 or attention.shape[-1] != attention.shape[-2] or not attention.is_floating_point():
            raise ValueError(
                f"attention must be a floating (B, H, N, N) tensor, got {attention.dtype} of shape "
                f"{tuple(attention.shape)} (block {self.num_blocks})"
            )
        B, _, Nb, _ = attention.shape
        N = self.num_tokens if self.num_tokens is not None else (Nb if token_index is None else None)
        if N is None:
            raise ValueError("the first block has a token_index; pass num_tokens (the original N) to Rollout")
        if token_index is None and Nb != N:
            raise ValueError(
                f"block {self.num_blocks} saw {Nb} tokens but the model has {N}; pass its token_index (B, {Nb})"
            )
        if token_index is not None:
            _check_token_index(token_index, B, Nb, N, self.num_blocks)
        if self._result is not None and self._result.shape[0] != B:
            raise ValueError(f"block {self.num_blocks} has batch {B}, earlier blocks had {self._result.shape[0]}")
        self.num_tokens = N
        step = rollout_step(fuse_heads(attention, self.head_fusion), self.discard_ratio, self.num_prefix)  # (B,Nb,Nb)
        if self._result is None:
            self._result = torch.eye(N, device=step.device, dtype=step.dtype).expand(B, N, N).clone()
        if token_index is None:
            self._result = step @ self._result  # (B, N, N)
        else:
            rows = token_index.to(step.device)[:, :, None].expand(B, Nb, N)  # (B, Nb, N)
            seen = self._result.gather(1, rows)  # rollout so far of the tokens this block saw
            self._result.scatter_(1, rows, step @ seen)
        self.num_blocks += 1

    @property
    def result(self) -> Tensor:
        """R (B, N, N) float32 over the original tokens; every row sums to 1."""
        if self._result is None:
            raise ValueError("Rollout has seen no block yet; call update(attention) first")
        return self._result


def _check_token_index(token_index: Tensor, batch: int, length: int, num_tokens: int, block: int) -> None:
    if not isinstance(token_index, Tensor) or token_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"token_index of block {block} must be an integer tensor (B, N_b), got {token_index!r:.80}")
    if tuple(token_index.shape) != (batch, length):
        raise ValueError(
            f"token_index of block {block} must have shape ({batch}, {length}) to match its attention, "
            f"got {tuple(token_index.shape)}"
        )
    if token_index.numel() and (int(token_index.min()) < 0 or int(token_index.max()) >= num_tokens):
        raise ValueError(
            f"token_index of block {block} must lie in [0, {num_tokens}), got values "
            f"{int(token_index.min())} … {int(token_index.max())}"
        )


def attention_rollout(
    attentions: Sequence[Tensor],
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    *,
    token_indices: Sequence[Tensor | None] | None = None,
    num_prefix: int = 1,
    num_tokens: int | None = None,
) -> Tensor:
    """Attention rollout of a list of per-block maps (module doc).

    Args:
        attentions: one (B, H, N_b, N_b) tensor per block, first block first (``forward_detailed(…).attentions``).
        head_fusion: "mean", "max" or "min" over heads.
        discard_ratio: fraction in [0, 1) of the weakest links dropped per block (never the prefix rows/columns).
        token_indices: for pruned models, one (B, N_b) long tensor (or None for "all N tokens") per block: each
            token's index among the original N tokens; :func:`block_token_indices` builds it from
            ``forward_detailed(…).block_positions``.
        num_prefix: prefix tokens ([CLS] = 1; DeiT distilled = 2).
        num_tokens: original N; needed only when the first block already saw fewer tokens.

    Returns:
        R (B, N, N) float32; rows sum to 1; ``R[:, 0, num_prefix:]`` is the [CLS] relevance of each patch.
    """
    if isinstance(attentions, Tensor) or not isinstance(attentions, Sequence) or len(attentions) == 0:
        raise ValueError("attentions must be a non-empty list of (B, H, N, N) tensors, one per block")
    if token_indices is not None and len(token_indices) != len(attentions):
        raise ValueError(f"token_indices has {len(token_indices)} entries but attentions has {len(attentions)}")
    rollout = Rollout(head_fusion, discard_ratio, num_prefix, num_tokens)
    with torch.no_grad():
        for b, attention in enumerate(attentions):
            rollout.update(attention, None if token_indices is None else token_indices[b])
    return rollout.result


def block_token_indices(
    block_positions: Sequence[Tensor], num_prefix: int = 1, num_tokens: int | None = None
) -> list[Tensor | None]:
    """Which original tokens each block saw, from the provenance the blocks recorded (``ViTOutput.block_positions``).

    Args:
        block_positions: per block, (B, N_b − num_prefix) absolute patch positions of the tokens its attention saw.
        num_tokens: the original N (prefix + every patch); default: what the first block saw.

    Returns one (B, N_b) long tensor per block (see :func:`positions_to_token_index`), or None for a block that saw
    all N tokens in their original order, as :func:`attention_rollout` takes it.
    """
    if len(block_positions) == 0:
        raise ValueError("block_positions must be a non-empty list of (B, n) tensors, one per block")
    if num_tokens is None:
        num_tokens = num_prefix + block_positions[0].shape[1]
    return [
        None
        if positions.shape[1] + num_prefix == num_tokens and _is_identity(positions)
        else positions_to_token_index(positions, num_prefix)
        for positions in block_positions
    ]


def positions_to_token_index(positions: Tensor, num_prefix: int = 1) -> Tensor:
    """Absolute patch positions (B, k) -> token indices (B, num_prefix + k): the prefix first, then prefix + p."""
    B = positions.shape[0]
    prefix = torch.arange(num_prefix, device=positions.device).expand(B, num_prefix)
    return torch.cat([prefix, positions.long() + num_prefix], dim=1)


def attention_rollout_model(
    model: nn.Module,
    images: Tensor,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> Tensor:
    """Streaming rollout of a vitrim ViT on ``images`` (B, C, H, W): one block's (B, H, N_b, N_b) map at a time.

    Runs ``model.embed`` and then each block with ``need_weights=True`` under ``torch.inference_mode``, folding
    every map into a :class:`Rollout` before the next block runs, so peak memory is one block's attention plus
    the (B, N, N) accumulator, never depth × (B, H, N, N). The tokens each block saw come from the provenance the
    block records in the token state, so pruned models (DynamicViT, top-k, EViT) are followed exactly. Put the model in
    ``eval()`` first: in training mode, dropout and DynamicViT's training-time masking shape the maps.

    Returns R (B, N, N) float32, as :func:`attention_rollout`.
    """
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"model must be a vitrim VisionTransformer, got {type(model).__name__}")
    num_prefix = model.num_prefix
    with torch.inference_mode():
        state = model.embed(images)
        rollout = Rollout(head_fusion, discard_ratio, num_prefix, num_tokens=state.tokens.shape[1])
        for block in model.blocks:
            state, weights = block(state, need_weights=True)
            if weights is None:
                raise TypeError(f"block {type(block).__name__} returned no attention weights")
            seen = state.block_positions[-1]  # (B, N_b − prefix): recorded by the block as its attention ran
            if seen.shape[1] + num_prefix != weights.shape[-1]:
                raise ValueError(
                    f"block {rollout.num_blocks}: attention over {weights.shape[-1]} tokens but it recorded "
                    f"{seen.shape[1]} patch tokens and {num_prefix} prefix tokens"
                )
            full = seen.shape[1] + num_prefix == rollout.num_tokens and _is_identity(seen)
            rollout.update(weights, None if full else positions_to_token_index(seen, num_prefix))
            del weights, seen
    return rollout.result


def _is_identity(positions: Tensor) -> bool:
    return bool((positions == torch.arange(positions.shape[1], device=positions.device)).all())
