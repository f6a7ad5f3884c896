"""An independent re-implementation of the official ToMe forward on a timm ViT (facebookresearch/ToMe,
``tome/patch/timm.py`` + ``tome/merge.py``), in plain torch, with timm's module structure and parameter names.

Written from the paper and the structure of the authors' code, not from vitrim: it shares no code with the package.
It is what the authors' patched timm model runs in evaluation with ``prop_attn=True`` (their default off the shelf):

* modules as timm builds them (``Attention`` with ``qkv``/``attn_drop``/``proj``/``proj_drop``, ``Mlp`` with
  ``fc1``/``act``/``drop1``/``norm``/``fc2``/``drop2``, ``Block`` with ``norm1``/``ls1``/``drop_path1``/…), so that a
  timed forward pays the module calls the authors' model pays;
* attention is the explicit matrix: ``(q @ kᵀ) · scale + log(size)``, softmax, ``@ v``; the block hands the mean of
  the keys over heads to the merge as its metric;
* ``bipartite_soft_matching`` returns a merge closure: cosine scores between the even (a) and odd (b) tokens, the
  [CLS] row set to −∞ (and the distillation token's column when there is one), each a token's best b partner,
  ``argsort`` of those maxima, the unmerged a tokens sorted back into order when there is a [CLS] token;
* ``merge_wavg``: ``x · size`` and ``size`` merged by ``scatter_reduce(..., "sum")`` into their b partners, then
  divided by the merged size; the merged sequence is ``[unmerged a tokens, b tokens]``;
* the per-forward state is a shared dict (``r`` list popped block by block, ``size``), as the authors keep it.

Used by ``benchmarks/official_pairs.py`` (the side-by-side timing) and checked against vitrim's logits in
``tests/reduce/test_tome_official.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from tome_functional import matching, merge_sum
from torch import Tensor, nn


def bipartite_soft_matching(metric: Tensor, r: int, class_token: bool, distill_token: bool) -> Callable[..., Tensor]:
    """The merge function of the r best (a, b) pairs of ``metric`` (B, N, c); the identity if none can merge. The
    authors' closure over the matching of ``tome_functional`` (the same paper's code, shared by its two forms)."""
    idx = matching(metric, r, class_token, distill_token)
    if idx is None:
        return lambda x, mode="sum": x

    def merge(x: Tensor, mode: str = "sum") -> Tensor:
        assert mode == "sum", "the eval forward merges sums only (merge_wavg)"
        return merge_sum(x, idx, distill_token)

    return merge


def merge_wavg(merge: Callable[..., Tensor], x: Tensor, size: Tensor | None) -> tuple[Tensor, Tensor]:
    """Size-weighted average through ``merge``: (B, N, C), sizes (B, N, 1) or None -> merged x and sizes."""
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    x = merge(x * size, mode="sum")
    size = merge(size, mode="sum")
    return x / size, size


class Attention(nn.Module):
    """timm's Attention with ToMe's changes: proportional attention, and k averaged over heads returned."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: Tensor, size: Tensor | None) -> tuple[Tensor, Tensor]:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if size is not None:
            attn = attn + size.log()[:, None, None, :, 0]
        attn = self.attn_drop(attn.softmax(dim=-1))
        x = self.proj_drop(self.proj((attn @ v).transpose(1, 2).reshape(B, N, C)))
        return x, k.mean(1)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(0.0)
        self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(hidden, dim), nn.Dropout(0.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class ToMeBlock(nn.Module):
    """timm's Block as ToMe patches it: merge between the attention and the MLP, sizes kept in the shared dict."""

    def __init__(self, dim: int, num_heads: int, info: dict[str, Any]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.ls1, self.drop_path1 = nn.Identity(), nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.ls2, self.drop_path2 = nn.Identity(), nn.Identity()
        self._tome_info = info

    def _drop_path1(self, x: Tensor) -> Tensor:
        return self.drop_path1(x) if hasattr(self, "drop_path1") else x

    def _drop_path2(self, x: Tensor) -> Tensor:
        return self.drop_path2(x) if hasattr(self, "drop_path2") else x

    def forward(self, x: Tensor) -> Tensor:
        info = self._tome_info
        x_attn, metric = self.attn(self.norm1(x), info["size"] if info["prop_attn"] else None)
        x = x + self._drop_path1(x_attn)
        r = info["r"].pop(0)
        if r > 0:
            merge = bipartite_soft_matching(metric, r, info["class_token"], info["distill_token"])
            x, info["size"] = merge_wavg(merge, x, info["size"])
        return x + self._drop_path2(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.norm = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class ToMeVisionTransformer(nn.Module):
    """A timm ViT/DeiT (token pooling, [CLS], optionally DeiT's distillation token) with ToMe applied, r per block.

    Parameter names are timm's, so ``load_state_dict`` takes a vitrim (or timm) state dict as it is.
    """

    def __init__(
        self, *, depth: int, dim: int, heads: int, patch: int, grid: int, classes: int, r: int, distilled: bool
    ) -> None:
        super().__init__()
        self.r = r
        self.distilled = distilled
        prefix = 2 if distilled else 1
        self._tome_info: dict[str, Any] = {
            "r": r,
            "size": None,
            "source": None,
            "trace_source": False,
            "prop_attn": True,
            "class_token": True,
            "distill_token": distilled,
        }
        self.patch_embed = PatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)) if distilled else None
        self.pos_embed = nn.Parameter(torch.zeros(1, prefix + grid * grid, dim))
        self.pos_drop, self.patch_drop, self.norm_pre = nn.Dropout(0.0), nn.Identity(), nn.Identity()
        self.blocks = nn.Sequential(*(ToMeBlock(dim, heads, self._tome_info) for _ in range(depth)))
        self.norm, self.fc_norm, self.head_drop = nn.LayerNorm(dim, eps=1e-6), nn.Identity(), nn.Dropout(0.0)
        self.head = nn.Linear(dim, classes)
        self.head_dist = nn.Linear(dim, classes) if distilled else None

    def forward_features(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        prefix = [self.cls_token.expand(x.shape[0], -1, -1)]
        if self.dist_token is not None:
            prefix.append(self.dist_token.expand(x.shape[0], -1, -1))
        x = self.pos_drop(torch.cat([*prefix, x], dim=1) + self.pos_embed)
        x = self.norm_pre(self.patch_drop(x))
        return self.norm(self.blocks(x))

    def forward_head(self, x: Tensor) -> Tensor:
        if self.head_dist is not None:  # DeiT-distilled in eval: the mean of the two heads
            return (self.head(self.head_drop(x[:, 0])) + self.head_dist(x[:, 1])) / 2
        return self.head(self.head_drop(self.fc_norm(x[:, 0])))

    def forward(self, x: Tensor) -> Tensor:
        self._tome_info["r"] = [self.r] * len(self.blocks)  # the authors' parse_r for an int r
        self._tome_info["size"] = None
        self._tome_info["source"] = None
        return self.forward_head(self.forward_features(x))


def official_tome_model(sd: dict[str, Tensor], *, depth: int, heads: int, patch: int, r: int) -> ToMeVisionTransformer:
    """The official ToMe model holding the weights of ``sd`` (timm names), in eval mode; sizes read from ``sd``."""
    dim = sd["cls_token"].shape[-1]
    distilled = "dist_token" in sd
    grid = math.isqrt(sd["pos_embed"].shape[1] - (2 if distilled else 1))
    classes = sd["head.weight"].shape[0]
    model = ToMeVisionTransformer(
        depth=depth, dim=dim, heads=heads, patch=patch, grid=grid, classes=classes, r=r, distilled=distilled
    )
    model.load_state_dict(sd, strict=True)
    return model.eval()
