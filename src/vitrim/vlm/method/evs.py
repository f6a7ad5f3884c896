"""``evs``: Efficient Video Sampling (Bagrov et al., NVIDIA, 2025): prune the tokens of a video that did not change
since the temporal patch before, after the merger, before the LLM - what vLLM ships in tree for Qwen2.5-VL and
Qwen3-VL (``video_pruning_method="evs"``).

Per video of t temporal patches of P tokens (the merged embeddings x, (t, P, E)):

1. a token's score is its dissimilarity to the same cell one temporal patch earlier, ``1 − cos(x[τ, p], x[τ−1, p])``
   (``torch.nn.functional.cosine_similarity``, in the embeddings' dtype); the first temporal patch scores above
   every dissimilarity (it is always kept);
2. the count is ``max(P, int(t·P·(1 − q)))`` with q = ``video_pruning_rate``: never fewer than one temporal patch, so
   a one-temporal-patch clip is never pruned;
3. the tokens of the ``count`` highest scores are kept, ties broken by raster order (a stable descending sort).

This file is written from that description (the paper and vLLM's documented behaviour); ``tests/vllm`` checks its
kept indices against vLLM's own in-tree function on the same embeddings.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from vitrim.vlm.method.base import ImageSelection, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost
from vitrim.vlm.method.video_rate import VideoMethod, video_tokens

FIRST_PATCH_SCORE = 255.0  # above any 1 − cosine (at most 2): the first temporal patch sorts before every other


def evs_count(per_frame: int, frames: int, rate: float) -> int:
    """Tokens a video of ``frames`` temporal patches of ``per_frame`` tokens keeps at pruning rate ``rate``."""
    return max(per_frame, int(per_frame * frames * (1 - rate)))


def evs_keep(tokens: Tensor, rate: float) -> Tensor:
    """Sorted (k,) long: the raster indices EVS keeps of one video's merged embeddings ``tokens`` (t, P, E)."""
    frames, per_frame = tokens.shape[:2]
    change = 1 - F.cosine_similarity(tokens[1:], tokens[:-1], dim=-1)  # (t − 1, P)
    first = torch.full_like(tokens[:1, :, 0], FIRST_PATCH_SCORE)  # (1, P)
    scores = torch.cat([first, change]).reshape(-1)  # (t·P,)
    ranked = torch.argsort(scores, descending=True, stable=True)
    return ranked[: evs_count(per_frame, frames, rate)].sort().values


@register_method("evs", stage="pre_llm")
class EVSSelection(VideoMethod):
    """Options: ``video_pruning_rate`` (float in [0, 1), default 0.75: the fraction of a video's tokens pruned)."""

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        tokens, _, _ = video_tokens(evidence)
        return [ImageSelection.unmerged(evs_keep(tokens, float(self.options["video_pruning_rate"])))]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """One video of ``model``'s t temporal patches of P tokens: the rate decides the count (:func:`evs_count`;
        ``keep`` is not read), and every token after the first temporal patch costs one cosine with the same cell
        one temporal patch earlier (a dot and two norms of E)."""
        per_frame, frames = model.tokens_per_temporal_patch, model.temporal_patches
        count = evs_count(per_frame, frames, float(self.options["video_pruning_rate"]))
        return MethodCost.before_llm(count, 3 * (frames - 1) * per_frame * model.llm.width)
