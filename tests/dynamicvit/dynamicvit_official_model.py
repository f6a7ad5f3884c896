"""The official DynamicViT evaluation forward (raoyongming/DynamicViT, ``models/dyvit.py``,
``VisionTransformerDiffPruning``) re-implemented with its module structure, for timing next to vitrim.

Independent of vitrim. ``dynamicvit_reference.py`` is the functional form the parity tests use; this one builds the
authors' modules (``Block`` with ``norm1``/``attn``/``drop_path``/``norm2``/``mlp``, ``Attention`` with
``qkv``/``attn_drop``/``proj``/``proj_drop``, ``Mlp`` with ``fc1``/``act``/``fc2``/``drop``, ``PredictorLG`` with its
two ``nn.Sequential``) so that a timed forward pays the module calls their model pays. Parameter names are the
official checkpoints', so ``load_state_dict`` takes a vitrim DynamicViT state dict as it is. Evaluation only:
explicit softmax attention, ``argsort`` of the keep score, ``batch_index_select``.
"""

from __future__ import annotations

import math

import torch
from dynamicvit_reference import batch_index_select  # the official code's helper, shared by both forms
from torch import Tensor, nn


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2, self.drop = (
            nn.Linear(dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, dim),
            nn.Dropout(0),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv, self.attn_drop = nn.Linear(dim, dim * 3), nn.Dropout(0)
        self.proj, self.proj_drop = nn.Linear(dim, dim), nn.Dropout(0)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention(dim, num_heads)
        self.drop_path = nn.Identity()
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), Mlp(dim, 4 * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PredictorLG(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_conv = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.out_conv = nn.Sequential(
            nn.Linear(dim, dim // 2),
            nn.GELU(),
            nn.Linear(dim // 2, dim // 4),
            nn.GELU(),
            nn.Linear(dim // 4, 2),
            nn.LogSoftmax(dim=-1),
        )

    def forward(self, x: Tensor, policy: Tensor) -> Tensor:
        x = self.in_conv(x)
        B, N, C = x.size()
        local_x = x[:, :, : C // 2]
        global_x = (x[:, :, C // 2 :] * policy).sum(dim=1, keepdim=True) / torch.sum(policy, dim=1, keepdim=True)
        x = torch.cat([local_x, global_x.expand(B, N, C // 2)], dim=-1)
        return self.out_conv(x)


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformerDiffPruning(nn.Module):
    """Evaluation forward of the official model: score, argsort, keep ``int(init_n · ratio)`` before each stage."""

    def __init__(
        self, *, depth: int, dim: int, heads: int, patch: int, grid: int, classes: int, pruning_loc: tuple[int, ...]
    ) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid + 1, dim))
        self.pos_drop = nn.Dropout(0)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pre_logits = nn.Identity()
        self.head = nn.Linear(dim, classes)
        self.score_predictor = nn.ModuleList(PredictorLG(dim) for _ in pruning_loc)
        self.pruning_loc = pruning_loc
        self.init_n = grid * grid
        self.token_ratio: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        B = x.shape[0]
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        p_count = 0
        init_n = self.init_n
        prev_decision = torch.ones(B, init_n, 1, dtype=x.dtype, device=x.device)
        for i, blk in enumerate(self.blocks):
            if i in self.pruning_loc:
                spatial_x = x[:, 1:]
                pred_score = self.score_predictor[p_count](spatial_x, prev_decision).reshape(B, -1, 2)
                score = pred_score[:, :, 0]
                num_keep_node = int(init_n * self.token_ratio[p_count])
                keep_policy = torch.argsort(score, dim=1, descending=True)[:, :num_keep_node]
                cls_policy = torch.zeros(B, 1, dtype=keep_policy.dtype, device=keep_policy.device)
                now_policy = torch.cat([cls_policy, keep_policy + 1], dim=1)
                x = batch_index_select(x, now_policy)
                prev_decision = batch_index_select(prev_decision, keep_policy)
                x = blk(x)
                p_count += 1
            else:
                x = blk(x)
        x = self.norm(x)
        return self.head(self.pre_logits(x[:, 0]))


def official_dynamicvit_model(
    sd: dict[str, Tensor], *, depth: int, heads: int, patch: int, pruning_loc: tuple[int, ...], keep_ratio: float
) -> VisionTransformerDiffPruning:
    """The official model holding the weights of ``sd`` (official names), in eval mode; sizes read from ``sd``."""
    dim = sd["cls_token"].shape[-1]
    grid = math.isqrt(sd["pos_embed"].shape[1] - 1)
    model = VisionTransformerDiffPruning(
        depth=depth,
        dim=dim,
        heads=heads,
        patch=patch,
        grid=grid,
        classes=sd["head.weight"].shape[0],
        pruning_loc=pruning_loc,
    )
    model.token_ratio = [keep_ratio ** (s + 1) for s in range(len(pruning_loc))]
    model.load_state_dict(sd, strict=True)
    return model.eval()
