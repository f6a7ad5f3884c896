"""LLaVA-1.5 (transformers' ``LlavaForConditionalGeneration``): where its image tokens are made and enter the LLM.

The model (transformers ≥ 5): ``model.model.vision_tower`` (CLIP) → ``hidden_states[vision_feature_layer]``
([CLS] dropped under the "default" strategy) → ``model.model.multi_modal_projector`` → scattered into the
``input_ids == image_token_id`` positions of the embeddings → ``model.model.language_model``. Each image gives
(image_size / patch_size)² tokens (576 for LLaVA-1.5 at 336 px), +1 under the "full" strategy.

Seams used (hooks on this instance's submodules only):
- a forward pre-hook on the scoring layer's attention (tower layer ``vision_feature_layer``): its input hidden
  states, from which the [CLS] attention row and the keys are computed with the layer's own q/k projections;
- a forward hook on that layer (for a method with ``uses_cls_token``): its output's [CLS] row, the [CLS] of the
  feature layer the "default" strategy drops, which the method may hand the LLM (written into a free slot before
  the projector, so it is projected as the authors' VisionZip projects it);
- a forward pre-hook on the projector: the features of the images, where the method selects (and merged tokens
  are written into their slots); a forward hook on it for methods that select on its output;
- everything else (the prefill, the shortened LLM input, decoding, beams) is the pre-LLM stage's
  (:mod:`vitrim.vlm.stages.pre_llm`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.families.boxes import NO_VIEW, TokenBoxes, crop_axis, grid_boxes, resized_size, size_field
from vitrim.vlm.families.contract import FamilyAdapter, FamilyTraits
from vitrim.vlm.families.seams import inner_model, write_merged
from vitrim.vlm.method.base import VisionEvidence, content_seed
from vitrim.vlm.stages.pre_llm import PreLLMStage


class LlavaAdapter(FamilyAdapter):
    """The seams of one ``LlavaForConditionalGeneration`` instance (see the module docstring)."""

    traits = FamilyTraits(
        classes=("LlavaForConditionalGeneration",),
        title="LLaVA-1.5 (LlavaForConditionalGeneration)",
        stages=("pre_llm", "in_llm", "tower"),
    )
    cls_to_llm = True  # a method may hand the LLM the tower's [CLS] (VisionZip), through this model's projector

    def __init__(self, model: nn.Module) -> None:
        parts = ("vision_tower", "multi_modal_projector", "language_model")
        inner = inner_model(model, parts, "LlavaForConditionalGeneration")
        self.model = model
        self.inner: Any = inner
        self.language_model: nn.Module = inner.language_model
        self.config: Any = model.config

    def tile_tokens(self) -> int:
        """Tokens of one tower image entering the projector: the grid, +1 ([CLS]) under the "full" strategy."""
        vision = self.config.vision_config
        grid = (vision.image_size // vision.patch_size) ** 2
        return grid + (1 if self.config.vision_feature_select_strategy == "full" else 0)

    def tokens_per_image(self) -> int | None:
        return self.tile_tokens()

    def scoring_layer(self) -> Any:
        """The tower layer that produces the feature layer (``vision_feature_layer`` −2: the tower's layer −2, whose
        attention the authors of FasterVLM, VisPruner and VisionZip read); None for the embeddings (layer 0)."""
        layer = self.config.vision_feature_layer
        layers = self.inner.vision_tower.encoder.layers
        if not isinstance(layer, int) or layer == 0:
            return None
        return layers[layer] if layer < 0 else layers[layer - 1]

    # the pre-LLM stage's seams

    def select_hooks(self, stage: PreLLMStage) -> list[Callable[[], None]]:
        method = stage.method
        layer_ok = self.config.vision_feature_select_strategy == "default" and self.scoring_layer() is not None
        if method.needs_cls_attention and not layer_ok:
            raise ValueError(
                f"vlm method {method.name!r} scores by [CLS] attention at one tower layer; this model has "
                f"vision_feature_layer={self.config.vision_feature_layer!r} and vision_feature_select_strategy="
                f"{self.config.vision_feature_select_strategy!r} (expected an int layer and 'default')"
            )
        return ProjectorSelection(self, stage).hooks()

    # where its image tokens lie in the user's picture

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        """Per picture of ``sizes`` (H, W): its tokens' boxes (:func:`llava_boxes`)."""
        return [llava_boxes(image_processor, self.config, size) for size in sizes]


