"""LLaVA-1.5 (transformers' ``LlavaForConditionalGeneration``): where its image tokens are made and enter the LLM.

The model (transformers ≥ 5): ``model.model.vision_tower`` (CLIP) → ``hidden_states[vision_feature_layer]``
([CLS] dropped under the "default" strategy) → ``model.model.multi_modal_projector`` → scattered into the
``input_ids == image_token_id`` positions of the embeddings → ``model.model.language_model``. Each image gives
(image_size / patch_size)² tokens (576 for LLaVA-1.5 at 336 px), +1 under the "full" strategy.

Where it taps (the capture → select → write sequence is :mod:`vitrim.vlm.stages.capture`'s; hooks on this
instance's submodules only):
- the scoring layer's attention (tower layer ``vision_feature_layer``): [CLS]'s attention row and the keys from the
  layer's own q/k projections on its input (:func:`read_cls_attention`);
- that layer's output (for a method with ``uses_cls_token``): its [CLS] row, the [CLS] of the feature layer the
  "default" strategy drops, which the method may hand the LLM (written into a free slot before the projector, so it
  is projected as the authors' VisionZip projects it);
- the projector's input: the features of the images, where the method selects and merged tokens are written; its
  output for methods that select on it;
- everything else (the prefill, the shortened LLM input, decoding, beams) is the pre-LLM stage's
  (:mod:`vitrim.vlm.stages.pre_llm`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.boxes import NO_VIEW, TokenBoxes, crop_axis, grid_boxes, resized_size, size_field
from vitrim.vlm.evidence.attention import cls_attention_and_keys
from vitrim.vlm.method.base import ImageSelection
from vitrim.vlm.stages.capture import EncoderSeam, HandOn, Reader, Taps
from vitrim.vlm.stages.contract import FamilyAdapter, FamilyTraits, ServedArchitecture


class LlavaAdapter(FamilyAdapter):
    """The seams of one ``LlavaForConditionalGeneration`` instance (see the module docstring)."""

    traits = FamilyTraits(
        classes=("LlavaForConditionalGeneration",),
        title="LLaVA-1.5 (LlavaForConditionalGeneration)",
        stages=("pre_llm", "in_llm", "tower"),
        served=(
            ServedArchitecture(
                "VitrimLlavaForConditionalGeneration", "vitrim.vllm.llava", "LlavaForConditionalGeneration", "llava"
            ),
        ),
    )
    cls_to_llm = True  # a method may hand the LLM the tower's [CLS] (VisionZip), through this model's projector

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

    def select_hooks(self, stage: EncoderSeam) -> list[Callable[[], None]]:
        method = stage.method
        layer_ok = self.config.vision_feature_select_strategy == "default" and self.scoring_layer() is not None
        if method.needs_cls_attention and not layer_ok:
            raise ValueError(
                f"vlm method {method.name!r} scores by [CLS] attention at one tower layer; this model has "
                f"vision_feature_layer={self.config.vision_feature_layer!r} and vision_feature_select_strategy="
                f"{self.config.vision_feature_select_strategy!r} (expected an int layer and 'default')"
            )
        return ProjectorSelection(self, stage, hand_on=self.hand_on_for(stage)).hooks()

    def hand_on_for(self, stage: EncoderSeam) -> HandOn:
        """What selects at the projector: the stage's own :class:`HandOn` (LLaVA-NeXT's unpadded tiles: its own)."""
        return stage.hand_on

    # where its image tokens lie in the user's picture

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        """Per picture of ``sizes`` (H, W): its tokens' boxes (:func:`llava_boxes`)."""
        return [llava_boxes(image_processor, self.config, size) for size in sizes]


def read_cls_attention(
    attention: Any, args: tuple[Any, ...], kwargs: dict[str, Any], key: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """A transformers CLIP attention's [CLS] row (I, H, N) and keys (I, H, N, hd), from its own ``q_proj`` and
    ``k_proj`` on its input ``hidden_states`` (I, 1 + N, D) (after the layer's first LayerNorm, [CLS] first); ``key``
    (I, 1 + N, H·hd): the layer's own ``k_proj`` output where the tap kept it (:class:`ScoringTap`), else computed
    here. [CLS]'s query is computed on its row alone, as before (one row: a product on the whole input may round
    that row's last bits differently)."""
    hidden: Tensor = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    images, length, _ = hidden.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    query = attention.q_proj(hidden[:, :1]).view(images, 1, heads, head_dim).transpose(1, 2)  # (I, H, 1, hd)
    key = attention.k_proj(hidden) if key is None else key
    keys = key.view(images, length, heads, head_dim).transpose(1, 2)  # (I, H, 1+N, hd)
    return cls_attention_and_keys(query, keys, attention.scale)


class ProjectorSelection:
    """Where LLaVA hands on its tokens: the projector's input (select, write merged) or, for a method that scores
    the projector's output, its output; the taps of :class:`~vitrim.vlm.stages.capture.Taps` on the tower."""

    def __init__(
        self,
        adapter: LlavaAdapter,
        stage: EncoderSeam,
        reader: Reader = read_cls_attention,
        projections: tuple[str, ...] = ("k_proj",),
        hand_on: HandOn | None = None,
    ) -> None:
        """``reader``: the scoring layer's evidence from its input (CLIP's [CLS] row; a tower without [CLS] gives
        the attention each token receives), given the outputs of the layer's own ``projections`` (names of its
        attention's submodules, in the reader's order: :class:`~vitrim.vlm.stages.capture.ScoringTap`); ``hand_on``:
        what selects and writes (None: the stage's own)."""
        self.adapter, self.stage = adapter, stage
        self.hand_on = stage.hand_on if hand_on is None else hand_on
        scoring = adapter.scoring_layer()
        self.taps = Taps(
            stage.method,
            tower=adapter.inner.vision_tower,
            scoring=None
            if scoring is None
            else (scoring.self_attn, reader, *(getattr(scoring.self_attn, name) for name in projections)),
            cls_layer=scoring if adapter.cls_to_llm else None,
        )
        self.features: Tensor | None = None
        stage.taps.append(self.taps)

    def hooks(self) -> list[Callable[[], None]]:
        projector = self.adapter.inner.multi_modal_projector
        handles = [
            projector.register_forward_pre_hook(self.on_projector),
            projector.register_forward_hook(self.after_projector),
        ]
        return [handle.remove for handle in handles] + [self.taps.remove]

    def captured(self) -> dict[str, Any]:
        """What the taps saw in this tower run, as :meth:`HandOn.run`'s keyword arguments."""
        attention = self.taps.take_attention()
        cls_attention, keys = (None, None) if attention is None else attention
        return {
            "attention": cls_attention,
            "keys": keys,
            "seeds": self.taps.seeds,
            "cls_feature": self.taps.take_cls_row(),
        }

    def report(self, selections: list[ImageSelection]) -> None:
        """Hand the pre-LLM stage the selections of this tower run's images."""
        self.stage.selected(selections)

    def on_projector(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        features = args[0]  # (I, N, D) the tower features of every image of this forward pass
        self.features = features
        if self.stage.method.scores_projected:
            return None  # selected on the projector's output (after_projector)
        selections, written = self.hand_on.run(
            features, values=features, project=lambda states: states, **self.captured()
        )
        self.report(selections)
        return None if written is None else (written, *args[1:])

    def after_projector(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        if self.stage.method.scores_projected and self.features is not None:
            selections, _ = self.hand_on.run(self.features, projected=output, **self.captured())
            self.report(selections)
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
