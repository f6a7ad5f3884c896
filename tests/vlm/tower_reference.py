"""Independent paths for the tokens a reducer leaves in a transformers SigLIP tower (Gemma 3, PaliGemma): vitrim's
own ViT of the same weights, a re-implementation of received-attention EViT / top-k on transformers' own layers, and
the tokens put back on the patch grid by hand. Each returns the tokens (B, n, C), the patch each stands in for
(B, n) and each patch's token (B, P), -1 for a dropped patch."""

from __future__ import annotations

import math

import torch

import vitrim
import vitrim.reduce


def vitrim_tome(tower: torch.nn.Module, images: torch.Tensor, r: int) -> tuple[torch.Tensor, ...]:
    """vitrim's own ViT of the tower's weights (fused qkv, vitrim's Block and attention) with ToMe in every block."""
    vit = vitrim.from_transformers(tower).double().eval()
    vitrim.reduce.apply(vit, "tome", r=r)
    state = vit.embed(images)
    for block in vit.blocks:
        state, _ = block(state)
    return state.tokens, state.positions, state.patch_to_token[-1]


def received_ranking(
    tower: torch.nn.Module, images: torch.Tensor, keep_rate: float, fuse: bool
) -> tuple[torch.Tensor, ...]:
    """EViT (``fuse``) or top-k in every SigLIP layer, written from the papers on transformers' own layers: after
    the attention residual, token j scores s_j = mean over heads and queries of softmax(q·kᵀ·scale)_{·j} (the map
    computed here in full); the ⌈keep_rate · N⌉ best stay in descending order; EViT appends Σ_{j dropped} s_j x_j,
    standing at its best-scored patch."""
    x = tower.embeddings(images)  # (B, P, C)
    B, P, C = x.shape
    positions = torch.arange(P).expand(B, P)
    patch_to_token = torch.arange(P).expand(B, P)
    for layer in tower.encoder.layers:
        attention = layer.self_attn
        heads = attention.num_heads
        h = layer.layer_norm1(x)
        N = h.shape[1]
        q, k, v = (
            proj(h).view(B, N, heads, C // heads).transpose(1, 2)
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj)
        )
        weights = (q @ k.transpose(-1, -2) * attention.scale).softmax(-1)  # (B, H, N, N)
        x = x + attention.out_proj((weights @ v).transpose(1, 2).reshape(B, N, C))
        scores = weights.mean(dim=(1, 2))  # (B, N)
        kept_count = math.ceil(keep_rate * N)
        order = scores.argsort(dim=1, descending=True)
        kept, dropped = order[:, :kept_count], order[:, kept_count:]
        new_tokens = [x.gather(1, kept[..., None].expand(-1, -1, C))]
        new_positions = [positions.gather(1, kept)]
        where = torch.full((B, N), -1)  # old token -> new token
        where.scatter_(1, kept, torch.arange(kept_count).expand(B, -1))
        if fuse:
            weight = scores.gather(1, dropped)  # (B, N − k)
            new_tokens.append((weight[..., None] * x.gather(1, dropped[..., None].expand(-1, -1, C))).sum(1, True))
            new_positions.append(positions.gather(1, dropped[:, :1]))  # the best-scored dropped token
            where.scatter_(1, dropped, kept_count)
        x, positions = torch.cat(new_tokens, 1), torch.cat(new_positions, 1)
        patch_to_token = torch.where(patch_to_token < 0, -1, where.gather(1, patch_to_token.clamp(min=0)))
        x = x + layer.mlp(layer.layer_norm2(x))
    return x, positions, patch_to_token


