"""Independent references for relevance, written from the papers' code, not from vitrim's.

* :func:`chefer_reference`: a plain pre-norm ViT re-implemented with torch.nn.functional from a vitrim model's
  weights, with the attention map saved and its gradient caught by a hook in every block (the structure of
  hila-chefer/Transformer-Explainability's ``ViT_new.py``), then the authors' loop from
  ``Transformer_MM_explainability_ViT.ipynb``: ``cam = (grad * cam).clamp(min=0).mean(heads)``,
  ``R = eye; R += cam @ R``, returning ``R[:, 0]`` (all N entries). Per sample (the notebook reshapes the batch into
  the heads, which only works for one image).
* :func:`forward_rows_reference`: Chefer's recursion read *forwards* over a reducing model, with dense matrices: the
  full (B, n_cur, N) relevance of every current token over the original tokens, R ← R + Ā R per block, and at each
  change of tokens the new rows as the share-weighted mean of the rows they came from (shares from the patch maps,
  built as one-hot matrices). Compared against vitrim's backward-streaming row.
* :func:`attnlrp_reference`: the same plain ViT built from ``lxt.explicit.functional`` (lxt 2.1's explicit LRP
  rules: ``linear_epsilon``, ``layer_norm`` (its stabiliser set to the same ε), ``softmax``, ``matmul``, ``add2``,
  ``mul2``) with GELU through lxt's explicit identity rule; the relevance of the tokens entering the first block is
  their ``.grad`` after a backward pass seeded with the logit (lxt's explicit functions return relevance, not
  gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _embed(model: nn.Module, images: Tensor) -> Tensor:
    x = F.conv2d(images, model.patch_embed.proj.weight, model.patch_embed.proj.bias, stride=model.config.patch_size)
    x = x.flatten(2).transpose(1, 2)
    cls = model.cls_token.expand(x.shape[0], -1, -1)
    return torch.cat([cls, x], dim=1) + model.pos_embed


def chefer_reference(model: nn.Module, images: Tensor, target: Tensor) -> Tensor:
    """(B, N): row 0 of the authors' R for class ``target`` (B,), on a plain [CLS] ViT (DeiT layout)."""
    c = model.config
    H, D = c.num_heads, c.embed_dim
    x = _embed(model, images).detach().requires_grad_(True)
    maps: list[Tensor] = []
    grads: dict[int, Tensor] = {}
    h = x
    for i, blk in enumerate(model.blocks):
        y = F.layer_norm(h, (D,), blk.norm1.weight, blk.norm1.bias, c.norm_eps)
        B, N, _ = y.shape
        q, k, v = F.linear(y, blk.attn.qkv.weight, blk.attn.qkv.bias).reshape(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
        attn = (torch.einsum("bhid,bhjd->bhij", q, k) * (D // H) ** -0.5).softmax(dim=-1)
        maps.append(attn)
        attn.register_hook(lambda g, i=i: grads.__setitem__(i, g))
        out = torch.einsum("bhij,bhjd->bhid", attn, v).transpose(1, 2).reshape(B, N, D)
        h = h + F.linear(out, blk.attn.proj.weight, blk.attn.proj.bias)
        y = F.layer_norm(h, (D,), blk.norm2.weight, blk.norm2.bias, c.norm_eps)
        h = h + F.linear(
            F.gelu(F.linear(y, blk.mlp.fc1.weight, blk.mlp.fc1.bias)), blk.mlp.fc2.weight, blk.mlp.fc2.bias
        )
    h = F.layer_norm(h, (D,), model.norm.weight, model.norm.bias, c.norm_eps)
    logits = F.linear(h[:, 0], model.head.weight, model.head.bias)
    logits.gather(1, target[:, None]).sum().backward()
    rows = []
    for b in range(images.shape[0]):
        N = maps[0].shape[-1]
        R = torch.eye(N, dtype=images.dtype)
        for i, cam in enumerate(maps):
            cam = (grads[i][b] * cam[b].detach()).clamp(min=0).mean(dim=0)  # the authors' avg_heads, one image
            R += torch.matmul(cam, R)  # the authors' apply_self_attention_rules
        rows.append(R[0])
    return torch.stack(rows)


def _share_matrix(later: Tensor, n_later: int, earlier: Tensor, n_earlier: int, prefix: int) -> Tensor:
    """(n_later + prefix, n_earlier + prefix): later token j's row = Σ_i share_ji · earlier row i, one sample."""
    P = later.shape[0]
    later_onehot = torch.zeros(P, n_later, dtype=torch.float64)
    earlier_onehot = torch.zeros(P, n_earlier, dtype=torch.float64)
    for p in range(P):
        if later[p] >= 0:
            later_onehot[p, later[p]] = 1.0
        if earlier[p] >= 0:
            earlier_onehot[p, earlier[p]] = 1.0
    counts = later_onehot.sum(dim=0).clamp(min=1)  # patches per later token
    share = (later_onehot.T @ earlier_onehot) / counts[:, None]
    T = torch.zeros(n_later + prefix, n_earlier + prefix, dtype=torch.float64)
    T[:prefix, :prefix] = torch.eye(prefix, dtype=torch.float64)
    T[prefix:, prefix:] = share
    return T


def forward_rows_reference(model: nn.Module, images: Tensor, target: Tensor) -> Tensor:
    """(B, N) Chefer's [CLS] row over the original tokens of a reducing [CLS] model, forwards (module doc)."""
    p = model.num_prefix
    out = model.forward_detailed(images, need_weights=True)
    for a in out.attentions:
        a.retain_grad()
    out.logits.gather(1, target[:, None]).sum().backward()
    B = images.shape[0]
    P = out.block_positions[0].shape[1] if out.block_patch_to_token[0] is None else out.block_patch_to_token[0].shape[1]
    rows = []
    for b in range(B):
        maps = []
        for pos, recorded in zip(out.block_positions, out.block_patch_to_token):
            if recorded is not None:
                maps.append(recorded[b])
            else:
                m = torch.full((P,), -1, dtype=torch.long)
                m[pos[b]] = torch.arange(pos.shape[1])
                maps.append(m)
        R = torch.eye(P + p, dtype=torch.float64)  # rows: current tokens; columns: original tokens
        current = torch.arange(P)
        for i, attention in enumerate(out.attentions):
            n = attention.shape[-1] - p
            R = _share_matrix(maps[i], n, current, R.shape[0] - p, p) @ R
            current = maps[i]
            cam = (attention.grad[b] * attention[b].detach()).clamp(min=0).mean(dim=0).double()
            R = R + cam @ R
        rows.append(R[0])
    return torch.stack(rows)


def attnlrp_reference(model: nn.Module, images: Tensor, target: Tensor, epsilon: float = 1e-12) -> Tensor:
    """(B, N) AttnLRP relevance of the tokens entering the first block, from lxt's explicit rules (module doc)."""
    import lxt.explicit.functional as lf
    from lxt.explicit.rules import identity

    def layer_norm(x: Tensor, norm: nn.LayerNorm) -> Tensor:  # lf.layer_norm with its stabiliser set too
        return lf.layer_norm_grad_fn.apply(x, norm.weight, norm.bias, c.norm_eps, epsilon)

    c = model.config
    H, D = c.num_heads, c.embed_dim
    x = _embed(model, images).detach().requires_grad_(True)
    h = x
    for blk in model.blocks:
        y = layer_norm(h, blk.norm1)
        B, N, _ = y.shape
        qkv = lf.linear_epsilon(y, blk.attn.qkv.weight, blk.attn.qkv.bias, epsilon)
        q, k, v = qkv.reshape(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
        logits = lf.mul2(lf.matmul(q, k.transpose(-1, -2), epsilon=epsilon), (D // H) ** -0.5)
        attn = lf.softmax(logits, -1)
        out = lf.matmul(attn, v, epsilon=epsilon).transpose(1, 2).reshape(B, N, D)
        h = lf.add2(h, lf.linear_epsilon(out, blk.attn.proj.weight, blk.attn.proj.bias, epsilon), epsilon=epsilon)
        y = layer_norm(h, blk.norm2)
        hidden = identity(F.gelu, lf.linear_epsilon(y, blk.mlp.fc1.weight, blk.mlp.fc1.bias, epsilon))
        h = lf.add2(h, lf.linear_epsilon(hidden, blk.mlp.fc2.weight, blk.mlp.fc2.bias, epsilon), epsilon=epsilon)
    h = layer_norm(h, model.norm)
    logits = lf.linear_epsilon(h[:, 0], model.head.weight, model.head.bias, epsilon)
    seed = torch.zeros_like(logits).scatter(1, target[:, None], logits.gather(1, target[:, None]))
    logits.backward(seed)  # relevance at the output: the explained logit
    assert x.grad is not None
    return x.grad.sum(dim=-1)
