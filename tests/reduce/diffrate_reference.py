"""DiffRate's evaluation forward (OpenGVLab/DiffRate ``DiffRate/patch/deit.py`` ``DiffRateBlock.forward``, eval branch;
``DiffRate/merge.py`` ``get_merge_func``), re-written independently in the authors' style on the plain ViT of
vit_reference. Shares no vitrim code.

Every block: sort all tokens but [CLS] by the [CLS] attention row (mean over heads), keep the first ``prune_kept``;
if ``merge_kept`` is fewer, each token past it goes to its most similar (cosine of x) token among the first ones,
[CLS] excluded; tokens merge by ``scatter_reduce(mean)``, sizes by the sum of size · similarity; the attention adds
log(size) (proportional attention, always on).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from vit_reference import BlockIO, vit_forward


def _merge_func(metric: Tensor, kept: int):
    metric = metric / metric.norm(dim=-1, keepdim=True)
    similarity = metric[:, kept:] @ metric[:, :kept].transpose(-1, -2)
    similarity[..., :, 0] = -math.inf
    node_max, node_idx = similarity.max(dim=-1)
    dst_idx = node_idx[..., None]

    def merge(x: Tensor, mode: str) -> Tensor:
        src, dst = x[:, kept:], x[:, :kept]
        n, t1, c = src.shape
        return dst.scatter_reduce(-2, dst_idx.expand(n, t1, c), src, reduce=mode)

    return merge, node_max


def diffrate_forward(
    images: Tensor, sd: dict[str, Tensor], heads: int, depth: int, prune_kept: list[int], merge_kept: list[int]
) -> tuple[Tensor, Tensor, list[int]]:
    """-> logits, the final source matrix (B, T, P), and the tokens after every block."""
    counts: list[int] = []

    def hook(io: BlockIO) -> BlockIO:
        x = io.x
        B = x.shape[0]
        size = io.size if io.size is not None else torch.ones_like(x[..., :1])
        _, idx = torch.sort(io.attn[:, :, 0, 1:].mean(dim=1), descending=True)
        idx = torch.cat((torch.zeros((B, 1), dtype=torch.long), idx + 1), dim=1)
        x = torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        size = torch.gather(size, 1, idx.unsqueeze(-1))
        source = torch.gather(io.source, 1, idx.unsqueeze(-1).expand(-1, -1, io.source.shape[-1]))
        p, m = prune_kept[io.i], merge_kept[io.i]
        x, size, source = x[:, :p], size[:, :p], source[:, :p]
        if m < p:
            merge, node_max = _merge_func(x, m)
            x = merge(x, "mean")
            size = torch.cat((size[:, :m], size[:, m:] * node_max[..., None]), dim=1)
            size = merge(size, "sum")
            source = merge(source, "amax")
        io.x, io.size, io.source = x, size, source
        counts.append(x.shape[1])
        return io

    logits, source = vit_forward(images, sd, heads, depth, hook, prop_attn=True)
    return logits, source, counts
