"""The attention of the prompt's last token (the one that emits the answer) over the image, in one decoder layer.

FastV ranks image tokens by this row at layer K−1 and drops the lowest from layer K on. It is computed here from the
layer's own projections (q of the last token, k of every token, RoPE at the positions the model used, the padding
masked out, softmax, mean over heads), captured by a forward pre-hook for one prefill and removed after it: the
model keeps running on SDPA, which returns no weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from vitrim.demos.vlm.words import IMAGE_ID


@torch.no_grad()
def last_token_attention(model: nn.Module, inputs: dict[str, Tensor], layer: int) -> Tensor:
    """(B, image tokens) mean-over-heads attention of each prompt's last token over its image tokens, at decoder
    ``layer`` (0-based) of ``model`` (a LlavaForConditionalGeneration with a Llama-style decoder)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    layers: Any = model.model.language_model.layers  # type: ignore[union-attr]
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}) (decoder layers), got {layer}")
    attention = layers[layer].self_attn
    captured: dict[str, Any] = {}

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["hidden"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        captured["rope"] = kwargs["position_embeddings"]

    handle = attention.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model(**inputs)
    finally:
        handle.remove()
    hidden = captured["hidden"]  # (B, L, D), the layer's normalised input
    B, L, _ = hidden.shape
    d = attention.head_dim
    q = attention.q_proj(hidden).view(B, L, -1, d).transpose(1, 2)  # (B, H, L, d)
    k = attention.k_proj(hidden).view(B, L, -1, d).transpose(1, 2)  # (B, Hkv, L, d)
    cos, sin = captured["rope"]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = repeat_kv(k, attention.num_key_value_groups)  # (B, H, L, d)
    scores = (q[:, :, -1:] @ k.transpose(-1, -2)).squeeze(2) * attention.scaling  # (B, H, L): the last query row
    mask = inputs["attention_mask"].bool()  # (B, L) left padding: 0
    weights = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1).mean(1)  # (B, L)
    image = inputs["input_ids"] == IMAGE_ID  # (B, L)
    return weights[image].view(B, -1)  # (B, 64), raster order of the patches
