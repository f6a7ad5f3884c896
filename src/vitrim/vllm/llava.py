"""LLaVA-1.5 in vLLM with a vitrim.vlm pre-LLM method: ``VitrimLlavaForConditionalGeneration``.

A subclass of vLLM's ``LlavaForConditionalGeneration`` that changes two things, at the seams vLLM gives a model:

- **How many placeholders an image gets** (the processor's prompt updates): ``keep`` instead of the grid's N,
  decided from the options alone (vLLM lays out the prompt before the tower runs): the engine's, or the request's own
  (``mm_processor_kwargs={"vitrim": {"keep": …}}``, :mod:`vitrim.vllm.request_keep`), which then travels to the
  tower beside the image's pixels;
- **Which features fill them** (``embed_multimodal``): the tower runs as vLLM's does, and vitrim.vlm's one encoder
  seam (:mod:`vitrim.vlm.stages.capture`) taps its scoring layer (:func:`read_cls_attention`: vLLM's fused ``qkv``),
  selects, and writes merged features and VisionZip's [CLS] into their slots before the projector, as on
  transformers; each image hands the LLM its ``keep`` projected tokens in the authors' order
  (``ImageSelection.llm_slots``: VisionZip's [CLS], dominant, contextual; raster order for the others). A method
  that reads the prompt (CDPruner) selects each image on the text its processor handed beside the pixels
  (:mod:`vitrim.vllm.prompt_instruction`).

Positions: vLLM numbers the shortened prompt 0, 1, 2, … (the kept image tokens and the text after them take
consecutive positions), as the authors' LLaVA code does when it drops tokens and as vitrim.vlm does by default
(``positions="authors"``); ``positions="original"`` (each kept token at its unpruned position) cannot be served here
and is refused when the engine starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.model_executor.models.llava import (
    LlavaDummyInputsBuilder,
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.parse import ImageProcessorItems
from vllm.multimodal.processing import PromptReplacement

from vitrim.reduce import Reducer
from vitrim.vllm.compat import check_vllm_version
from vitrim.vllm.options import TrimOptions, own_count, request_options, sets_own_count, trim_options
from vitrim.vllm.prompt_instruction import PromptInstruction, image_prompts, load_clip, select_with_prompts
from vitrim.vllm.request_keep import BuiltMethods, RequestKeep, asked_keeps, item_methods, keep_field, select_items
from vitrim.vllm.selection_record import SelectionRecord, recording
from vitrim.vllm.tensor_parallel import all_heads
from vitrim.vllm.tower_stage import clip_layout, install_tower, kept_in_raster_order, tower_reducers
from vitrim.vlm.evidence.attention import cls_attention_and_keys
from vitrim.vlm.evidence.seeds import image_seeds
from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.base import Selector, VisionEvidence
from vitrim.vlm.method.tower_reducers import TowerMethod
from vitrim.vlm.stages.capture import HandOn, Taps, select_keeping_each

ARCHITECTURE = "VitrimLlavaForConditionalGeneration"


def scoring_layer_index(feature_layer: int, num_layers: int) -> int:
    """The index of the tower layer whose output is hidden state ``feature_layer`` (−2: layer ``num_layers`` − 2).

    The same index in vLLM's tower, which builds only the layers up to the feature layer. ``ValueError`` for the
    embeddings (layer 0), which no attention produces."""
    index = feature_layer + num_layers if feature_layer < 0 else feature_layer - 1
    if not 0 <= index < num_layers:
        raise ValueError(
            f"vitrim: the [CLS]-attention methods read the layer that produces vision_feature_layer; "
            f"vision_feature_layer={feature_layer} of a {num_layers}-layer tower has none"
        )
    return index


def read_cls_attention(attention: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """A vLLM ``CLIPAttention``'s [CLS] row (I, H, N) and keys (I, H, N, hd) on its input (I, 1 + N, D): the q and
    k thirds of its fused ``qkv_proj``, computed for this tensor-parallel rank's heads and gathered over all ranks."""
    hidden: Tensor = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    images, length, _ = hidden.shape
    heads, head_dim = int(attention.num_heads_per_partition), int(attention.head_dim)
    query = attention.qkv_proj(hidden[:, :1])[0].chunk(3, dim=-1)[0]  # (I, 1, H·hd)
    keys = attention.qkv_proj(hidden)[0].chunk(3, dim=-1)[1]  # (I, 1 + N, H·hd)
    query = query.view(images, 1, heads, head_dim).transpose(1, 2)
    keys = keys.view(images, length, heads, head_dim).transpose(1, 2)
    attention_row, keys = cls_attention_and_keys(query, keys, float(attention.scale))
    return all_heads(attention_row, dim=1), all_heads(keys, dim=1)


