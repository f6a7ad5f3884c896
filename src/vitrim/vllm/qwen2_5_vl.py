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

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
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
from vitrim.vlm.method.base import ImageSelection
from vitrim.vlm.stages.capture import HandOn, Taps, select_keeping

ARCHITECTURE = "VitrimQwen2_5_VLForConditionalGeneration"


def qwen_trim_options(hf_config: Any, architecture: str = ARCHITECTURE) -> TrimOptions:
    """The validated ``vitrim`` options of a Qwen-VL config for ``architecture`` (Qwen2.5-VL's, or Qwen3-VL's)."""
    check_vllm_version()
    options = trim_options(hf_config, architecture)
    if options.keep.count is not None:
        options.method.check_keep(options.keep.count)
    return options


class TrimmedQwen2_5_VLProcessingInfo(Qwen2_5_VLProcessingInfo):
    """vLLM's Qwen2.5-VL processing info, images only."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "video": 0}


def trimmed_qwen_info(ctx: Any) -> TrimmedQwen2_5_VLProcessingInfo:
    """The processing info, its options checked first: on the untyped config, so another family's checkpoint gets
    vitrim's line (naming its model_type) before vLLM's typed getter refuses it with a ``TypeError``."""
    qwen_trim_options(ctx.get_hf_config())
    return TrimmedQwen2_5_VLProcessingInfo(ctx)


class TrimmedQwen2_5_VLMultiModalProcessor(Qwen2_5_VLMultiModalProcessor):
    """vLLM's Qwen2.5-VL processor whose image replacements hold ``keep`` placeholders."""

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Sequence[Any]:
        options = qwen_trim_options(self.info.get_hf_config())
        return shortened_images(super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs), options)


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


def shortened_images(updates: Sequence[Any], options: TrimOptions) -> list[Any]:
    """A Qwen processor's prompt updates with each image's replacement :func:`shortened` (videos untouched)."""
    return [
        PromptReplacement(modality="image", target=update.target, replacement=shortened(update.replacement, options))
        if update.modality == "image"
        else update
        for update in updates
    ]


def shortened(replacement: Any, options: TrimOptions) -> Any:
    """The replacement of an image with ``options.tokens(N)`` of its N placeholders."""

    def replace(item: int) -> list[int]:
        full = replacement(item)
        return full[: options.tokens(len(full))]

    return replace


@dataclass(frozen=True)
class ImageCut:
    """One image's cut: its index in the request's images, its own tokens (N, E) as the tower made them, their M-RoPE
    cells (N, 4) (:func:`~vitrim.vllm.compat.image_positions`), the selection and, where the method merges, the tokens
    it wrote (N, E; None where it only drops)."""

    image: int
    own: Tensor
    positions: Tensor
    selection: ImageSelection
    written: Tensor | None


