"""``visionzip`` (Yang et al., CVPR 2025, "VisionZip: Longer is Better but Not Necessary in VLMs"): dominant tokens
by [CLS] attention, the rest merged into a few contextual tokens by key similarity.

As the authors' code selects, per image, at the tower layer −2 (the layer producing LLaVA-1.5's features):

1. dominant: the tokens with the highest [CLS] attention summed over heads;
2. contextual: the remaining tokens, in raster order, R of them; every ``max(1, R // contextual)``-th is a target
   (the first ``contextual``); every other remaining token joins the target whose key (that layer's keys averaged
   over heads, L2-normalised) is most cosine-similar (the first on ties); a contextual token is its target's
   feature plus the mean of its members' features (the authors' formula: target + mean, not the mean of all).

Counting: the authors count [CLS] among the dominant tokens (``dominant=54, contextual=10`` hands the LLM [CLS],
53 patches and 10 contextual tokens: 64), and so does vitrim by default: where the family hands the method the
tower's [CLS] (``VisionEvidence.cls_feature``: LLaVA-1.5), the image gives the LLM its [CLS] row of the feature
layer through the family's own projector, ``keep − contextual − 1`` dominant patches and ``contextual`` merged
ones, in the authors' order: [CLS], the dominant patches in raster order, the contextual tokens in their targets'
raster order (``ImageSelection.cls`` / ``order``; the stage lays them out so under ``positions="authors"``).

Where there is no [CLS] to hand on - SigLIP (Gemma 3, PaliGemma) and Qwen's tower have none; LLaVA-NeXT's tiles
each have one, which vitrim does not pack among the tiles' tokens; ``positions="original"``, where every token sits
in its own slot and [CLS] has none - one more dominant patch takes its place: ``keep − contextual`` dominant
patches, the authors' selection at ``dominant + 1`` without [CLS]. Option ``cls`` makes the choice explicit: None
(default) the [CLS] where there is one, else one more patch; True insists on the [CLS] (``ValueError`` where there
is none); False always one more patch (vitrim's layout before issue 43). At ``keep = N`` every token stays (no
[CLS]), the unmodified model.

Options (the authors' names and their 64-token setting): ``dominant=54``, ``contextual=10``; without ``keep=``,
``keep = dominant + contextual``; with ``keep=`` alone, ``contextual = round(keep · 10 / 64)`` (the authors' 54:10
split: 10, 20, 30 at 64, 128, 192). Ties in the [CLS] scores go to the lower index (the authors' ``topk`` leaves
them to the backend). Under ``positions="original"`` a merged token sits in its target's slot
(vitrim.vlm.stages.sequence).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, cls_row_macs
from vitrim.vlm.method.fastervlm import top_indices

AUTHORS_DOMINANT, AUTHORS_CONTEXTUAL = 54, 10


def visionzip_select(
    scores: Tensor, keys: Tensor, features: Tensor, dominant: int, contextual: int, cls: bool = False
) -> ImageSelection:
    """One image: scores (N,) [CLS] attention summed over heads; keys (N, hd) averaged over heads; features (N, D).

    ``dominant`` patch tokens are kept as they are, ``contextual`` tokens merged; returns the kept slots (dominant
    tokens and targets) with their groups and features, the authors' order (dominant, then contextual), and
    ``cls`` (the [CLS] enters first, besides these patches).
    """
    num_tokens = scores.shape[0]
    dominant_indices = top_indices(scores, dominant)  # (dominant,)
    is_remaining = torch.ones(num_tokens, dtype=torch.bool, device=scores.device)
    is_remaining[dominant_indices] = False
    remaining = is_remaining.nonzero()[:, 0]  # (R,) raster order
    groups: dict[int, Tensor] = {int(i): i.view(1) for i in dominant_indices}
    merged: dict[int, Tensor] = {int(i): features[i] for i in dominant_indices}
    if contextual > 0:
        metric = keys[remaining] / keys[remaining].norm(dim=-1, keepdim=True)  # (R, hd)
        step = max(1, len(remaining) // contextual)
        target_rank = torch.arange(0, len(remaining), step, device=scores.device)[:contextual]  # (C,)
        is_target = torch.zeros(len(remaining), dtype=torch.bool, device=scores.device)
        is_target[target_rank] = True
        other_rank = (~is_target).nonzero()[:, 0]  # (R − C,)
        assigned = (metric[other_rank] @ metric[target_rank].T).argmax(-1)  # (R − C,) which target
        for number, rank in enumerate(target_rank.tolist()):
            members = remaining[other_rank[assigned == number]]
            target = remaining[rank]
            feature = features[target]
            if len(members):
                feature = feature + features[members].mean(0)
            groups[int(target)] = torch.cat([target.view(1), members]).sort().values
            merged[int(target)] = feature
    kept = torch.tensor(sorted(groups), dtype=torch.long, device=scores.device)
    dominant_set = {int(i) for i in dominant_indices}
    rank = {int(index): number for number, index in enumerate(kept.tolist())}
    order = sorted(rank[i] for i in dominant_set) + sorted(rank[i] for i in rank if i not in dominant_set)
    return ImageSelection(
        kept=kept,
        groups=tuple(groups[int(i)] for i in kept),
        merged=torch.stack([merged[int(i)] for i in kept]),
        cls=cls,
        order=torch.tensor(order, dtype=torch.long, device=scores.device),
    )


@register_method("visionzip", stage="pre_llm")
class VisionZip(Method):
    """Options: ``dominant`` (int ≥ 1, default 54, [CLS] counted as the authors do), ``contextual`` (int ≥ 0,
    default 10), ``cls`` (None, True or False: whether the [CLS] enters); see the module docstring for how they and
    ``keep=`` fit together."""

    defaults: ClassVar[Mapping[str, Any]] = {
        "dominant": AUTHORS_DOMINANT,
        "contextual": AUTHORS_CONTEXTUAL,
        "cls": None,
    }
    needs_cls_attention = True
    uses_cls_token = True

    def check(self) -> None:
        for name, least in (("dominant", 1), ("contextual", 0)):
            value = self.options[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an int >= {least}")
        if self.options["cls"] is not None and not isinstance(self.options["cls"], bool):  # 0 == False, yet 0 is not
            raise ValueError(
                f"cls={self.options['cls']!r} must be None (the tower's [CLS] where it has one), True or False"
            )
        if self.options["cls"] is True and not self.authors_layout():
            raise ValueError(
                "cls=True hands the LLM the tower's [CLS], which has no slot of its own under positions='original'; "
                "use positions='authors' (the default) or cls=None / False"
            )

    def with_cls(self, evidence: VisionEvidence) -> bool:
        """Whether [CLS] enters for these images (the ``cls`` option and the family's evidence)."""
        wanted = self.options["cls"]
        if wanted is True and evidence.cls_feature is None:
            raise ValueError(
                "visionzip cls=True: this model hands vitrim no [CLS] token to give the LLM (its tower has none, or "
                "the family packs tiles); use cls=None (one more dominant patch where there is no [CLS]) or False"
            )
        return wanted is not False and self.authors_layout() and evidence.cls_feature is not None

    def default_keep(self) -> int:
        return self.options["dominant"] + self.options["contextual"]

    def contextual_for(self, keep: int) -> int:
        """Contextual tokens at ``keep`` tokens per image."""
        if "contextual" in self.given:
            return int(self.options["contextual"])
        if "dominant" in self.given:
            return keep - int(self.options["dominant"])
        return round(keep * AUTHORS_CONTEXTUAL / (AUTHORS_DOMINANT + AUTHORS_CONTEXTUAL))

    def check_keep(self, keep: int) -> None:
        given = {name: self.options[name] for name in ("dominant", "contextual") if name in self.given}
        if len(given) == 2 and keep != given["dominant"] + given["contextual"]:
            raise ValueError(
                f"keep={keep} differs from dominant + contextual = {given['dominant']} + {given['contextual']}; "
                "give keep= or the two counts, not both"
            )
        if self.contextual_for(keep) > keep or self.contextual_for(keep) < 0:
            raise ValueError(f"visionzip cannot keep {keep} tokens with {given}: expected contextual <= keep")

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        if evidence.cls_attention is None or evidence.keys is None:
            raise ValueError("visionzip needs the [CLS] attention row and the keys of the scoring layer")
        self.check_keep(keep)
        contextual = self.contextual_for(keep)
        # [CLS] takes one of the dominant places (the authors' count), beside at least one dominant patch (the
        # authors' [CLS] always comes with one); never at keep = N (the unmodified model)
        room = keep - contextual >= 2
        if self.options["cls"] is True and not room:
            raise ValueError(
                f"visionzip cls=True at keep={keep}: no room beside contextual={contextual} for the [CLS] "
                "and a dominant patch; keep at least contextual + 2, or cls=None"
            )
        cls = self.with_cls(evidence) and room and keep < evidence.features.shape[1]
        dominant = keep - contextual - int(cls)
        scores = evidence.cls_attention.sum(1)  # (I, N) summed over heads, as the authors do
        keys = evidence.keys.mean(1)  # (I, N, hd) averaged over heads
        return [
            visionzip_select(s, k, f, dominant, contextual, cls) for s, k, f in zip(scores, keys, evidence.features)
        ]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """The [CLS] row picks the dominant tokens; each of the other N − keep is compared by its key with every
        contextual target (the dominant : contextual split of the options, scaled to ``keep``)."""
        n, d = model.image_tokens, model.tower.width
        share = self.options["contextual"] / (self.options["dominant"] + self.options["contextual"])
        return MethodCost.before_llm(keep, cls_row_macs(model.tower) + (n - keep) * max(1, round(keep * share)) * d)