def clip_taps(vision_tower: Any, hf_config: Any, method: Selector, *, cls_row: bool) -> Taps | None:
    """The taps a LLaVA class puts on vLLM's CLIP ``vision_tower`` for ``method``: the scoring layer's [CLS]
    attention (:func:`read_cls_attention`) and, where the class hands a [CLS] to the LLM (``cls_row``), that layer's
    [CLS] row; None when the method reads neither. They run on every image: a request may ask for fewer tokens than
    the engine's keep. Under tensor parallelism each rank gathers every rank's heads (:func:`read_cls_attention`)."""
    if not (method.needs_cls_attention or (cls_row and method.uses_cls_token)):
        return None
    index = scoring_layer_index(hf_config.vision_feature_layer, hf_config.vision_config.num_hidden_layers)
    layer = vision_tower.vision_model.encoder.layers[index]
    return Taps(method, scoring=(layer.self_attn, read_cls_attention), cls_layer=layer if cls_row else None)


def llava_trim_options(hf_config: Any, architecture: str = ARCHITECTURE) -> TrimOptions:
    """The validated ``vitrim`` options of a LLaVA-1.5 config (a CLIP tower, one feature layer, [CLS] dropped), or
    of another ``architecture`` whose tiles are LLaVA-1.5 images (LLaVA-NeXT's: ``keep`` counts a tile's tokens)."""
    check_vllm_version()
    options = trim_options(hf_config, architecture)
    vision = hf_config.vision_config
    strategy, layer = hf_config.vision_feature_select_strategy, hf_config.vision_feature_layer
    if vision.model_type != "clip_vision_model" or strategy != "default" or not isinstance(layer, int):
        raise ValueError(
            f"vitrim: {architecture} runs a CLIP tower, an int vision_feature_layer, strategy 'default'; "
            f"this checkpoint has a {vision.model_type!r} tower, vision_feature_layer={layer!r}, "
            f"vision_feature_select_strategy={strategy!r}"
        )
    grid = (vision.image_size // vision.patch_size) ** 2
    if isinstance(options.method, TowerMethod):  # its reducers, built here: a bad option stops the engine start
        if not sets_own_count(options.method):
            llava_tower_reducers(hf_config, options.method, options.tokens(grid))
            return options
        # PiToMe, PPT: keep is the count their options leave at the feature layer, whatever the image
        reducers = llava_tower_reducers(hf_config, options.method, None)
        return replace(options, keep=KeepSpec(count=own_count(options.method, clip_layout(hf_config), reducers)))
    if not options.method.authors_layout():
        raise ValueError(
            "vitrim: positions='original' keeps each kept token at its unpruned position; vLLM numbers a shortened "
            "LLaVA prompt 0, 1, 2, … (the authors' convention, vitrim.vlm's default positions='authors')"
        )
    options.tokens(grid)  # keep above the grid fails here, when the engine starts
    if options.method.needs_cls_attention:
        scoring_layer_index(layer, vision.num_hidden_layers)
    options.method.check_keep(options.tokens(grid))
    return options


def llava_tower_reducers(hf_config: Any, method: TowerMethod, keep: int | None) -> dict[int, Reducer]:
    """A tower method's reducers on LLaVA-1.5's CLIP (:mod:`vitrim.vllm.tower_stage`) for ``keep`` patches at the
    feature layer (None: a method that sets its own count), the kept tokens handed on alone (``to_grid=False``); a
    bad option is one ``vitrim:`` line."""
    why = "vLLM serves a tower method on LLaVA-1.5 with the kept tokens alone (to_grid=False)"
    return tower_reducers(clip_layout(hf_config), method, keep, to_grid=False, why=why)


def image_tokens(hf_config: Any) -> int:
    """N, the image tokens of a LLaVA-1.5 image (every image is resized to the tower's size)."""
    vision = hf_config.vision_config
    return int((vision.image_size // vision.patch_size) ** 2)


def trimmed_llava_info(ctx: Any) -> LlavaProcessingInfo:
    """vLLM's processing info, the options checked first (the front end builds it when the engine starts): on the
    untyped config, so another family's checkpoint gets vitrim's line (naming its model_type) before vLLM's typed
    getter refuses it with a ``TypeError``. Its ``get_num_image_tokens`` stays the grid's N, the most a request can
    ask for, which vLLM's profiling and encoder budget read."""
    llava_trim_options(ctx.get_hf_config())
    return LlavaProcessingInfo(ctx)


class LlavaPlaceholders(RequestKeep):
    """The processor seams of both LLaVA classes, mixed in before vLLM's processor: each request's options (the
    engine's of ``architecture``, with the request's ``keep``), that ``keep`` handed to the model beside each image's
    pixels (:mod:`vitrim.vllm.request_keep`; LLaVA-NeXT: per tile), and :meth:`image_placeholders` per image."""

    architecture: ClassVar[str] = ARCHITECTURE
    info: Any

    def request_trim(self, hf_kwargs: Mapping[str, object]) -> TrimOptions:
        return request_options(llava_trim_options(self.info.get_hf_config(), self.architecture), hf_kwargs)

    def kept_per_item(self, processed: Mapping[str, Any], options: TrimOptions) -> dict[str, Tensor]:
        pixels = processed.get("pixel_values")
        if pixels is None:
            return {}
        keep = options.tokens(image_tokens(self.info.get_hf_config()))
        return {keep_field("image"): torch.full((len(pixels),), keep, dtype=torch.long)}

    def image_placeholders(
        self, hf_config: Any, images: ImageProcessorItems, item: int, keep: int, options: TrimOptions
    ) -> int:
        """The placeholders of image ``item`` at ``keep`` (resolved against a tower image), its request's
        ``options`` (LLaVA-1.5: ``keep``, every image is one tower image)."""
        return keep

    def _get_prompt_updates(
        self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
    ) -> Sequence[PromptReplacement]:
        config = self.info.get_hf_config()
        image_token_id = config.image_token_index
        options = self.request_trim(hf_processor_mm_kwargs)
        keep = options.tokens(image_tokens(config))

        def replacement(item: int) -> list[int]:
            images = mm_items.get_items("image", object)
            if not isinstance(images, ImageProcessorItems):
                raise ValueError(
                    f"vitrim: {self.architecture} selects from the tower's evidence; send images, not embeddings"
                )
            return [image_token_id] * self.image_placeholders(config, images, item, keep, options)

        return [PromptReplacement(modality="image", target=[image_token_id], replacement=replacement)]


class TrimmedLlavaProcessor(PromptInstruction, LlavaPlaceholders, LlavaMultiModalProcessor):
    """vLLM's LLaVA processor with each request's ``keep`` placeholders per image (:class:`LlavaPlaceholders`) and,
    for a method that reads the prompt, each image's text (:class:`~vitrim.vllm.prompt_instruction.PromptInstruction`:
    the ``<image>`` token is the image in the prompt, and the only image token)."""

    def instruction_tokens(self) -> tuple[int, frozenset[int]]:
        image = int(self.info.get_hf_config().image_token_index)
        return image, frozenset({image})


@MULTIMODAL_REGISTRY.register_processor(
    TrimmedLlavaProcessor, info=trimmed_llava_info, dummy_inputs=LlavaDummyInputsBuilder
)
class VitrimLlavaForConditionalGeneration(LlavaForConditionalGeneration):
    """vLLM's LLaVA-1.5 whose images hand the LLM the ``keep`` tokens a vitrim.vlm method selects."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        options = llava_trim_options(config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vitrim_grid = image_tokens(config)
        self.vitrim_options = options
        self.vitrim_keep = options.tokens(self.vitrim_grid)
        self.vitrim_record = SelectionRecord()
        self.vitrim_methods: BuiltMethods = {}  # the requests' own option sets' methods (request_keep)
        method = options.method
        # a tower method: vitrim.vlm's tower stage on vLLM's CLIP layers (vitrim.vllm.tower_stage); else the taps
        self.vitrim_tower = None
        if isinstance(method, TowerMethod):
            layers = self.vision_tower.vision_model.encoder.layers
            keep = None if sets_own_count(method) else self.vitrim_keep  # PiToMe, PPT: built from their options
            reducers = llava_tower_reducers(config, method, keep)
            self.vitrim_tower = install_tower(layers, clip_layout(config), reducers, siglip=False)
        self.vitrim_taps = None if self.vitrim_tower else clip_taps(self.vision_tower, config, method, cls_row=True)
        device = next(self.multi_modal_projector.parameters()).device
        load_clip(method, int(config.vision_config.hidden_size), device)  # relevance="clip": its CLIP

    def embed_multimodal(self, **kwargs: object) -> Any:
        image_input = self._parse_and_validate_image_input(**kwargs)
        if image_input is None:
            return []
        if image_input["type"] != "pixel_values":
            raise ValueError("vitrim: trimmed LLaVA selects from the tower's evidence; send images, not image_embeds")
        pixels: Tensor = image_input["pixel_values"]  # (I, 3, H, W)
        features = self._image_pixels_to_features(self.vision_tower, pixels)  # (I, N, D); tower method: (I, keep, D)
        assert isinstance(features, Tensor)
        if self.vitrim_tower is not None:  # the tower reduced: its keep tokens, in raster order, to the projector
            tokens, kept = kept_in_raster_order(self.vitrim_tower, features, self.vitrim_keep)
            self.vitrim_record.add_all(image_seeds(pixels) if recording() else None, kept)
            return tuple(self.multi_modal_projector(tokens).unbind(0))
        method = self.vitrim_options.method
        # each image's content seed: read by a seeded method, and the key of the test's record (selection_record)
        seeds = image_seeds(pixels) if method.needs_seeds or recording() else None  # (I,)
        record = seeds if recording() else None
        keeps = asked_keeps(kwargs, "image") or [self.vitrim_keep] * len(pixels)  # each image's request's keep
        # each image's request's method: the engine's, with the request's own options (same class: same taps)
        methods = item_methods(kwargs, "image", method, self.vitrim_methods) or [method] * len(pixels)
        taps = self.vitrim_taps
        attention = None if taps is None else taps.take_attention()
        cls_row = None if taps is None else taps.take_cls_row()
        if all(keep == features.shape[1] for keep in keeps):  # every token stays: the model runs as vLLM's
            self.vitrim_record.add_all(record, [torch.arange(features.shape[1])] * len(pixels))
            return tuple(self.multi_modal_projector(features).unbind(0))
        cls_attention, keys = (None, None) if attention is None else attention
        projected = self.multi_modal_projector(features) if method.scores_projected else None
        prompts = image_prompts(kwargs, method, len(pixels))  # what each image answers to (CDPruner)
        if prompts is None:

            def each(chosen: Selector, part: VisionEvidence, part_keeps: list[int], items: list[int]) -> Any:
                return select_keeping_each(chosen, part, part_keeps)

            hand_on = HandOn(method, lambda evidence, count: select_items(methods, evidence, keeps, each))
        else:
            embed = self.get_language_model().embed_input_ids
            hand_on = HandOn(
                method, lambda evidence, count: select_with_prompts(methods, evidence, keeps, prompts, embed)
            )
        selections, written = hand_on.run(
            features,
            values=features if projected is None else None,
            project=lambda states: states,
            attention=cls_attention,
            keys=keys,
            seeds=seeds,
            projected=projected,
            cls_feature=cls_row,
        )
        if projected is None:
            projected = self.multi_modal_projector(features if written is None else written)  # (I, N, E)
        self.vitrim_record.add_all(record, [selection.kept for selection in selections])
        # vLLM numbers the prompt contiguously: the authors' sequence, each image's tokens in their order
        return tuple(projected[image, selection.llm_slots()] for image, selection in enumerate(selections))