def fed_the_grid(model: torch.nn.Module, inputs: dict, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the unmodified ``model`` on ``inputs`` with its projector fed ``grid`` (B, P, C) (the reference),
    and its logits as they are (B, L, V) each."""
    with torch.no_grad():
        handle = model.model.multi_modal_projector.register_forward_pre_hook(lambda m, args: (grid,))
        try:
            reference = model(**inputs).logits
        finally:
            handle.remove()
        return reference, model(**inputs).logits


def on_grid(tower: torch.nn.Module, tokens: torch.Tensor, patch_to_token: torch.Tensor) -> torch.Tensor:
    """(B, P, C): the tower's output (post-LayerNorm) of each patch's token, zero for a dropped patch."""
    normed = tower.post_layernorm(tokens)
    grid = torch.zeros(tokens.shape[0], patch_to_token.shape[1], tokens.shape[2], dtype=tokens.dtype)
    for b in range(tokens.shape[0]):
        for patch, token in enumerate(patch_to_token[b].tolist()):
            if token >= 0:
                grid[b, patch] = normed[b, token]
    return grid


def tower_layers(tower: torch.nn.Module, images: torch.Tensor, cut=None) -> list[dict[str, torch.Tensor]]:
    """transformers' CLIP or SigLIP tower re-run layer by layer on its own modules, every attention map formed in
    full: per layer its ``weights`` (B, H, N, N) softmax map, ``values`` (B, H, N, hd) and ``output`` (B, N, C) after
    the MLP (SigLIP's post-LayerNorm not applied). ``cut(index, output, weights, values)``, when given, returns the
    tokens the next layer runs on (a method that cuts between layers, written in the test as its authors wrote it)."""
    x = tower.embeddings(images)
    if hasattr(tower, "pre_layrnorm"):  # CLIP
        x = tower.pre_layrnorm(x)
    trace = []
    for index, layer in enumerate(tower.encoder.layers):
        attention = layer.self_attn
        B, N, C = x.shape
        heads = attention.num_heads
        h = layer.layer_norm1(x)
        q, k, v = (
            proj(h).view(B, N, heads, C // heads).transpose(1, 2)
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj)
        )
        weights = (q @ k.transpose(-1, -2) * attention.scale).softmax(-1)
        x = x + attention.out_proj((weights @ v).transpose(1, 2).reshape(B, N, C))
        x = x + layer.mlp(layer.layer_norm2(x))
        trace.append({"weights": weights, "values": v, "output": x})
        if cut is not None:
            x = cut(index, x, weights, v)
    return trace


def authors_flowcut_cut(
    run: dict, rpl: int, target: int, cls_attention: torch.Tensor, semantic_attn: torch.Tensor, v_metric: torch.Tensor
) -> torch.Tensor | None:
    """The FlowCut block of the authors' ``CLIPEncoderLayer_forward`` after one layer, batched as they wrote it
    (``compute_score``, ``adaptive_prune_ratio`` with the batch's largest prune), for a layer whose output has more
    than ``target`` tokens ([CLS] counted): cls_attention (B, n) [CLS]'s row over the patches, averaged over heads;
    semantic_attn (B, n) and v_metric (B, n, hd) of the patches. ``run["scores"]`` carries the cumulative score.
    Returns the patches kept (B, k) sorted, or None when the layer does not cut. topk is stable here and log N is
    float64 (the authors': float32)."""
    relation = cls_attention / cls_attention.sum(dim=-1, keepdim=True)
    semantic = semantic_attn / semantic_attn.sum(dim=-1, keepdim=True)
    scores = (relation + semantic) * torch.norm(v_metric, p=1, dim=-1)
    run["scores"] = scores.clone() if run.get("scores") is None else 0.5 * run["scores"] + 0.5 * scores
    if rpl % 2:
        return None
    tokens = cls_attention.shape[-1] + 1
    if rpl:
        n = cls_attention.shape[-1]
        prob = cls_attention / cls_attention.sum(dim=-1, keepdim=True)
        entropy = -torch.sum(prob * torch.log(prob), dim=-1)
        ratio = entropy / torch.log(torch.tensor(n, dtype=torch.float64))
        r = (n - (target - 1)) / rpl**0.5 * (1 - ratio**2)
        if r.shape[0] > 1:
            r = r.max(0).values
        prune_num = int(r.round())
    else:
        prune_num = tokens
    target_num = max(tokens - prune_num, target)
    order = torch.sort(run["scores"], dim=1, descending=True, stable=True).indices
    keep_indices = order[:, : target_num - 1].sort(dim=1).values
    run["scores"] = run["scores"].gather(1, keep_indices)
    return keep_indices
