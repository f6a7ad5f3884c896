"""``flashvid``: FlashVID, Efficient Video LLMs via Training-free Tree-based Spatiotemporal Token Merging (Fan et
al., ICLR 2026; Fanziyang-v/FlashVID, MIT licence), its pre-LLM stage, written here from the facts of the authors'
code (``flashvid/utils.py``, ``token_selection.py``, ``modeling_qwen2_5_vl.py``), not copied. Its in-LLM stage is
``flashvid_llm`` (:mod:`vitrim.vlm.method.flashvid_llm`), stacked after this one.

Over one video's merged embeddings x (t temporal patches of P tokens, (t, P, E)) and each token's attention a (t, P):

1. **Segments** (DySeg): each temporal patch's mean token, L2-normalised; s_τ = its cosine with the next one. A
   segment ends after τ where s_τ < ``segment_threshold``; where that gives fewer than ``min_segment_num``
   segments (and ``complementary_segment``), also after the lowest of the other s_τ, as many as are missing.
   ``do_segment=False``: the video is one segment.
2. **Budgets**, per temporal patch: B = ⌈P·``retention_ratio``·``expansion``⌉ tokens, of which
   A = ⌈B·``alpha``⌉ chosen by ADTS and C = B − A left to the merging (the ``expansion`` over the ratio is what
   the in-LLM stage later takes back: at their defaults the LLM's layers see ``retention_ratio`` on average).
3. **ADTS** (``token_selection_method="attn_div"``), per temporal patch: the pairwise cosine distances 1 − cos
   of its tokens, column j scaled by a_j (×1e6, as theirs); the first token the one whose nearest other token is
   farthest, then greedily the token whose least scaled distance to those chosen is largest (a max-min diversity
   pick calibrated by attention), A tokens. ``"attn_div_v2"`` also scales column j by the mean of x_j's dot
   products with the segment's temporal-patch means; ``"div"`` scales by nothing; ``"attn"`` takes the top-A a.
4. **TSTM**, per segment of several temporal patches, when C > 0 and ``temporal_threshold`` < 1: each token not
   chosen finds its most cosine-similar unchosen token one temporal patch earlier; it joins that one's tree where
   the cosine is above ``temporal_threshold``. Where fewer than B·F tokens of the segment's F temporal patches (the
   chosen included) would be left, the threshold is raised to the (F·P − B·F)-th largest of those cosines (at
   least −1 + 10⁻⁶; joining needs strictly more). Trees are summed from the last temporal patch to the first: a
   root's value is (its own + every token of its tree) / (1 + its direct children), their arithmetic (the count
   is of direct children, not of the tree).
5. **Spatial merging**: the roots left per temporal patch, n_τ of them, are clustered (DPC-kNN,
   :mod:`~vitrim.vlm.method.density_peaks`, k = min(clusters, 7)) into ⌈n_τ·r⌉ clusters, r = C·F / Σ n_τ (none
   when r ≥ 1): each root goes to its nearest peak (‖·‖ / √E), and a cluster's token is the plain mean of its roots'
   values, in the peak's slot. The ceilings add up to C·F or more, at most one more per temporal patch (F − 1 per
   segment in exact arithmetic; their float product n_τ·r can also lie just above a whole quota and round up;
   Σ n_τ ≥ C·F: TSTM leaves at least B·F roots), so a video keeps t·B tokens or more, by its content.
   ``exact_count=True`` (vitrim's option, off by default) shares the segment's C·F among its temporal patches by
   largest remainder instead (:func:`cluster_counts`, integers throughout): from the ceilings, one is taken back
   from each of the temporal patches whose quota n_τ·C·F / Σ n_τ lies furthest below its ceiling (ties: the later
   temporal patch first), until the segment holds exactly C·F; a temporal patch may get 0 clusters, and its roots
   (with their trees) are then dropped. Every video then keeps exactly t·B tokens (t·A where nothing merges), a
   count its grid fixes: what vLLM serving needs, which writes a prompt's placeholders before the tower runs
   (docs/video.md).

The kept tokens are the ADTS picks (their own embeddings) and the cluster peaks (merged, after the merger:
:attr:`ImageSelection.projected`), each at its own position (the authors index ``position_ids`` with them; vitrim's
video convention, docs/video.md), in raster order. The attention a is what the Qwen towers' last block gives: per
temporal patch, the attention each merged token receives, averaged over the queries and heads (the authors' mean
over queries, heads and the token's m² patches, times a constant per video: the same picks). On LLaVA-OneVision a
"temporal patch" is a frame: x its pooled rows, a the attention each patch receives at the tower's last layer
resized by the same bilinear pooling (the authors' OneVision form, ``flashvid/llava_arch.py``).

Defaults: the authors' Qwen2.5-VL-7B script (``scripts/qwen2_5_vl.sh``: ``min_segment_num`` 4, ADTS v1
``attn_div``, ``alpha`` 0.7, ``temporal_threshold`` 0.8, ``expansion`` 1.25) with their ``flashvid()`` default
``retention_ratio`` 0.25 (the script sweeps 0.10 … 0.25; their LLaVA-OneVision runs use ``attn_div_v2`` and
``min_segment_num`` 8).

Where vitrim differs from that code (docs/video.md says the same):

- in a segment of ONE temporal patch their code clusters all P tokens, the ADTS picks included (it skips the mask
  it applies to longer segments), so a cluster's peak can be an ADTS pick and that slot then enters the LLM twice;
  vitrim clusters the tokens ADTS did not pick, as in their longer segments;
- their distances, similarities and sums run in the tower's dtype (bfloat16) except ADTS and the DPC distances
  (float32); vitrim's in float32 at least throughout; their DPC density gets a random 1e-6 jitter, vitrim's none;
- where their code fails (a raised threshold when no token may join, ``min_segment_num`` more than the temporal
  patches after a cut, ``attn_div_v2`` picking a token twice), vitrim lets no token join, cuts every gap, and never
  picks a token twice; a budget B above P is refused in one line;
- their code takes one video at batch 1; vitrim runs each video of a prompt and of a padded batch alone;
- ``exact_count=True`` (off by default) is vitrim's, not theirs: the largest remainder of step 5.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F

from vitrim.vlm.method.base import ImageSelection, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost
from vitrim.vlm.method.density_peaks import peak_scores, token_distances
from vitrim.vlm.method.video_rate import VideoMethod, sizes_from_cuts, video_tokens

SELECTIONS = ("attn_div", "attn_div_v2", "attn", "div")  # ADTS v1, v2; attention alone; diversity alone
ATTENTION_SCALE = 1e6  # theirs: the attention ×1e6 before it scales the distances ("to avoid numerical issues")
MOST_NEIGHBOURS = 7  # DPC-kNN's k: min(clusters, 7)
LEAST_THRESHOLD = -1.0 + 1e-6  # a raised TSTM threshold never goes below it (cosines of masked pairs are −1)


@dataclass(frozen=True)
class FlashVIDOptions:
    """The authors' knobs of the pre-LLM stage, their names (``flashvid()``'s keyword arguments)."""

    retention_ratio: float
    expansion: float
    alpha: float
    token_selection_method: str
    temporal_threshold: float
    do_segment: bool
    segment_threshold: float
    min_segment_num: int
    complementary_segment: bool
    exact_count: bool = False  # vitrim's: the clusters shared by largest remainder (module docstring, 5)

    def budgets(self, per_frame: int) -> tuple[int, int]:
        """(A, C) per temporal patch of ``per_frame`` tokens: ADTS picks and merged tokens (module docstring, 2)."""
        budget = math.ceil(per_frame * self.retention_ratio * self.expansion)
        if budget > per_frame:
            raise ValueError(
                f"retention_ratio={self.retention_ratio!r} with expansion={self.expansion!r} budgets "
                f"ceil({per_frame}·{self.retention_ratio!r}·{self.expansion!r}) = {budget} tokens of a temporal "
                f"patch's {per_frame}; expected at most {per_frame} (retention_ratio·expansion ≤ 1)"
            )
        chosen = math.ceil(budget * self.alpha)
        return chosen, budget - chosen


def flashvid_count(options: FlashVIDOptions, frames: int, per_frame: int) -> int:
    """t·B tokens of a video of ``frames`` temporal patches of ``per_frame`` tokens, t·A where nothing merges
    (module docstring, 2, 5): what ``exact_count`` keeps, the least the authors' rounding keeps."""
    chosen, context = options.budgets(per_frame)
    merges = context > 0 and options.temporal_threshold < 1.0
    return frames * (chosen + context if merges else chosen)


