"""Peak memory of attention rollout, streaming against all-at-once (``vitrim viz rollout-memory``).

Default: ViT-S/16 (random weights; memory does not depend on them) on one 1024×1024 image, N = 64² + 1 = 4097
tokens. Streaming (:func:`vitrim.viz.attention_rollout_model`) holds one block's (B, H, N, N) map and the (B, N, N)
accumulator; all-at-once (``forward_detailed(need_weights=True)`` then :func:`vitrim.viz.attention_rollout`)
holds every block's map: depth × B·H·N²·4 bytes (ViT-S at N = 4097: 12 × 403 MB ≈ 4.8 GB).

Each measurement runs in a fresh process (:mod:`vitrim.bench.memory`) and reports the growth of the process's peak
resident set (VmHWM) over a baseline taken after the model is built and one small image has run (kernels loaded).
"""

from __future__ import annotations

import time

import torch

from vitrim.bench.memory import measure_in_fresh_process, peak_rss_bytes
from vitrim.factory import create_model
from vitrim.models.config import ViTConfig
from vitrim.viz.maps import model_config
from vitrim.viz.rollout import attention_rollout, attention_rollout_model, block_token_indices

MODES = ("stream", "all")


def build(model: str, img_size: int) -> tuple[torch.nn.Module, ViTConfig]:
    """The registered model (random weights: memory does not depend on them) in eval mode, and its config."""
    built = create_model(model, img_size=img_size, num_classes=10).eval()
    return built, model_config(built)


def _rollout(model: torch.nn.Module, images: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "stream":
        return attention_rollout_model(model, images)
    with torch.inference_mode():
        out = model.forward_detailed(images, need_weights=True)  # type: ignore[operator]
        prefix = model_config(model).num_prefix
        index = block_token_indices(out.block_positions, prefix)
        return attention_rollout(out.attentions, token_indices=index, num_prefix=prefix)


def rollout_memory(model: str, img_size: int, batch: int, mode: str) -> dict[str, float]:
    """Peak-RSS growth (bytes) and seconds of one rollout, measured in this process (call it through a fresh one)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    built, c = build(model, img_size)
    _rollout(built, torch.randn(batch, c.in_chans, 2 * c.patch_size, 2 * c.patch_size), mode)
    images = torch.randn(batch, c.in_chans, img_size, img_size)
    before = peak_rss_bytes()
    start = time.perf_counter()
    result = _rollout(built, images, mode)
    seconds = time.perf_counter() - start
    return {"peak_bytes": peak_rss_bytes() - before, "seconds": seconds, "tokens": result.shape[-1]}


def measure(model: str, img_size: int, batch: int, mode: str) -> dict[str, float]:
    """:func:`rollout_memory` in a fresh process."""
    args = dict(model=model, img_size=img_size, batch=batch, mode=mode)
    return measure_in_fresh_process(rollout_memory, **args)
