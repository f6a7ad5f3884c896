"""FLOP counting with ``torch.utils.flop_counter.FlopCounterMode``, attention included on every backend.

Convention (fvcore's and torch's): only matrix products are counted, one multiply-add = 2 FLOPs; element-wise
work (softmax, GELU, LayerNorm, residual adds) is not. So a ViT block counts qkv, QKᵀ, A·V, proj, fc1 and fc2.

Why a custom mapping: torch's counter knows the CUDA attention kernels, but on CPU ``F.scaled_dot_product_attention``
runs ``aten._scaled_dot_product_flash_attention_for_cpu``, which it does not know and counts as 0 (checked on torch
2.13: a dense ViT would lose its attention matmuls, a model that drops tokens would look better than it is). The
masked and ``need_weights`` paths go through ``bmm``, which is counted; the mapping below makes the fused kernel
count the same 2·Lq·Lk·E (QKᵀ) + 2·Lq·Lk·Ev (A·V) per head and batch element.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten


def attention_flops(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int]) -> int:
    """FLOPs of softmax(QKᵀ)·V for q (…, Lq, E), k (…, Lk, E), v (…, Lk, Ev); leading dims are q's (heads, batch)."""
    lead = math.prod(q_shape[:-2])
    Lq, E = q_shape[-2], q_shape[-1]
    Lk, Ev = k_shape[-2], v_shape[-1]
    return 2 * lead * Lq * Lk * E + 2 * lead * Lq * Lk * Ev


def _sdpa_forward(q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return attention_flops(q_shape, k_shape, v_shape)


def _sdpa_backward(
    grad_out_shape: Any, q_shape: Any, k_shape: Any, v_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    # Backward recomputes QKᵀ and does four more products of the same sizes (dV, dA, dQ, dK): torch's own rule.
    lead = math.prod(q_shape[:-2])
    Lq, E = q_shape[-2], q_shape[-1]
    Lk, Ev = k_shape[-2], v_shape[-1]
    return 2 * lead * Lq * Lk * (3 * E + 2 * Ev)


def _custom_mapping() -> dict[Any, Callable[..., int]]:
    """Formulas for the attention kernels torch's counter does not know (looked up by name: some builds lack one)."""
    mapping: dict[Any, Callable[..., int]] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward),
        ("_scaled_dot_product_fused_attention_overrideable", _sdpa_forward),
        ("_scaled_dot_product_fused_attention_overrideable_backward", _sdpa_backward),
    ):
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = formula
    return mapping


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` (no printout) that also counts torch's CPU attention kernels (see module doc)."""
    return FlopCounterMode(display=False, custom_mapping=_custom_mapping())


def count_flops(fn: Callable[[], object]) -> int:
    """Total FLOPs of the matrix products ``fn()`` runs (2 per multiply-add), in inference mode."""
    with torch.inference_mode(), flop_counter() as counter:
        fn()
    return int(counter.get_total_flops())


def model_flops_per_image(
    model: nn.Module, img_size: int | tuple[int, int], in_chans: int = 3, batch_size: int = 2
) -> float:
    """FLOPs of one forward pass per image: ``model`` on a (batch_size, in_chans, H, W) random batch, over the batch.

    Token reducers here keep a fixed number of tokens, so the count does not depend on the pixels. The model
    should be in eval mode (DynamicViT only gathers its kept tokens at inference). The default batch of 2 counts
    the path every batch above 1 runs: at batch 1 merges are one product with a one-hot assignment
    (:func:`vitrim.reduce.tokens.merge_rows`), the same sums written with more multiply-adds and fewer calls.
    """
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    images: Tensor = torch.randn(batch_size, in_chans, h, w, generator=torch.Generator().manual_seed(0))
    images = images.to(device=device, dtype=dtype)
    return count_flops(lambda: model(images)) / batch_size
