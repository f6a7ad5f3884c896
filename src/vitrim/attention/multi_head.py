"""Multi-head attention: one fused projection for Q, K, V, split into heads, attend, concat, project.

Parameter names are timm's (``qkv``, ``proj``; for cross-attention ``q`` and ``kv``; ``q_norm``/``k_norm``), so timm
and DeiT weights load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrim.attention.functional import scaled_dot_product_attention
from vitrim.attention.rotary import apply_rotary


@dataclass(frozen=True)
class AttentionResult:
    """What one multi-head attention call computed, so that a token reducer never has to compute it again.

    out: (B, Lq, D) after the output projection; weights: (B, H, Lq, Lk) when asked, else None; q (B, H, Lq, hd) and
    k (B, H, Lk, hd) as they entered the dot product (after qk-norm and RoPE; for weights computed ahead and then
    merged, MCTF, those of the tokens before the merge); scale: the logit scale; mask and keep_policy: what the call
    received (see :func:`vitrim.scaled_dot_product_attention`).
    """

    out: Tensor
    weights: Tensor | None
    q: Tensor
    k: Tensor
    scale: float
    mask: Tensor | None = None
    keep_policy: Tensor | None = None
    v: Tensor | None = None  # (B, H, Lk, hd): the values, for reducers that score tokens by ‖v‖ (PPT, Zero-TPrune)


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention, or cross-attention when ``kv_dim`` is given or ``context`` is passed.

    Args:
        dim: model width D of the queries (and of the output).
        num_heads: H; D must be divisible by H (head width hd = D / H).
        kv_dim: width of the context for cross-attention; builds ``q = Linear(D, D)`` and ``kv = Linear(kv_dim, 2D)``.
            Without it, one ``qkv = Linear(D, 3D)`` serves self-attention, and its K/V rows serve a ``context`` of
            width D.
        qkv_bias: bias on the Q, K, V projections.
        qk_norm: LayerNorm on each head's queries and keys (timm's ``q_norm``, ``k_norm``).
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after the output projection.
        proj_bias: bias on the output projection.
        norm_eps: epsilon of the qk-norm LayerNorms.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        kv_dim: int | None = None,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        proj_bias: bool = True,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if dim % num_heads != 0:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        if kv_dim is not None and (not isinstance(kv_dim, int) or kv_dim <= 0):
            raise ValueError(f"kv_dim must be a positive int or None, got {kv_dim!r}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.kv_dim = kv_dim
        self.attn_drop = attn_drop
        if kv_dim is None:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        else:
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(kv_dim, 2 * dim, bias=qkv_bias)
        self.q_norm: nn.Module = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        keep_policy: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` (B, Lq, D) to itself, or to ``context`` (B, Lk, kv_dim).

        ``mask`` broadcasts to (B, H, Lq, Lk) (bool True = may attend, or float added to the logits);
        ``keep_policy`` is (B, Lk) (see :func:`vitrim.scaled_dot_product_attention`).

        Returns:
            out (B, Lq, D), and the per-head weights (B, H, Lq, Lk) when ``need_weights`` else None.
        """
        result = self.attend(x, context, mask=mask, keep_policy=keep_policy, need_weights=need_weights)
        return result.out, result.weights

    def attend(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        keep_policy: Tensor | None = None,
        need_weights: bool = False,
        rope: Tensor | None = None,
        ahead: tuple[Tensor, Tensor, Tensor] | None = None,
        no_empty_rows: bool = False,
    ) -> AttentionResult:
        """The same computation as :meth:`forward`, returning everything it made (an :class:`AttentionResult`).

        ``rope`` (B or 1, 1, n, 2·hd): rotary sin ‖ cos rows (:mod:`vitrim.attention.rotary`) applied to the last n
        tokens of q and k (prefix tokens come first and are not rotated), after qk-norm.

        ``ahead`` (weights (B, H, Lq, Lk), q, k): attention weights computed ahead by :meth:`attention_weights` and
        then merged with the tokens (MCTF's one-step-ahead attention). ``no_empty_rows``: the mask opens some key in
        every row (see :func:`vitrim.scaled_dot_product_attention`). They replace softmax(q kᵀ): only the values of
        ``x`` are projected, and the result's q and k are the ones that made the weights (before the merge).
        """
        if ahead is not None:
            if context is not None or self.kv_dim is not None:
                raise ValueError("ahead weights are self-attention weights: attend(x, ahead=...) takes no context")
            return self._attend_ahead(x, ahead, need_weights)
        q, k, v = self.project_qkv(x, context)
        q, k = _rotate(q, k, rope)
        out, weights = scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            keep_policy=keep_policy,
            dropout_p=self.attn_drop if self.training else 0.0,
            need_weights=need_weights,
            no_empty_rows=no_empty_rows,
        )
        return AttentionResult(self.project_out(out), weights, q, k, self.head_dim**-0.5, mask, keep_policy, v)

    def attention_weights(
        self, x: Tensor, *, mask: Tensor | None = None, rope: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Only the self-attention weights of ``x`` (B, N, D): softmax(q kᵀ · scale + mask) (B, H, N, N), with the q
        and k (B, H, N, hd) that made them. No values, no output: what MCTF's one-step-ahead attention looks at before
        it merges (only the q and k rows of ``qkv`` are applied, as the authors do)."""
        if x.dim() != 3 or x.shape[-1] != self.dim or self.kv_dim is not None:
            raise ValueError(f"attention_weights takes x of shape (B, N, {self.dim}) on a self-attention module")
        B, N, _ = x.shape
        bias = None if self.qkv.bias is None else self.qkv.bias[: 2 * self.dim]
        qk = F.linear(x, self.qkv.weight[: 2 * self.dim], bias).reshape(B, N, 2, self.num_heads, self.head_dim)
        q, k = qk.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, N, hd)
        q, k = _rotate(self.q_norm(q), self.k_norm(k), rope)
        logits = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5  # (B, H, N, N)
        if mask is not None:
            logits = logits + mask
        return logits.softmax(dim=-1), q, k

    def _attend_ahead(self, x: Tensor, ahead: tuple[Tensor, Tensor, Tensor], need_weights: bool) -> AttentionResult:
        """Apply weights computed ahead (see :meth:`attend`) to the values of ``x``."""
        weights, q, k = ahead
        B, N, _ = x.shape
        if weights.shape != (B, self.num_heads, N, N):
            raise ValueError(f"ahead weights must have shape {(B, self.num_heads, N, N)}, got {tuple(weights.shape)}")
        bias = None if self.qkv.bias is None else self.qkv.bias[2 * self.dim :]
        v = F.linear(x, self.qkv.weight[2 * self.dim :], bias).reshape(B, N, self.num_heads, self.head_dim)
        v = v.transpose(1, 2)  # (B, H, N, hd)
        applied = F.dropout(weights, self.attn_drop) if self.training and self.attn_drop > 0 else weights
        out = self.project_out(applied @ v)
        return AttentionResult(out, applied if need_weights else None, q, k, self.head_dim**-0.5, None, None, v)

    def project_qkv(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Project and split into heads: q (B, H, Lq, hd), k and v (B, H, Lk, hd)."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, L, {self.dim}), got {tuple(x.shape)}")
        B, Lq, _ = x.shape
        if context is None and self.kv_dim is None:
            qkv = self.qkv(x).reshape(B, Lq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)  # each (B, H, L, hd)
        else:
            if context is None:
                raise ValueError(f"context (B, Lk, {self.kv_dim}) is required by a cross-attention module")
            kv_dim = self.kv_dim if self.kv_dim is not None else self.dim
            if context.dim() != 3 or context.shape[-1] != kv_dim or context.shape[0] not in (1, B):
                raise ValueError(f"context must have shape ({B}, Lk, {kv_dim}), got {tuple(context.shape)}")
            if self.kv_dim is None:  # self-attention weights used across sequences, as torch's MHA does
                w_q, w_kv = self.qkv.weight.split([self.dim, 2 * self.dim])
                b_q, b_kv = self.qkv.bias.split([self.dim, 2 * self.dim]) if self.qkv.bias is not None else (None, None)
                q, kv = F.linear(x, w_q, b_q), F.linear(context, w_kv, b_kv)
            else:
                q, kv = self.q(x), self.kv(context)
            Lk = context.shape[1]
            q = q.reshape(B, Lq, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, Lq, hd)
            k, v = kv.reshape(context.shape[0], Lk, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity):
            return q, k, v  # no qk-norm: skip two identity calls
        return self.q_norm(q), self.k_norm(k), v

    def project_out(self, out: Tensor) -> Tensor:
        """Concatenate heads and project: (B, H, Lq, hd) -> (B, Lq, D)."""
        B, _, Lq, _ = out.shape
        out = self.proj(out.transpose(1, 2).reshape(B, Lq, self.dim))
        return self.proj_drop(out) if self.training else out  # dropout is the identity in evaluation

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """Build an equivalent module from ``torch.nn.MultiheadAttention`` (copies the weights).

        The result always takes batch-first inputs (B, L, D), whatever ``module.batch_first`` was. Self-attention,
        and cross-attention when ``kdim == vdim``, are supported; ``add_bias_kv`` and ``add_zero_attn`` are not.
        Note torch's ``key_padding_mask`` marks keys to *ignore*; vitrim's boolean mask marks keys that may be seen:
        pass ``mask=~key_padding_mask[:, None, None, :]``.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("nn.MultiheadAttention with add_bias_kv or add_zero_attn has no vitrim equivalent")
        if module.kdim != module.vdim:
            raise ValueError(f"kdim ({module.kdim}) != vdim ({module.vdim}) has no vitrim equivalent")
        dim = module.embed_dim
        has_bias = module.in_proj_bias is not None
        same = module._qkv_same_embed_dim
        ref = module.out_proj.weight
        new = cls(
            dim,
            module.num_heads,
            kv_dim=None if same else module.kdim,
            qkv_bias=has_bias,
            attn_drop=module.dropout,
            proj_bias=module.out_proj.bias is not None,
        ).to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            if same:
                new.qkv.weight.copy_(module.in_proj_weight)
                if has_bias:
                    new.qkv.bias.copy_(module.in_proj_bias)
            else:
                new.q.weight.copy_(module.q_proj_weight)
                new.kv.weight.copy_(torch.cat([module.k_proj_weight, module.v_proj_weight]))
                if has_bias:
                    b_q, b_kv = module.in_proj_bias.split([dim, 2 * dim])
                    new.q.bias.copy_(b_q)
                    new.kv.bias.copy_(b_kv)
            new.proj.weight.copy_(module.out_proj.weight)
            if module.out_proj.bias is not None:
                new.proj.bias.copy_(module.out_proj.bias)
        return new.train(module.training)


def _rotate(q: Tensor, k: Tensor, rope: Tensor | None) -> tuple[Tensor, Tensor]:
    """Rotate the last n tokens of q and k by ``rope`` (B or 1, 1, n, 2·hd); prefix tokens come first, unrotated."""
    if rope is None:
        return q, k
    n = rope.shape[-2]
    q = torch.cat([q[..., :-n, :], apply_rotary(q[..., -n:, :], rope)], dim=-2)
    k = torch.cat([k[..., :-n, :], apply_rotary(k[..., -n:, :], rope)], dim=-2)
    return q, k
