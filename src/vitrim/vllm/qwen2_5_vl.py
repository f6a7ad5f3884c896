"""Qwen2.5-VL in vLLM with a vitrim.vlm pre-LLM method: ``VitrimQwen2_5_VLForConditionalGeneration``.

A subclass of vLLM's ``Qwen2_5_VLForConditionalGeneration``:

- **Placeholders** (the processor's ``_get_prompt_updates``): an image of N tokens gets ``keep`` (an int: at most
  N, else the request fails naming both; a fraction: of N), decided from its grid before the tower runs;
- **Features** (``embed_multimodal``): the tower runs as vLLM's does, the method selects per image from
  vitrim.vlm's evidence (vitrim.vllm.qwen_evidence), merged tokens go through the merger (vitrim.vlm's Qwen rule),
  and each image hands the LLM its kept tokens in raster order;
- **Positions**: each kept token keeps its ORIGINAL M-RoPE position (t, h, w of the full grid) and the text after an
  image continues where it would after the full image, as vitrim.vlm does in transformers. vLLM does this through
  the machinery of its video pruning (EVS): the embeddings carry their positions, the runner re-numbers the prompt
  (vitrim.vllm.compat says what that needs). Videos are not served by this architecture (its video limit is 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptReplacement

from vitrim.vllm.compat import (
    check_vllm_version,
    declare_image_pruning,
    image_positions,
    sequential_mrope_positions,
)
from vitrim.vllm.options import TrimOptions, trim_options
from vitrim.vllm.qwen_evidence import TowerCapture
from vitrim.vllm.selection_record import SelectionRecord
from vitrim.vlm.families.qwen2vl_vision import image_evidence
from vitrim.vlm.method.base import VisionEvidence, content_seed

ARCHITECTURE = "VitrimQwen2_5_VLForConditionalGeneration"


def qwen_trim_options(hf_config: Any) -> TrimOptions:
    """The validated ``vitrim`` options of a Qwen2.5-VL config."""
    check_vllm_version()
    options = trim_options(hf_config, ARCHITECTURE)
    if options.keep.count is not None:
        options.method.check_keep(options.keep.count)
    return options


class TrimmedQwen2_5_VLProcessingInfo(Qwen2_5_VLProcessingInfo):
    """vLLM's Qwen2.5-VL processing info, images only."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "video": 0}


def trimmed_qwen_info(ctx: Any) -> TrimmedQwen2_5_VLProcessingInfo:
    info = TrimmedQwen2_5_VLProcessingInfo(ctx)
    qwen_trim_options(info.get_hf_config())
    return info


class TrimmedQwen2_5_VLMultiModalProcessor(Qwen2_5_VLMultiModalProcessor):
    """vLLM's Qwen2.5-VL processor whose image replacements hold ``keep`` placeholders."""

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Sequence[Any]:
        options = qwen_trim_options(self.info.get_hf_config())
        updates = list(super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs))
        for index, update in enumerate(updates):
            if update.modality == "image":
                updates[index] = PromptReplacement(
                    modality="image", target=update.target, replacement=shortened(update.replacement, options)
                )
        return updates


def shortened(replacement: Any, options: TrimOptions) -> Any:
    """The replacement of an image with ``options.tokens(N)`` of its N placeholders."""

    def replace(item: int) -> list[int]:
        full = replacement(item)
        return full[: options.tokens(len(full))]

    return replace


@MULTIMODAL_REGISTRY.register_processor(
    TrimmedQwen2_5_VLMultiModalProcessor, info=trimmed_qwen_info, dummy_inputs=Qwen2_5_VLDummyInputsBuilder
)
class VitrimQwen2_5_VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL whose images hand the LLM the tokens a vitrim.vlm method selects, at their own positions."""

    # The processor normalizes the pixels, as transformers' does: vLLM's on-device normalization differs in the last
    # bit, so the tower's features (and the seed "random" draws from the pixels) would not be transformers'.
    supports_mm_device_do_normalize = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        options = qwen_trim_options(vllm_config.model_config.hf_config)
        declare_image_pruning(vllm_config.model_config.multimodal_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if options.method.needs_cls_attention and get_tensor_model_parallel_world_size() > 1:
            raise ValueError(
                f"vitrim: method {options.method.name!r} reads the tower's attention over all heads; "
                "serve it with --tensor-parallel-size 1 (replicas scale it out: --data-parallel-size)"
            )
        if self.use_data_parallel:
            raise ValueError("vitrim: trimmed Qwen2.5-VL runs its tower whole; drop --mm-encoder-tp-mode data")
        self.vitrim_options = options
        self.vitrim_record = SelectionRecord()
        self.vitrim_capture = TowerCapture(self.visual, options.method.needs_cls_attention)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[Tensor, int]:
        return sequential_mrope_positions(len(input_tokens))  # re-numbered from the images on (compat)

    def embed_multimodal(self, **kwargs: object) -> Any:
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)
        if not inputs:
            return []
        if set(inputs) != {"image"}:
            raise ValueError("vitrim: trimmed Qwen2.5-VL serves images only")
        image_input: Any = inputs["image"]
        if image_input["type"] != "pixel_values":
            raise ValueError("vitrim: trimmed Qwen2.5-VL selects from the tower's evidence; send images, not embeds")
        grid: Tensor = image_input["image_grid_thw"]  # (I, 3)
        pixels: Tensor = image_input["pixel_values"]  # (P, C·t·p·p) every image's patches
        embeds = self.visual(pixels, grid_thw=grid.tolist())  # (ΣN, E) raster order
        capture, states = self.vitrim_capture.take()
        merge = self.visual.spatial_merge_size
        tokens = (grid.prod(-1) // (merge * merge)).tolist()
        metadata = self.visual.prepare_encoder_metadata(grid.tolist())
        evidence = image_evidence(capture, states, grid, merge, metadata["window_index"].to(states.device))
        seeds = [content_seed(p) for p in pixels.split(grid.prod(-1).tolist())]
        method = self.vitrim_options.method
        out: list[Tensor] = []
        start = 0
        for image, (item, count) in enumerate(zip(evidence, tokens, strict=True)):
            keep = self.vitrim_options.tokens(count)
            own = embeds[start : start + count]  # (N, E)
            positions = image_positions(grid[image].tolist(), merge).to(own.device)  # (N, 4)
            start += count
            if keep == count:  # every token stays
                self.vitrim_record.add(seeds[image], torch.arange(count))
                out.append(torch.cat([own, positions.to(own.dtype)], dim=1))
                continue
            found = VisionEvidence(
                features=item.features[None],
                cls_attention=None if item.received is None else item.received[None],
                keys=None if item.keys is None else item.keys[None],
                seeds=torch.tensor([seeds[image]], dtype=torch.long),
                projected=own[None],
            )
            chosen = method.select(found, keep)[0]
            kept_embeds = own[chosen.kept]
            if chosen.merged is not None:
                merged = chosen.merged.reshape(keep * merge * merge, -1).to(states.dtype)
                kept_embeds = self.visual.merger(merged[:, None]).to(own.dtype)  # (k, E): the projector on them
            self.vitrim_record.add(seeds[image], chosen.kept)
            out.append(torch.cat([kept_embeds, positions[chosen.kept].to(own.dtype)], dim=1))
        return tuple(out)
