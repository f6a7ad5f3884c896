"""A plain-torch timm/DeiT ViT forward from a state dict, with a hook between attention and MLP: the skeleton that
the authors' token-reduction forwards (PiToMe, PPT, MCTF, Zero-TPrune references) plug into. Shares no vitrim code.

Each block, as the authors' patched timm blocks run it:
    x_attn, k, attn = Attention(LN1(x), bias)        # bias: log(size) when the method uses proportional attention
    x = x + x_attn
    x, size, source = hook(i, x, k.mean(heads) / attn / q, size, source)
    x = x + MLP(LN2(x))
``source`` (B, T, P) is ToMe's source matrix: row t marks the patches token t stands for ([CLS] row included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Hook = Callable[["BlockIO"], "BlockIO"]


@dataclass
class BlockIO:
    """What a method's hook sees in block ``i`` and returns (x, size, source updated)."""

    i: int
    x: Tensor  # (B, T, C) after the attention residual, [CLS] first
    q: Tensor  # (B, H, T, hd)
    k: Tensor  # (B, H, T, hd)
    v: Tensor  # (B, H, T, hd)
    attn: Tensor  # (B, H, T, T) softmax weights
    size: Tensor | None  # (B, T, 1) or None (all ones)
    source: Tensor  # (B, T, P)


def _ln(x: Tensor, sd: dict[str, Tensor], name: str) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), sd[f"{name}.weight"], sd[f"{name}.bias"], 1e-6)


def _fc(x: Tensor, sd: dict[str, Tensor], name: str) -> Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])


def vit_forward(
    images: Tensor, sd: dict[str, Tensor], heads: int, depth: int, hook: Hook, prop_attn: bool
) -> tuple[Tensor, Tensor]:
    """-> logits (B, classes) from the [CLS] token, and the final source matrix (B, T, P)."""
    x = F.conv2d(
        images,
        sd["patch_embed.proj.weight"],
        sd["patch_embed.proj.bias"],
        stride=sd["patch_embed.proj.weight"].shape[-1],
    )
    x = x.flatten(2).transpose(1, 2)  # (B, P, C)
    B, P, C = x.shape
    x = torch.cat([sd["cls_token"].expand(B, -1, -1), x], dim=1) + sd["pos_embed"]
    size: Tensor | None = None
    source = torch.eye(P + 1, dtype=x.dtype)[None].expand(B, -1, -1)[:, :, 1:]  # (B, T, P)
    for i in range(depth):
        h = _ln(x, sd, f"blocks.{i}.norm1")
        T = h.shape[1]
        qkv = _fc(h, sd, f"blocks.{i}.attn.qkv").reshape(B, T, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        logits = (q @ k.transpose(-2, -1)) * (C // heads) ** -0.5
        if prop_attn and size is not None:
            logits = logits + size.log()[:, None, None, :, 0]
        attn = logits.softmax(dim=-1)
        x = x + _fc((attn @ v).transpose(1, 2).reshape(B, T, C), sd, f"blocks.{i}.attn.proj")
        io = hook(BlockIO(i, x, q, k, v, attn, size, source))
        x, size, source = io.x, io.size, io.source
        x = x + _fc(F.gelu(_fc(_ln(x, sd, f"blocks.{i}.norm2"), sd, f"blocks.{i}.mlp.fc1")), sd, f"blocks.{i}.mlp.fc2")
    return _fc(_ln(x, sd, "norm")[:, 0], sd, "head"), source


def grid_sources(patch_to_token: Tensor, num_tokens: int) -> Tensor:
    """vitrim's (B, P) patch -> token map as a (B, num_tokens, P) 0/1 source matrix, to compare with the authors'."""
    return (
        F.one_hot(patch_to_token.clamp_min(0), num_tokens).transpose(1, 2).to(torch.float64)
        * (patch_to_token >= 0)[:, None]
    )
