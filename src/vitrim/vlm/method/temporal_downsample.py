"""``temporal_downsample``: keep every ``stride``-th temporal patch of a video whole (the first, then every stride-th
after it) - the baseline of sampling the clip at a lower frame rate, which video pruning tables report beside
``random``. A video of t temporal patches keeps ⌈t / stride⌉ of them; images are not touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from vitrim.vlm.method.base import ImageSelection, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost
from vitrim.vlm.method.video_rate import VideoMethod, video_tokens


@register_method("temporal_downsample", stage="pre_llm")
class TemporalDownsample(VideoMethod):
    """Options: ``stride`` (int ≥ 1, default 2: keep temporal patches 0, stride, 2·stride, …)."""

    defaults: ClassVar[Mapping[str, Any]] = {"stride": 2}

    def check(self) -> None:
        stride = self.options["stride"]
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride={stride!r} must be an int >= 1 (keep every stride-th temporal patch)")

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        tokens, frames, per_frame = video_tokens(evidence)
        kept_frames = torch.arange(0, frames, self.options["stride"], device=tokens.device)  # (t',)
        kept = (kept_frames[:, None] * per_frame + torch.arange(per_frame, device=tokens.device)).reshape(-1)
        return [ImageSelection.unmerged(kept)]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """One video of ``model``'s t temporal patches of P tokens: ⌈t / stride⌉·P stay (``keep`` is not read); an
        index pattern, no products."""
        frames = -(-model.temporal_patches // self.options["stride"])
        return MethodCost.before_llm(frames * model.tokens_per_temporal_patch)
