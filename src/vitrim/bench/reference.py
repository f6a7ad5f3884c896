"""timm's eager ViT forward, written out op for op, to time against vitrim on the same weights.

timm cannot run here, and the throughput target is "at least timm's eager ViT on the same weights". This is
``timm.models.vision_transformer.VisionTransformer.forward`` as timm 1.0 runs it in eval mode with fused
attention (``Attention.forward``: qkv, reshape, permute, unbind, q/k norm, ``F.scaled_dot_product_attention``,
transpose, reshape, proj), reading the parameters of a vitrim :class:`~vitrim.models.vit.VisionTransformer` (they
have timm's names and layout). Tests check it against timm's own outputs in ``tests/data/timm``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrim.attention import MultiHeadAttention
from vitrim.models.block import Block
from vitrim.models.vit import VisionTransformer


def check_timm_reference(model: nn.Module) -> VisionTransformer:
    """The model, if timm's plain forward computes it: a dense ViT at its own grid, no distillation token."""
    if not isinstance(model, VisionTransformer):
        raise ValueError(f"the timm reference needs a vitrim VisionTransformer, got {type(model).__name__}")
    if model.config.distilled:
        raise ValueError("the timm reference covers ViTs without a distillation token (DeiT-distilled is not one)")
    if any(block.reducer is not None for block in model.blocks):
        raise ValueError("the timm reference is the dense model; this one has token reducers")
    return model


def timm_eager_forward(model: VisionTransformer, images: Tensor) -> Tensor:
    """Logits (B, num_classes) of images (B, C, H, W) at the model's own image size, by timm's eager ops."""
    c = model.config
    if tuple(images.shape[-2:]) != tuple(c.img_size):
        raise ValueError(f"the timm reference runs at the model's img_size {c.img_size}, got {tuple(images.shape)}")
    x = model.patch_embed.proj(images).flatten(2).transpose(1, 2)  # (B, P, D): timm's PatchEmbed, flatten=True
    if model.cls_token is not None:
        x = torch.cat([model.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + P, D)
    x = model.pos_drop(x + model.pos_embed)
    for blk in cast(Iterable[Block], model.blocks):
        x = x + blk.drop_path1(blk.ls1(_timm_attention(blk.attn, blk.norm1(x))))
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    x = model.norm(x)
    x = x[:, model.num_prefix :].mean(dim=1) if c.global_pool == "avg" else x[:, 0]
    return model.head(model.head_drop(model.fc_norm(x)))


def _timm_attention(attn: MultiHeadAttention, x: Tensor) -> Tensor:
    """timm's ``Attention.forward`` (fused_attn=True), eval mode: (B, N, D) -> (B, N, D)."""
    B, N, C = x.shape
    heads = attn.num_heads
    qkv = attn.qkv(x).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)  # (3, B, H, N, hd)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)  # (B, H, N, hd)
    x = x.transpose(1, 2).reshape(B, N, C)
    return attn.proj_drop(attn.proj(x))
