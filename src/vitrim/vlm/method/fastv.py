"""FastV (Chen et al., ECCV 2024): at layer K, keep the image tokens the LAST token attended to most at layer K−1.

score_j = (1/H) Σ_h softmax(q_last,h · k_j,hᵀ · scale)   at layer K−1 (its input, its own q/k and rotary; the
softmax runs over every key the last token sees, text included), then the image's top ``keep`` scores stay from
layer K on. The authors (``fastv_forward`` in their modified ``modeling_llama.py``) take layer K−1's
``output_attentions`` of batch row 0, average over heads, read row −1 on the image span and keep
``topk(round(N·(1−R)))``; their defaults are K = 2, R = 50 %. Here the row is recomputed from the layer's weights
(every layer stays on SDPA), per sample (the last real token of each), per image, and ties go to the earlier token.
Kept tokens keep their original positions, as the authors' ``position_ids = keep_indexs`` do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from vitrim.vlm.method.ranking import rank_by_attention

if TYPE_CHECKING:
    from vitrim.vlm.evidence.llm_layer import LayerEvidence

from vitrim.vlm.method.base import DropStage, Method, StageOptions, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, attention_row_macs

FASTV_LAYER = 2  # the authors' K
FASTV_RATIO = 0.5  # the authors' R: the fraction of image tokens dropped


def fastv_keep(rows: Tensor, keep: int) -> Tensor:
    """(keep,) ascending positions among the image's n tokens that FastV keeps; rows (H, n): the last token's
    per-head attention at layer K−1 on those tokens."""
    return rank_by_attention(rows, keep)


@dataclass(frozen=True)
class FastVDrop:
    """FastV as a drop policy for :class:`vitrim.vlm.stages.in_llm.InLLMDrop`: one drop before ``layer``; ``tokens(N)``
    image tokens of an N-token image stay."""

    layer: int
    tokens: Callable[[int], int]
    needs_previous_layer: bool = True
    reads_attention: bool = True

    def drop_stages(self, num_layers: int) -> list[DropStage]:
        return [DropStage(self.layer, self.tokens)]

    def choose(self, evidence: LayerEvidence, counts: list[int]) -> list[Tensor]:
        return evidence.rank_by_last_token(counts, previous=True, rank=fastv_keep)


@register_method("fastv", stage="in_llm")
class FastV(Method):
    """FastV. Options: ``layer=`` (default 2, the authors' K), ``keep=`` (image tokens per image kept from layer K
    on; default 0.5, the authors' R = 50 % dropped)."""

    default_layer = FASTV_LAYER

    defaults: ClassVar[Mapping[str, Any]] = {}

    def default_keep(self) -> float:  # a fraction: parse_keep takes it
        return 1.0 - FASTV_RATIO

    def drop_policy(self, options: StageOptions) -> FastVDrop:
        assert options.keep is not None  # default_keep always gives one
        return FastVDrop(layer=FASTV_LAYER if options.layer is None else options.layer, tokens=options.keep.tokens)

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """Every token runs layers 0 … K−1, ``keep`` image tokens the rest; its own: the last token's attention
        row at layer K−1 over the image and text (recomputed from the layer's weights)."""
        everything = model.image_tokens + text_tokens
        return MethodCost(own=attention_row_macs(model.llm, everything), llm_cuts=((FASTV_LAYER, keep),))
