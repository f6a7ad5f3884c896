"""PaliGemma (transformers' ``PaliGemmaForConditionalGeneration``): its vision tower only.

The model (transformers ≥ 5): ``model.model.vision_tower`` (SigLIP, no [CLS]; its last layer's states after the
post-LayerNorm) → ``model.model.multi_modal_projector`` (one linear map per patch: each of the P = p×p patches is
one image token, 256 at 224 px) → scattered into the ``input_ids == image_token_id`` positions →
``model.model.language_model`` (Gemma, attending bidirectionally over the image and the prompt: the prefix).

What vitrim.vlm runs here: the tower stage (``vitrim.vlm.stages.tower``), its tokens put back on the patch grid, so
the LLM input keeps its P image tokens per image and the tower gets cheaper. The pre-LLM and in-LLM stages would
shorten a prefix that attends both ways, whose masks vitrim does not build for this family: its traits declare the
tower stage only, and ``apply`` refuses the others.
"""

from __future__ import annotations

from typing import Any

from vitrim.vlm.boxes import TokenBoxes, one_image_per_picture, resized_grid_boxes
from vitrim.vlm.stages.contract import FamilyAdapter, FamilyTraits


class PaliGemmaAdapter(FamilyAdapter):
    """The seams of one ``PaliGemmaForConditionalGeneration`` instance (see the module docstring)."""

    traits = FamilyTraits(
        classes=("PaliGemmaForConditionalGeneration",),
        title="PaliGemma (PaliGemmaForConditionalGeneration)",
        stages=("tower",),
        tower_grid_only="vitrim.vlm does not shorten its LLM input (the image and prompt attend both ways)",
    )

    def tokens_per_image(self) -> int:
        """Image tokens per image entering the LLM: one per patch of the tower's grid."""
        vision = self.config.vision_config
        return int((vision.image_size // vision.patch_size) ** 2)

    # where its image tokens lie in the user's picture

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        """Per picture of ``sizes`` (H, W): its tokens' boxes, one per patch (:func:`paligemma_boxes`)."""
        one_image_per_picture(
            inputs, sizes, "PaliGemma's processor makes one image per picture; give the sizes of the pictures it read"
        )
        return [paligemma_boxes(image_processor, self.config, size) for size in sizes]


def paligemma_boxes(image_processor: Any, config: Any, size: tuple[int, int]) -> TokenBoxes:
    """PaliGemma's tokens (one per SigLIP patch) on a picture of ``size`` (H, W).

    ``SiglipImageProcessor`` resizes the picture to its ``height × width`` (no crop, the aspect ratio not kept).
    Returns one box per patch, all of view 0 ("image").
    """
    return resized_grid_boxes(image_processor, int(config.vision_config.patch_size), None, size, "image")
