"""DynamicViT's prediction module: scores every patch token for keeping, from its own and the image's features.

Rao et al., "DynamicViT", NeurIPS 2021, Sec. 3.2 (the official code calls it ``PredictorLG``):

    z = GELU(Linear(LayerNorm(x)))                       (B, N, C)
    local = z[..., :C/2]                                 per token
    global = Σ_j D̂_j · z_j[C/2:] / Σ_j D̂_j               the policy-weighted mean over the tokens still kept
    π = log_softmax(MLP([local, global]))                MLP: C -> C/2 -> C/4 -> 2, GELU between
    π[..., 0] = log-probability of keeping the token

Parameter names are the official checkpoints' (``in_conv.0`` LayerNorm, ``in_conv.1`` Linear, ``out_conv.0/2/4``
Linear), so a released DynamicViT ``score_predictor.{i}.*`` loads as it is. The LayerNorm keeps torch's default
eps 1e-5, as the official module does (the backbone uses 1e-6).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrim.reduce.index_cache import cached


class ScorePredictor(nn.Module):
    """Keep/drop log-probabilities for patch tokens.

    Args:
        dim: token width C (at least 4, so that the MLP's C/4 hidden width is not empty).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 4:
            raise ValueError(f"dim must be an int >= 4 (the MLP narrows to dim // 4), got {dim!r}")
        self.dim = dim
        self.in_conv = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.out_conv = nn.Sequential(
            nn.Linear(dim, dim // 2),
            nn.GELU(),
            nn.Linear(dim // 2, dim // 4),
            nn.GELU(),
            nn.Linear(dim // 4, 2),
            nn.LogSoftmax(dim=-1),
        )

    def forward(self, x: Tensor, policy: Tensor | None = None) -> Tensor:
        """Score patch tokens.

        Args:
            x: (B, N, C) patch tokens only (never [CLS]).
            policy: (B, N) in [0, 1], 1 = token still kept; None = every token is kept (evaluation, where dropped
                tokens are already gone).

        Returns:
            (B, N, 2) log-probabilities; channel 0 = keep, channel 1 = drop.
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, N, {self.dim}), got {tuple(x.shape)}")
        z = self.in_conv(x)  # (B, N, C)
        if policy is None:
            pooled = z.mean(dim=1, keepdim=True)  # (B, 1, C)
        else:
            if policy.shape != x.shape[:2]:
                raise ValueError(f"policy must have shape {tuple(x.shape[:2])} (B, N), got {tuple(policy.shape)}")
            w = policy.to(z.dtype).unsqueeze(-1)  # (B, N, 1)
            # clamp: an image whose every token was dropped gets a zero global feature instead of 0/0 = NaN
            pooled = (z * w).sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True).clamp_min(1e-6)
        # [local, global] per token, as the official torch.cat([local_x, global_x.expand(...)]): each token's first
        # half beside the image's pooled second half, chosen in one call (the pooled first half goes unused).
        half = self.dim // 2
        second_half = cached(
            ("second_half", self.dim, z.device), lambda: torch.arange(self.dim, device=z.device) >= half
        )
        return self.out_conv(torch.where(second_half, pooled, z))  # (B, N, 2)
