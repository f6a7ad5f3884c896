"""Peak memory of class-specific relevance against the backward pass it rides on (``vitrim viz relevance-memory``).

Modes, each in a fresh process (:mod:`vitrim.bench.memory`), on one batch of random images:

* ``backward``: the forward pass (torch's fused attention, no maps) and the gradient of the explained logit with
  respect to the tokens entering the first block: the backward pass alone;
* ``backward_maps``: the same with every block's attention map computed explicitly (``need_weights=True``), as
  Chefer's method needs them: what the backward pass itself keeps then (each block's map is saved for A·V's backward);
* ``chefer``: :func:`vitrim.viz.chefer.chefer_relevance`, streaming (each block's Ā folded into one (B, N) row as
  the backward reaches it);
* ``chefer_all``: the authors' way: every block's map and gradient kept to the end, then R = I; R += Ā R over
  (B, N, N) matrices;
* ``attnlrp``: :func:`vitrim.viz.attnlrp.attnlrp_relevance` (no maps at all).

The number is the growth of the process's peak resident set (VmHWM) over a baseline taken after the model is built
and a small image has run through the same mode (kernels loaded).
"""

from __future__ import annotations

import time

import torch

from vitrim.bench.memory import measure_in_fresh_process, peak_rss_bytes
from vitrim.factory import create_model
from vitrim.models.vit import VisionTransformer
from vitrim.viz.attnlrp import attnlrp_relevance
from vitrim.viz.chefer import chefer_relevance, gradient_weighted_heads
from vitrim.viz.maps import model_config, vision_transformer
from vitrim.viz.relevance_trace import leaf_tokens

MODES = ("backward", "backward_maps", "chefer", "chefer_all", "attnlrp")


def _backward(model: VisionTransformer, images: torch.Tensor, need_weights: bool) -> torch.Tensor:
    with torch.enable_grad():
        state, tokens = leaf_tokens(model, images)
        state, _ = model.forward_blocks(state, need_weights=need_weights)
        logits = model.forward_head(model.norm(state.tokens))
        (gradient,) = torch.autograd.grad(logits[:, 0].sum(), tokens)
    return gradient


def _chefer_all(model: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        state, _ = leaf_tokens(model, images)
        state, maps = model.forward_blocks(state, need_weights=True)
        for attention in maps:
            attention.retain_grad()
        model.forward_head(model.norm(state.tokens))[:, 0].sum().backward()
    B, _, N, _ = maps[0].shape
    R = torch.eye(N).expand(B, N, N).clone()
    for attention in maps:
        assert attention.grad is not None
        R = R + gradient_weighted_heads(attention.detach(), attention.grad) @ R
    return R[:, 0]


def run_mode(model: torch.nn.Module, images: torch.Tensor, mode: str) -> torch.Tensor:
    """One relevance (or backward) computation in ``mode`` (module doc)."""
    if mode in ("backward", "backward_maps"):
        return _backward(vision_transformer(model), images, mode == "backward_maps")
    if mode == "chefer":
        return chefer_relevance(model, images, 0)[0]
    if mode == "chefer_all":
        return _chefer_all(vision_transformer(model), images)
    if mode == "attnlrp":
        return attnlrp_relevance(model, images, 0)[0]
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def relevance_memory(model: str, img_size: int, batch: int, mode: str) -> dict[str, float]:
    """Peak-RSS growth (bytes) and seconds of one run of ``mode``, measured in this process (call it in a fresh one)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    built = create_model(model, img_size=img_size, num_classes=10).eval()
    for p in built.parameters():
        p.requires_grad_(False)  # only activations count: no parameter gradients are ever made
    c = model_config(built)
    run_mode(built, torch.randn(batch, c.in_chans, 2 * c.patch_size, 2 * c.patch_size), mode)
    images = torch.randn(batch, c.in_chans, img_size, img_size)
    before = peak_rss_bytes()
    start = time.perf_counter()
    run_mode(built, images, mode)
    seconds = time.perf_counter() - start
    N = (img_size // c.patch_size) ** 2 + c.num_prefix
    return {"peak_bytes": peak_rss_bytes() - before, "seconds": seconds, "tokens": N, "heads": c.num_heads}


def measure(model: str, img_size: int, batch: int, mode: str) -> dict[str, float]:
    """:func:`relevance_memory` in a fresh process."""
    return measure_in_fresh_process(relevance_memory, model=model, img_size=img_size, batch=batch, mode=mode)
