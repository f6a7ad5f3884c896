"""PaliGemma (transformers' ``PaliGemmaForConditionalGeneration``): its vision tower only.

The model (transformers ≥ 5): ``model.model.vision_tower`` (SigLIP, no [CLS]; its last layer's states after the
post-LayerNorm) → ``model.model.multi_modal_projector`` (one linear map per patch: each of the P = p×p patches is
one image token, 256 at 224 px) → scattered into the ``input_ids == image_token_id`` positions →
``model.model.language_model`` (Gemma, attending bidirectionally over the image and the prompt: the prefix).

What vitrim.vlm runs here: the tower stage (``vitrim.vlm.stages.tower``), its tokens put back on the patch grid, so the
LLM input keeps its P image tokens per image and the tower gets cheaper. The pre-LLM and in-LLM stages would
shorten a prefix that attends both ways, whose masks vitrim does not build for this family: they are refused at
``apply`` (:attr:`PaliGemmaAdapter.stages`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from vitrim.vlm.families.seams import inner_model
from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.base import Installation, Method
from vitrim.vlm.stages.spans import ImageSpans


class PaliGemmaAdapter:
    """The seams of one ``PaliGemmaForConditionalGeneration`` instance (see the module docstring)."""

    stages = ("tower",)  # the stages vitrim.vlm handles on this family; api.apply refuses the others

    def __init__(self, model: nn.Module) -> None:
        parts = ("vision_tower", "multi_modal_projector", "language_model")
        inner = inner_model(model, parts, "PaliGemmaForConditionalGeneration")
        self.model = model
        self.inner: Any = inner
        self.language_model: nn.Module = inner.language_model
        self.config: Any = model.config

    def tokens_per_image(self) -> int:
        """Image tokens per image entering the LLM: one per patch of the tower's grid."""
        vision = self.config.vision_config
        return int((vision.image_size // vision.patch_size) ** 2)

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        raise TypeError(_TOWER_ONLY.format(stage="inside the LLM"))

    def install_pre_llm(self, method: Method, keep: KeepSpec) -> Installation:
        raise TypeError(_TOWER_ONLY.format(stage="before the LLM"))


# api.apply refuses these stages first (stages above); the adapter's own seams refuse them too
_TOWER_ONLY = "vitrim.vlm does not cut {stage} on PaliGemmaForConditionalGeneration; it runs tower methods there only"
