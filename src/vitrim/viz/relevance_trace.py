"""What every class-specific relevance method shares: the target, the row it explains, and the way back to the grid.

Conventions (owned here):

* **Target.** ``target`` None explains each sample's predicted class (argmax of its logits); an int explains that
  class for every sample; a sequence or a (B,) tensor one class per sample. The score differentiated is the sum over
  the batch of ``logits[b, target[b]]`` (samples do not interact, so each gets its own gradient).
* **Token space.** Relevance lives on the *original* tokens: prefix tokens first ([CLS], distillation, registers),
  then the P patches of the input's grid in row-major order, as ``model.embed`` makes them. A block that saw fewer
  or merged tokens is mapped back through the provenance the blocks record (``TokenState.block_positions`` and
  ``block_patch_to_token``), never inferred from counts.
* **Moving a row between token spaces.** A row v over the tokens of a later point of the forward pass goes to an
  earlier point by sharing each patch token's value among the patches it stands for, equally, and summing the
  patches back into the tokens that stood for them earlier (:func:`to_earlier_tokens`). For ToMe's size-weighted
  average this is exactly its share s_i / Σ s of each merged token; EViT's fused token is shared by patch count too
  (not by the [CLS] weights that made it). A dropped token gets nothing from later blocks. Prefix tokens map to
  themselves.
* **The explained row.** With a [CLS] token the head reads token 0, so the row explained is [CLS]'s; a distilled
  DeiT averages [CLS] and the distillation token, so its row is their mean; a mean-pooling ViT (``global_pool='avg'``)
  reads the weighted mean of the patch tokens, so its row is those pooling weights (ToMe's sizes, normalised);
  SigLIP's attention pool is a cross-attention of one learned query over the patch tokens, so its row is that
  query's attention row, weighted by the method's own rule (Chefer: the gradient-weighted head mean, as for every
  other attention map). See :func:`explained_row`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vitrim.models.config import ViTConfig
from vitrim.models.vit import VisionTransformer
from vitrim.reduce import TokenState
from vitrim.viz.maps import vision_transformer

Target = int | Sequence[int] | Tensor | None


@dataclass(frozen=True)
class TokenSpace:
    """Which patches the tokens at one point of the forward pass stand for.

    patch_map: (B, P) long: for each patch of the input's grid, the index (0 … n−1) of the patch token standing for
    it, −1 if dropped. num_patch_tokens: n. Identity (each patch its own token, in grid order) when ``identity``.
    """

    patch_map: Tensor
    num_patch_tokens: int
    identity: bool


def grid_space(batch: int, num_patches: int, device: torch.device) -> TokenSpace:
    """The input's own tokens: patch p is token p."""
    grid = torch.arange(num_patches, device=device).expand(batch, num_patches)
    return TokenSpace(grid, num_patches, True)


def block_space(state: TokenState, num_patches: int) -> TokenSpace:
    """The tokens the last block's attention saw, from the provenance it recorded (``state.block_*[-1]``)."""
    positions = state.block_positions[-1]  # (B, n): absolute patch positions, recorded as the attention ran
    recorded = state.block_patch_to_token[-1]
    return _space(positions, recorded, num_patches, state)


def current_space(state: TokenState, num_patches: int) -> TokenSpace:
    """The tokens of ``state`` now (after any reduction that followed the last block's attention)."""
    recorded = state.patch_to_token[-1] if state.patch_to_token and state.trace else None
    if state.positions is None:  # a state made for plain inference (record False) keeps no provenance
        raise ValueError("relevance needs the tokens' provenance: run the model with forward_detailed or embed")
    return _space(state.positions, recorded, num_patches, state)


def _space(positions: Tensor, recorded: Tensor | None, num_patches: int, state: TokenState) -> TokenSpace:
    B, n = positions.shape
    if recorded is not None:
        return TokenSpace(recorded, n, False)
    if not state.trace:
        raise ValueError(
            "relevance needs to know which patches each token stands for, but a reducer was told not to trace "
            "them (ToMe's trace_source=False); apply it with trace_source=True"
        )
    if n != num_patches and (state.sizes is not None or state.fused is not None):
        raise ValueError("tokens were merged without a patch_to_token record; relevance cannot place them")
    identity = n == num_patches and bool((positions == torch.arange(n, device=positions.device)).all())
    tokens = torch.arange(n, device=positions.device).expand(B, n)
    patch_map = torch.full((B, num_patches), -1, dtype=torch.long, device=positions.device)
    return TokenSpace(patch_map.scatter(1, positions.long(), tokens), n, identity)