def cls_attention_and_keys(attention: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """The [CLS] attention row and the keys of a CLIP attention layer, from its own q/k projections.

    hidden_states: (I, 1 + N, D) the layer's input after its first LayerNorm ([CLS] first).
    Returns ((I, H, N) softmax row of [CLS] over [CLS] and the N tokens, [CLS]'s own weight left out;
    (I, H, N, hd) the keys of the N tokens).
    """
    images, length, _ = hidden_states.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    query = attention.q_proj(hidden_states[:, :1]).view(images, 1, heads, head_dim).transpose(1, 2)  # (I, H, 1, hd)
    keys = attention.k_proj(hidden_states).view(images, length, heads, head_dim).transpose(1, 2)  # (I, H, 1+N, hd)
    row = torch.softmax((query @ keys.transpose(-1, -2)) * attention.scale, dim=-1)  # (I, H, 1, 1+N)
    return row[:, :, 0, 1:], keys[:, :, 1:]


class ProjectorSelection:
    """The pre-LLM method picks at LLaVA's projector, for every image of one tower run.

    The tower's pre-hook keeps each image's seed (for the seeded method), the scoring layer's pre-hook its input;
    the projector's pre-hook selects (``method.select``) and writes merged features into their slots, or, for a
    method that selects on the projector's output, its forward hook selects.
    """

    def __init__(self, adapter: LlavaAdapter, stage: PreLLMStage) -> None:
        self.adapter, self.stage, self.method = adapter, stage, stage.method
        self.seeds: Tensor | None = None
        self.scoring_input: Tensor | None = None
        self.cls_feature: Tensor | None = None  # (I, D) the feature layer's [CLS] rows of this tower run
        self.features: Tensor | None = None

    def hooks(self) -> list[Callable[[], None]]:
        inner = self.adapter.inner
        handles = [
            inner.multi_modal_projector.register_forward_pre_hook(self.on_projector),
            inner.multi_modal_projector.register_forward_hook(self.after_projector),
        ]
        if self.method.needs_seeds:
            handles.append(inner.vision_tower.register_forward_pre_hook(self.on_tower, with_kwargs=True))
        scoring = self.adapter.scoring_layer()
        if self.method.needs_cls_attention and scoring is not None:
            handles.append(scoring.self_attn.register_forward_pre_hook(self.on_scoring_attention, with_kwargs=True))
        if self.method.uses_cls_token and self.adapter.cls_to_llm and scoring is not None:
            handles.append(scoring.register_forward_hook(self.on_feature_layer))
        return [handle.remove for handle in handles]

    def on_feature_layer(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # (I, 1 + N, D) the feature layer, [CLS] first
        self.cls_feature = hidden[:, 0]

    def on_tower(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pixel_values: Any = kwargs.get("pixel_values", args[0] if args else None)
        self.seeds = torch.tensor([content_seed(image) for image in pixel_values], dtype=torch.long)

    def on_scoring_attention(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.scoring_input = kwargs.get("hidden_states", args[0] if args else None)

    def evidence(self, features: Tensor, projected: Tensor | None = None) -> VisionEvidence:
        cls_attention = keys = None
        if self.method.needs_cls_attention:
            if self.scoring_input is None:
                raise ValueError("vitrim.vlm saw no input of the tower's scoring layer in this forward pass")
            attention = self.adapter.scoring_layer().self_attn
            cls_attention, keys = cls_attention_and_keys(attention, self.scoring_input)
        self.scoring_input = None
        cls_feature, self.cls_feature = self.cls_feature, None
        return VisionEvidence(
            features=features,
            cls_attention=cls_attention,
            keys=keys,
            seeds=self.seeds,
            projected=projected,
            cls_feature=cls_feature,
        )

    def on_projector(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        features = args[0]  # (I, N, D) the tower features of every image of this forward pass
        self.features = features
        if self.method.scores_projected:
            return None  # selected on the projector's output (after_projector)
        evidence = self.evidence(features)
        selections = self.stage.select(evidence, features.shape[1])
        self.stage.selected(selections)
        written = write_merged(features, selections, lambda states: states, evidence.cls_feature)
        return None if written is None else (written, *args[1:])

    def after_projector(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        if self.method.scores_projected and self.features is not None:
            evidence = self.evidence(self.features, projected=output)
            self.stage.selected(self.stage.select(evidence, output.shape[1]))
        self.features = None


def llava_boxes(image_processor: Any, config: Any, size: tuple[int, int]) -> TokenBoxes:
    """LLaVA-1.5's tokens on a picture of ``size`` (H, W): the patch grid of the processed (cropped) frame.

    The processor (``CLIPImageProcessor`` / ``LlavaImageProcessor``): an optional pad to a square (``do_pad``), a
    resize (shortest edge to ``size``, or to ``height × width``), a centre crop to ``crop_size``; the tokens are the
    ``crop / patch`` grid in raster order (with the ``"full"`` feature strategy a first [CLS] token, which has no
    box). Returns T = rows·cols (+1) boxes, view 0 ("image") or NO_VIEW.
    """
    height, width = size
    pad = max(height, width) if getattr(image_processor, "do_pad", False) else None
    pad_h, pad_w = (pad, pad) if pad is not None else (height, width)
    do_resize = getattr(image_processor, "do_resize", True)
    r_h, r_w = resized_size(pad_h, pad_w, image_processor.size) if do_resize else (pad_h, pad_w)
    crop_size = image_processor.crop_size if getattr(image_processor, "do_center_crop", False) else None
    c_h = size_field(crop_size, "height") if crop_size is not None else None
    c_w = size_field(crop_size, "width") if crop_size is not None else None
    p_h, p_w = c_h or r_h, c_w or r_w
    patch = int(config.vision_config.patch_size)
    if p_h % patch or p_w % patch:
        raise ValueError(f"the processed image {p_h}x{p_w} is not a whole number of {patch}-pixel patches")
    y = crop_axis(height, r_h, c_h, pad_h)
    x = crop_axis(width, r_w, c_w, pad_w)
    rows, cols = p_h // patch, p_w // patch
    boxes = grid_boxes(rows, cols, patch, x, y, size)
    view = torch.zeros(len(boxes), dtype=torch.long)
    if getattr(config, "vision_feature_select_strategy", "default") == "full":  # [CLS] first: no place
        boxes = torch.cat([torch.full((1, 4), math.nan, dtype=torch.float64), boxes])
        view = torch.cat([torch.tensor([NO_VIEW]), view])
    view[boxes[:, 0].isnan()] = NO_VIEW
    return TokenBoxes(boxes, view, ("image",), ((rows, cols),), size)
