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
137, 96, 67). Prefix tokens ([CLS], DeiT's distillation token, registers) are never scored and never dropped.

On any ViT: ``vitrim.reduce.apply(model, "dynamicvit", keep_ratio=0.7, prune_layers=(3, 6, 9))`` (or
``create_model(name, reducer="dynamicvit", ...)``) adds fresh predictors to the model as ``score_predictor.{i}``
(the official checkpoints' names, so those load as they are; a checkpoint without them loads too, leaving them
fresh) and one pruning stage before each block of ``layers`` (default: a quarter, half and three quarters deep).
``remove`` takes both off again. The ``dynamicvit_*`` models are this on a DeiT, with ``keep_ratio`` and
``prune_layers`` in their config.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrim.reduce.base import Reducer, StrengthOption, quarter_layers
from vitrim.reduce.dynamicvit_training import PREDICTOR_PREFIX, DistillObjective
from vitrim.reduce.index_cache import cached
from vitrim.reduce.registry import register
from vitrim.reduce.score_predictor import ScorePredictor
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import keep_rows

PREDICTORS = PREDICTOR_PREFIX[:-1]  # the model attribute (and checkpoint prefix) holding the predictors


def num_keep(num_patches: int, keep_fraction: float) -> int:
    """Tokens a stage keeps: ``max(1, int(num_patches · keep_fraction))``, as the official ``int(init_n · ratio)``."""
    return max(1, int(num_patches * keep_fraction))


def check_keep_ratio(keep_ratio: object) -> float:
    """Validate ρ: a finite number in (0, 1]."""
    if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, (int, float)):
        raise TypeError(f"keep_ratio must be a number in (0, 1], got {keep_ratio!r}")
    if not (math.isfinite(keep_ratio) and 0.0 < keep_ratio <= 1.0):
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    return float(keep_ratio)


def build_predictors(dim: int, count: int) -> nn.ModuleList:
    """``count`` fresh predictors with the official init (timm's): trunc-normal std 0.02 weights, zero biases."""
    predictors = nn.ModuleList(ScorePredictor(dim) for _ in range(count))
    with torch.no_grad():
        for module in predictors.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    return predictors


def pruning_stages(
    predictors: nn.ModuleList, layers: Sequence[int], keep_ratio: float, *, gumbel_noise: bool = True
) -> dict[int, DynamicViTPruning]:
    """Block index -> the pruning stage before it: stage s (from 1) keeps ρ^s of the image's patches."""
    rho = check_keep_ratio(keep_ratio)
    return {
        layer: DynamicViTPruning(p, rho ** (s + 1), gumbel_noise=gumbel_noise)
        for s, (layer, p) in enumerate(zip(sorted(layers), predictors))
    }


@register("dynamicvit")
class DynamicViTPruning(Reducer):
    """Learned token pruning before a block (see module doc).

    Args:
        predictor: the model-owned score module (not copied).
        keep_fraction: ρ^s, the fraction of the image's patches this stage keeps, in (0, 1].
        gumbel_noise: True (default) samples training decisions with Gumbel noise, as the paper trains. False makes
            training-mode decisions the evaluation top-k (as a hard mask over the kept tokens, straight-through
            gradient via the keep probability) — a deterministic mode for checking that both modes agree.
    """

    example_options: ClassVar[dict[str, Any]] = {"keep_ratio": 0.5}
    identity_options: ClassVar[dict[str, Any]] = {"keep_ratio": 1.0}
    strength_option: ClassVar[StrengthOption | None] = StrengthOption("keep_ratio", 1.0, 0.001, step=0.001)
    adds_modules: ClassVar[tuple[str, ...]] = (PREDICTORS,)
    layers_alias = "prune_layers"

    def __init__(self, predictor: nn.Module, keep_fraction: float, *, gumbel_noise: bool = True) -> None:
        if not isinstance(predictor, ScorePredictor):
            raise TypeError(f"predictor must be a ScorePredictor, got {type(predictor).__name__}")
        if isinstance(keep_fraction, bool) or not isinstance(keep_fraction, (int, float)):
            raise TypeError(f"keep_fraction must be a number in (0, 1], got {keep_fraction!r}")
        if not (math.isfinite(keep_fraction) and 0.0 < keep_fraction <= 1.0):
            raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction!r}")
        self.predictor = predictor
        self.keep_fraction = float(keep_fraction)
        self.gumbel_noise = gumbel_noise

    default_layers = staticmethod(quarter_layers)

    @classmethod
    def training_objective(
        cls, model: nn.Module, *, label_smoothing: float, options: dict[str, Any], teacher: nn.Module | None = None
    ) -> DistillObjective | None:
        """With a dense teacher, the paper's fine-tuning (:mod:`vitrim.reduce.dynamicvit_training`), each stage's
        kept fraction ρ^s its ratio target; without one, plain cross-entropy."""
        if teacher is None:
            return None
        stages = [b.reducer.keep_fraction for b in getattr(model, "blocks", ()) if isinstance(b.reducer, cls)]
        return DistillObjective.from_options(teacher, stages, label_smoothing, options)

    @classmethod
    def for_model(  # type: ignore[override]  # a reducer takes its own options; apply checks their names
        cls, model: nn.Module, layers: tuple[int, ...], *, keep_ratio: float = 0.7, gumbel_noise: bool = True
    ) -> dict[int, Reducer | None]:
        """Add fresh predictors to ``model`` (as ``score_predictor``) and one pruning stage per block of ``layers``."""
        rho = check_keep_ratio(keep_ratio)
        if hasattr(model, PREDICTORS):
            raise ValueError(f"the model already has {PREDICTORS} modules (a DynamicViT?); remove its reducers first")
        reference = next(model.parameters())
        dim = int(model.blocks[0].attn.dim)  # type: ignore[index, union-attr]
        predictors = build_predictors(dim, len(layers)).to(device=reference.device, dtype=reference.dtype)
        setattr(model, PREDICTORS, predictors)
        optional = tuple(getattr(model, "checkpoint_optional_prefixes", ()))
        model.checkpoint_optional_prefixes = (*optional, f"{PREDICTORS}.")  # type: ignore[assignment]
        return dict(pruning_stages(predictors, layers, rho, gumbel_noise=gumbel_noise))

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
            if not state.record or state.positions is None:
                return state
            return state.replace(kept_indices=(*state.kept_indices, state.positions))
        policy = None if state.keep_policy is None else state.keep_policy[:, p:]
        keep_score = self.predictor(x[:, p:], policy)[..., 0]  # (B, n) log-probabilities, all <= 0
        # The prefix in front with scores p, p − 1, …, 1 (above any log-probability): one top-k lists every kept
        # token, prefix first, then by descending keep score (the official argsort order).
        prefix = cached(
            ("prefix_scores", x.shape[0], p, keep_score.dtype, x.device),
            lambda: torch.arange(p, 0, -1, dtype=keep_score.dtype, device=x.device).repeat(x.shape[0], 1),
        )
        scores = torch.cat([prefix, keep_score], dim=1) if p else keep_score  # (B, p + n)
        return keep_rows(state, scores.topk(p + k, dim=1, sorted=True).indices)

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
        if not state.record or state.positions is None:
            return state.replace(keep_policy=policy)
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
