"""The authors' PiToMe forward for DeiT/timm (hchautran/PiToMe ``algo/pitome``), re-written independently in the
authors' style (index splits, ``scatter_reduce`` merges, ToMe's source matrix), on the plain ViT of vit_reference.

Per block i of L: margin 0.75 − 0.75·i/L; the first ⌈L/2⌉ blocks use ``pitome_bsm``, the rest ``pitome``; r =
floor(T − T·ratio) with T the non-[CLS] tokens; sizes weight the merge (merge_wavg) but not the attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from vit_reference import BlockIO, vit_forward


def _matching(metric: Tensor, ratio: float, margin: float, use_bsm_pitome: bool):
    metric = metric[:, 1:, :]  # class_token=True
    B, T, _ = metric.shape
    r = math.floor(T - T * ratio)
    metric = F.normalize(metric, p=2, dim=-1)
    sim = metric @ metric.transpose(-1, -2)
    energy = F.elu(sim - margin, alpha=1.0).mean(dim=-1)
    indices = torch.argsort(energy, descending=True)
    batch_idx = torch.arange(B).unsqueeze(1)
    if use_bsm_pitome:
        a_idx, b_idx = indices[..., ::2], indices[..., 1::2]
        scores = sim.gather(-1, b_idx.unsqueeze(-2).expand(B, T, b_idx.shape[-1]))
        scores = scores.gather(-2, a_idx.unsqueeze(-1).expand(B, a_idx.shape[-1], b_idx.shape[-1]))
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx, src_idx = edge_idx[..., r:, :], edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(-2, src_idx)

        def merge(x: Tensor, mode: str) -> Tensor:
            x_cls, x = x[:, :1], x[:, 1:]
            src, dst = x[batch_idx, a_idx, :], x[batch_idx, b_idx, :]
            n, t1, c = src.shape
            unm = src.gather(-2, unm_idx.expand(n, t1 - r, c))
            src = src.gather(-2, src_idx.expand(n, r, c))
            dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)
            return torch.cat([x_cls, unm, dst], dim=1)

        return merge
    merge_idx, protected_idx = indices[..., : 2 * r], indices[..., 2 * r :]
    a_idx, b_idx = merge_idx[..., ::2], merge_idx[..., 1::2]
    scores = sim.gather(-1, b_idx.unsqueeze(-2).expand(B, T, r))
    scores = scores.gather(-2, a_idx.unsqueeze(-1).expand(B, r, r))
    _, dst_idx = scores.max(dim=-1)

    def merge(x: Tensor, mode: str) -> Tensor:  # type: ignore[no-redef]
        x_cls, x = x[:, :1], x[:, 1:]
        C = x.shape[-1]
        protected = x[batch_idx, protected_idx, :]
        src, dst = x[batch_idx, a_idx, :], x[batch_idx, b_idx, :]
        dst = dst.scatter_reduce(-2, dst_idx.unsqueeze(2).expand(B, r, C), src, reduce=mode)
        return torch.cat([x_cls, protected, dst], dim=1)

    return merge


def pitome_forward(
    images: Tensor, sd: dict[str, Tensor], heads: int, depth: int, ratio: float
) -> tuple[Tensor, Tensor]:
    """-> logits, final source matrix (B, T, P) of the authors' DeiT PiToMe at one ``ratio`` in every block."""
    margins = [0.75 - 0.75 * (i / depth) for i in range(depth)]
    use_bsm = [True] * math.ceil(depth * 0.5) + [False] * (depth - math.ceil(depth * 0.5))

    def hook(io: BlockIO) -> BlockIO:
        if ratio >= 1.0:
            return io
        merge = _matching(io.k.mean(1), ratio, margins[io.i], use_bsm[io.i])
        size = io.size if io.size is not None else torch.ones_like(io.x[..., 0, None])
        x = merge(io.x * size, "sum")
        size = merge(size, "sum")
        io.source = merge(io.source, "amax")
        io.x, io.size = x / size, size
        return io

    return vit_forward(images, sd, heads, depth, hook, prop_attn=False)
