"""``random``: ``keep`` image tokens drawn uniformly without replacement, the baseline every pruning paper reports.

The draw is seeded by ``seed`` and by a number computed from the image's own features
(:attr:`VisionEvidence.seeds`), so an image gets the same tokens alone or anywhere in a batch, and two different
images get different draws. The kept tokens are the first ``keep`` of a seeded permutation of 0 … N−1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost


def random_keep(num_tokens: int, keep: int, seed: int) -> Tensor:
    """Sorted (keep,) long: the first ``keep`` entries of ``torch.randperm(num_tokens)`` under a CPU generator
    seeded with ``seed`` (CPU, so the draw is the same on every device)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_tokens, generator=generator)[:keep].sort().values


def image_seed(seed: int, image_seed: int) -> int:
    """The generator seed for one image: the user's seed and the image's own number, mixed into 63 bits."""
    return (seed * 0x9E3779B97F4A7C15 + image_seed) % (1 << 63)


@register_method("random", stage="pre_llm")
class RandomSelection(Method):
    """Options: ``seed`` (int, default 0)."""

    defaults: ClassVar[Mapping[str, Any]] = {"seed": 0}
    needs_seeds = True

    def check(self) -> None:
        seed = self.options["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r} must be an int")

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        num_images, num_tokens = evidence.features.shape[:2]
        if evidence.seeds is None:
            raise ValueError("random selection needs each image's seed (VisionEvidence.seeds)")
        selections = []
        for image in range(num_images):
            kept = random_keep(num_tokens, keep, image_seed(self.options["seed"], int(evidence.seeds[image])))
            kept = kept.to(evidence.features.device)
            selections.append(ImageSelection.unmerged(kept))
        return selections

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        return MethodCost.before_llm(keep)  # a draw: no products