def segment_sizes(frame_means: Tensor, options: FlashVIDOptions) -> list[int]:
    """DySeg's segment sizes of t temporal patches from their mean tokens ``frame_means`` (t, E)."""
    frames = len(frame_means)
    if not options.do_segment or frames == 1:
        return [frames]
    unit = frame_means / frame_means.norm(dim=-1, keepdim=True)
    similarity = (unit[:-1] * unit[1:]).sum(-1)  # (t − 1,)
    below = similarity < options.segment_threshold
    cuts = below.nonzero()[:, 0]
    missing = options.min_segment_num - 1 - len(cuts)
    if options.complementary_segment and missing > 0:
        others = (~below).nonzero()[:, 0]
        lowest = torch.topk(similarity[others], min(missing, len(others)), largest=False).indices
        cuts = torch.cat([cuts, others[lowest]])
    return sizes_from_cuts(sorted(cuts.tolist()), frames)


def max_min_diverse(distance: Tensor, count: int) -> Tensor:
    """Sorted (count,) greedy max-min picks over ``distance`` (n, n), [i, j] how far j is from i: first the token
    whose nearest other is farthest (each column's second smallest), then each time the token farthest from its
    nearest pick; ties to the earlier index; a token is never picked twice."""
    size = len(distance)
    if count == 0 or count >= size:
        return torch.arange(size if count else 0, device=distance.device)
    nearest_other = torch.topk(distance, 2, dim=0, largest=False).values[1]  # (n,)
    picks = [int(nearest_other.argmax())]
    gap = distance[picks[0]].clone()  # (n,) each token's least distance to a pick
    taken = torch.zeros(size, dtype=torch.bool, device=distance.device)
    taken[picks[0]] = True
    for _ in range(1, count):
        pick = int(gap.masked_fill(taken, -math.inf).argmax())
        picks.append(pick)
        taken[pick] = True
        gap = torch.minimum(gap, distance[pick])
    return torch.tensor(sorted(picks), dtype=torch.long, device=distance.device)


