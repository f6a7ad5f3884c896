"""An independent re-implementation of the authors' MCTF DeiT forward (mlvlab/MCTF: ``Block_DEIT``, ``MHSA``,
``utils/mctf.py``), in plain torch on a state dict, for the tests. Shares no vitrim code.

As the authors run it: in each active block, the attention weights of the block's input are computed from q and k
alone; the input x is merged (bipartite, both directions, multi-criteria scores, scatter_reduce sums); with
``one_step_ahead=1`` the weights are merged too and applied to the values of the merged tokens, with ``2`` the
attention is computed again. The ``source`` matrix (B, T, P) is tracked with ``amax`` merges, as ``merge_source``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from vit_reference import _fc, _ln


def _matching(
    x: Tensor, attn: Tensor, size: Tensor | None, r: int, protected: int, taus: tuple[float, float, float], bidir: bool
):
    """The authors' bipartite_soft_matching: -> merge(t, mode) acting on dim -2 of t (…, T, C)."""
    tau_sim, tau_info, tau_size = taus
    r1, r2 = (r // 2, r - r // 2) if bidir else (r, 0)
    with torch.no_grad():
        m = x / x.norm(dim=-1, keepdim=True)
        a, b = m[..., ::2, :], m[..., 1::2, :]
        w_sim = ((a @ b.transpose(-1, -2) + 1) / 2) ** (1 / tau_sim)
        inv = 1 / attn.mean(dim=[1, 2])
        inv = inv / inv.max(1, keepdim=True)[0]
        w_info = (inv[..., ::2, None] * inv[..., 1::2, None].transpose(1, 2)) ** (1 / tau_info)
        if size is not None:
            s = 1 / size
            s = s / s.max(1, keepdim=True)[0]
            w_size = (s[..., ::2, :] * s[..., 1::2, :].transpose(1, 2)) ** (1 / tau_size)
        else:
            w_size = 1
        scores = w_sim * w_info * w_size
        scores[..., :protected, :] = -math.inf
        t1, t2 = scores.shape[1], scores.shape[2]
        node_max, node_idx = scores.max(dim=-1)
        edge = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx, src_idx = edge[..., r1:, :], edge[..., :r1, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
        if protected:
            unm_idx = unm_idx.sort(dim=1)[0]
        if bidir:
            scores2 = scores.gather(dim=-2, index=unm_idx.repeat(1, 1, t2)).transpose(1, 2)
            node_max2, node_idx2 = scores2.max(dim=-1)
            edge2 = node_max2.sort(dim=-1, descending=True)[1][..., None]
            unm_idx2, src_idx2 = edge2[..., r2:, :], edge2[..., :r2, :]
            dst_idx2 = node_idx2[..., None].gather(dim=-2, index=src_idx2)

    def lift(idx: Tensor, t: Tensor) -> Tensor:  # (B, k, 1) -> broadcast over t's middle dims
        while idx.dim() < t.dim():
            idx = idx.unsqueeze(1)
        return idx

    def merge(t: Tensor, mode: str) -> Tensor:
        src, dst = t[..., ::2, :], t[..., 1::2, :]
        mid, c = src.shape[1:-2], src.shape[-1]
        n = src.shape[0]
        unm = src.gather(-2, lift(unm_idx, t).expand(n, *mid, t1 - r1, c))
        src = src.gather(-2, lift(src_idx, t).expand(n, *mid, r1, c))
        dst = dst.scatter_reduce(-2, lift(dst_idx, t).expand(n, *mid, r1, c), src, reduce=mode)
        if not bidir:
            return torch.cat([unm, dst], dim=-2)
        unm2 = dst.gather(-2, lift(unm_idx2, t).expand(n, *mid, t2 - r2, c))
        src2 = dst.gather(-2, lift(src_idx2, t).expand(n, *mid, r2, c))
        dst2 = unm.scatter_reduce(-2, lift(dst_idx2, t).expand(n, *mid, r2, c), src2, reduce=mode)
        return torch.cat([dst2, unm2], dim=-2)

    return merge


def _attention_weights(h: Tensor, sd: dict[str, Tensor], i: int, heads: int, size: Tensor | None) -> Tensor:
    B, N, C = h.shape
    w, b = sd[f"blocks.{i}.attn.qkv.weight"], sd[f"blocks.{i}.attn.qkv.bias"]
    qk = (h @ w.T[:, : 2 * C] + b[: 2 * C]).reshape(B, N, 2, heads, C // heads).permute(2, 0, 3, 1, 4)
    attn = (qk[0] @ qk[1].transpose(-2, -1)) * (C // heads) ** -0.5
    if size is not None:
        attn = attn + size.log()[:, None, None, :, 0]
    return attn.softmax(dim=-1)


def _apply_weights(h: Tensor, attn: Tensor, sd: dict[str, Tensor], i: int, heads: int) -> Tensor:
    B, N, C = h.shape
    w, b = sd[f"blocks.{i}.attn.qkv.weight"], sd[f"blocks.{i}.attn.qkv.bias"]
    v = (h @ w.T[:, 2 * C :] + b[2 * C :]).reshape(B, N, heads, C // heads).permute(0, 2, 1, 3)
    return _fc((attn @ v).transpose(1, 2).reshape(B, N, C), sd, f"blocks.{i}.attn.proj")


def mctf_forward(
    images: Tensor,
    sd: dict[str, Tensor],
    heads: int,
    depth: int,
    r: float,
    *,
    active: tuple[int, ...] | None = None,
    taus: tuple[float, float, float] = (1.0, 20.0, 40.0),
    bidirection: bool = True,
    one_step_ahead: int = 1,
    pooling: int = 1,
) -> tuple[Tensor, Tensor]:
    """-> logits (B, classes) from [CLS], and the final source matrix (B, T, P) of the authors' MCTF DeiT."""
    active = tuple(range(1, depth)) if active is None else active
    w = sd["patch_embed.proj.weight"]
    x = F.conv2d(images, w, sd["patch_embed.proj.bias"], stride=w.shape[-1]).flatten(2).transpose(1, 2)
    B, P, _ = x.shape
    x = torch.cat([sd["cls_token"].expand(B, -1, -1), x], dim=1) + sd["pos_embed"]
    size: Tensor | None = None
    source = torch.eye(P + 1, dtype=x.dtype)[None].expand(B, -1, -1)
    for i in range(depth):
        if i in active:
            attn = _attention_weights(_ln(x, sd, f"blocks.{i}.norm1"), sd, i, heads, size)
            t = x.shape[1]
            rr = r
            if t - rr < 10:
                rr = t - 10
            rr = min(int((t - 1) * rr) if rr < 1 else rr, (t - 1) // 2)
            if rr > 0:
                merge = _matching(x, attn, size, int(rr), 1, taus, bidirection)
                ones = size if size is not None else torch.ones_like(x[..., 0, None])
                source = merge(source, "amax")
                if pooling == 1:
                    with torch.no_grad():
                        attn_m = attn.mean(dim=[1, 2]).unsqueeze(-1)
                        wgt = attn_m * (ones / ones.amax(dim=-2, keepdim=True))
                        norm = merge(wgt, "sum")
                else:
                    wgt, norm = ones, merge(ones, "sum")
                attn_n = merge(attn[..., None], "sum").squeeze(-1)
                attn_n = merge(attn_n * wgt[:, None], "sum").squeeze(-1) / norm[:, None]
                x = merge(x * wgt, "sum") / norm
                size = merge(ones, "sum")
                h = _ln(x, sd, f"blocks.{i}.norm1")
                if one_step_ahead == 2:
                    attn_n = _attention_weights(h, sd, i, heads, size)
                x = x + _apply_weights(h, attn_n, sd, i, heads)
            else:
                x = x + _apply_weights(_ln(x, sd, f"blocks.{i}.norm1"), attn, sd, i, heads)
        else:
            h = _ln(x, sd, f"blocks.{i}.norm1")
            x = x + _apply_weights(h, _attention_weights(h, sd, i, heads, size), sd, i, heads)
        x = x + _fc(F.gelu(_fc(_ln(x, sd, f"blocks.{i}.norm2"), sd, f"blocks.{i}.mlp.fc1")), sd, f"blocks.{i}.mlp.fc2")
    return _fc(_ln(x, sd, "norm")[:, 0], sd, "head"), source[:, :, 1:]
