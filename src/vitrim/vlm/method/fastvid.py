"""``fastvid``: FastVID, Dynamic Density Pruning for Fast Video LLMs (Shen et al., 2025; LunarShen/FastVID, MIT
licence, written here from the facts of the authors' Qwen2.5-VL code, ``fastvid_qwen25vl/…/modeling_qwen2_5_vl.py``,
not copied). Over one video's merged embeddings x (t temporal patches of P tokens, (t, P, E)):

1. **DySeg**, temporal segments: g_τ = mean of x[τ] over its P tokens, L2-normalised; s_τ = g_τ·g_τ₊₁. A segment
   ends after temporal patch τ where s_τ is among the ``DySeg_c`` − 1 lowest, or s_τ < ``DySeg_tau``.
2. **Budgets**, per segment of S temporal patches: R = int(P·``retention_ratio``) per temporal patch, the segment's
   R·S split into ``context`` = max(int(R·S·``STPrune_d``), 1) anchors and the rest ``salient``. A one-patch segment
   gives its patch both. A longer one is cut again where s_τ < ``DySeg_ignore`` into V sub-segments; only the LAST
   temporal patch of each keeps tokens: salient split evenly over the V (the remainder to the first), context over
   ⌈V / ``DTM_p``⌉ groups (likewise) given, counting from the last sub-segment, to every ``DTM_p``-th one, at most
   ⌊P/2⌋ each; a sub-segment's salient is capped at P minus its context.
3. **STPrune**, per such temporal patch: its ``salient`` tokens of highest salience, then ``context`` anchors
   among the others by density peaks (DPC): pairwise distances ‖xᵢ − xⱼ‖ / √E, density ρᵢ = exp(−mean of the
   squared distances to its 4 nearest, itself included), δᵢ = distance to the nearest token of higher density (the
   largest distance of the patch where none), anchors the top ρ·δ.
4. **DTM**, merge: for each temporal patch with anchors, every token of its segment that is neither salient nor one
   of THIS patch's anchors is assigned to its most cosine-similar anchor; an anchor with n assigned becomes
   w·anchor + (1 − w)·mean(assigned), w = max(1 / (n + 1), ``DTM_beta``) (an anchor assigned none stays as it is).

The salience, as theirs: at the tower's last block, per head, softmax over a temporal patch's tokens of its mean
query (over all its patches) · each token's mean key (over its 2×2 patches), both after rotary, scaled by 1/√hd;
then the mean over heads (:attr:`VisionEvidence.query_attention`,
:func:`~vitrim.vlm.evidence.merged_tokens.mean_query_attention`).

The kept tokens (salient and anchors) keep their own positions (the authors index ``position_ids`` with them, vitrim's
video convention, docs/video.md), in raster order; the anchors' merged embeddings go to the LLM as they are (after the
merger: :attr:`ImageSelection.projected`). Defaults: the authors' Qwen2.5-VL-7B script (``retention_ratio`` 0.27,
which kept 24.1 % of VideoMME's video tokens there; their LLaVA-OneVision runs use 0.10 and ``DySeg_tau`` 0.9).

Where vitrim differs from that code (docs/video.md says the same):

- their salience is computed in the tower's dtype (bfloat16 in their runs) and only in their flash-attention class;
  vitrim computes it in float32 at least, whichever attention the model runs;
- their density gets a random 1e-6 jitter (``torch.rand``) to break ties; vitrim adds none (deterministic);
- where their code raises (a clip of fewer than ``DySeg_c`` temporal patches, one segment without a cut, fewer than
  4 candidates for the density), vitrim takes the ``DySeg_c`` − 1 lowest of what there is, one segment, and every
  candidate; a video is one item, so several videos and a batch are each video alone (their code: batch 1, one video).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from vitrim.vlm.method.base import ImageSelection, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost
from vitrim.vlm.method.density_peaks import density_peaks
from vitrim.vlm.method.fastvid_onevision import (
    NEIGHBOURS,
    ONEVISION_DEFAULTS,
    SIGLIP,
    PoolingHead,
    merge_into_anchors,
    onevision_select,
    pooling_head_macs,
)
from vitrim.vlm.method.video_rate import VideoMethod, sizes_from_cuts, video_tokens

OPTION_RANGES: dict[str, tuple[bool, Callable[[float], bool], float | None, str]] = {  # integer?, low, high, words
    "retention_ratio": (False, lambda v: v > 0, 1.0, "a float in (0, 1] (each temporal patch's budget, int(P·r))"),
    "DySeg_c": (True, lambda v: v >= 1, None, "an int >= 1 (the least number of segments)"),
    "DySeg_tau": (False, lambda v: True, None, "a float (cosine threshold between temporal patches)"),
    "DySeg_ignore": (False, lambda v: True, None, "a float (cosine threshold inside a segment)"),
    "STPrune_d": (False, lambda v: v >= 0, 1.0, "a float in [0, 1] (the anchors' share)"),
    "DTM_p": (True, lambda v: v >= 1, None, "an int >= 1 (anchors every p-th sub-segment)"),
    "DTM_beta": (False, lambda v: v >= 0, 1.0, "a float in [0, 1] (an anchor's least weight)"),
}


@dataclass(frozen=True)
class FastVIDOptions:
    """The authors' knobs (their names without the ``fastvid_`` prefix of their command line)."""

    retention_ratio: float  # the other names keep the authors' capitals
    DySeg_c: int
    DySeg_tau: float
    DySeg_ignore: float
    STPrune_d: float
    DTM_p: int
    DTM_beta: float


