"""PiToMe (Tran et al., NeurIPS 2024): energy-based merging that protects informative tokens, no training needed.

Conventions, read from the authors' code (hchautran/PiToMe, ``algo/pitome/merge.py`` ``pitome_vision``,
``pitome_bsm``, ``pitome``, ``merge_wavg``; ``algo/pitome/patch/timm.py`` ``PiToMeBlock``; ``patch/deit.py``
``apply_patch``) and adopted here:

* Where: in every block, after the attention residual, before the MLP (``after_attention``), as ToMe.
* Metric: the block's keys averaged over heads (B, N, hd), prefix tokens removed, L2-normalised; sim = cosine
  similarity of every pair of the n patch tokens (B, n, n).
* Energy: E_i = mean_j ELU(sim_ij − m, α) over all n tokens (itself included), α = ``alpha`` = 1.0. The margin of the
  i-th of L reducing blocks is m = 0.75 − 0.75 · i / L (the authors' ``margins`` over the model's blocks; with the
  default layers, every block, i is the block index and L the depth). ``margin`` overrides it (one number, or one
  per reducing block).
* Counts: r = ⌊n − n · ratio⌋ tokens merged away in each block, n = the patch tokens entering it (the authors'
  ``math.floor(T - T*ratio)``, same float expression); ``ratio`` = 1 (or r = 0) leaves the block dense. ratio must be
  ≥ 0.5 (the 2r merge candidates must exist).
* Ordering: tokens sorted by descending energy (``torch.argsort``): high energy = many similar neighbours =
  redundant.
* Matching: the first ⌈L/2⌉ reducing blocks use bipartite soft matching over *all* n tokens split by energy rank
  (a = ranks 0, 2, 4, …, b = ranks 1, 3, …; each a proposes its most similar b; the r best proposals merge;
  ``pitome_bsm``); the others split only the 2r highest-energy tokens (a = even ranks, b = odd ranks), every a merges
  into its most similar b, and the n − 2r lower-energy tokens are protected (``pitome``).
* Merge: size-weighted mean, sizes add (``merge_wavg``), written with gathers and one dense assignment product
  (:mod:`vitrim.reduce.assign`), not ``scatter_reduce``.
* Layout after a merge: [prefix, unmerged a tokens in proposal order (descending best similarity), b tokens in
  energy-rank order] for matching blocks; [prefix, protected tokens in energy order, b tokens in energy-rank order]
  otherwise; each output token keeps its anchor's position (the unmerged / protected / b token it continues).
* Proportional attention: the authors' timm/DeiT attention never receives the sizes (``PiToMeBlock`` calls
  ``self.attn(self.norm1(x))``), so sizes only weight the merges: ``prop_attn=False`` by default (TokenState's
  ``size_bias``); ``prop_attn=True`` adds log(size) to the logits as ToMe does.
* Protected: every prefix token ([CLS], distillation token, registers). The authors strip only [CLS]; a DeiT
  distillation token would be mergeable there (a deviation only on distilled models).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.attention import AttentionResult
from vitrim.reduce.assign import merge_tokens
from vitrim.reduce.base import Reducer, StrengthOption
from vitrim.reduce.index_cache import cached
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState


def pitome_margins(num_layers: int) -> list[float]:
    """The authors' margin schedule: 0.75 − 0.75 · i / L for the i-th of L blocks."""
    return [0.75 - 0.75 * (i / num_layers) for i in range(num_layers)]


def merge_count(n: int, ratio: float) -> int:
    """r = ⌊n − n · ratio⌋, the authors' expression."""
    return 0 if ratio >= 1.0 else math.floor(n - n * ratio)


def pitome_patches_left(patches: int, ratios: Sequence[float]) -> int:
    """The patch tokens left of ``patches`` after PiToMe blocks of ``ratios``, in block order: each merges away
    :func:`merge_count` of the n patch tokens entering it, a count its ratio and n alone fix, whatever the image (the
    energies decide *which* tokens merge, never how many). What a server writes as an image's placeholders before
    the tower runs (vitrim.vllm)."""
    left = patches
    for ratio in ratios:
        left -= merge_count(left, ratio)
    return left


def energy_scores(metric: Tensor, margin: float, alpha: float = 1.0) -> tuple[Tensor, Tensor]:
    """metric (B, n, C) -> cosine similarities (B, n, n) and energies (B, n) = mean_j ELU(sim_ij − margin, alpha)."""
    C = metric.shape[-1]
    unit = F.rms_norm(metric, (C,), eps=torch.finfo(metric.dtype).tiny)  # metric / ‖metric‖ · √C
    per_width = cached(("inverse", C, metric.dtype, metric.device), lambda: metric.new_tensor(1.0 / C))
    sim = torch.einsum("bic,bjc,->bij", unit, unit, per_width)  # (B, n, n) cosine similarities
    return sim, F.elu(sim - margin, alpha=alpha).mean(dim=-1)


def _pair_scores(sim: Tensor, a_idx: Tensor, b_idx: Tensor) -> Tensor:
    """(B, na, nb) similarities of the a tokens to the b tokens."""
    B, n, _ = sim.shape
    rows = sim.gather(1, a_idx[..., None].expand(B, a_idx.shape[1], n))  # (B, na, n)
    return rows.gather(2, b_idx[:, None, :].expand(B, a_idx.shape[1], b_idx.shape[1]))  # (B, na, nb)


