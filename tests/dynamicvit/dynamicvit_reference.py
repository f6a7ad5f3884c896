"""An independent, minimal re-implementation of the official DynamicViT forward (raoyongming/DynamicViT,
``VisionTransformerDiffPruning``) in plain torch, straight from a state dict with the official key names.

Written from the paper and the official code's structure, not from vitrim: it shares no code with the package.
Evaluation: argsort of the keep score, ``batch_index_select`` of the tokens. Training: hard Gumbel-softmax decisions
multiplied into the previous decision, and every block's attention through ``softmax_with_policy`` (eps = 1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


def softmax_with_policy(attn: Tensor, policy: Tensor, eps: float = 1e-6) -> Tensor:
    """The official training-time attention normalisation. attn (B, H, N, N) logits; policy (B, N, 1)."""
    B, N, _ = policy.size()
    attn_policy = policy.reshape(B, 1, 1, N)
    eye = torch.eye(N, dtype=attn_policy.dtype, device=attn_policy.device).view(1, 1, N, N)
    attn_policy = attn_policy + (1.0 - attn_policy) * eye
    max_att = torch.max(attn, dim=-1, keepdim=True)[0]
    attn = attn - max_att
    attn = attn.to(torch.float32).exp_() * attn_policy.to(torch.float32)
    attn = (attn + eps / N) / (attn.sum(dim=-1, keepdim=True) + eps)
    return attn.type_as(max_att)


def batch_index_select(x: Tensor, idx: Tensor) -> Tensor:
    """Rows ``idx`` (B, N') of each batch element of x (B, N, C) or (B, N), with flat offsets as the official code."""
    B, N = x.shape[:2]
    offset = torch.arange(B, dtype=torch.long, device=x.device).view(B, 1) * N
    flat = (idx + offset).reshape(-1)
    if x.dim() == 3:
        return x.reshape(B * N, x.shape[2])[flat].reshape(B, idx.shape[1], x.shape[2])
    return x.reshape(B * N)[flat].reshape(B, idx.shape[1])


def _ln(x: Tensor, sd: dict[str, Tensor], name: str, eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), sd[f"{name}.weight"], sd[f"{name}.bias"], eps)


def _fc(x: Tensor, sd: dict[str, Tensor], name: str) -> Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])


def attention(x: Tensor, sd: dict[str, Tensor], name: str, heads: int, policy: Tensor | None) -> Tensor:
    B, N, C = x.shape
    qkv = _fc(x, sd, f"{name}.qkv").reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q @ k.transpose(-2, -1)) * (C // heads) ** -0.5
    attn = attn.softmax(dim=-1) if policy is None else softmax_with_policy(attn, policy)
    return _fc((attn @ v).transpose(1, 2).reshape(B, N, C), sd, f"{name}.proj")


def block(x: Tensor, sd: dict[str, Tensor], i: int, heads: int, policy: Tensor | None) -> Tensor:
    x = x + attention(_ln(x, sd, f"blocks.{i}.norm1", 1e-6), sd, f"blocks.{i}.attn", heads, policy)
    h = F.gelu(_fc(_ln(x, sd, f"blocks.{i}.norm2", 1e-6), sd, f"blocks.{i}.mlp.fc1"))
    return x + _fc(h, sd, f"blocks.{i}.mlp.fc2")


def predictor(x: Tensor, policy: Tensor, sd: dict[str, Tensor], s: int) -> Tensor:
    """PredictorLG: x (B, N, C) patch tokens, policy (B, N, 1) -> (B, N, 2) log-probabilities."""
    p = f"score_predictor.{s}"
    x = F.gelu(_fc(_ln(x, sd, f"{p}.in_conv.0", 1e-5), sd, f"{p}.in_conv.1"))
    B, N, C = x.size()
    local_x = x[:, :, : C // 2]
    global_x = (x[:, :, C // 2 :] * policy).sum(dim=1, keepdim=True) / torch.sum(policy, dim=1, keepdim=True)
    x = torch.cat([local_x, global_x.expand(B, N, C - C // 2)], dim=-1)
    x = F.gelu(_fc(x, sd, f"{p}.out_conv.0"))
    x = F.gelu(_fc(x, sd, f"{p}.out_conv.2"))
    return F.log_softmax(_fc(x, sd, f"{p}.out_conv.4"), dim=-1)


@dataclass
class OfficialOutput:
    logits: Tensor
    features: Tensor  # (B, N', C) final patch tokens after the norm
    kept_positions: list[Tensor] = field(default_factory=list)  # eval: absolute positions per stage, in kept order
    decisions: list[Tensor] = field(default_factory=list)  # training: (B, N) hard decisions per stage


def official_forward(
    sd: dict[str, Tensor],
    images: Tensor,
    *,
    depth: int,
    heads: int,
    patch: int,
    pruning_loc: tuple[int, ...],
    token_ratio: list[float],
    training: bool,
) -> OfficialOutput:
    """The official forward at the checkpoint's own image size (no position-embedding resampling)."""
    B = images.shape[0]
    x = F.conv2d(images, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch)
    x = x.flatten(2).transpose(1, 2)  # (B, N, C)
    init_n = x.shape[1]
    x = torch.cat([sd["cls_token"].expand(B, -1, -1), x], dim=1) + sd["pos_embed"]
    positions = torch.arange(init_n).expand(B, init_n)
    prev_decision = torch.ones(B, init_n, 1, dtype=x.dtype)
    policy = torch.ones(B, init_n + 1, 1, dtype=x.dtype)
    out = OfficialOutput(logits=x, features=x)
    p_count = 0
    for i in range(depth):
        if i in pruning_loc:
            pred_score = predictor(x[:, 1:], prev_decision, sd, p_count).reshape(B, -1, 2)
            if training:
                hard_keep_decision = F.gumbel_softmax(pred_score, hard=True)[:, :, 0:1] * prev_decision
                out.decisions.append(hard_keep_decision.reshape(B, init_n))
                policy = torch.cat([torch.ones(B, 1, 1, dtype=x.dtype), hard_keep_decision], dim=1)
                x = block(x, sd, i, heads, policy)
                prev_decision = hard_keep_decision
            else:
                score = pred_score[:, :, 0]
                num_keep_node = int(init_n * token_ratio[p_count])
                keep_policy = torch.argsort(score, dim=1, descending=True)[:, :num_keep_node]
                now_policy = torch.cat([torch.zeros(B, 1, dtype=keep_policy.dtype), keep_policy + 1], dim=1)
                x = batch_index_select(x, now_policy)
                prev_decision = batch_index_select(prev_decision, keep_policy)
                positions = batch_index_select(positions, keep_policy)
                out.kept_positions.append(positions)
                x = block(x, sd, i, heads, None)
            p_count += 1
        else:
            x = block(x, sd, i, heads, policy if training else None)
    x = _ln(x, sd, "norm", 1e-6)
    out.features = x[:, 1:]
    out.logits = _fc(x[:, 0], sd, "head")
    return out
