"""DynamicViT's pruning step: score the patch tokens entering a block, keep the best, drop the rest.

One :class:`DynamicViTPruning` is the reducer of each pruning block and acts before its attention. It refers to a
:class:`~vitrim.reduce.score_predictor.ScorePredictor` that the model owns (so parameters stay at
``score_predictor.{i}.*``), and behaves differently in the two modes, as the paper does:

* training (``state.training``, the model's mode): hard Gumbel-softmax decisions, straight-through
  (``F.gumbel_softmax(log_probs, hard=True)[..., 0]``), multiplied into the previous policy so that a dropped token
  stays dropped. Tokens are masked, not removed: the new ``keep_policy`` (B, N) (prefix = 1) reaches every later
  attention call, shapes stay static, and the decision over the full grid (B, P) is appended to ``keep_masks``.
* evaluation: ``torch.topk`` of the keep score (log-probability of channel 0) with a static k, then one gather of the
  tokens and their positions. The kept tokens stand in descending keep score (the official code's argsort order);
  their absolute patch positions are appended to ``kept_indices``. When a stage would keep every token it is the
  identity (no scoring, order unchanged), so ρ = 1 is exactly the dense backbone.

Stage s keeps ``max(1, int(P · ρ^s))`` tokens of the P patches in the input image's own grid (224/16 at ρ = 0.7:
137, 96, 67). Prefix tokens ([CLS], DeiT's distillation token) are never scored and never dropped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.reduce.base import Reducer
from vitrim.reduce.score_predictor import ScorePredictor
from vitrim.reduce.state import TokenState


def num_keep(num_patches: int, keep_fraction: float) -> int:
    """Tokens a stage keeps: ``max(1, int(num_patches · keep_fraction))``, as the official ``int(init_n · ratio)``."""
    return max(1, int(num_patches * keep_fraction))


class DynamicViTPruning(Reducer):
    """Learned token pruning before a block (see module doc).

    Args:
        predictor: the model-owned score module (not copied).
        keep_fraction: ρ^s, the fraction of the image's patches this stage keeps, in (0, 1].
        gumbel_noise: True (default) samples training decisions with Gumbel noise, as the paper trains. False makes
            training-mode decisions the evaluation top-k (as a hard mask over the kept tokens, straight-through
            gradient via the keep probability) — a deterministic mode for checking that both modes agree.
    """

    def __init__(self, predictor: ScorePredictor, keep_fraction: float, *, gumbel_noise: bool = True) -> None:
        if not isinstance(predictor, ScorePredictor):
            raise TypeError(f"predictor must be a ScorePredictor, got {type(predictor).__name__}")
        if isinstance(keep_fraction, bool) or not isinstance(keep_fraction, (int, float)):
            raise TypeError(f"keep_fraction must be a number in (0, 1], got {keep_fraction!r}")
        if not (math.isfinite(keep_fraction) and 0.0 < keep_fraction <= 1.0):
            raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction!r}")
        self.predictor = predictor
        self.keep_fraction = float(keep_fraction)
        self.gumbel_noise = gumbel_noise

    def before_attention(self, state: TokenState) -> TokenState:
        if state.grid_patches is None:
            raise ValueError("DynamicViT pruning needs TokenState.grid_patches (the image's patch count); got None")
        if state.training:
            return self._mask(state, state.grid_patches)
        return self._gather(state, state.grid_patches)

    def _gather(self, state: TokenState, grid_patches: int) -> TokenState:
        """Evaluation: keep the top-k patch tokens, remove the rest."""
        x, p = state.tokens, state.num_prefix  # x (B, p + n, D)
        n = state.num_patch_tokens
        k = min(n, num_keep(grid_patches, self.keep_fraction))
        if k == n:
            return state.replace(kept_indices=(*state.kept_indices, state.positions))
        policy = None if state.keep_policy is None else state.keep_policy[:, p:]
        keep_score = self.predictor(x[:, p:], policy)[..., 0]  # (B, n)
        return self.keep(state, keep_score.topk(k, dim=1, sorted=True).indices)  # descending keep score

    def _mask(self, state: TokenState, grid_patches: int) -> TokenState:
        """Training: decide per token, multiply into the previous policy, keep every token in place."""
        x, p = state.tokens, state.num_prefix
        B, n = x.shape[0], x.shape[1] - p
        if state.keep_policy is None:
            prev = x.new_ones(B, n)
        else:
            prev = state.keep_policy[:, p:].to(x.dtype)  # (B, n)
        log_probs = self.predictor(x[:, p:], prev)  # (B, n, 2)
        if self.gumbel_noise:
            hard = F.gumbel_softmax(log_probs, hard=True)[..., 0]  # (B, n) in {0, 1}, straight-through
        else:
            hard = self._topk_mask(log_probs[..., 0], prev, num_keep(grid_patches, self.keep_fraction))
        decision = hard * prev  # (B, n): a dropped token stays dropped
        policy = torch.cat([x.new_ones(B, p), decision], dim=1)  # (B, p + n)
        mask = decision
        if n != grid_patches:  # an earlier reducer removed tokens: report over the full grid anyway
            mask = decision.new_zeros(B, grid_patches).scatter(1, state.positions, decision)
        return state.replace(keep_policy=policy, keep_masks=(*state.keep_masks, mask))

    @staticmethod
    def _topk_mask(keep_log_prob: Tensor, prev: Tensor, k: int) -> Tensor:
        """(B, n) hard mask of the k best tokens among those still kept; straight-through gradient via exp(score)."""
        k = min(k, keep_log_prob.shape[1])
        with torch.no_grad():
            candidates = keep_log_prob.masked_fill(prev <= 0, float("-inf"))
            index = candidates.topk(k, dim=1).indices  # (B, k)
            hard = torch.zeros_like(keep_log_prob).scatter(1, index, 1.0)
        prob = keep_log_prob.exp()
        return hard + (prob - prob.detach())  # exactly `hard` in value, d/dscore like the Gumbel straight-through

    def extra_repr(self) -> str:
        noise = "" if self.gumbel_noise else ", gumbel_noise=False"
        return f"keep_fraction={self.keep_fraction:.4g}{noise}"