def adts(tokens: Tensor, attention: Tensor, count: int, method: str) -> Tensor:
    """Sorted (F, count) picks per temporal patch of a segment's ``tokens`` (F, P, E) (work dtype) by ``method``
    (:data:`SELECTIONS`), ``attention`` (F, P)."""
    if method == "attn":
        return torch.topk(attention, count, dim=-1).indices.sort(-1).values
    unit = tokens / tokens.norm(dim=-1, keepdim=True)
    distance = 1 - unit @ unit.transpose(-1, -2)  # (F, P, P)
    if method != "div":
        distance = distance * (attention * ATTENTION_SCALE)[:, None, :]
    if method == "attn_div_v2":  # the event relevance: x_j's mean dot product with the segment's temporal-patch means
        relevance = (tokens @ tokens.mean(1).T).mean(-1)  # (F, P)
        distance = distance * relevance[:, None, :]
    return torch.stack([max_min_diverse(frame, count) for frame in distance])


@dataclass(frozen=True)
class Roots:
    """What TSTM leaves of a segment of F temporal patches of P tokens.

    values: (F, P, E)  every token's value after the trees are summed (a root's: module docstring, step 4)
    root_of: (F·P,)    the segment-local raster index of the root each token's tree ends at (itself for a root)
    left: (F, P) bool  the roots not chosen by ADTS: what the spatial merging clusters
    """

    values: Tensor
    root_of: Tensor
    left: Tensor


