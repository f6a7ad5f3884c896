"""Attention pooling (the MAP head of SigLIP, timm's ``AttentionPoolLatent``): a learned query attends to the tokens.

    q = latent W_q (one learned query),  k, v = tokens W_kv
    A_j = exp(q k_jᵀ / √hd) · w_j / Σ_k exp(q k_kᵀ / √hd) · w_k     through vitrim.scaled_dot_product_attention
    x = proj(A v);  out = x + MLP(LN(x))                            (B, D)

``w`` are token weights: how many patches each token stands for after ToMe merged some (a merged token counts as
its copies would: merging does not bias the pool), times DynamicViT's keep policy (0 for a dropped token). They
enter as the attention's ``keep_policy`` (scaled by each row's largest weight into [0, 1]; the softmax does not
change under that scale), not as a bias log w: log 0 = −∞ is harmless forward but its derivative 1/w is infinite
at a dropped token, and 0 · ∞ made every gradient of a DynamicViT with this head NaN. Without weights (or all
ones) this is timm's head exactly. Parameter names are timm's (``latent``, ``q``, ``kv``, ``proj``, ``norm``,
``mlp``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrim.attention import MultiHeadAttention
from vitrim.models.layers import Mlp


class AttentionPool(MultiHeadAttention):
    """Pool (B, N, D) tokens into (B, D) with one learned query (module doc)."""

    def __init__(
        self, dim: int, num_heads: int, *, mlp_ratio: float = 4.0, norm_eps: float = 1e-6, act: str = "gelu"
    ) -> None:
        super().__init__(dim, num_heads, kv_dim=dim)
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act=act)
        nn.init.trunc_normal_(self.latent, std=dim**-0.5)

    def forward(self, tokens: Tensor, token_weights: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """tokens (B, N, D), token_weights (B, N) or None -> pooled (B, D)."""
        pooled, _ = self.pool_with_weights(tokens, token_weights, need_weights=False)
        return pooled

    def pool_with_weights(
        self, tokens: Tensor, token_weights: Tensor | None = None, *, need_weights: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """As :meth:`forward`, also returning the query's attention (B, H, 1, N) when ``need_weights`` (relevance
        methods weight it by its gradient, as any other attention map)."""
        # repeat, not expand: a no-grad view of a parameter claims requires_grad without a grad_fn, which torch's
        # module tracker (FLOP counting) cannot follow; the copy is one (B, 1, D) row
        latent = self.latent.repeat(tokens.shape[0], 1, 1)  # (B, 1, D)
        policy = None
        if token_weights is not None:
            weights = token_weights.float()  # (B, N)
            largest = weights.amax(dim=1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
            policy = (weights / largest).to(tokens.dtype)  # (B, N) in [0, 1]; all dropped: zeros, pooled 0
        x, attention = super().forward(latent, tokens, keep_policy=policy, need_weights=need_weights)  # (B, 1, D)
        x = x + self.mlp(self.norm(x))
        return x[:, 0], attention
