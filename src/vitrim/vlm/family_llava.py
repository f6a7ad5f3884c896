"""LLaVA-1.5 (transformers' ``LlavaForConditionalGeneration``): where its image tokens are made and enter the LLM.

The model (transformers ≥ 5): ``model.model.vision_tower`` (CLIP) → ``hidden_states[vision_feature_layer]``
([CLS] dropped under the "default" strategy) → ``model.model.multi_modal_projector`` → scattered into the
``input_ids == image_token_id`` positions of the embeddings → ``model.model.language_model``. Each image gives
(image_size / patch_size)² tokens (576 for LLaVA-1.5 at 336 px), +1 under the "full" strategy.

Seams used (hooks on this instance's submodules only):
- a forward pre-hook with kwargs on the model itself: the ``input_ids`` and ``pixel_values`` of a prefill;
- a forward pre-hook on the scoring layer's attention (tower layer ``vision_feature_layer``): its input hidden
  states, from which the [CLS] attention row and the keys are computed with the layer's own q/k projections;
- a forward pre-hook on the projector: the features of the images, where the method selects (and merged tokens
  are written into their slots);
- a forward pre-hook with kwargs on the language model: the LLM input is shortened (``vitrim.vlm.sequence``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.registry import Installation, Method
from vitrim.vlm.spans import ImageSpans, spans_from_mask


class LlavaAdapter:
    """The seams of one ``LlavaForConditionalGeneration`` instance (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        inner = getattr(model, "model", None)
        parts = ("vision_tower", "multi_modal_projector", "language_model")
        if inner is None or not all(hasattr(inner, part) for part in parts):
            raise TypeError(
                f"{type(model).__name__} lacks model.vision_tower / multi_modal_projector / language_model "
                "(vitrim.vlm needs transformers >= 5's LlavaForConditionalGeneration layout)"
            )
        self.model = model
        self.inner = inner
        self.language_model: nn.Module = inner.language_model
        self.config: Any = model.config

    def tokens_per_image(self) -> int:
        vision = self.config.vision_config
        grid = (vision.image_size // vision.patch_size) ** 2
        return grid + (1 if self.config.vision_feature_select_strategy == "full" else 0)

    def spans(self, input_ids: Tensor) -> ImageSpans:
        """The image positions of ``input_ids`` (B, L): every image gives :meth:`tokens_per_image` tokens."""
        is_image: Tensor = input_ids == self.config.image_token_id  # (B, L)
        per_image = self.tokens_per_image()
        num_images = int(is_image.sum()) // per_image
        return spans_from_mask(is_image, [per_image] * num_images)

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if kwargs.get("pixel_values") is None:
                return  # a decode step (generate drops pixel_values after the prefill) or a text-only call
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            if input_ids is None:
                raise ValueError("vitrim.vlm needs input_ids (not inputs_embeds) to find the image tokens")
            on_prefill(self.spans(input_ids))

        handle = self.model.register_forward_pre_hook(hook, with_kwargs=True)
        return handle.remove

    def install_pre_llm(self, method: Method, keep: KeepSpec) -> Installation:
        raise NotImplementedError("LLaVA pre-LLM plumbing lands with milestone 2")
