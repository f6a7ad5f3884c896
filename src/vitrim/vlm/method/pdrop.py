"""PyramidDrop (Xing et al., CVPR 2025): staged drops, each ranking the image tokens by the last instruction
token's attention at the drop layer itself.

At each drop layer L_s (defaults ``layers=(8, 16, 24)``), with layer L_s's own q/k on its input (the tokens still
there), score_j = (1/H) Σ_h softmax(q_last,h · k_j,hᵀ · scale); the image's top ``int(N · ratios[s])`` stay from L_s
on (defaults ``ratios=(0.5, 0.25, 0.125)``, fractions of the image's ORIGINAL N tokens, truncated as the authors'
``int(...)`` does). The authors (``pdrop_rank_drop`` in ``modeling_llama_pdrop.py``) rank with layer ``rank_layer``'s
``input_layernorm``/``q_proj``/``k_proj`` and rotary on the previous layer's output, query = the last prompt token
at inference, average over heads, ``topk``. Differences, on purpose: kept tokens keep their ORIGINAL positions
(the authors renumber them 0…n−1 and shift decode positions), so dropping equals masking those keys; ties go to
the earlier token; several images per sample are ranked image by image.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from vitrim.vlm.method.ranking import rank_by_attention

if TYPE_CHECKING:
    from vitrim.vlm.evidence.llm_layer import LayerEvidence

from vitrim.vlm.method.base import DropStage, Method, StageOptions, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, attention_row_macs

PDROP_LAYERS = (8, 16, 24)
PDROP_RATIOS = (0.5, 0.25, 0.125)


def pdrop_keep(rows: Tensor, keep: int) -> Tensor:
    """(keep,) ascending positions among the image's current tokens that a PyramidDrop stage keeps; rows (H, n):
    the last token's per-head attention at the drop layer on those tokens."""
    return rank_by_attention(rows, keep)


@dataclass(frozen=True)
class StageTokens:
    """Tokens a stage keeps of an image of N tokens: ``int(N · ratio)``."""

    ratio: float

    def __call__(self, num_tokens: int) -> int:
        return int(num_tokens * self.ratio)  # the authors' int(): truncation, not rounding


def check_pyramid(layers: Any, ratios: Any) -> None:
    """``ValueError`` unless ``layers`` increase and ``ratios`` (same length) decrease within (0, 1]."""
    if not isinstance(layers, tuple | list) or not isinstance(ratios, tuple | list):
        raise ValueError(f"layers={layers!r} and ratios={ratios!r} must be tuples (decoder layers, fractions)")
    if any(isinstance(ratio, bool) or not isinstance(ratio, int | float) for ratio in ratios):
        raise ValueError(f"ratios={ratios!r} must be numbers (fractions of the image's tokens)")
    if len(layers) == 0 or len(layers) != len(ratios):
        raise ValueError(f"layers={layers} and ratios={ratios} must be non-empty and of the same length")
    if any(not isinstance(layer, int) or isinstance(layer, bool) for layer in layers):
        raise ValueError(f"layers={layers} must be ints (decoder layer indices)")
    if any(later <= earlier for earlier, later in itertools.pairwise(layers)):
        raise ValueError(f"layers={layers} must increase")
    if any(not 0.0 < ratio <= 1.0 for ratio in ratios) or any(b > a for a, b in itertools.pairwise(ratios)):
        raise ValueError(f"ratios={ratios} must be fractions in (0, 1] that do not increase")


@dataclass(frozen=True)
class PyramidDrop:
    """PyramidDrop as a drop policy for :class:`vitrim.vlm.stages.in_llm.InLLMDrop`."""

    layers: tuple[int, ...] = PDROP_LAYERS
    ratios: tuple[float, ...] = PDROP_RATIOS
    needs_previous_layer: bool = False
    reads_attention: bool = True

    def __post_init__(self) -> None:
        check_pyramid(tuple(self.layers), tuple(self.ratios))

    def drop_stages(self, num_layers: int) -> list[DropStage]:
        return [DropStage(layer, StageTokens(ratio)) for layer, ratio in zip(self.layers, self.ratios, strict=True)]

    def choose(self, evidence: LayerEvidence, counts: list[int]) -> list[Tensor]:
        return evidence.rank_by_last_token(counts, previous=False, rank=pdrop_keep)


@register_method("pdrop", stage="in_llm")
class PDrop(Method):
    """PyramidDrop. Options: ``layers`` (default (8, 16, 24)), ``ratios`` (default (0.5, 0.25, 0.125)): from
    ``layers[s]`` on, ``int(N · ratios[s])`` tokens of each N-token image stay. ``keep=`` and ``layer=`` are refused
    (the stages say both)."""

    defaults: ClassVar[Mapping[str, Any]] = {"layers": PDROP_LAYERS, "ratios": PDROP_RATIOS}

    def check(self) -> None:
        check_pyramid(self.options["layers"], self.options["ratios"])

    def drop_policy(self, options: StageOptions) -> PyramidDrop:
        if options.keep is not None or options.layer is not None:
            raise ValueError("pdrop drops in stages: give layers=(...) and ratios=(...), not keep= or layer=")
        return PyramidDrop(layers=tuple(self.options["layers"]), ratios=tuple(self.options["ratios"]))

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """``keep`` image tokens from the first drop layer on, the later stages scaled by the ratios (0.5 : 0.25 :
        0.125 -> keep, keep/2, keep/4, which ``vitrim.vlm`` runs as ``ratios=(keep / N, keep / 2N, keep / 4N)``);
        its own: at each drop layer, the last token's attention row over the tokens still there."""
        layers, ratios = tuple(self.options["layers"]), tuple(self.options["ratios"])
        kept = [max(1, round(keep * ratio / ratios[0])) for ratio in ratios]
        before = [model.image_tokens, *kept[:-1]]
        own = sum(attention_row_macs(model.llm, tokens + text_tokens) for tokens in before)
        return MethodCost(own=own, llm_cuts=tuple(zip(layers, kept, strict=True)))
