"""``flashvid_llm``: FlashVID's in-LLM stage (Fan et al., ICLR 2026; Fanziyang-v/FlashVID, MIT licence), written
from the facts of the authors' code (``fastv_prune`` in ``flashvid/utils.py`` and their Qwen2.5-VL text model), not
copied. It runs after FlashVID's pre-LLM stage (``flashvid``), stacked:
``vitrim.vlm.apply(model, "flashvid")`` then ``vitrim.vlm.apply(model, "flashvid_llm")``.

It is FastV's rule (:mod:`vitrim.vlm.method.fastv`) with the authors' count and layer: before decoder layer K
(``layer=``, their ``pruning_layer``, 20), the visual tokens the last token attended to most at layer K − 1 (its
softmax row over every key, the mean over heads) stay, ⌈N·``llm_retention_ratio``⌉ of the N that entered the LLM
(a ceiling where FastV's ``keep=`` fraction rounds); every other token keeps its position. Their defaults are their
Qwen2.5-VL script's (K = 20 of 28 layers, 0.3); for Qwen3-VL-8B (36 layers) their script uses K = 28 and 0.1.

Where vitrim differs: their code ranks all of a prompt's visual tokens together (one video at batch 1); vitrim
ranks each video's (and image's) own, as every in-LLM method does, per sample of a padded batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from vitrim.vlm.method.base import Method, StageOptions, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, attention_row_macs
from vitrim.vlm.method.fastv import FastVDrop

PRUNING_LAYER = 20  # the authors' pruning_layer on Qwen2.5-VL (and LLaVA-OneVision)


def retained(tokens: int, ratio: float) -> int:
    """Visual tokens of an item of ``tokens`` that stay: ⌈tokens·ratio⌉, at least one, at most all."""
    return max(1, min(tokens, math.ceil(tokens * ratio)))


@register_method("flashvid_llm", stage="in_llm")
class FlashVIDInLLM(Method):
    """FlashVID's in-LLM stage (stack it after ``flashvid``). Options: ``llm_retention_ratio`` (0.3, in (0, 1]: the
    share of each video's tokens that stays from layer K on, ⌈N·r⌉), ``layer=`` (default 20, their
    ``pruning_layer``). ``keep=`` is not taken (the count is ``llm_retention_ratio``'s)."""

    default_layer = PRUNING_LAYER
    defaults: ClassVar[Mapping[str, Any]] = {"llm_retention_ratio": 0.3}

    def check(self) -> None:
        ratio = self.options["llm_retention_ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise ValueError(
                f"llm_retention_ratio={ratio!r} for vlm method 'flashvid_llm' must be a float in (0, 1] (the share of "
                "each video's tokens kept from layer= on)"
            )

    def drop_policy(self, options: StageOptions) -> FastVDrop:
        if options.keep is not None:
            given = options.keep.count if options.keep.count is not None else options.keep.fraction
            raise ValueError(
                f"keep={given!r}: vlm method 'flashvid_llm' keeps ceil(N·llm_retention_ratio) of each video's "
                "N tokens; give llm_retention_ratio= instead"
            )
        ratio = float(self.options["llm_retention_ratio"])
        layer = PRUNING_LAYER if options.layer is None else options.layer
        return FastVDrop(layer=layer, tokens=lambda count: retained(count, ratio))

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """Every token runs layers 0 … K−1, ``keep`` visual tokens the rest; its own: the last token's attention row
        at layer K−1 over the visual and text tokens (recomputed from the layer's weights)."""
        everything = model.image_tokens + text_tokens
        return MethodCost(own=attention_row_macs(model.llm, everything), llm_cuts=((PRUNING_LAYER, keep),))