class QwenImageTrimming:
    """What a trimmed Qwen-VL class of vLLM adds to vLLM's: the options, the taps on the tower, the per-image cut
    through vitrim.vlm's encoder seam, and the prompt's first positions. Mixed in before vLLM's class (Qwen2.5-VL's,
    Qwen3-VL's), whose ``visual`` it reads; the class's ``embed_multimodal`` runs the tower and builds its rows."""

    title: str  # the family's name in errors
    visual: Any  # vLLM's vision tower
    use_data_parallel: bool

    def install_vitrim(self, options: TrimOptions) -> None:
        """After vLLM's ``__init__``: refuse what the seam cannot serve, then tap the scoring block and the merger."""
        if options.method.needs_cls_attention and get_tensor_model_parallel_world_size() > 1:
            raise ValueError(
                f"vitrim: method {options.method.name!r} reads the tower's attention over all heads; "
                "serve it with --tensor-parallel-size 1 (replicas scale it out: --data-parallel-size)"
            )
        if self.use_data_parallel:
            raise ValueError(f"vitrim: trimmed {self.title} runs its tower whole; drop --mm-encoder-tp-mode data")
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

    def vitrim_images(self, kwargs: dict[str, object]) -> tuple[Tensor, Tensor] | None:
        """The request's images as (grid (I, 3), pixels (P, C·t·p·p)), or None where it has none; anything else
        refused in one line."""
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)  # type: ignore[attr-defined]
        if not inputs:
            return None
        if set(inputs) != {"image"}:
            raise ValueError(f"vitrim: trimmed {self.title} serves images only")
        image_input: Any = inputs["image"]
        if image_input["type"] != "pixel_values":
            raise ValueError(f"vitrim: trimmed {self.title} selects from the tower's evidence; send images, not embeds")
        return image_input["image_grid_thw"], image_input["pixel_values"]

    def cut_images(
        self, grid: Tensor, pixels: Tensor, own: Sequence[Tensor], window_index: Tensor | None
    ) -> Iterator[ImageCut]:
        """After the tower ran on ``pixels``: each image's selection from the evidence the taps caught, ``own`` its
        tokens (N_i, E) in raster order, ``window_index`` the tower's window order (None: full attention, raster
        order); each selection recorded under the image's content seed."""
        states, self.vitrim_merger_input = self.vitrim_merger_input, None
        if states is None:
            raise RuntimeError(f"vitrim: the {self.title} tower ran without its merger")
        merge = self.visual.spatial_merge_size
        evidence = image_evidence(self.vitrim_taps.take_attention(), states, grid, merge, window_index)
        seeds = image_seeds(pixels.split(grid.prod(-1).tolist()))  # (I,)
        unit = merge * merge

        def project(merged: Tensor) -> Tensor:  # (k, m²C) merged patch states -> (k, E) through the merger
            return self.visual.merger(merged.reshape(-1, merged.shape[-1] // unit).to(states.dtype)[:, None])

        for image, (item, tokens) in enumerate(zip(evidence, own, strict=True)):
            chosen, written = self.vitrim_hand_on.run(
                item.features[None],
                values=tokens[None],
                project=project,
                attention=None if item.received is None else item.received[None],
                keys=None if item.keys is None else item.keys[None],
                seeds=seeds[image : image + 1],
                projected=tokens[None],
                grid=item.grid,
            )
            self.vitrim_record.add(int(seeds[image]), chosen[0].kept)
            positions = image_positions(grid[image].tolist(), merge).to(tokens.device)  # (N, 4)
            yield ImageCut(image, tokens, positions, chosen[0], None if written is None else written[0])


@MULTIMODAL_REGISTRY.register_processor(
    TrimmedQwen2_5_VLMultiModalProcessor, info=trimmed_qwen_info, dummy_inputs=Qwen2_5_VLDummyInputsBuilder
)
class VitrimQwen2_5_VLForConditionalGeneration(QwenImageTrimming, Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL whose images hand the LLM the tokens a vitrim.vlm method selects, at their own positions."""

    title = "Qwen2.5-VL"
    # The processor normalizes the pixels, as transformers' does: vLLM's on-device normalization differs in the last
    # bit, so the tower's features (and the seed "random" draws from the pixels) would not be transformers'.
    supports_mm_device_do_normalize = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        options = qwen_trim_options(vllm_config.model_config.hf_config)
        declare_image_pruning(vllm_config.model_config.multimodal_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.install_vitrim(options)

    def embed_multimodal(self, **kwargs: object) -> Any:
        images = self.vitrim_images(kwargs)
        if images is None:
            return []
        grid, pixels = images
        embeds = self.visual(pixels, grid_thw=grid.tolist())  # (ΣN, E) raster order
        window_index = self.visual.prepare_encoder_metadata(grid.tolist())["window_index"].to(embeds.device)
        own = embeds.split(tokens_per_image(grid, self.visual.spatial_merge_size))
        out = []
        for cut in self.cut_images(grid, pixels, own, window_index):
            kept = (cut.own if cut.written is None else cut.written)[cut.selection.kept]  # (k, E)
            out.append(torch.cat([kept, cut.positions[cut.selection.kept].to(kept.dtype)], dim=1))
        return tuple(out)
