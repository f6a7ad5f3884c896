"""An independent re-implementation of the authors' EViT forward (youweiliang/evit, evit.py), in plain torch.

Written from their code, not from vitrim's: explicit softmax attention; in a reducing block
``left_tokens = math.ceil(keep_rate * (N - 1))`` (no reduction when keep_rate is 1 or left_tokens == N − 1);
``torch.topk(cls_attn, left_tokens, sorted=True)`` on the [CLS] row averaged over heads; the kept tokens gathered
after the attention residual; with ``fuse_token`` the others summed with their [CLS] attention as weights
(``complement_idx``) into one token appended last; then the MLP residual. Weights use timm / vitrim key names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def complement_idx(idx: Tensor, dim: int) -> Tensor:
    """The authors' helper: sorted indices of range(dim) not in idx (B, k) -> (B, dim − k)."""
    a = torch.arange(dim, device=idx.device).expand(idx.shape[0], dim)
    masked = torch.scatter(a, -1, idx, 0)
    compl, _ = torch.sort(masked, dim=-1, descending=False)
    return compl[:, idx.shape[1] :]


def evit_forward(
    sd: dict[str, Tensor], x: Tensor, *, depth: int, heads: int, patch: int, keep_rates: dict[int, float], fuse: bool
) -> tuple[Tensor, list[int]]:
    """Logits of a DeiT with EViT in the blocks of ``keep_rates``; also the token count after every block."""
    B = x.shape[0]
    t = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch).flatten(2).transpose(1, 2)
    t = torch.cat([sd["cls_token"].expand(B, -1, -1), t], dim=1) + sd["pos_embed"]
    counts = []
    for i in range(depth):
        p = f"blocks.{i}."
        h = F.layer_norm(t, t.shape[-1:], sd[p + "norm1.weight"], sd[p + "norm1.bias"], 1e-6)
        B, N, C = h.shape
        qkv = F.linear(h, sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"])
        q, k, v = qkv.reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (C // heads) ** -0.5).softmax(dim=-1)
        out = F.linear(
            (attn @ v).transpose(1, 2).reshape(B, N, C), sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"]
        )
        t = t + out
        keep_rate = keep_rates.get(i, 1.0)
        if keep_rate < 1:
            left = math.ceil(keep_rate * (N - 1))
            if left != N - 1:
                cls_attn = attn[:, :, 0, 1:].mean(dim=1)  # (B, N − 1)
                _, idx = torch.topk(cls_attn, left, dim=1, largest=True, sorted=True)
                non_cls = t[:, 1:]
                kept = torch.gather(non_cls, 1, idx.unsqueeze(-1).expand(-1, -1, C))
                parts = [t[:, :1], kept]
                if fuse:
                    compl = complement_idx(idx, N - 1)
                    others = torch.gather(non_cls, 1, compl.unsqueeze(-1).expand(-1, -1, C))
                    weights = torch.gather(cls_attn, 1, compl)
                    parts.append(torch.sum(others * weights.unsqueeze(-1), dim=1, keepdim=True))
                t = torch.cat(parts, dim=1)
        h = F.layer_norm(t, t.shape[-1:], sd[p + "norm2.weight"], sd[p + "norm2.bias"], 1e-6)
        h = F.linear(F.gelu(F.linear(h, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"])), sd[p + "mlp.fc2.weight"])
        t = t + h + sd[p + "mlp.fc2.bias"]
        counts.append(t.shape[1])
    t = F.layer_norm(t, t.shape[-1:], sd["norm.weight"], sd["norm.bias"], 1e-6)
    return F.linear(t[:, 0], sd["head.weight"], sd["head.bias"]), counts
