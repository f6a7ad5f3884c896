"""Qwen2.5-VL in vLLM with a vitrim.vlm pre-LLM method: ``VitrimQwen2_5_VLForConditionalGeneration``.

A subclass of vLLM's ``Qwen2_5_VLForConditionalGeneration``:

- **Placeholders** (the processor's ``_get_prompt_updates``): an image of N tokens gets ``keep`` (an int: at most
  N, else the request fails naming both; a fraction: of N), decided from its grid before the tower runs;
- **Features** (``embed_multimodal``): the tower runs as vLLM's does, and vitrim.vlm's one encoder seam
  (:mod:`vitrim.vlm.stages.capture`) selects per image from the evidence of :mod:`vitrim.vlm.evidence.merged_tokens`
  (the scoring block read by :func:`read_tower_attention` with vLLM's fused ``qkv`` and rotary op; the token grid
  included), merged tokens go through the merger as on transformers, and each image hands the LLM its kept tokens
  in raster order;
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
    tap_input,
)
from vitrim.vllm.options import TrimOptions, trim_options
from vitrim.vllm.selection_record import SelectionRecord
from vitrim.vlm.evidence.attention import received_by_segment
from vitrim.vlm.evidence.merged_tokens import TowerAttention, image_evidence, tokens_per_image
from vitrim.vlm.evidence.seeds import image_seeds
from vitrim.vlm.stages.capture import HandOn, Taps, select_keeping

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


def read_tower_attention(attention: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TowerAttention:
    """A vLLM ``Qwen2_5_VisionAttention``'s evidence: the attention each patch receives within its segment (H, P)
    and its keys before rotary (P, H, hd), from its fused ``qkv`` and vLLM's own rotary op, as vLLM's block computes
    them. args/kwargs: the block's call, its normed input (P, 1, C) in tower (window) order, ``cu_seqlens`` and
    ``rotary_pos_emb_cos`` / ``rotary_pos_emb_sin``."""
    hidden: Tensor = args[0] if args else kwargs["x"]
    heads = int(attention.num_attention_heads_per_partition)
    head_dim = int(attention.hidden_size_per_attention_head)
    qkv, _ = attention.qkv(hidden)  # (P, 1, 3·H·hd)
    patches = qkv.shape[0]
    qkv = qkv.reshape(patches, 3, heads, head_dim)  # vLLM's "s b (three head head_dim)"
    query, key = qkv[:, 0], qkv[:, 1]  # (P, H, hd)
    rotated = attention.apply_rotary_emb(
        torch.stack([query, key]).contiguous(),  # (2, P, H, hd): vLLM's "(two b) s head head_dim", b = 1
        kwargs["rotary_pos_emb_cos"],
        kwargs["rotary_pos_emb_sin"],
    ).view(2, patches, heads, head_dim)
    work = torch.promote_types(hidden.dtype, torch.float32)  # a half-precision tower's map is scored in float32
    received = received_by_segment(rotated[0].to(work), rotated[1].to(work), kwargs["cu_seqlens"], head_dim**-0.5)
    return TowerAttention(received=received, keys=key.to(work))


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
        method = options.method
        self.vitrim_hand_on = HandOn(
            method, lambda evidence, count: select_keeping(method, evidence, options.tokens(count))
        )
        last: Any = self.visual.blocks[-1]
        self.vitrim_taps = Taps(method, scoring=(last.attn, read_tower_attention))
        self.vitrim_merger_input: Tensor | None = None
        tap_input(self.visual.merger, self.keep_merger_input)  # the merger takes no hooks (vitrim.vllm.compat)

    def keep_merger_input(self, states: Tensor) -> None:
        self.vitrim_merger_input = states.reshape(states.shape[0], -1)  # (P, 1, C) -> (P, C)

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
        states, self.vitrim_merger_input = self.vitrim_merger_input, None
        if states is None:
            raise RuntimeError("vitrim: the Qwen tower ran without its merger")
        merge = self.visual.spatial_merge_size
        tokens = tokens_per_image(grid, merge)
        window_index = self.visual.prepare_encoder_metadata(grid.tolist())["window_index"].to(states.device)
        evidence = image_evidence(self.vitrim_taps.take_attention(), states, grid, merge, window_index)
        seeds = image_seeds(pixels.split(grid.prod(-1).tolist()))  # (I,)
        unit = merge * merge

        def project(merged: Tensor) -> Tensor:  # (k, m²C) merged patch states -> (k, E) through the merger
            return self.visual.merger(merged.reshape(-1, merged.shape[-1] // unit).to(states.dtype)[:, None])

        out: list[Tensor] = []
        start = 0
        for image, (item, count) in enumerate(zip(evidence, tokens, strict=True)):
            own = embeds[start : start + count]  # (N, E)
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
            kept = (own if written is None else written[0])[selection.kept]  # (k, E)
            self.vitrim_record.add(int(seeds[image]), selection.kept)
            out.append(torch.cat([kept, positions[selection.kept].to(own.dtype)], dim=1))
        return tuple(out)
