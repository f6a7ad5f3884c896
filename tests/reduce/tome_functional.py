"""The official ToMe forward on a timm ViT (facebookresearch/ToMe, ``tome/patch/timm.py`` + ``tome/merge.py``) as
plain functions of a state dict with timm's key names: no modules, so none of their per-call overhead.

``tome_official.py`` is the same forward with timm's modules, as the authors' code runs; this one is a stricter
baseline for timing at batch 1 (``benchmarks/official_pairs.py --pairs tome_functional``).

Written from the paper and the structure of the authors' code, not from vitrim: it shares no code with the package.
It is what the authors' patched timm model runs in evaluation with ``prop_attn=True`` (their default off the shelf):

* attention is the explicit matrix: ``(q @ kᵀ) · scale + log(size)``, softmax, ``@ v``; the block hands the mean of
  the keys over heads to the merge as its metric;
* ``bipartite_soft_matching``: cosine scores between the even (a) and odd (b) tokens, the [CLS] row set to −∞ (and
  the distillation token's column when there is one), each a token's best b partner, ``argsort`` of those maxima,
  the unmerged a tokens sorted back into order when there is a [CLS] token;
* ``merge_wavg``: ``x · size`` and ``size`` merged by ``scatter_reduce(..., "sum")`` into their b partners,
  then divided by the merged size; the merged sequence is ``[unmerged a tokens, b tokens]``.

Checked against vitrim's logits in ``tests/reduce/test_tome_official.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _ln(x: Tensor, sd: dict[str, Tensor], name: str) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), sd[f"{name}.weight"], sd[f"{name}.bias"], 1e-6)


def _fc(x: Tensor, sd: dict[str, Tensor], name: str) -> Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])


def tome_attention(
    x: Tensor, sd: dict[str, Tensor], name: str, heads: int, size: Tensor | None
) -> tuple[Tensor, Tensor]:
    """timm's Attention with proportional attention: (B, N, C) -> output (B, N, C) and the metric k.mean(heads)."""
    B, N, C = x.shape
    qkv = _fc(x, sd, f"{name}.qkv").reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q @ k.transpose(-2, -1)) * (C // heads) ** -0.5
    if size is not None:
        attn = attn + size.log()[:, None, None, :, 0]
    attn = attn.softmax(dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(B, N, C)
    return _fc(out, sd, f"{name}.proj"), k.mean(1)


def matching(metric: Tensor, r: int, class_token: bool, distill_token: bool) -> tuple[Tensor, Tensor, Tensor] | None:
    """Bipartite soft matching: (unmerged a, merged a, their b partners) index tensors (B, ·, 1), or None if r = 0."""
    protected = int(class_token) + int(distill_token)
    r = min(r, (metric.shape[1] - protected) // 2)
    if r <= 0:
        return None
    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, b = metric[..., ::2, :], metric[..., 1::2, :]
        scores = a @ b.transpose(-1, -2)
        if class_token:
            scores[..., 0, :] = float("-inf")
        if distill_token:
            scores[..., :, 0] = float("-inf")
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx = edge_idx[..., r:, :]
        src_idx = edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
        if class_token:
            unm_idx = unm_idx.sort(dim=1)[0]
    return unm_idx, src_idx, dst_idx


def merge_sum(x: Tensor, idx: tuple[Tensor, Tensor, Tensor], distill_token: bool) -> Tensor:
    """Sum every merged a token into its b partner: (B, N, c) -> (B, N − r, c), layout [unmerged a, b]."""
    unm_idx, src_idx, dst_idx = idx
    src, dst = x[..., ::2, :], x[..., 1::2, :]
    n, t1, c = src.shape
    r = src_idx.shape[1]
    unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
    src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
    dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce="sum")
    if distill_token:
        return torch.cat([unm[:, :1], dst[:, :1], unm[:, 1:], dst[:, 1:]], dim=1)
    return torch.cat([unm, dst], dim=1)


def functional_tome_forward(
    sd: dict[str, Tensor],
    images: Tensor,
    *,
    depth: int,
    heads: int,
    patch: int,
    r: int,
    distill_token: bool = False,
) -> Tensor:
    """Logits (B, classes) of the official ToMe on a timm ViT with a [CLS] token at the checkpoint's own size.

    ``r`` tokens are merged in every block (the authors' ``model.r = r``); with a distillation token the two heads
    are averaged, as DeiT-distilled evaluates.
    """
    B = images.shape[0]
    x = F.conv2d(images, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch)
    x = x.flatten(2).transpose(1, 2)  # (B, P, C)
    prefix = [sd["cls_token"].expand(B, -1, -1)]
    if distill_token:
        prefix.append(sd["dist_token"].expand(B, -1, -1))
    x = torch.cat([*prefix, x], dim=1) + sd["pos_embed"]
    size: Tensor | None = None
    for i in range(depth):
        name = f"blocks.{i}"
        x_attn, metric = tome_attention(_ln(x, sd, f"{name}.norm1"), sd, f"{name}.attn", heads, size)
        x = x + x_attn
        idx = matching(metric, r, True, distill_token)
        if idx is not None:
            if size is None:
                size = torch.ones_like(x[..., 0, None])
            x = merge_sum(x * size, idx, distill_token)
            size = merge_sum(size, idx, distill_token)
            x = x / size
        h = F.gelu(_fc(_ln(x, sd, f"{name}.norm2"), sd, f"{name}.mlp.fc1"))
        x = x + _fc(h, sd, f"{name}.mlp.fc2")
    x = _ln(x, sd, "norm")
    if distill_token:
        return (_fc(x[:, 0], sd, "head") + _fc(x[:, 1], sd, "head_dist")) / 2
    return _fc(x[:, 0], sd, "head")