@torch.no_grad()
def pitome_matching(metric: Tensor, r: int, margin: float, alpha: float, bipartite: bool) -> tuple[Tensor, ...]:
    """metric (B, n, C) of the patch tokens -> keep (B, n − r), src (B, r), src_dest (B, r) (vitrim.reduce.assign)."""
    sim, energy = energy_scores(metric, margin, alpha)
    order = torch.argsort(energy, dim=-1, descending=True)  # (B, n) most redundant first
    n = order.shape[1]
    if bipartite:
        a_idx, b_idx = order[:, ::2], order[:, 1::2]  # (B, na), (B, nb)
        node_max, node_idx = _pair_scores(sim, a_idx, b_idx).max(dim=-1)  # (B, na)
        edge_idx = node_max.argsort(dim=-1, descending=True)  # (B, na)
        unm = a_idx.gather(1, edge_idx[:, r:])  # (B, na − r)
        src = a_idx.gather(1, edge_idx[:, :r])  # (B, r)
        src_dest = unm.shape[1] + node_idx.gather(1, edge_idx[:, :r])  # (B, r)
        return torch.cat([unm, b_idx], dim=1), src, src_dest
    a_idx, b_idx = order[:, : 2 * r : 2], order[:, 1 : 2 * r : 2]  # (B, r) each
    protected = order[:, 2 * r :]  # (B, n − 2r)
    dst = _pair_scores(sim, a_idx, b_idx).argmax(dim=-1)  # (B, r)
    return torch.cat([protected, b_idx], dim=1), a_idx, (n - 2 * r) + dst


def _per_layer(name: str, value: object, layers: tuple[int, ...]) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != len(layers):
            raise ValueError(f"{name} must be one value or one per reducing block ({len(layers)}), got {list(value)}")
        return list(value)
    return [value] * len(layers)


def _check_ratio(ratio: object) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.5 <= ratio <= 1.0:
        raise ValueError(f"ratio must be a number in [0.5, 1] (fraction of tokens kept per block), got {ratio!r:.80}")


@register("pitome")
class PiToMe(Reducer):
    """Energy-protected token merging (see module doc).

    Options: ``ratio`` (fraction of patch tokens kept per block; one number or one per block); ``margin`` (default:
    the authors' schedule); ``alpha`` (ELU); ``prop_attn``; ``bipartite`` (default: the first half of the reducing
    blocks match over all tokens, the rest protect the low-energy tokens).
    """

    example_options: ClassVar[dict[str, Any]] = {"ratio": 0.8}
    identity_options: ClassVar[dict[str, Any]] = {"ratio": 1.0}
    strength_option: ClassVar[StrengthOption | None] = StrengthOption("ratio", 1.0, 0.5, step=0.001)

    def __init__(
        self, ratio: float, margin: float = 0.5, alpha: float = 1.0, prop_attn: bool = False, bipartite: bool = False
    ) -> None:
        _check_ratio(ratio)
        for name, value in (("margin", margin), ("alpha", alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r:.80}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0 (the ELU's scale), got {alpha!r}")
        for name, flag in (("prop_attn", prop_attn), ("bipartite", bipartite)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r:.80}")
        self.ratio = float(ratio)
        self.margin = float(margin)
        self.alpha = float(alpha)
        self.prop_attn = prop_attn
        self.bipartite = bipartite

    @classmethod
    def for_layers(  # type: ignore[override]  # a reducer takes its own options; apply checks their names
        cls,
        layers: tuple[int, ...],
        *,
        ratio: float | Sequence[float],
        margin: float | Sequence[float] | None = None,
        alpha: float = 1.0,
        prop_attn: bool = False,
        bipartite: bool | Sequence[bool] | None = None,
    ) -> dict[int, Reducer | None]:
        L = len(layers)
        ratios = _per_layer("ratio", ratio, layers)
        for value in ratios:
            _check_ratio(value)  # before the comparison below
        margins = pitome_margins(L) if margin is None else _per_layer("margin", margin, layers)
        first_half = [i < math.ceil(L * 0.5) for i in range(L)]
        matching = first_half if bipartite is None else _per_layer("bipartite", bipartite, layers)
        return {
            layer: cls(ratios[i], margins[i], alpha, prop_attn, matching[i]) if ratios[i] < 1.0 else None
            for i, layer in enumerate(layers)
        }

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        n = state.num_patch_tokens
        r = merge_count(n, self.ratio)
        if r <= 0:
            return state
        if state.keep_policy is not None:
            raise ValueError("PiToMe cannot follow a training-time keep_policy (DynamicViT training); got one")
        metric = attention.k.mean(dim=1)[:, state.num_prefix :]  # (B, n, hd)
        keep, src, src_dest = pitome_matching(metric, r, self.margin, self.alpha, self.bipartite)
        return merge_tokens(state, keep, src, src_dest, proportional_attention=self.prop_attn)

    def extra_repr(self) -> str:
        return f"ratio={self.ratio}, margin={self.margin:.4g}, bipartite={self.bipartite}"