def to_earlier_tokens(row: Tensor, later: TokenSpace, earlier: TokenSpace, num_prefix: int) -> Tensor:
    """Move ``row`` (B, num_prefix + n_later) to the earlier tokens (B, num_prefix + n_earlier) (module doc).

    Each later patch token's value is split equally among the patches it stands for; each earlier token gets the sum
    of its patches' shares. The total over patch tokens is kept, except what sat on a token standing for no patch.
    """
    if later.identity and earlier.identity:
        return row
    B = later.patch_map.shape[0]
    patches = row[:, num_prefix:]  # (B, n_later)
    alive = later.patch_map >= 0  # (B, P)
    index = later.patch_map.clamp(min=0)
    sizes = torch.zeros_like(patches).scatter_add_(1, index, alive.to(row.dtype))  # (B, n_later): patches per token
    density = torch.where(alive, patches.gather(1, index) / sizes.gather(1, index).clamp(min=1), 0.0)  # (B, P)
    earlier_patches = row.new_zeros(B, earlier.num_patch_tokens)
    earlier_patches.scatter_add_(1, earlier.patch_map.clamp(min=0), density * (earlier.patch_map >= 0))
    return torch.cat([row[:, :num_prefix], earlier_patches], dim=1)


def resolve_target(logits: Tensor, target: Target) -> Tensor:
    """(B,) long class indices to explain (module doc); ValueError naming ``target`` if out of range."""
    B, C = logits.shape
    if target is None:
        return logits.argmax(dim=-1)
    array_like = isinstance(target, (Tensor, Sequence)) or hasattr(target, "__array__")  # numpy too
    if isinstance(target, (bool, str, bytes)) or not (isinstance(target, int) or array_like):
        raise TypeError(f"target must be None, a class index, or one per sample, got {target!r:.80}")
    if isinstance(target, int):
        _check_class(target, C, target)
        index = torch.full((B,), target, dtype=torch.long, device=logits.device)
    else:
        if isinstance(target, Sequence):  # plain ints, each a class, before torch sees them
            if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in target):
                raise TypeError(f"target must hold integer class indices, got {target!r:.80}")
            for t in target:
                _check_class(int(t), C, target)
        try:
            index = torch.as_tensor(target, device=logits.device)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"target must be None, a class index, or one per sample, got {target!r:.80}") from None
        if index.is_floating_point() or index.dtype == torch.bool or index.dim() != 1 or index.shape[0] != B:
            raise ValueError(f"target must hold {B} integer class indices (one per image), got {target!r:.80}")
        index = index.long().clone()  # also a normal tensor when the caller made it under inference_mode
    if int(index.min()) < 0 or int(index.max()) >= C:
        raise ValueError(f"target must be a class index in [0, {C}), got {target!r:.80}")
    return index


def _check_class(value: int, num_classes: int, target: object) -> None:
    if not 0 <= value < num_classes:
        raise ValueError(f"target must be a class index in [0, {num_classes}), got {target!r:.80}")


def explained_row(config: ViTConfig, state: TokenState, batch: int, dtype: torch.dtype) -> Tensor | None:
    """(B, N') the row the head reads, over the final tokens of ``state``; None for the attention pool (module doc)."""
    N = state.tokens.shape[1]
    p = state.num_prefix
    row = torch.zeros(batch, N, dtype=dtype, device=state.tokens.device)
    if config.global_pool == "map":
        return None
    if config.global_pool == "avg":
        weights = state.patch_weights()
        patch = torch.ones(batch, N - p, dtype=dtype, device=row.device) if weights is None else weights.to(dtype)
        row[:, p:] = patch / patch.sum(dim=1, keepdim=True).clamp_min(1e-12)
        return row
    if config.distilled:
        row[:, :2] = 0.5
        return row
    row[:, 0] = 1.0
    return row


def eval_model(model: nn.Module) -> tuple[VisionTransformer, ViTConfig, bool]:
    """The vitrim ViT (TypeError otherwise), its config, and whether it was in training mode (to restore)."""
    vit = vision_transformer(model)
    if torch.is_inference_mode_enabled():
        raise RuntimeError("relevance needs gradients; call it outside torch.inference_mode()")
    was_training = vit.training
    vit.eval()
    return vit, vit.config, was_training


def check_images(images: Tensor) -> Tensor:
    """images must be a floating (B, C, H, W) tensor."""
    if not isinstance(images, Tensor):
        raise TypeError(f"images must be a torch.Tensor (B, C, H, W), got {type(images).__name__}")
    if images.dim() != 4 or not images.is_floating_point():
        raise ValueError(f"images must be a floating (B, C, H, W) tensor, got {images.dtype} {tuple(images.shape)}")
    return images


def leaf_tokens(model: VisionTransformer, images: Tensor) -> tuple[TokenState, Tensor]:
    """``model.embed(images)`` with its tokens replaced by a leaf that requires grad: (state, tokens (B, N, D))."""
    state = model.embed(images)
    tokens = state.tokens.detach().requires_grad_(True)
    return state.replace(tokens=tokens), tokens
