"""MCTF (Lee et al., CVPR 2024): multi-criteria token fusion with one-step-ahead attention.

Conventions, read from the authors' code (mlvlab/MCTF: ``utils/mctf.py`` ``mctf``, ``bipartite_soft_matching``,
``merge_wavg``; ``models/modules/blocks.py`` ``Block_DEIT``; ``models/SA/MHSA.py``; ``models/deit.py``; the defaults
of ``run/eval_deit_s_mctf.sh`` and the README's fine-tuning command) and adopted here:

* Where: at the start of a block, before its attention (``one_step_ahead=1``, the default): the block's attention
  weights A = softmax(q kᵀ/√d + log size) of the tokens entering it are computed first (q and k only), the tokens
  are merged by them, and A, merged alike, is applied to the values of the merged tokens (the block does not
  compute its attention again: the Block's ``reduce_ahead`` hook). ``one_step_ahead=2`` (the authors' "precise")
  merges the same way, then computes the attention of the merged tokens anew. The authors' ``0`` (merge after the
  MLP) is not offered. Default blocks: every block but the first (``--activate_layer [1, …, 11]``).
* What is compared: the tokens entering the block (the residual stream x, not its keys), cosine similarity between
  set a (tokens 0, 2, 4, …, prefix included, as ToMe) and set b (1, 3, 5, …). Scores multiply three criteria:
  similarity ((cos + 1) / 2)^(1/τ_sim); informativeness (ĩ_a ĩ_b)^(1/τ_info), ĩ = 1 / (attention a token receives,
  averaged over heads and queries), divided by its maximum; size (s̃_a s̃_b)^(1/τ_size), s̃ = 1 / size divided by its
  maximum. A τ of 0 leaves its criterion out. Defaults τ_sim = 1, τ_info = 20, τ_size = 40.
* Counts: ``r`` per block, an int (tokens merged away) or a fraction in (0, 1) of the non-prefix tokens; as the
  authors: if N − r < 10 then r = N − 10; r = min(⌊(N − p) · r⌋ for a fraction, else r; ⌊(N − p) / 2⌋).
* Bidirectional matching (default): the r_1 = ⌊r/2⌋ a tokens with the best scores merge into their best b token;
  then r_2 = r − r_1 b tokens (merged ones included) merge into their best *unmerged* a token, by the same score
  matrix (not recomputed). ``bidirection=False``: all r from a into b.
* Pooling (``pooling="attention"``, the authors' ``pooling_type`` 1): a merged token is the mean of its members
  weighted by the attention each receives × its size; sizes add. ``pooling="size"`` (their 0): weighted by size.
  The merged weights A: columns (keys) of one merged token add up; rows (queries) are averaged with the same
  weights as the tokens, so every row still sums to 1.
* Layout after a merge: [prefix, unmerged a tokens (in token order), unmerged b tokens (best second-direction
  scores first)]; without bidirection [prefix, unmerged a (in token order), b tokens (in token order)]. Each output
  token keeps its anchor's position (the unmerged token it continues), for RoPE and pictures.
* Protected: every prefix token (its scores are −∞ on both sides). The authors protect ``num_protected`` leading
  tokens of set a only, which for a [CLS]-only DeiT is the same; with a distillation token or registers a prefix
  token can land in set b, and vitrim protects it too. Without a prefix (p = 0) the unmerged a tokens keep the
  order of their scores, as the authors' code (it sorts them only when something is protected).
* Proportional attention (``prop_attn``, default True): log(size) is added to the attention logits.
* Merges are gathers and dense assignment products (:mod:`vitrim.reduce.assign`), so they export to ONNX.

Training: the authors fine-tune DeiT with r = 16 on blocks 1–11 and a token-reduction consistency loss (a second
pass with a random smaller r, :mod:`vitrim.losses`); ``vitrim train --reducer mctf`` runs it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrim.reduce.assign import merge_tokens
from vitrim.reduce.base import Reducer, StrengthOption
from vitrim.reduce.mctf_training import MCTFObjective
from vitrim.reduce.registry import register
from vitrim.reduce.state import TokenState

POOLINGS = ("attention", "size")


def mctf_count(r: float, num_tokens: int, num_prefix: int) -> int:
    """Tokens merged away in a block that N = ``num_tokens`` tokens enter (the authors' expression, module doc)."""
    if num_tokens - r < 10:
        r = num_tokens - 10
    mergeable = num_tokens - num_prefix
    count = int(mergeable * r) if r < 1 else int(r)
    return max(0, min(count, mergeable // 2))


@torch.no_grad()
def mctf_scores(
    x: Tensor, received: Tensor, sizes: Tensor, num_prefix: int, tau_sim: float, tau_info: float, tau_size: float
) -> Tensor:
    """(B, Na, Nb) multi-criteria scores of set a (tokens 0, 2, …) against set b (1, 3, …); prefix pairs are −∞.

    x (B, N, C) the tokens; received (B, N) the attention each receives (mean over heads and queries); sizes (B, N).
    """
    metric = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    a, b = metric[:, ::2], metric[:, 1::2]
    scores = ((a @ b.transpose(1, 2) + 1) / 2) ** (1 / tau_sim) if tau_sim else x.new_ones(1, 1, 1)
    for tau, value in ((tau_info, 1 / received), (tau_size, 1 / sizes)):
        if tau:
            value = value / value.amax(dim=-1, keepdim=True)  # (B, N)
            scores = scores * (value[:, ::2, None] * value[:, None, 1::2]) ** (1 / tau)
    scores = scores.expand(x.shape[0], a.shape[1], b.shape[1]).clone()
    pa, pb = (num_prefix + 1) // 2, num_prefix // 2  # prefix tokens in a (0, 2, …) and in b (1, 3, …)
    scores[:, :pa] = float("-inf")
    scores[:, :, :pb] = float("-inf")
    return scores


@torch.no_grad()
def mctf_matching(scores: Tensor, r: int, num_prefix: int, bidirection: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Scores (B, Na, Nb) -> the merge, in token indices of the N = Na + Nb tokens (prefix included):

    keep (B, N − r) the token each output row continues (the layout of the module doc, prefix first); src (B, r)
    the tokens merged away; src_dest (B, r) the output row each one ends in (through both directions).
    """
    B, Na, Nb = scores.shape
    device = scores.device
    p, pa, pb = num_prefix, (num_prefix + 1) // 2, num_prefix // 2
    r1, r2 = (r // 2, r - r // 2) if bidirection else (r, 0)
    node_max, node_idx = scores.max(dim=-1)  # (B, Na) each a token's best b
    edge = node_max.argsort(dim=-1, descending=True, stable=True)
    unm, src1 = edge[:, r1:], edge[:, :r1]  # a-local
    if p:
        unm = unm.sort(dim=-1).values  # prefix a tokens first, then token order
    anchor = torch.arange(Na + Nb, device=device).expand(B, -1).clone()  # (B, N) the token each one ends in
    a_tok, b_tok = 2 * unm, 2 * node_idx.gather(1, src1) + 1  # unmerged a tokens; the b each src1 joins
    if bidirection:
        second = scores.gather(1, unm[..., None].expand(B, Na - r1, Nb)).transpose(1, 2)  # (B, Nb, Na − r1)
        node_max2, node_idx2 = second.max(dim=-1)  # (B, Nb) each b token's best unmerged a
        edge2 = node_max2.argsort(dim=-1, descending=True, stable=True)  # b-local; prefix b (−∞) last
        src2, unm2 = edge2[:, :r2], edge2[:, r2:]
        anchor.scatter_(1, 2 * src2 + 1, a_tok.gather(1, node_idx2.gather(1, src2)))
        rest_b = 2 * unm2[:, : unm2.shape[1] - pb] + 1  # unmerged non-prefix b tokens, best scores first
        merged_away = torch.cat([2 * src1, 2 * src2 + 1], dim=1)
    else:
        rest_b = torch.arange(2 * pb + 1, Na + Nb, 2, device=device).expand(B, -1)
        merged_away = 2 * src1
    anchor.scatter_(1, 2 * src1, anchor.gather(1, b_tok))  # an a merged into a b ends where that b ends
    prefix = torch.arange(p, device=device).expand(B, p)
    keep = torch.cat([prefix, a_tok[:, pa:] if p else a_tok, rest_b], dim=1)  # (B, N − r)
    row = torch.empty_like(anchor).scatter_(1, keep, torch.arange(keep.shape[1], device=device).expand(B, -1))
    return keep, merged_away, row.gather(1, anchor.gather(1, merged_away))


def merge_rows(t: Tensor, keep: Tensor, src: Tensor, src_dest: Tensor) -> Tensor:
    """Sum the rows (dim −2) of t (B, …, N, C) into N' groups: out_j = t[keep_j] + Σ_{src_dest_i = j} t[src_i].

    keep (B, N'), src and src_dest (B, r): row selections and one assignment product (no scatter_reduce).
    """
    B, N, C = t.shape[0], t.shape[-2], t.shape[-1]
    lead = t.shape[1:-2]
    flat = t.reshape(-1, C)  # (B · L · N, C), L = the middle dims (heads)
    base = (torch.arange(flat.shape[0] // N, device=t.device) * N).view(B, -1, 1)  # (B, L, 1) first row of each

    def rows(index: Tensor) -> Tensor:  # (B, k) -> (B, …, k, C); one index_select, cheaper than a strided gather
        return flat.index_select(0, (index[:, None, :] + base).reshape(-1)).view(B, *lead, index.shape[1], C)

    assign = F.one_hot(src_dest, keep.shape[1]).to(t.dtype).transpose(1, 2)  # (B, N', r)
    return rows(keep) + assign.view(B, *(1,) * len(lead), *assign.shape[1:]) @ rows(src)


def merge_columns(t: Tensor, keep: Tensor, src: Tensor, src_dest: Tensor) -> Tensor:
    """Sum the columns (dim −1) of t (B, …, M, N) into N' groups, as :func:`merge_rows` does the rows."""
    middle = (1,) * (t.dim() - 2)

    def columns(index: Tensor) -> Tensor:  # (B, k) -> (B, …, M, k)
        return t.gather(-1, index.view(t.shape[0], *middle, -1).expand(*t.shape[:-1], index.shape[1]))

    assign = F.one_hot(src_dest, keep.shape[1]).to(t.dtype)  # (B, r, N')
    return columns(keep) + columns(src) @ assign.view(t.shape[0], *middle[1:], *assign.shape[1:])


@register("mctf")
class MCTF(Reducer):
    """Multi-criteria token fusion with one-step-ahead attention (see module doc).

    Options (the authors' names): ``r`` (int tokens, or a fraction, per block; one value or one per block of
    ``layers``); ``tau_sim``, ``tau_info``, ``tau_size``; ``bidirection``; ``one_step_ahead`` (1 or 2);
    ``pooling`` ("attention" or "size"); ``prop_attn``.
    """

    example_options: ClassVar[dict[str, Any]] = {"r": 2}
    identity_options: ClassVar[dict[str, Any]] = {"r": 0}
    strength_option: ClassVar[StrengthOption | None] = StrengthOption("r", weakest=0, strongest=None)
    looks_ahead: ClassVar[bool] = True

    def __init__(
        self,
        r: float,
        tau_sim: float = 1.0,
        tau_info: float = 20.0,
        tau_size: float = 40.0,
        bidirection: bool = True,
        one_step_ahead: int = 1,
        pooling: str = "attention",
        prop_attn: bool = True,
    ) -> None:
        # written as `not 0 <= r` (not `r < 0`) so that NaN, which fails every comparison, is refused too
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r >= 0 or (isinstance(r, float) and not r < 1):
            raise ValueError(f"r must be an int >= 0 (tokens merged per block) or a fraction in (0, 1), got {r!r}")
        for name, tau in (("tau_sim", tau_sim), ("tau_info", tau_info), ("tau_size", tau_size)):
            if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 <= tau < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0 (0 leaves the criterion out), got {tau!r}")
        if one_step_ahead not in (1, 2) or isinstance(one_step_ahead, bool):
            raise ValueError(
                f"one_step_ahead must be 1 (reuse the merged attention) or 2 (recompute it), got {one_step_ahead!r}"
            )
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        for name, value in (("bidirection", bidirection), ("prop_attn", prop_attn)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self.r = r
        self.taus = (float(tau_sim), float(tau_info), float(tau_size))
        self.bidirection = bidirection
        self.one_step_ahead = one_step_ahead
        self.pooling = pooling
        self.prop_attn = prop_attn

    @classmethod
    def training_objective(
        cls, model: nn.Module, *, label_smoothing: float, options: dict[str, Any], teacher: nn.Module | None = None
    ) -> MCTFObjective:
        """The authors' fine-tuning: token-reduction consistency (:mod:`vitrim.reduce.mctf_training`); its teacher
        is the model itself at a smaller r, so a dense ``teacher`` is refused."""
        if teacher is not None:
            raise ValueError("teacher is for DynamicViT: MCTF trains against itself at a smaller r (its mctf options)")
        return MCTFObjective.from_options(label_smoothing, options.get("mctf", {}))

    @classmethod
    def default_layers(cls, depth: int) -> tuple[int, ...]:
        """Every block but the first, as the authors' ``--activate_layer [1, …, 11]``."""
        return tuple(range(1, depth)) if depth > 1 else (0,)

    @classmethod
    def for_layers(  # type: ignore[override]  # a reducer takes its own options; apply checks their names
        cls, layers: tuple[int, ...], *, r: float | list[float], **options: Any
    ) -> dict[int, Reducer | None]:
        values = list(r) if isinstance(r, (list, tuple)) else [r] * len(layers)
        if len(values) != len(layers):
            raise ValueError(f"r must be one value or one per block of layers ({len(layers)}), got {r!r}")
        return {layer: cls(value, **options) if value else None for layer, value in zip(layers, values)}

    def reduce_ahead(self, state: TokenState, weights: Tensor) -> tuple[TokenState, Tensor | None]:
        x = state.tokens  # (B, N, C)
        B, N, _ = x.shape
        p = state.num_prefix
        r = mctf_count(self.r, N, p)
        if r <= 0:
            return state, None
        if state.keep_policy is not None:
            raise ValueError("MCTF cannot follow a training-time keep_policy (DynamicViT training); got one")
        sizes = state.sizes if state.sizes is not None else x.new_ones(B, N)
        received = weights.detach().mean(dim=(1, 2))  # (B, N) attention each token receives
        scores = mctf_scores(x.detach(), received, sizes, p, *self.taus)
        keep, src, src_dest = mctf_matching(scores, r, p, self.bidirection)
        pool = (received * sizes / sizes.amax(dim=-1, keepdim=True)) if self.pooling == "attention" else sizes
        pool = pool.detach()
        merged = merge_tokens(
            state, keep[:, p:] - p, src - p, src_dest - p, weights=pool[:, p:], proportional_attention=self.prop_attn
        )
        if self.one_step_ahead == 2:
            return merged, None
        by_key = merge_columns(weights, keep, src, src_dest)  # (B, H, N, N')
        rows = merge_rows(by_key * pool[:, None, :, None], keep, src, src_dest)  # (B, H, N', N')
        norm = merge_rows(pool[..., None], keep, src, src_dest)  # (B, N', 1)
        return merged, rows / norm[:, None]

    def extra_repr(self) -> str:
        return (
            f"r={self.r}"
            + ("" if self.bidirection else ", bidirection=False")
            + ("" if self.one_step_ahead == 1 else f", one_step_ahead={self.one_step_ahead}")
        )
