"""An independent re-implementation of the authors' ToMe on a timm ViT (facebookresearch/ToMe: tome/utils.py
``parse_r``, tome/merge.py ``bipartite_soft_matching`` / ``merge_wavg``, tome/patch/timm.py), in plain torch.

Written from their code: explicit softmax attention with ``size.log()`` added when ``prop_attn``; the metric is
k averaged over heads; matching protects [CLS] (its row of scores is −inf); ``merge_wavg`` merges x·size and size
with ``scatter_reduce(sum)`` and divides; the merged layout is [unmerged a tokens (sorted), b tokens].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def parse_r(num_layers: int, r: list[int] | tuple[int, float] | int) -> list[int]:
    """tome.utils.parse_r, as the authors wrote it."""
    inflect = 0.0
    if isinstance(r, list):
        if len(r) < num_layers:
            r = r + [0] * (num_layers - len(r))
        return list(r)
    if isinstance(r, tuple):
        r, inflect = r
    min_val = int(r * (1.0 - inflect))
    max_val = 2 * r - min_val
    step = (max_val - min_val) / (num_layers - 1)
    return [int(min_val + step * i) for i in range(num_layers)]


def cls_matching(metric: Tensor, r: int) -> tuple[Tensor, Tensor, Tensor]:
    """Indices of one bipartite soft matching with a protected [CLS] (class_token=True)."""
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a, b = metric[..., ::2, :], metric[..., 1::2, :]
    scores = a @ b.transpose(-1, -2)
    scores[..., 0, :] = -math.inf
    node_max, node_idx = scores.max(dim=-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    unm_idx = edge_idx[..., r:, :].sort(dim=1)[0]
    src_idx = edge_idx[..., :r, :]
    dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
    return unm_idx, src_idx, dst_idx


def _apply(x: Tensor, idx: tuple[Tensor, Tensor, Tensor], r: int) -> Tensor:
    unm_idx, src_idx, dst_idx = idx
    src, dst = x[..., ::2, :], x[..., 1::2, :]
    n, t1, c = src.shape
    unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
    src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
    dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce="sum")
    return torch.cat([unm, dst], dim=1)


def tome_forward(
    sd: dict[str, Tensor], x: Tensor, *, depth: int, heads: int, patch: int, r: object, prop_attn: bool
) -> Tensor:
    """Logits of a [CLS] ViT (timm / vitrim key names) with ToMe patched in as the authors patch timm."""
    B = x.shape[0]
    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch).flatten(2).transpose(1, 2)
    t = torch.cat([sd["cls_token"].expand(B, -1, -1), t], dim=1) + sd["pos_embed"]
    schedule = parse_r(depth, r)  # type: ignore[arg-type]
    size = None
    for i in range(depth):
        p = f"blocks.{i}."
        h = F.layer_norm(t, t.shape[-1:], sd[p + "norm1.weight"], sd[p + "norm1.bias"], 1e-6)
        B, N, C = h.shape
        qkv = F.linear(h, sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"])
        q, k, v = qkv.reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (C // heads) ** -0.5
        if prop_attn and size is not None:
            attn = attn + size.log()[:, None, None, :, 0]
        attn = attn.softmax(dim=-1)
        t = t + F.linear(
            (attn @ v).transpose(1, 2).reshape(B, N, C), sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"]
        )
        step = min(schedule[i], (N - 1) // 2)
        if step > 0:
            idx = cls_matching(k.mean(1), step)
            size = torch.ones_like(t[..., 0, None]) if size is None else size
            t = _apply(t * size, idx, step)
            size = _apply(size, idx, step)
            t = t / size
        h = F.layer_norm(t, t.shape[-1:], sd[p + "norm2.weight"], sd[p + "norm2.bias"], 1e-6)
        h = F.linear(F.gelu(F.linear(h, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"])), sd[p + "mlp.fc2.weight"])
        t = t + h + sd[p + "mlp.fc2.bias"]
    t = F.layer_norm(t, t.shape[-1:], sd["norm.weight"], sd["norm.bias"], 1e-6)
    return F.linear(t[:, 0], sd["head.weight"], sd["head.bias"])
