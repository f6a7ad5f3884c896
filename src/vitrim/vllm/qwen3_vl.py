"""Qwen3-VL in vLLM with a vitrim.vlm pre-LLM method: ``VitrimQwen3VLForConditionalGeneration``.

A subclass of vLLM's ``Qwen3VLForConditionalGeneration``, on the seams of :mod:`vitrim.vllm.qwen2_5_vl`:

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
served by this architecture (its video limit is 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vitrim.vllm.compat import (
    declare_image_pruning,
    image_positions,
    sequential_mrope_positions,
    tap_input,
)
from vitrim.vllm.qwen2_5_vl import qwen_trim_options, read_tower_attention, shortened_images
from vitrim.vllm.selection_record import SelectionRecord
from vitrim.vlm.evidence.merged_tokens import image_evidence, tokens_per_image
from vitrim.vlm.evidence.seeds import image_seeds
from vitrim.vlm.families.qwen2vl import merge_deepstack
from vitrim.vlm.stages.capture import HandOn, Taps, select_keeping

ARCHITECTURE = "VitrimQwen3VLForConditionalGeneration"


class TrimmedQwen3VLProcessingInfo(Qwen3VLProcessingInfo):
    """vLLM's Qwen3-VL processing info, images only."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "video": 0}


def trimmed_qwen3_info(ctx: Any) -> TrimmedQwen3VLProcessingInfo:
    """The processing info, its options checked first, on the untyped config (vitrim's line, not vLLM's
    ``TypeError``, for another family's checkpoint)."""
    qwen_trim_options(ctx.get_hf_config(), ARCHITECTURE)
    return TrimmedQwen3VLProcessingInfo(ctx)


class TrimmedQwen3VLMultiModalProcessor(Qwen3VLMultiModalProcessor):
    """vLLM's Qwen3-VL processor whose image replacements hold ``keep`` placeholders."""

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Sequence[Any]:
        options = qwen_trim_options(self.info.get_hf_config(), ARCHITECTURE)
        return shortened_images(super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs), options)


@MULTIMODAL_REGISTRY.register_processor(
    TrimmedQwen3VLMultiModalProcessor, info=trimmed_qwen3_info, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class VitrimQwen3VLForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL whose images hand the LLM the tokens (and their DeepStack rows) a vitrim.vlm method selects,
    at their own positions."""

    # the processor normalizes the pixels, as transformers' does (see VitrimQwen2_5_VLForConditionalGeneration)
    supports_mm_device_do_normalize = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model") -> None:
        options = qwen_trim_options(vllm_config.model_config.hf_config, ARCHITECTURE)
        declare_image_pruning(vllm_config.model_config.multimodal_config)  # before vLLM's class reads it
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if options.method.needs_cls_attention and get_tensor_model_parallel_world_size() > 1:
            raise ValueError(
                f"vitrim: method {options.method.name!r} reads the tower's attention over all heads; "
                "serve it with --tensor-parallel-size 1 (replicas scale it out: --data-parallel-size)"
            )
        if self.use_data_parallel:
            raise ValueError("vitrim: trimmed Qwen3-VL runs its tower whole; drop --mm-encoder-tp-mode data")
        self.vitrim_options = options
        self.vitrim_record = SelectionRecord()
        method = options.method
        self.vitrim_hand_on = HandOn(
            method, lambda evidence, count: select_keeping(method, evidence, options.tokens(count))
        )
        last: Any = self.visual.blocks[-1]
        self.vitrim_taps = Taps(method, scoring=(last.attn, read_tower_attention))
        self.vitrim_merger_input: Tensor | None = None
        tap_input(self.visual.merger, self.keep_merger_input)

    def keep_merger_input(self, states: Tensor) -> None:
        self.vitrim_merger_input = states.reshape(states.shape[0], -1)  # (P, 1, C) -> (P, C)

    # an image's 4 position columns, the text continuing after the full grid (the module docstring: Positions)
    recompute_mrope_positions = Qwen2_5_VLForConditionalGeneration.recompute_mrope_positions

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[Tensor, int]:
        return sequential_mrope_positions(len(input_tokens))  # re-numbered from the images on (compat)

    def embed_multimodal(self, **kwargs: object) -> Any:
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)
        if not inputs:
            return []
        if set(inputs) != {"image"}:
            raise ValueError("vitrim: trimmed Qwen3-VL serves images only")
        image_input: Any = inputs["image"]
        if image_input["type"] != "pixel_values":
            raise ValueError("vitrim: trimmed Qwen3-VL selects from the tower's evidence; send images, not embeds")
        grid: Tensor = image_input["image_grid_thw"]  # (I, 3)
        pixels: Tensor = image_input["pixel_values"]  # (P, C·t·p·p) every image's patches
        rows = self.visual(pixels, grid_thw=grid)  # (ΣN, E·(1 + L)): the merger's output, then L DeepStack rows
        states, self.vitrim_merger_input = self.vitrim_merger_input, None
        if states is None:
            raise RuntimeError("vitrim: the Qwen3-VL tower ran without its merger")
        merge = self.visual.spatial_merge_size
        tokens = tokens_per_image(grid, merge)
        evidence = image_evidence(self.vitrim_taps.take_attention(), states, grid, merge, None)  # raster order
        seeds = image_seeds(pixels.split(grid.prod(-1).tolist()))  # (I,)
        unit = merge * merge
        width = self.visual_dim

        def project(merged: Tensor) -> Tensor:  # (k, m²C) merged patch states -> (k, E) through the merger
            return self.visual.merger(merged.reshape(-1, merged.shape[-1] // unit).to(states.dtype)[:, None])

        out: list[Tensor] = []
        start = 0
        for image, (item, count) in enumerate(zip(evidence, tokens, strict=True)):
            own, deepstack = rows[start : start + count].split([width, rows.shape[1] - width], dim=1)
            positions = image_positions(grid[image].tolist(), merge).to(own.device)  # (N, 4)
            start += count
            chosen, written = self.vitrim_hand_on.run(
                item.features[None],
                values=own[None],
                project=project,
                attention=None if item.received is None else item.received[None],
                keys=None if item.keys is None else item.keys[None],
                seeds=seeds[image : image + 1],
                projected=own[None],
                grid=item.grid,
            )
            selection = chosen[0]
            main = own if written is None else written[0]  # (N, E)
            levels = merge_deepstack(list(deepstack.split(width, dim=1)), [selection], [count])  # L × (N, E)
            self.vitrim_record.add(int(seeds[image]), selection.kept)
            out.append(torch.cat([main, *levels, positions.to(own.dtype)], dim=1)[selection.kept])
        return tuple(out)
