"""Qwen3-VL in vLLM with a vitrim.vlm pre-LLM method: ``VitrimQwen3VLForConditionalGeneration``.

A subclass of vLLM's ``Qwen3VLForConditionalGeneration`` with :class:`~vitrim.vllm.qwen2_5_vl.QwenImageTrimming`
(the options, the taps and the per-image cut both Qwen classes share):

- **Placeholders** (the processor's ``_get_prompt_updates``): an image of N tokens gets ``keep`` of them
  (:func:`~vitrim.vllm.qwen2_5_vl.shortened_images`), decided from its grid before the tower runs;
- **Features** (``embed_multimodal``): the tower runs as vLLM's does; the scoring block is vLLM's
  ``Qwen2_5_VisionAttention`` (the same class as Qwen2.5-VL's: :func:`~vitrim.vllm.qwen2_5_vl.read_tower_attention`
  reads it, full attention per image, no window order), the merger's input is the evidence's features, and
  vitrim.vlm's encoder seam (:mod:`vitrim.vlm.stages.capture`) selects and writes merged tokens through the merger;
- **DeepStack**: vLLM's tower hands each token its merger output and its DeepStack rows side by side in one row
  ((N, E·(1 + L))), which vLLM splits in ``embed_input_ids``; cutting the rows cuts the DeepStack features with the
  same indices, and a merged slot's DeepStack rows are its group's mean, as on transformers
  (:func:`vitrim.vlm.families.qwen2vl.merge_deepstack`);
- **Positions**: each kept token keeps its original M-RoPE cell and the text after an image continues after the
  full image, through vLLM's pruning machinery (EVS). Qwen3-VL's own ``recompute_mrope_positions`` reads 5 position
  columns and continues the text after the largest KEPT cell (+ 1), which differs from transformers whenever the
  last row or column of the grid is dropped; the class takes Qwen2.5-VL's instead (4 columns: t, h, w and the
  span where the text continues, :func:`~vitrim.vllm.compat.image_positions`), exact for images (no timestamps).

What vLLM's class allowed without copying it: the processor's replacement, the tower, the merger, DeepStack's split
and its injection into the LLM, and the position re-numbering (Qwen2.5-VL's) are vLLM's own; vitrim replaces
``embed_multimodal`` (the tower call and the per-image cut) and the prompt's first positions
(:func:`~vitrim.vllm.compat.sequential_mrope_positions`: vLLM's lays out a full grid per image). Videos are not
served by this architecture yet (its video limit is 0; a video method is refused at engine start): a Qwen3-VL video
interleaves a timestamp text with its temporal patches, whose placeholders a video method's content-dependent
per-patch counts would have to lay out before the tower runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vitrim.vllm.compat import declare_image_pruning
from vitrim.vllm.options import TrimOptions, refuse_vllm_video_pruning, request_options
from vitrim.vllm.qwen2_5_vl import (
    QwenImageTrimming,
    kept_per_qwen_item,
    qwen_trim_options,
    shortened_images,
)
from vitrim.vllm.request_keep import RequestKeep, asked_keeps
from vitrim.vlm.evidence.merged_tokens import tokens_per_image
from vitrim.vlm.families.qwen2vl import merge_deepstack

ARCHITECTURE = "VitrimQwen3VLForConditionalGeneration"


class TrimmedQwen3VLProcessingInfo(Qwen3VLProcessingInfo):
    """vLLM's Qwen3-VL processing info, images only."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "video": 0}


def trimmed_qwen3_info(ctx: Any) -> TrimmedQwen3VLProcessingInfo:
    """The processing info, its options checked first, on the untyped config (vitrim's line, not vLLM's
    ``TypeError``, for another family's checkpoint)."""
    options = qwen_trim_options(ctx.get_hf_config(), ARCHITECTURE)
    refuse_vllm_video_pruning(ctx.get_mm_config().get_video_pruning_spec(), options)
    return TrimmedQwen3VLProcessingInfo(ctx)


class TrimmedQwen3VLMultiModalProcessor(RequestKeep, Qwen3VLMultiModalProcessor):
    """vLLM's Qwen3-VL processor whose image replacements hold ``keep`` placeholders (the engine's, or the
    request's own: :mod:`vitrim.vllm.request_keep`)."""

    def request_trim(self, hf_kwargs: Mapping[str, object]) -> TrimOptions:
        return request_options(qwen_trim_options(self.info.get_hf_config(), ARCHITECTURE), hf_kwargs)

    def kept_per_item(self, processed: Mapping[str, Any], options: TrimOptions) -> dict[str, Tensor]:
        return kept_per_qwen_item(processed, options, int(self.info.get_hf_config().vision_config.spatial_merge_size))

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Sequence[Any]:
        options = self.request_trim(hf_processor_mm_kwargs)
        return shortened_images(super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs), options)


@MULTIMODAL_REGISTRY.register_processor(
    TrimmedQwen3VLMultiModalProcessor, info=trimmed_qwen3_info, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class VitrimQwen3VLForConditionalGeneration(QwenImageTrimming, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL whose images hand the LLM the tokens (and their DeepStack rows) a vitrim.vlm method selects,
    at their own positions."""

    title = "Qwen3-VL"
    # the processor normalizes the pixels, as transformers' does (see VitrimQwen2_5_VLForConditionalGeneration)
    supports_mm_device_do_normalize = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model") -> None:
        options = qwen_trim_options(vllm_config.model_config.hf_config, ARCHITECTURE)
        refuse_vllm_video_pruning(vllm_config.model_config.multimodal_config.get_video_pruning_spec(), options)
        declare_image_pruning(vllm_config.model_config.multimodal_config)  # before vLLM's class reads it
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.install_vitrim(options)

    # an image's 4 position columns, the text continuing after the full grid (the module docstring: Positions)
    recompute_mrope_positions = Qwen2_5_VLForConditionalGeneration.recompute_mrope_positions

    def embed_multimodal(self, **kwargs: object) -> Any:
        images = self.vitrim_images(kwargs)
        if images is None:
            return []
        grid, pixels = images
        rows = self.visual(pixels, grid_thw=grid)  # (ΣN, E·(1 + L)): the merger's output, then L DeepStack rows
        width = self.visual_dim
        own, deepstack = rows.split([width, rows.shape[1] - width], dim=1)
        counts = tokens_per_image(grid, self.visual.spatial_merge_size)
        stacks = deepstack.split(counts)
        out = []
        keeps = asked_keeps(kwargs, "image")
        for cut in self.cut_media(grid, pixels, own.split(counts), None, keeps=keeps):  # full attention: raster order
            main = cut.own if cut.written is None else cut.written  # (N, E)
            levels = merge_deepstack(list(stacks[cut.image].split(width, dim=1)), [cut.selection], [len(main)])
            out.append(torch.cat([main, *levels, cut.positions.to(main.dtype)], dim=1)[cut.selection.kept])
        return tuple(out)
