"""The authors' PPT forward for DeiT (xjwu1024/PPT ``ppt_deit.py``), re-written independently in the authors' style
(sub-batches by the variance test, ToMe merge with ``scatter_reduce``, ``batch_index_select`` pruning), on the plain
ViT of vit_reference. Proportional attention on; [CLS] only prefix token.
"""

from __future__ import annotations

import torch
from tome_model_reference import cls_matching
from torch import Tensor
from vit_reference import BlockIO, vit_forward


def _tome(metric: Tensor, r: int):
    unm_idx, src_idx, dst_idx = cls_matching(metric, r)  # PPT merges with ToMe's own matching

    def merge(x: Tensor, mode: str) -> Tensor:
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(-2, unm_idx.expand(n, t1 - r, c))
        src = src.gather(-2, src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)
        return torch.cat([unm, dst], dim=1)

    return merge


def _select(x: Tensor, idx: Tensor) -> Tensor:
    B, N, C = x.shape
    flat = (idx + torch.arange(B).view(B, 1) * N).reshape(-1)
    return x.reshape(B * N, C)[flat].reshape(B, idx.shape[1], C)


def ppt_forward(
    images: Tensor, sd: dict[str, Tensor], heads: int, depth: int, r_tokens: int, layers: list[int], threshold: float
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """-> logits, final source matrix (B, T, P), and per reducing block the per-image pooling decision."""
    decisions: list[Tensor] = []

    def hook(io: BlockIO) -> BlockIO:
        if io.i not in layers:
            return io
        x = io.x
        B, N, C = x.shape
        size = io.size if io.size is not None else torch.ones(B, N, 1, dtype=x.dtype)
        v_norm = torch.linalg.norm(io.v.transpose(1, 2).reshape(B, N, C), ord=2, dim=2)
        sig = (io.attn[:, :, 0].sum(dim=1) * v_norm)[:, 1:]
        sig = sig / sig.sum(dim=1, keepdim=True)
        scores = torch.cat([2 * torch.ones(B, 1, dtype=x.dtype), sig], dim=-1)
        r = min(r_tokens, (N - 1) // 2)
        s_op = torch.var(scores[:, 1:], dim=1)
        decisions.append(s_op < threshold)
        if r <= 0:
            return io
        out_x = torch.zeros(B, N - r, C, dtype=x.dtype)
        out_size = torch.ones(B, N - r, 1, dtype=x.dtype)
        out_source = torch.zeros(B, N - r, io.source.shape[-1], dtype=x.dtype)
        pool_idx = torch.nonzero(s_op < threshold).squeeze(-1)
        if pool_idx.shape[0] > 0:
            merge = _tome(io.k.mean(1)[pool_idx], r)
            xs, ss = x[pool_idx], size[pool_idx]
            px = merge(xs * ss, "sum")
            ps = merge(ss, "sum")
            out_x[pool_idx], out_size[pool_idx] = px / ps, ps
            out_source[pool_idx] = merge(io.source[pool_idx], "amax")
        prune_idx = torch.nonzero(s_op >= threshold).squeeze(-1)
        if prune_idx.shape[0] > 0:
            _, sorted_indices = torch.sort(scores[prune_idx], descending=True, dim=-1)
            keep = sorted_indices[:, :-r]
            out_x[prune_idx] = _select(x[prune_idx], keep)
            out_size[prune_idx] = _select(size[prune_idx], keep)
            out_source[prune_idx] = _select(io.source[prune_idx], keep)
        io.x, io.size, io.source = out_x, out_size, out_source
        return io

    logits, source = vit_forward(images, sd, heads, depth, hook, prop_attn=True)
    return logits, source, decisions
