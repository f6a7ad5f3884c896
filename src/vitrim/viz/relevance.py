"""Class-specific relevance of every input patch, for any vitrim ViT, dense or trimming its tokens on the way.

    rel = vitrim.viz.relevance(model, images, target=None, method="chefer")     # (B, gh, gw)

Methods:

* ``"chefer"``: Chefer, Gur & Wolf's generic attention relevance (ICCV 2021): per block the head mean of
  (∂y_c/∂A ⊙ A)⁺, accumulated R ← R + Ā·R from the identity; the explained row of R over the patches
  (:mod:`vitrim.viz.chefer`). Positive by construction.
* ``"attnlrp"``: AttnLRP (Achtibat et al., ICML 2024): layer-wise relevance propagation with the softmax, uniform,
  identity and ε rules, as gradient × input of the tokens entering the first block, summed over channels
  (:mod:`vitrim.viz.attnlrp`). Signed: negative relevance speaks against the class.
* ``"rollout"``: attention rollout of [CLS] (Abnar & Zuidema 2020; :mod:`vitrim.viz.rollout`). Class-agnostic;
  models with a [CLS] token only.

Which row is explained, how a pruned or merged token is followed, and how targets are chosen:
:mod:`vitrim.viz.relevance_trace`. :func:`relevance_map` also returns the token relevance, the logits, the explained
classes and which patch token stood for each patch at the end (for the picture of what was kept or merged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from vitrim.models.vit import VisionTransformer
from vitrim.viz.attnlrp import attnlrp_relevance
from vitrim.viz.chefer import chefer_relevance
from vitrim.viz.maps import model_config, vision_transformer
from vitrim.viz.relevance_trace import Target, check_images, resolve_target
from vitrim.viz.rollout import attention_rollout_model

Method = Literal["chefer", "attnlrp", "rollout"]
METHODS = ("chefer", "attnlrp", "rollout")


@dataclass(frozen=True)
class RelevanceMap:
    """What :func:`relevance_map` computed.

    grid: (B, gh, gw) float32 relevance of every patch of the input's grid. tokens: (B, num_prefix + P) the same
    over the original tokens, prefix tokens first. logits: (B, classes). target: (B,) the explained classes.
    patch_to_token: (B, P) long, for each patch the final patch token standing for it (−1: dropped), or None for a
    model without reducers.
    """

    grid: Tensor
    tokens: Tensor
    logits: Tensor
    target: Tensor
    patch_to_token: Tensor | None
    method: str


def relevance(model: nn.Module, images: Tensor, target: Target = None, method: Method = "chefer") -> Tensor:
    """(B, gh, gw) relevance of each patch of ``images`` (B, C, H, W) for class ``target`` (module doc)."""
    return relevance_map(model, images, target, method).grid


def relevance_map(model: nn.Module, images: Tensor, target: Target = None, method: Method = "chefer") -> RelevanceMap:
    """Relevance with everything needed to draw it (:class:`RelevanceMap`); see the module doc for the methods."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    config = model_config(model)
    images = check_images(images)
    gh, gw = images.shape[-2] // config.patch_size, images.shape[-1] // config.patch_size
    p = config.num_prefix
    if method == "chefer":
        tokens, logits, index = chefer_relevance(model, images, target)
    elif method == "attnlrp":
        tokens, logits, index = attnlrp_relevance(model, images, target)
    else:
        if not config.class_token or config.global_pool != "token":
            raise ValueError(
                f"method='rollout' explains the [CLS] row, but this model pools with global_pool="
                f"{config.global_pool!r}{'' if config.class_token else ' and has no [CLS] token'}; "
                "use method='chefer' or 'attnlrp'"
            )
        tokens, logits, index = _rollout_row(model, images, target)
    B = images.shape[0]
    vit = vision_transformer(model)
    final = _final_patch_map(vit, images) if _reduces(vit) else None
    grid = tokens[:, p:].float().reshape(B, gh, gw)
    return RelevanceMap(grid, tokens.float(), logits, index, final, method)


def _rollout_row(model: nn.Module, images: Tensor, target: Target) -> tuple[Tensor, Tensor, Tensor]:
    was_training = model.training
    model.eval()
    try:
        rollout = attention_rollout_model(model, images)  # (B, N, N), streaming
        with torch.inference_mode():
            logits = model(images)
    finally:
        model.train(was_training)
    return rollout[:, 0].clone(), logits.clone(), resolve_target(logits, target)


def _reduces(model: VisionTransformer) -> bool:
    return any(getattr(block, "reducer", None) is not None for block in model.blocks)


def _final_patch_map(model: VisionTransformer, images: Tensor) -> Tensor | None:
    """(B, P) the final patch token of every patch (−1: dropped), from the provenance the model recorded."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            out = model.forward_detailed(images)
    finally:
        model.train(was_training)
    return out.patch_to_token[-1].clone() if out.patch_to_token else None
