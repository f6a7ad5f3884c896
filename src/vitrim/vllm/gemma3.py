"""Gemma 3 in vLLM with a vitrim.vlm pre-LLM method: ``VitrimGemma3ForConditionalGeneration``.

A subclass of vLLM's ``Gemma3ForConditionalGeneration`` (images only, as vLLM's):

- **Placeholders** (the processor's prompt updates): vLLM's Gemma 3 replaces each ``<start_of_image>`` with
  ``\\n\\n<start_of_image>`` + N ``<image_soft_token>`` + ``<end_of_image>\\n\\n`` (N = ``mm_tokens_per_image``, the
  pooled grid: 256 on the checkpoints); here the soft tokens are the ``keep`` of the engine or the request
  (:mod:`vitrim.vllm.request_keep`), the begin and end tokens and newlines as they are. Pan-and-scan (crops, each
  an image of its own with a text around it) is refused in one line: vitrim.vlm maps no crop back to the picture;
- **Features** (``embed_multimodal``): vLLM's SigLIP tower runs, its last layer's queries and keys are tapped from
  its fused ``qkv_proj`` (:func:`read_received_attention`, the evidence maths of
  :func:`vitrim.vlm.families.gemma3.pooled_received`), and vitrim.vlm's encoder seam
  (:mod:`vitrim.vlm.stages.capture`) selects among the projector's pooled tokens and writes merged ones through the
  projector's norm and matmul, as on transformers. Each image hands the LLM its kept tokens in raster order;
- **Positions and attention**: as vitrim.vlm on transformers, every kept token keeps its ORIGINAL position and the
  text after an image continues where it would after all N (:mod:`vitrim.vllm.gemma3_positions`, through vLLM's
  M-RoPE machinery, which the class declares: :func:`vitrim.vllm.compat.declare_gemma3_mrope`), and the LLM attends
  by transformers' rule on those positions: an image's kept tokens see each other both ways, the sliding window
  counts original distance (:mod:`vitrim.vllm.gemma3_attention`; vLLM's CPU kernel alone is causal).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.model_executor.models.gemma3_mm import (
    Gemma3DummyInputsBuilder,
    Gemma3ForConditionalGeneration,
    Gemma3MultiModalProcessor,
    Gemma3ProcessingInfo,
)
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModalPruning
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptReplacement, PromptUpdateDetails
from vllm.platforms import current_platform
from vllm.transformers_utils.processor import cached_image_processor_from_config

from vitrim.reduce import Reducer
from vitrim.vllm.compat import check_vllm_version, declare_image_pruning
from vitrim.vllm.gemma3_attention import OriginalMaskAttention, StepPositions
from vitrim.vllm.gemma3_positions import blocks_of, place_kept, prompt_positions
from vitrim.vllm.options import TrimOptions, request_options, trim_options
from vitrim.vllm.pipeline_positions import PositionsAcrossStages, carry_positions
from vitrim.vllm.request_keep import BuiltMethods, RequestKeep, asked_keeps, item_methods, keep_field, select_items
from vitrim.vllm.selection_record import SelectionRecord
from vitrim.vllm.tensor_parallel import all_heads
from vitrim.vllm.tower_stage import install_tower, on_grid, siglip_layout, tower_reducers
from vitrim.vlm.evidence.seeds import image_seeds
from vitrim.vlm.families.gemma3 import pooled_received, projector_pool
from vitrim.vlm.method.base import Selector, VisionEvidence
from vitrim.vlm.method.tower_reducers import TowerMethod
from vitrim.vlm.stages.capture import HandOn, Taps, select_keeping_each
from vitrim.vlm.stages.tower import TowerReduction

ARCHITECTURE = "VitrimGemma3ForConditionalGeneration"
PAN_AND_SCAN = (
    "vitrim: trimmed Gemma 3 serves images without pan-and-scan (do_pan_and_scan=False, the checkpoints' default): "
    "its crops are images of their own, which vitrim.vlm does not map back to the picture"
)


def gemma3_trim_options(hf_config: Any) -> TrimOptions:
    """The validated ``vitrim`` options of a Gemma 3 config (``keep`` checked against its pooled tokens; a tower
    method's against the tower's patches, its reducers built)."""
    check_vllm_version()
    options = trim_options(hf_config, ARCHITECTURE)
    if isinstance(options.method, TowerMethod):
        gemma3_tower_reducers(hf_config, options)
        return options
    options.method.check_keep(options.tokens(int(hf_config.mm_tokens_per_image)))
    return options


def gemma3_tower_reducers(hf_config: Any, options: TrimOptions) -> dict[int, Reducer]:
    """A tower method's reducers on Gemma 3's SigLIP (:mod:`vitrim.vllm.tower_stage`): ``keep`` counts the tower's
    patches (PiToMe, PPT: none, their options set their count), and the tokens go back on the patch grid for the
    projector's pooling, so the prompt is vLLM's own whatever the count; a bad option is one line."""
    assert isinstance(options.method, TowerMethod)
    layout = siglip_layout(hf_config)
    why = "Gemma 3's projector average-pools the whole patch grid, so the tower's tokens go back on it"
    keep = None if options.keep is None else options.tokens(layout.patches)  # None: PiToMe, PPT (their options)
    return tower_reducers(layout, options.method, keep, to_grid=True, why=why)


def soft_tokens(options: TrimOptions, hf_config: Any) -> int:
    """The soft tokens an image hands the LLM: ``keep`` of the N pooled tokens; all N under a tower method (it
    reduces inside the tower, and the projector pools the refilled grid to N)."""
    tokens = int(hf_config.mm_tokens_per_image)
    return tokens if isinstance(options.method, TowerMethod) else options.tokens(tokens)


def pan_and_scan_on(info: Gemma3ProcessingInfo, mm_kwargs: Mapping[str, object]) -> bool:
    """Whether Gemma 3's processor cuts images into crops under ``mm_kwargs`` (the engine's and the request's
    processor options over the checkpoint's image processor), as vLLM's processing info reads it."""
    processor = info.get_hf_processor()
    asked = {**info.ctx.get_merged_mm_kwargs({}), **mm_kwargs}
    return bool(asked.get("do_pan_and_scan", processor.image_processor.do_pan_and_scan))


def refuse_unserved(model_config: Any) -> None:
    """What trimmed Gemma 3 cannot serve in this release, refused in one line when the engine starts: a platform
    other than vLLM's CPU (the attention rule keeps its copy of the KV cache in the CPU runner's slots:
    :mod:`vitrim.vllm.gemma3_attention`), and a compiled LLM (the rule runs in Python around vLLM's kernel)."""
    if not current_platform.is_cpu():
        raise ValueError(
            "vitrim: trimmed Gemma 3 is served on vLLM's CPU backend in this release (its image-block and "
            "sliding-window rule runs beside the CPU attention: vitrim.vllm.gemma3_attention)"
        )
    if not model_config.enforce_eager:
        raise ValueError(
            "vitrim: trimmed Gemma 3 applies its LLM's attention rule in Python around vLLM's kernel; start the "
            "engine with --enforce-eager"
        )


def trimmed_gemma3_info(ctx: Any) -> Gemma3ProcessingInfo:
    """vLLM's processing info, the options checked first on the untyped config (another family's checkpoint gets
    vitrim's line naming its model_type), then what this release does not serve and pan-and-scan. vLLM's config
    reads a ``ValueError`` here as "no multimodal processor" and goes on text-only, so the class checks the same
    again when it loads, where the line stops the engine."""
    gemma3_trim_options(ctx.get_hf_config())
    refuse_unserved(ctx.model_config)
    info = Gemma3ProcessingInfo(ctx)
    if pan_and_scan_on(info, {}):
        raise ValueError(PAN_AND_SCAN)
    return info


class TrimmedGemma3Processor(RequestKeep, Gemma3MultiModalProcessor):
    """vLLM's Gemma 3 processor with each request's ``keep`` soft tokens per image (:mod:`vitrim.vllm.request_keep`)."""

    def request_trim(self, hf_kwargs: Mapping[str, object]) -> TrimOptions:
        if pan_and_scan_on(self.info, hf_kwargs):
            raise ValueError(PAN_AND_SCAN)
        return request_options(gemma3_trim_options(self.info.get_hf_config()), hf_kwargs)

    def kept_per_item(self, processed: Mapping[str, Any], options: TrimOptions) -> dict[str, Tensor]:
        crops = processed.get("num_patches")
        if crops is None:
            return {}
        keep = soft_tokens(options, self.info.get_hf_config())
        return {keep_field("image"): torch.full((len(crops),), keep, dtype=torch.long)}

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Sequence[Any]:
        config = self.info.get_hf_config()
        image_token = int(config.image_token_index)
        tokens = int(config.mm_tokens_per_image)
        keep = soft_tokens(self.request_trim(hf_processor_mm_kwargs), config)
        plain = {key: value for key, value in hf_processor_mm_kwargs.items() if key != "vitrim"}
        (update,) = super()._get_prompt_updates(mm_items, plain, out_mm_kwargs)

        def replacement(item: int) -> PromptUpdateDetails:
            full = update.replacement(item).full  # newlines, begin, N soft tokens, end, newlines
            first = full.index(image_token)
            shortened = full[: first + keep] + full[first + tokens :]
            return PromptUpdateDetails.select_token_id(shortened, image_token)

        return [PromptReplacement(modality="image", target=update.target, replacement=replacement)]


def read_received_attention(kernel: int, attention: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A vLLM ``SiglipAttention``'s evidence per pooled token (I, H, N) and its mean keys (I, H, N, hd), from the q
    and k thirds of its fused ``qkv_proj`` on its input (I, P, D): computed for this tensor-parallel rank's heads
    and gathered over all ranks (:func:`~vitrim.vllm.tensor_parallel.all_heads`)."""
    hidden: Tensor = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    query, key, _ = attention.qkv_proj(hidden)[0].chunk(3, dim=-1)  # (I, P, h·hd) each, this rank's h heads
    heads = int(attention.num_heads_per_partition)
    received, keys = pooled_received(query, key, heads, float(attention.scale), kernel)  # (I, h, N), (I, h, N, hd)
    return all_heads(received, dim=1), all_heads(keys, dim=1)


@MULTIMODAL_REGISTRY.register_processor(
    TrimmedGemma3Processor, info=trimmed_gemma3_info, dummy_inputs=Gemma3DummyInputsBuilder
)
class VitrimGemma3ForConditionalGeneration(
    PositionsAcrossStages, Gemma3ForConditionalGeneration, SupportsMRoPE, SupportsMultiModalPruning
):
    """vLLM's Gemma 3 whose images hand the LLM the ``keep`` tokens a vitrim.vlm method selects, at their original
    positions, attended as transformers does (module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        options = gemma3_trim_options(config)
        refuse_unserved(vllm_config.model_config)
        if cached_image_processor_from_config(vllm_config.model_config).do_pan_and_scan:  # the engine's, the folder's
            raise ValueError(PAN_AND_SCAN)
        declare_image_pruning(vllm_config.model_config.multimodal_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vitrim_tokens = int(config.mm_tokens_per_image)
        self.vitrim_record = SelectionRecord()
        self.vitrim_methods: BuiltMethods = {}  # the requests' own option sets' methods (request_keep)
        self.vitrim_taps: Taps | None = None
        self.vitrim_tower: TowerReduction | None = None
        self.use_trim(options)
        self.vitrim_step = StepPositions()
        carry_positions(self, vllm_config.model_config.mrope_num_dims)
        text, llm = config.text_config, self.language_model.model
        self.vitrim_attention = [  # this pipeline stage's layers (the others are vLLM's PPMissingLayer here)
            OriginalMaskAttention(
                layer.self_attn.attn, text.sliding_window if layer.self_attn.is_sliding else None, self.vitrim_step
            )
            for layer in llm.layers[llm.start_layer : llm.end_layer]
        ]

    def use_trim(self, options: TrimOptions) -> None:
        """Select by ``options`` from now on: the engine's (``__init__``), or another method at the engine's keep
        (tests switch methods on one engine; the front end counts placeholders by the engine's keep)."""
        if self.vitrim_taps is not None:
            self.vitrim_taps.remove()
        if self.vitrim_tower is not None:
            self.vitrim_tower.remove()
        self.vitrim_taps, self.vitrim_tower = None, None
        self.vitrim_options = options
        self.vitrim_keep = soft_tokens(options, self.config)
        if isinstance(options.method, TowerMethod):  # vitrim.vlm's tower stage on vLLM's SigLIP layers
            layers = self.vision_tower.vision_model.encoder.layers
            reducers = gemma3_tower_reducers(self.config, options)
            self.vitrim_tower = install_tower(layers, siglip_layout(self.config), reducers, siglip=True)
            return
        kernel = int(self.multi_modal_projector.kernel_size)
        last = self.vision_tower.vision_model.encoder.layers[-1]
        self.vitrim_taps = Taps(
            options.method, scoring=(last.self_attn, lambda a, args, kw: read_received_attention(kernel, a, args, kw))
        )

    def embed_multimodal(self, **kwargs: object) -> Any:
        image_input = self._parse_and_validate_image_input(**kwargs)
        if image_input is None:
            return []
        pixels: Tensor = image_input["pixel_values"]  # (I, 3, H, W): one crop per image (no pan-and-scan)
        features = self._image_pixels_to_features(self.vision_tower, pixels)  # (I, P, C); tower method: (I, n, C)
        seeds = image_seeds(pixels)  # (I,)
        if self.vitrim_tower is not None:  # the tower reduced: its tokens back on the grid, every pooled token on
            grid, kept = on_grid(self.vitrim_tower, features)  # (I, P, C)
            self.vitrim_record.add_all(seeds, kept)
            projected = self.multi_modal_projector(grid)  # (I, N, E)
            raster = torch.arange(projected.shape[1], dtype=projected.dtype)[:, None]  # each at its own position
            return tuple(torch.cat([image, raster], dim=1) for image in projected)
        projected = self.multi_modal_projector(features)  # (I, N, E)
        keeps = asked_keeps(kwargs, "image") or [self.vitrim_keep] * len(pixels)  # each image's request's keep
        assert self.vitrim_taps is not None
        attention = self.vitrim_taps.take_attention()
        method = self.vitrim_options.method
        projector = self.multi_modal_projector

        def project(states: Tensor) -> Tensor:  # (k, C) merged pooled states -> (k, E), the projector's own path
            return projector.mm_soft_emb_norm(states.to(features.dtype)) @ projector.mm_input_projection_weight

        received, keys = (None, None) if attention is None else attention
        # each image's request's method: the engine's, with the request's own options (same class: same taps)
        methods = item_methods(kwargs, "image", method, self.vitrim_methods) or [method] * len(pixels)

        def each(chosen: Selector, part: VisionEvidence, part_keeps: list[int], items: list[int]) -> Any:
            return select_keeping_each(chosen, part, part_keeps)

        hand_on = HandOn(method, lambda evidence, count: select_items(methods, evidence, keeps, each))
        selections, written = hand_on.run(
            projector_pool(projector, features),  # (I, N, C) what the projector's norm reads
            values=projected,
            project=project,
            attention=received,
            keys=keys,
            seeds=seeds,
            projected=projected,
        )
        tokens = projected if written is None else written
        out = []
        for image, (seed, selection) in enumerate(zip(seeds.tolist(), selections, strict=True)):
            self.vitrim_record.add(seed, selection.kept)
            slots = selection.slots()  # (k,) raster order: the kept tokens at their original positions
            raster = slots.to(tokens.dtype)[:, None]  # the last column: where place_kept puts each one
            out.append(torch.cat([tokens[image, slots], raster], dim=1))  # (k, E + 1)
        return tuple(out)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[Tensor, int]:
        return prompt_positions(input_tokens, int(self.config.image_token_index), self.vitrim_tokens)

    def recompute_mrope_positions(
        self,
        input_ids: Any,
        multimodal_embeddings: Sequence[Tensor],
        mrope_positions: torch.LongTensor,
        num_computed_tokens: int,
    ) -> tuple[Sequence[Tensor], Tensor, int]:
        stripped, positions = place_kept(multimodal_embeddings, mrope_positions, num_computed_tokens)
        _, delta = prompt_positions(input_ids, int(self.config.image_token_index), self.vitrim_tokens)
        return stripped, positions, delta

    def stage_positions(self, rows: Tensor) -> Tensor:
        """Row 0 of the (3, n) rows of vitrim.vllm.gemma3_positions for the rotary; all three for the attention
        rule (the original positions and image blocks of this step's tokens)."""
        if rows.dim() != 2:
            return rows
        self.vitrim_step.positions, self.vitrim_step.blocks = blocks_of(rows)
        return rows[0]