def dyseg(similarity: Tensor, count: int, threshold: float) -> list[int]:
    """DySeg's segment sizes of t temporal patches from ``similarity`` (t − 1,): cuts at the ``count`` − 1 lowest
    (as many as there are) and wherever it is below ``threshold``."""
    lowest = torch.topk(similarity, min(count - 1, len(similarity)), largest=False).indices
    below = (similarity < threshold).nonzero()[:, 0]
    cuts = torch.cat([lowest, below]).unique().tolist()  # sorted
    return sizes_from_cuts(cuts, len(similarity) + 1)


def spread(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal shares, the remainder one each to the first."""
    return [total // parts + (part < total % parts) for part in range(parts)]


def segment_budgets(similarity: Tensor, per_frame: int, options: FastVIDOptions) -> list[tuple[int, int]]:
    """(salient, context) per temporal patch of one segment whose adjacent similarities are ``similarity`` (S − 1,)."""
    length = len(similarity) + 1
    retain = int(per_frame * options.retention_ratio) * length
    context = max(int(retain * options.STPrune_d), 1)
    salient = retain - context
    if length == 1:
        return [(salient, context)]
    parts = sizes_from_cuts((similarity < options.DySeg_ignore).nonzero()[:, 0].tolist(), length)
    salient_shares = spread(salient, len(parts))
    context_shares = spread(context, -(-len(parts) // options.DTM_p))
    budgets: list[tuple[int, int]] = []
    for part, size in enumerate(parts):
        from_last = len(parts) - 1 - part  # the context goes to every DTM_p-th sub-segment counted from the last
        anchors = (
            min(context_shares[from_last // options.DTM_p], per_frame // 2) if from_last % options.DTM_p == 0 else 0
        )
        budgets += [(0, 0)] * (size - 1)
        budgets.append((min(salient_shares[part], per_frame - anchors), anchors))
    return budgets


def check_budget(per_frame: int, ratio: float) -> None:
    """Raise ``ValueError`` when ``retention_ratio`` budgets no token of a frame's ``per_frame``."""
    if int(per_frame * ratio) < 1:
        raise ValueError(
            f"retention_ratio={ratio!r} keeps int({per_frame}·{ratio!r}) = 0 of a temporal patch's {per_frame} "
            f"tokens; expected at least {1 / per_frame:.4g}"
        )


def fastvid_select(tokens: Tensor, salience: Tensor, options: FastVIDOptions) -> ImageSelection:
    """FastVID on one video's merged embeddings ``tokens`` (t, P, E) with ``salience`` (t, P) (the head-averaged
    mean-query attention, module docstring): the kept raster indices, the groups they stand for and the anchors'
    merged embeddings."""
    frames, per_frame, width = tokens.shape
    check_budget(per_frame, options.retention_ratio)
    glob = tokens.mean(1)
    glob = glob / glob.norm(dim=-1, keepdim=True)
    similarity = (glob[:-1] * glob[1:]).sum(-1)  # (t − 1,)
    flat = tokens.reshape(frames * per_frame, width)
    kept: list[Tensor] = []
    groups: dict[int, Tensor] = {}
    merged: dict[int, Tensor] = {}
    start = 0
    for size in dyseg(similarity, options.DySeg_c, options.DySeg_tau):
        budgets = segment_budgets(similarity[start : start + size - 1], per_frame, options)
        salient, anchors = [], []
        for frame, (salient_count, anchor_count) in enumerate(budgets, start=start):
            top = torch.topk(salience[frame], salient_count).indices
            rest = torch.ones(per_frame, dtype=torch.bool, device=tokens.device)
            rest[top] = False
            candidates = rest.nonzero()[:, 0]
            salient.append(top + frame * per_frame)
            if anchor_count:
                anchors.append(
                    candidates[density_peaks(tokens[frame, candidates], anchor_count, NEIGHBOURS)] + frame * per_frame
                )
        segment = torch.arange(start * per_frame, (start + size) * per_frame, device=tokens.device)
        chosen = torch.cat(salient)
        for frame_anchors in anchors:
            others = segment[~torch.isin(segment, torch.cat([chosen, frame_anchors]))]
            values, members = merge_into_anchors(flat, frame_anchors, others, options.DTM_beta)
            merged.update(zip(frame_anchors.tolist(), values.unbind(0), strict=True))
            groups.update(zip(frame_anchors.tolist(), members, strict=True))
        kept += [chosen, *anchors]
        start += size
    order = torch.cat(kept).sort().values
    merged_rows = torch.stack([merged.get(index, flat[index]) for index in order.tolist()])
    return ImageSelection(
        kept=order,
        groups=tuple(groups.get(index, order.new_tensor([index])) for index in order.tolist()),
        merged=merged_rows,
        projected=True,
    )


@register_method("fastvid", stage="pre_llm")
class FastVIDSelection(VideoMethod):
    """Options (the authors' names and their Qwen2.5-VL defaults): ``retention_ratio`` (0.27, in (0, 1]: tokens per
    temporal patch budgeted, int(P·r)), ``DySeg_c`` (8, int ≥ 1: at least c segments), ``DySeg_tau`` (0.84: cut where
    adjacent temporal patches' cosine is below), ``DySeg_ignore`` (0.95: sub-segments inside a segment),
    ``STPrune_d`` (0.4, in [0, 1]: the anchors' share), ``DTM_p`` (4, int ≥ 1: anchors every p-th sub-segment),
    ``DTM_beta`` (0.6, in [0, 1]: an anchor's least weight in its merge); ``siglip`` (LLaVA-OneVision only: the
    SigLIP whose attention-pooling head scores the frames, a hub name or folder or a ``SiglipVisionModel`` with
    ``vision_use_head=True``; default ``google/siglip-so400m-patch14-384``, the tower's source). On LLaVA-OneVision
    the options a caller leaves out take the authors' OneVision defaults (``retention_ratio`` 0.10, ``DySeg_tau``
    0.9; :mod:`~vitrim.vlm.method.fastvid_onevision`). Keep-all: ``retention_ratio=1`` with ``DySeg_tau`` above 1
    (every temporal patch its own segment, nothing merged; on LLaVA-OneVision also ``DTM_beta=1``)."""

    defaults: ClassVar[Mapping[str, Any]] = {
        "retention_ratio": 0.27,
        "DySeg_c": 8,
        "DySeg_tau": 0.84,
        "DySeg_ignore": 0.95,
        "STPrune_d": 0.4,
        "DTM_p": 4,
        "DTM_beta": 0.6,
        "siglip": SIGLIP,
    }
    needs_cls_attention = True  # the tower's last block (the scoring block) ranks the salient tokens,
    needs_query_attention = True  # by its mean-query attention (VisionEvidence.query_attention)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.pooling: PoolingHead | None = None  # SigLIP's head, loaded at the first LLaVA-OneVision video

    def check(self) -> None:
        for name, (integer, low, high, expected) in OPTION_RANGES.items():
            value = self.options[name]
            kind = int if integer else int | float
            number = not isinstance(value, bool) and isinstance(value, kind) and math.isfinite(value)
            if not (number and low(value) and (high is None or value <= high)):
                raise ValueError(f"{name}={value!r} for vlm method 'fastvid' must be {expected}")
        if not isinstance(self.options["siglip"], str | nn.Module):
            raise ValueError(
                f"siglip={self.options['siglip']!r} for vlm method 'fastvid' must be a hub name, a folder or a "
                "SiglipVisionModel with vision_use_head=True"
            )

    def authors_layout(self) -> bool:
        return False  # the authors feed the kept indices as position_ids (Qwen and LLaVA-OneVision alike)

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        if evidence.frame_states is not None:
            return [self.select_onevision(evidence)]
        tokens, frames, per_frame = video_tokens(evidence)
        if evidence.query_attention is None:
            raise ValueError(
                "fastvid reads the tower's mean-query attention (VisionEvidence.query_attention); the family gave none"
            )
        salience = evidence.query_attention[0].mean(0).reshape(frames, per_frame)  # (t, P): mean over heads
        options = FastVIDOptions(**{name: self.options[name] for name in OPTION_RANGES})
        return [fastvid_select(tokens, salience, options)]

    def select_onevision(self, evidence: VisionEvidence) -> ImageSelection:
        """The authors' LLaVA-OneVision form (:mod:`~vitrim.vlm.method.fastvid_onevision`) on one video whose
        frames' feature-layer states are ``evidence.frame_states``."""
        if "DySeg_ignore" in self.given:
            raise ValueError(
                f"DySeg_ignore={self.options['DySeg_ignore']!r} for vlm method 'fastvid': its authors' "
                "LLaVA-OneVision form has no sub-segments; leave it out on LLaVA-OneVision"
            )
        values = {name: self.options[name] if name in self.given else ONEVISION_DEFAULTS.get(name, self.options[name])
                  for name in OPTION_RANGES}  # fmt: skip
        options = FastVIDOptions(**values)
        tokens, frames, per_frame = video_tokens(evidence)
        check_budget(per_frame, options.retention_ratio)
        assert evidence.grid is not None and evidence.frame_states is not None  # video_tokens checked the grid
        if len(evidence.frame_states) != frames:
            raise ValueError(f"fastvid got {len(evidence.frame_states)} frames' tower states for {frames} frames")
        rows, columns = evidence.grid
        if self.pooling is None:
            self.pooling = PoolingHead.load(self.options["siglip"])
        with torch.no_grad():
            salience, vectors = self.pooling.read(evidence.frame_states, rows, columns)
        unit = vectors / vectors.norm(dim=-1, keepdim=True)
        segments = dyseg((unit[:-1] * unit[1:]).sum(-1), options.DySeg_c, options.DySeg_tau)
        return onevision_select(tokens, salience.to(tokens.dtype), segments, options)

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """One video of ``model``'s t temporal patches of P tokens (N = t·P; ``keep`` is not read): at most
        t·int(P·``retention_ratio``) stay (the budgets; fewer where a sub-segment's share is capped at P), an upper
        bound. Its own work, upper bounds too: the salience at the tower's last block (every patch's query and key,
        each temporal patch's mean query against its tokens' mean keys), the DPC distances of every temporal patch's
        P tokens (only those holding anchors compute them), and each token's cosine with the kept tokens (only its
        segment's anchors). On LLaVA-OneVision (``model.pooled_side`` set; a temporal patch is a frame) the salience
        and DySeg's frame vectors are SigLIP's attention-pooling head's instead, exact
        (:func:`~vitrim.vlm.method.fastvid_onevision.pooling_head_macs` per frame), and the options left out take the
        authors' OneVision defaults, as :meth:`select_onevision` takes them; DySeg's t − 1 dot products of the frame
        vectors are not counted (nor are the Qwen form's)."""
        n, width, per_frame = model.image_tokens, model.llm.width, model.tokens_per_temporal_patch
        onevision = model.pooled_side is not None
        ratio = self.options["retention_ratio"]
        if onevision and "retention_ratio" not in self.given:
            ratio = ONEVISION_DEFAULTS["retention_ratio"]
        count = model.temporal_patches * int(per_frame * float(ratio))
        patches, tower_width = model.tower.tokens, model.tower.width
        if onevision:
            salience = model.temporal_patches * pooling_head_macs(model.tower)
        else:
            salience = 2 * patches * tower_width * tower_width + n * tower_width
        density = model.temporal_patches * per_frame * per_frame * width
        return MethodCost.before_llm(count, salience + density + n * count * width)