def tree_merge(tokens: Tensor, free: Tensor, threshold: float, least_left: int) -> Roots:
    """TSTM over a segment's ``tokens`` (F, P, E) (work dtype), ``free`` (F, P) the tokens ADTS did not pick;
    ``least_left``: the tokens (picks included) that must stay roots (B·F)."""
    frames, per_frame, _ = tokens.shape
    unit = tokens / tokens.norm(dim=-1, keepdim=True)
    similarity = unit[1:] @ unit[:-1].transpose(-1, -2)  # (F − 1, P, P): [τ − 1, n, m] = cos(x[τ, n], x[τ − 1, m])
    similarity = similarity.masked_fill(~free[1:, :, None], -1.0).masked_fill(~free[:-1, None, :], -1.0)
    best, parent = similarity.max(-1)  # (F − 1, P): the first of equal maxima
    best = torch.cat([best.new_full((1, per_frame), -1.0), best])  # the first temporal patch joins nothing
    parent = torch.cat([parent.new_zeros(1, per_frame), parent])
    joins = best > threshold
    if int((~joins).sum()) < least_left:
        surplus = frames * per_frame - least_left
        if surplus > 0:
            raised = max(float(torch.topk(best.flatten(), surplus).values[-1]), LEAST_THRESHOLD)
            joins = best > raised
        else:  # every token must stay (their code fails here)
            joins = torch.zeros_like(joins)
    values = tokens.clone()
    counts = torch.ones(frames, per_frame, dtype=tokens.dtype, device=tokens.device)
    for frame in range(frames - 1, -1, -1):
        stays = ~joins[frame]
        values[frame, stays] = values[frame, stays] / counts[frame, stays, None]
        if bool(joins[frame].any()):
            into = F.one_hot(parent[frame, joins[frame]], per_frame).to(tokens.dtype)  # (m, P)
            values[frame - 1] += into.T @ values[frame, joins[frame]]
            counts[frame - 1] += into.sum(0)
    own = torch.arange(frames * per_frame, device=tokens.device).view(frames, per_frame)
    root_of = own.clone()
    for frame in range(1, frames):
        root_of[frame] = torch.where(joins[frame], root_of[frame - 1][parent[frame]], own[frame])
    return Roots(values=values, root_of=root_of.flatten(), left=~joins & free)


