"""Chefer, Gur & Wolf's generic relevance (ICCV 2021), streamed through the backward pass, through any reducer.

The authors' rule (hila-chefer/Transformer-MM-Explainability, ``Transformer_MM_explainability_ViT.ipynb``), for a
class c and every block b with attention A_b (B, H, N, N) and its gradient ∇A_b = ∂y_c/∂A_b:

    Ā_b = mean over heads of (∇A_b ⊙ A_b)⁺          the product first, then the positive part, then the head mean
    R = I;  for b = 1 … L:  R ← R + Ā_b · R          (B, N, N), accumulated from the first block
    relevance of patch j for [CLS] = R[0, num_prefix + j]

Streaming (why, beyond the maps the backward pass saves anyway, it holds one block's map and gradient at a time):
R_L = (I + Ā_L) ⋯ (I + Ā_1), and only the explained row e of it is wanted, so eᵀR = ((eᵀ(I + Ā_L))(I + Ā_{L−1}))⋯
can be taken from the left: one (B, N) row multiplied by one block's Ā at a time, *last block first* — exactly the
order in which the backward pass produces ∇A_b. A hook on each block's attention weights folds its Ā_b into the row
as soon as its gradient exists and then lets the map and the gradient go; the maps themselves are what the backward
pass of the attention keeps anyway.

Through reducers (:mod:`vitrim.viz.relevance_trace`): between two blocks the row moves from the later block's
tokens to the earlier block's by the provenance the blocks recorded; a merged token's value is shared by the
patches it stands for, and a dropped token gets nothing from the blocks after it (its relevance is what flowed into
it while it was present). The same row recursion read forwards is R[idx_b] ← R[idx_b] + Ā_b R[idx_b] over the
tokens a block saw, with merged rows averaged by share, as rollout does. The row explained (module doc of
``relevance_trace``) is [CLS]'s, or the mean-pool's weights, or SigLIP's pool query's gradient-weighted attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vitrim.models.vit import VisionTransformer
from vitrim.viz.relevance_trace import (
    Target,
    TokenSpace,
    block_space,
    check_images,
    current_space,
    eval_model,
    explained_row,
    grid_space,
    leaf_tokens,
    resolve_target,
    to_earlier_tokens,
)


def gradient_weighted_heads(attention: Tensor, gradient: Tensor) -> Tensor:
    """Ā = mean over heads of (∇A ⊙ A)⁺: (B, H, Lq, Lk) twice -> (B, Lq, Lk) (the authors' ``avg_heads``)."""
    return (gradient * attention).clamp(min=0).mean(dim=1)


class _RowFold:
    """The explained row, folded block by block as the backward pass reaches each block (module doc)."""

    def __init__(self, spaces: list[TokenSpace], final: TokenSpace, num_prefix: int) -> None:
        self.spaces = spaces  # the tokens each block's attention saw
        self.num_prefix = num_prefix
        self.row: Tensor | None = None  # (B, prefix + n) over the tokens of ``self.space``
        self.space = final
        self.next_block = len(spaces) - 1  # the backward pass reaches the last block first

    def start(self, row: Tensor) -> None:
        self.row = row

    def fold(self, block: int, weighted: Tensor | None) -> None:
        """Move the row to block ``block``'s tokens and add row · Ā_b (``weighted`` (B, N_b, N_b); None: Ā_b = 0)."""
        if self.row is None:
            raise RuntimeError("the explained row was not set before the backward pass reached the blocks")
        if block > self.next_block:
            raise RuntimeError(f"block {block} reached out of order (expected block {self.next_block} or earlier)")
        while self.next_block >= block:  # blocks the gradient skipped (Ā = 0) only move the row
            b = self.next_block
            self.row = to_earlier_tokens(self.row, self.space, self.spaces[b], self.num_prefix)
            self.space = self.spaces[b]
            if b == block and weighted is not None:
                self.row = self.row + torch.bmm(self.row[:, None, :], weighted.to(self.row.dtype))[:, 0]
            self.next_block -= 1

    def finish(self, grid: TokenSpace) -> Tensor:
        """The row over the original tokens (B, prefix + P), once every block is folded."""
        if self.next_block >= 0:
            self.fold(0, None)
        assert self.row is not None
        return to_earlier_tokens(self.row, self.space, grid, self.num_prefix)


def chefer_relevance(model: nn.Module, images: Tensor, target: Target = None) -> tuple[Tensor, Tensor, Tensor]:
    """Generic relevance of every original token for class ``target`` (module doc), streamed through the backward.

    Args:
        model: a vitrim VisionTransformer, dense or with any reducers (run in eval mode; its mode is restored).
        images: (B, C, H, W).
        target: None (the predicted class), a class index, or one per image.

    Returns:
        (relevance (B, num_prefix + P) over the original tokens, prefix first, then the grid in row-major order;
        logits (B, classes); target (B,)). For a [CLS] model ``relevance[:, 1:]`` is the authors' ``R[0, 1:]``.
    """
    vit, config, was_training = eval_model(model)
    images = check_images(images)
    try:
        with torch.enable_grad():
            return _chefer(vit, images, target, config.num_prefix)
    finally:
        vit.train(was_training)


def _chefer(model: VisionTransformer, images: Tensor, target: Target, p: int) -> tuple[Tensor, Tensor, Tensor]:
    state, tokens0 = leaf_tokens(model, images)
    B, N = tokens0.shape[:2]
    P = N - p
    spaces: list[TokenSpace] = []
    maps: list[Tensor] = []
    for block in model.blocks:
        state, weights = block(state, need_weights=True)
        if weights is None:
            raise TypeError(f"block {type(block).__name__} returned no attention weights")
        spaces.append(block_space(state, P))
        maps.append(weights)
    fold = _RowFold(spaces, current_space(state, P), p)
    for b, weights in enumerate(maps):
        weights.register_hook(_block_hook(fold, b, weights))
    # the head hands out the attention its pool ran (SigLIP's query), None for a [CLS] or mean pool
    logits, pool_weights = model.forward_head_with_weights(model.norm(state.tokens), state.patch_weights())
    if pool_weights is not None:
        pool_weights.register_hook(_pool_hook(fold, pool_weights, p))
    else:
        row = explained_row(model.config, state, B, torch.promote_types(tokens0.dtype, torch.float32))
        assert row is not None
        fold.start(row)
    index = resolve_target(logits, target)
    maps.clear()  # the hooks hold the only references of ours; the backward pass keeps what it needs
    score = logits.gather(1, index[:, None]).sum()
    torch.autograd.grad(score, tokens0)
    relevance = fold.finish(grid_space(B, P, images.device))
    return relevance.detach(), logits.detach(), index


def _block_hook(fold: _RowFold, block: int, weights: Tensor) -> Callable[[Tensor], None]:
    held = [weights]  # released as soon as the block is folded

    def hook(gradient: Tensor) -> None:
        fold.fold(block, gradient_weighted_heads(held.pop(), gradient))

    return hook


def _pool_hook(fold: _RowFold, weights: Tensor, num_prefix: int) -> Callable[[Tensor], None]:
    held = [weights]

    def hook(gradient: Tensor) -> None:
        query_row = gradient_weighted_heads(held.pop(), gradient)[:, 0]  # (B, n): the pool's one query
        fold.start(torch.cat([query_row.new_zeros(query_row.shape[0], num_prefix), query_row], dim=1))

    return hook
