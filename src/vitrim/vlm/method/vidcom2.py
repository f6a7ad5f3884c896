"""``vidcom2``: VidCom2, Video Compression Commander (Liu et al., EMNLP 2025; xuyang-liu16/VidCom2, Apache-2.0):
a per-temporal-patch budget from how distinct each temporal patch is, then the tokens least like the video and
their temporal patch - what vLLM ships in tree for Qwen2.5-VL and Qwen3-VL (``video_pruning_method="vidcom2"``).

Per video of t temporal patches of P tokens (merged embeddings, (t, P, E)), q = ``video_pruning_rate``:

1. the half of the channels with the lowest variance over the video's tokens (``topk`` smallest, at least one);
   each token's such channels L2-normalised;
2. the token's similarity to the video's mean v and to its temporal patch's mean f, each a sum of Gaussian kernels
   ``exp(−‖x − c‖² / 2α)`` over α = 2⁻³ … 2¹; a token's redundancy is v + f;
3. a temporal patch's distinctiveness is −mean(v) over its tokens; ``softmax`` of it at temperature 0.01 gives p,
   and its budget is ``round(min(1, (1 − q)(1 + p − mean p)) · P)``, clamped to 1 … P;
4. each temporal patch keeps its budget of least redundant tokens; the total is then brought to
   ``max(t, min(int(t·P·(1 − q)), t·P))`` by dropping the most redundant kept tokens or adding the least redundant
   others, over the whole video.

Written from the paper and the authors' repository's description; ``tests/vllm`` checks the kept indices against
vLLM's in-tree function on the same embeddings.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from vitrim.vlm.method.base import ImageSelection, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost
from vitrim.vlm.method.video_rate import VideoMethod, video_tokens

BANDWIDTHS = tuple(2.0**power for power in range(-3, 2))  # the authors' multi-scale α
CHANNEL_SHARE = 0.5  # the lowest-variance channels scored
TEMPERATURE = 0.01  # of the softmax over temporal patches' distinctiveness


def vidcom2_count(per_frame: int, frames: int, rate: float) -> int:
    """Tokens VidCom2 keeps of a video: the rate's share, at least one per temporal patch."""
    total = per_frame * frames
    return max(frames, min(int(total * (1.0 - rate)), total))


def gaussian_similarity(tokens: Tensor, center: Tensor) -> Tensor:
    """(t, P): Σ_α exp(−‖token − center‖² / 2α) for ``tokens`` (t, P, C) and a broadcastable ``center``."""
    squared = ((tokens - center) ** 2).sum(dim=-1)
    return sum(torch.exp(-squared / (2.0 * alpha)) for alpha in BANDWIDTHS)  # type: ignore[return-value]


def vidcom2_keep(tokens: Tensor, rate: float) -> Tensor:
    """Sorted (k,) long: the raster indices VidCom2 keeps of one video's merged embeddings ``tokens`` (t, P, E)."""
    frames, per_frame, width = tokens.shape
    flat = tokens.reshape(frames * per_frame, width)
    calm = torch.topk(flat.var(dim=0, unbiased=False), k=max(1, int(width * CHANNEL_SHARE)), largest=False).indices
    unit = F.normalize(flat.index_select(-1, calm).view(frames, per_frame, -1), dim=-1)  # (t, P, C')
    to_video = gaussian_similarity(unit, unit.mean(dim=(0, 1), keepdim=True))  # (t, P)
    to_frame = gaussian_similarity(unit, unit.mean(dim=1, keepdim=True))  # (t, P)
    redundancy = to_video + to_frame

    distinct = -to_video.mean(dim=-1)  # (t,)
    share = F.softmax((distinct - distinct.max()) / TEMPERATURE, dim=0)
    scale = ((1.0 - rate) * (1.0 + share - share.mean())).clamp(max=1.0)
    budgets = (scale * per_frame).round().long().clamp(min=1, max=per_frame).tolist()

    kept = torch.zeros(frames, per_frame, dtype=torch.bool, device=tokens.device)
    for frame, budget in enumerate(budgets):
        least = torch.topk(redundancy[frame], k=budget, largest=False, sorted=False).indices
        kept[frame, least] = True
    kept_flat, scores = kept.view(-1), redundancy.view(-1)
    target, have = vidcom2_count(per_frame, frames, rate), sum(budgets)
    if have > target:  # drop the most redundant kept tokens
        inside = kept_flat.nonzero()[:, 0]
        worst = torch.topk(scores[inside], k=have - target, largest=True, sorted=False).indices
        kept_flat[inside[worst]] = False
    elif have < target:  # add the least redundant of the others
        outside = (~kept_flat).nonzero()[:, 0]
        best = torch.topk(scores[outside], k=min(target - have, len(outside)), largest=False, sorted=False).indices
        kept_flat[outside[best]] = True
    return kept_flat.nonzero()[:, 0]


@register_method("vidcom2", stage="pre_llm")
class VidCom2Selection(VideoMethod):
    """Options: ``video_pruning_rate`` (float in [0, 1), default 0.75: the fraction of a video's tokens pruned)."""

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        tokens, _, _ = video_tokens(evidence)
        return [ImageSelection.unmerged(vidcom2_keep(tokens, float(self.options["video_pruning_rate"])))]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """One video of ``model``'s t temporal patches of P tokens: the rate decides the count
        (:func:`vidcom2_count`; ``keep`` is not read); its own work: the channels' variances over the N = t·P tokens
        (N·E) and each token's two Gaussian similarities over half the channels (a distance each)."""
        n, width = model.image_tokens, model.llm.width
        count = vidcom2_count(model.tokens_per_temporal_patch, model.temporal_patches,
                              float(self.options["video_pruning_rate"]))  # fmt: skip
        return MethodCost.before_llm(count, n * width + 2 * n * (width // 2))