def cluster(values: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """DPC-kNN of ``values`` (n, E) into ``count`` clusters: (peaks (count,) in score order, assigned (n,) each
    value's cluster: its nearest peak, a peak its own)."""
    distance = token_distances(values)  # (n, n)
    peaks = torch.topk(peak_scores(distance, min(count, MOST_NEIGHBOURS)), count).indices
    assigned = distance[:, peaks].argmin(-1)
    assigned[peaks] = torch.arange(count, device=values.device)
    return peaks, assigned


def cluster_counts(roots: list[int], merged: int, exact: bool) -> list[int]:
    """Clusters per temporal patch of a segment whose temporal patches keep ``roots`` (n_τ, F of them; Σ n_τ ≥
    ``merged`` > 0) roots for its ``merged`` (C·F) merged tokens: the authors' ⌈n_τ·r⌉, r = C·F / Σ n_τ (their float
    product), or with ``exact`` the largest remainder summing to exactly ``merged`` (module docstring, 5)."""
    total = sum(roots)
    if not exact:
        ratio = merged / total
        return [math.ceil(count * ratio) for count in roots]
    # integers only: ⌈n·C·F / Σn⌉, and how far the quota lies below it, times Σn (in [0, Σn))
    ceilings = [-(-count * merged // total) for count in roots]
    below = [ceiling * total - count * merged for ceiling, count in zip(ceilings, roots, strict=True)]
    # the ceilings overshoot by Σ(ceiling − quota) < F, an integer: that many temporal patches with below > 0
    losers = sorted(range(len(roots)), key=lambda frame: (-below[frame], -frame))[: sum(ceilings) - merged]
    for frame in losers:
        ceilings[frame] -= 1
    return ceilings


def flashvid_segment(
    tokens: Tensor, attention: Tensor, options: FlashVIDOptions, chosen: int, context: int
) -> tuple[list[int], list[Tensor], list[Tensor]]:
    """One segment's kept tokens (segment-local raster indices), the indices each stands for and their values
    (work dtype): ``tokens`` (F, P, E) in the work dtype, ``attention`` (F, P)."""
    frames, per_frame, _ = tokens.shape
    picks = adts(tokens, attention, chosen, options.token_selection_method)  # (F, A)
    offsets = torch.arange(frames, device=tokens.device)[:, None] * per_frame
    kept = (picks + offsets).flatten().tolist()
    groups = [tokens.new_tensor([index], dtype=torch.long) for index in kept]
    values = list(tokens.flatten(0, 1)[kept].unbind(0))
    if context == 0 or options.temporal_threshold >= 1.0:
        return kept, groups, values  # no merged tokens: the tokens ADTS did not pick are dropped
    free = torch.ones(frames, per_frame, dtype=torch.bool, device=tokens.device)
    free.scatter_(1, picks, False)
    if frames > 1:
        roots = tree_merge(tokens, free, options.temporal_threshold, (chosen + context) * frames)
    else:  # one temporal patch: every token not picked is its own root
        roots = Roots(values=tokens, root_of=torch.arange(per_frame, device=tokens.device), left=free)
    left = roots.left.sum(1).tolist()  # (F,) n_τ
    every = context * frames >= sum(left)  # r ≥ 1: every root stays as it is
    counts = cluster_counts(left, context * frames, options.exact_count)
    for frame in range(frames):
        local = roots.left[frame].nonzero()[:, 0]
        indices = local + frame * per_frame
        frame_values = roots.values[frame, local]
        count = counts[frame]
        if count == 0:  # no roots left here, or (exact_count) none of the segment's clusters: the roots are dropped
            continue
        if every:
            for index, value in zip(indices.tolist(), frame_values.unbind(0), strict=True):
                kept.append(index)
                groups.append((roots.root_of == index).nonzero()[:, 0])
                values.append(value)
            continue
        peaks, assigned = cluster(frame_values, count)
        members = F.one_hot(assigned, count).to(frame_values.dtype)  # (n, c)
        means = (members.T @ frame_values) / members.sum(0)[:, None]
        for number, peak in enumerate(peaks.tolist()):
            kept.append(int(indices[peak]))
            groups.append(torch.isin(roots.root_of, indices[assigned == number]).nonzero()[:, 0])
            values.append(means[number])
    return kept, groups, values


def flashvid_select(tokens: Tensor, attention: Tensor, options: FlashVIDOptions) -> ImageSelection:
    """FlashVID's pre-LLM stage on one video's merged embeddings ``tokens`` (t, P, E) with each token's attention
    ``attention`` (t, P) (module docstring): the kept raster indices, the groups they stand for and the LLM's
    embeddings of them (merged ones in ``merged``, ``projected``)."""
    per_frame = tokens.shape[1]
    chosen, context = options.budgets(per_frame)
    work = tokens.to(torch.promote_types(tokens.dtype, torch.float32))
    scores = attention.to(work.dtype)
    kept: list[int] = []
    groups: list[Tensor] = []
    values: list[Tensor] = []
    start = 0
    for size in segment_sizes(work.mean(1), options):
        segment = slice(start, start + size)
        some_kept, some_groups, some_values = flashvid_segment(work[segment], scores[segment], options, chosen, context)
        offset = start * per_frame
        kept += [index + offset for index in some_kept]
        groups += [group + offset for group in some_groups]
        values += some_values
        start += size
    order = sorted(range(len(kept)), key=kept.__getitem__)
    return ImageSelection(
        kept=torch.tensor([kept[i] for i in order], dtype=torch.long, device=tokens.device),
        groups=tuple(groups[i] for i in order),
        merged=torch.stack([values[i] for i in order]).to(tokens.dtype),
        projected=True,
    )


def check_number(name: str, value: Any, *, integer: bool, fits: Callable[[float], bool], expected: str) -> None:
    """``ValueError`` naming ``name``, ``value`` and what was ``expected`` unless it is a finite number (an int where
    ``integer``) that ``fits``."""
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or not fits(value):
        raise ValueError(f"{name}={value!r} for vlm method 'flashvid' must be {expected}")


@register_method("flashvid", stage="pre_llm")
class FlashVIDSelection(VideoMethod):
    """Options (the authors' names; defaults: their Qwen2.5-VL script): ``retention_ratio`` (0.25, in (0, 1]),
    ``expansion`` (1.25, > 0; each temporal patch budgets ⌈P·retention_ratio·expansion⌉ ≤ P tokens), ``alpha``
    (0.7, in [0, 1]: the share of the budget ADTS picks), ``token_selection_method`` ("attn_div"; or
    "attn_div_v2", "attn", "div"), ``temporal_threshold`` (0.8: a token joins a tree above this cosine; ≥ 1: no
    merging, only the ADTS picks stay), ``do_segment`` (True), ``segment_threshold`` (0.9), ``min_segment_num`` (4,
    int ≥ 1), ``complementary_segment`` (True); vitrim's ``exact_count`` (False: the authors' ⌈n_τ·r⌉ clusters per
    temporal patch; True: shared by largest remainder, exactly t·B tokens per video, which vLLM serving needs:
    module docstring, 5). Keep-all: ``retention_ratio=1, expansion=1``."""

    defaults: ClassVar[Mapping[str, Any]] = {
        "retention_ratio": 0.25,
        "expansion": 1.25,
        "alpha": 0.7,
        "token_selection_method": "attn_div",
        "temporal_threshold": 0.8,
        "do_segment": True,
        "segment_threshold": 0.9,
        "min_segment_num": 4,
        "complementary_segment": True,
        "exact_count": False,
    }
    needs_cls_attention = True  # the tower's last block: the attention each token receives (ADTS's calibration)

    def check(self) -> None:
        o = self.options
        for name, integer, fits, expected in (
            ("retention_ratio", False, lambda v: 0 < v <= 1, "a float in (0, 1] (the share of a temporal patch kept)"),
            ("expansion", False, lambda v: v > 0, "a float > 0 (the budget's factor over retention_ratio)"),
            ("alpha", False, lambda v: 0 <= v <= 1, "a float in [0, 1] (the share of the budget ADTS picks)"),
            ("temporal_threshold", False, lambda v: True, "a float (a cosine threshold)"),
            ("segment_threshold", False, lambda v: True, "a float (a cosine threshold)"),
            ("min_segment_num", True, lambda v: v >= 1, "an int >= 1 (the least number of segments)"),
        ):
            check_number(name, o[name], integer=integer, fits=fits, expected=expected)
        if o["token_selection_method"] not in SELECTIONS:
            raise ValueError(
                f"token_selection_method={o['token_selection_method']!r} for vlm method 'flashvid' must be one of "
                f"{', '.join(map(repr, SELECTIONS))}"
            )
        for name in ("do_segment", "complementary_segment", "exact_count"):
            if not isinstance(o[name], bool):
                raise ValueError(f"{name}={o[name]!r} for vlm method 'flashvid' must be True or False")

    def flashvid_options(self) -> FlashVIDOptions:
        return FlashVIDOptions(**{name: self.options[name] for name in self.defaults})

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        tokens, frames, per_frame = video_tokens(evidence)
        if evidence.cls_attention is None:
            raise ValueError("flashvid reads the attention each token receives (VisionEvidence.cls_attention)")
        attention = evidence.cls_attention[0].mean(0).reshape(frames, per_frame)  # (t, P): the mean over heads
        options = self.flashvid_options()
        return [flashvid_select(tokens, attention, options)]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """One video of ``model``'s t temporal patches of P tokens (``keep`` is not read): t·B stay, B = A + C the
        budget (module docstring, 2; t·A where nothing is merged): exactly with ``exact_count``, else a lower bound
        (at most one more per temporal patch, where its cluster count rounds up).
        Its own work: the received attention at the tower's last block (its queries and keys, each patch against
        its temporal patch's), then per temporal patch the pairwise cosines of its P tokens for ADTS, with the
        temporal patch before for TSTM (t − 1 of them), and the DPC distances of the roots left (at most P: an upper
        bound)."""
        width, per_frame, frames = model.llm.width, model.tokens_per_temporal_patch, model.temporal_patches
        options = self.flashvid_options()
        merges = options.budgets(per_frame)[1] > 0 and options.temporal_threshold < 1.0
        patches, tower_width = model.tower.tokens, model.tower.width
        attention = 2 * patches * tower_width * tower_width + patches * (patches // frames) * tower_width
        pairs = per_frame * per_frame * width  # one temporal patch's P × P products of E
        own = attention + frames * pairs + ((frames - 1) * pairs + frames * pairs if merges else 0)
        return MethodCost.before_llm(flashvid_count(options, frames, per_frame), own)
