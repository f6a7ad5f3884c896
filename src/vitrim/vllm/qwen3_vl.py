"""Qwen3-VL in vLLM with a vitrim.vlm pre-LLM method: ``VitrimQwen3VLForConditionalGeneration``, images and videos.

A subclass of vLLM's ``Qwen3VLForConditionalGeneration`` with :class:`~vitrim.vllm.qwen2_5_vl.QwenImageTrimming`
(the options, the taps and the per-item cut both Qwen classes share):

- **Placeholders** (the processor's ``_get_prompt_updates``): an image of N tokens gets ``keep`` of them
  (:func:`~vitrim.vllm.qwen2_5_vl.shortened_images`); a video is Qwen3-VL's per-temporal-patch text
  (``<τ seconds><|vision_start|>…<|vision_end|>`` per temporal patch, vLLM's ``get_video_repl``) holding the kept
  count (:func:`video_tokens_per_frame`): ``keep`` in each temporal patch under an image method, and under a video
  method its whole count in the first (how many of them each temporal patch keeps depends on the content, which the
  tower has not seen yet: vLLM's own EVS writes the same lump). Either way the whole text is the video's embedding
  span; all decided from the grid before the tower runs;
- **Features** (``embed_multimodal``): the tower runs as vLLM's does; the scoring block is vLLM's
  ``Qwen2_5_VisionAttention`` (the same class as Qwen2.5-VL's: :func:`~vitrim.vllm.qwen2_5_vl.read_tower_attention`
  reads it, full attention per image or temporal patch, no window order), the merger's input is the evidence's
  features, and vitrim.vlm's encoder seam (:mod:`vitrim.vlm.stages.capture`) selects and writes merged tokens through
  the merger: a video method over a whole video (images whole), an image method on each temporal patch;
- **A video's span** (:func:`video_span`): the model hands the LLM one row per token of the video's text, laid out
  as transformers' processor writes the pruned prompt (each temporal patch's timestamp, vision start, ITS kept
  tokens, vision end): timestamp and vision start/end rows are the LLM's own embeddings of those tokens, video rows
  the kept tokens. The prompt's token ids keep the processor's layout (under a video method, every kept placeholder
  in the first temporal patch): same length, and the LLM reads only the rows;
- **DeepStack**: vLLM's tower hands each token its merger output and its DeepStack rows side by side in one row
  ((N, E·(1 + L))), which vLLM splits in ``embed_input_ids``; cutting the rows cuts the DeepStack features with the
  same indices, and a merged slot's DeepStack rows are its group's mean, as on transformers
  (:func:`vitrim.vlm.families.qwen2vl.merge_deepstack`); a text row of a video's span has zeros there (transformers
  adds DeepStack at visual positions only);
- **Positions**: each kept token keeps its original M-RoPE cell and every text token (the timestamps too) its
  original position, the text after an image or video continuing where it would after the full one: transformers'
  ``get_rope_index``, which numbers each temporal patch as a one-frame grid after its vision start and continues
  after it at max(H′, W′). The re-numbering is vitrim's (:func:`~vitrim.vllm.compat.renumber_media`, 4 columns:
  t, h, w and where the text after continues, :func:`~vitrim.vllm.compat.image_positions`), which places each
  medium's rows from the token after its own vision start: an image's first token, a video's first timestamp token
  (transformers ≥ 5.10 writes the video inside an outer vision start / end, the text vLLM's processor replaces).
  Qwen3-VL's own (5 columns) counts a video's timestamp back from that outer vision start, too early, and continues
  the text after an image at its largest KEPT cell + 1 (docs/video.md).

What vLLM's class allowed without copying it: the processor's replacement text (``get_video_repl``, the timestamps
it computes), the tower, the merger, DeepStack's split and its injection into the LLM are vLLM's own; vitrim replaces
``embed_multimodal`` (the tower call, the per-item cut, a video's span), the prompt's first positions
(:func:`~vitrim.vllm.compat.sequential_mrope_positions`) and their re-numbering.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptReplacement

from vitrim.vllm.compat import declare_image_pruning
from vitrim.vllm.options import TrimOptions, refuse_vllm_video_pruning, request_options
from vitrim.vllm.prompt_instruction import image_prompts
from vitrim.vllm.qwen2_5_vl import (
    ImageCut,
    QwenImageTrimming,
    QwenPromptInstruction,
    kept_per_qwen_item,
    qwen_trim_options,
    shortened_images,
    trimmed_qwen_info,
)
from vitrim.vllm.request_keep import RequestKeep, asked_keeps
from vitrim.vlm.evidence.merged_tokens import tokens_per_image
from vitrim.vlm.families.qwen2vl import merge_deepstack

ARCHITECTURE = "VitrimQwen3VLForConditionalGeneration"


def video_text(
    tokens_per_frame: list[int], timestamps: Sequence[float] | Tensor, tokenizer: Any, config: Any
) -> list[int]:
    """The token ids of a Qwen3-VL video holding ``tokens_per_frame`` video tokens in each temporal patch (vLLM's
    ``get_video_repl``: per temporal patch its timestamp text, vision start, the tokens, vision end)."""
    return Qwen3VLMultiModalProcessor.get_video_repl(
        tokens_per_frame=tokens_per_frame,
        timestamps=timestamps,
        tokenizer=tokenizer,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        video_token_id=config.video_token_id,
    ).full


class TrimmedQwen3VLMultiModalProcessor(QwenPromptInstruction, RequestKeep, Qwen3VLMultiModalProcessor):
    """vLLM's Qwen3-VL processor whose image replacements hold ``keep`` placeholders and whose video replacements
    are Qwen3-VL's per-temporal-patch text holding the kept count (:func:`video_tokens_per_frame`), at the engine's
    options or the request's own ``keep`` (:mod:`vitrim.vllm.request_keep`). The whole text of a video is its
    embedding span (the model hands a row per token: :func:`video_span`). Each image's text for a method that reads
    the prompt (:class:`~vitrim.vllm.qwen2_5_vl.QwenPromptInstruction`)."""

    def request_trim(self, hf_kwargs: Mapping[str, object]) -> TrimOptions:
        return request_options(qwen_trim_options(self.info.get_hf_config(), ARCHITECTURE), hf_kwargs)

    def kept_per_item(self, processed: Mapping[str, Any], options: TrimOptions) -> dict[str, Any]:
        return kept_per_qwen_item(processed, options, int(self.info.get_hf_config().vision_config.spatial_merge_size))

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Sequence[Any]:
        options = self.request_trim(hf_processor_mm_kwargs)
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        config = self.info.get_hf_config()
        tokenizer = self.info.get_tokenizer()

        def replace_video(item: int) -> list[int]:
            video = out_mm_kwargs["video"][item]
            frames = video_tokens_per_frame(options, video["video_grid_thw"].data, config)
            return video_text(frames, video["timestamps"].data, tokenizer, config)

        return [
            PromptReplacement(modality="video", target=update.target, replacement=replace_video)
            if update.modality == "video"
            else update
            for update in shortened_images(updates, options)
        ]


def video_tokens_per_frame(options: TrimOptions, grid_thw: Tensor, config: Any) -> list[int]:
    """The placeholders of each temporal patch of a video of ``grid_thw`` (t, h, w patches): an image method's
    ``keep`` of each; a video method's whole count in the first, none in the others (which temporal patch keeps how
    many is known only after the tower ran: :func:`video_span` lays them out)."""
    merge = int(config.vision_config.spatial_merge_size)
    frames, height, width = (int(v) for v in grid_thw)
    total = options.video_tokens(frames, (height // merge) * (width // merge))
    if options.method.reads_time:
        return [total] + [0] * (frames - 1)
    return [total // frames] * frames


def video_span(ids: Tensor, cells: Tensor, grid_hw: tuple[int, int], config: Any) -> Tensor:
    """(S, 4) long: per token of a video's text ``ids`` (S,) (:func:`video_text` at the kept counts) its M-RoPE
    position counted from the text's first token, as transformers' ``get_rope_index`` numbers the unpruned video,
    and in the last column where the text after the video continues.

    cells: (k, 3) each kept video token's (0, row, column) within its temporal patch, in the order the video tokens
    stand in ``ids``; grid_hw: (H′, W′) the merged grid of a temporal patch. Text tokens count on one by one; a
    temporal patch's grid starts after its vision start, at s (token at (s, s + row, s + column)), and its vision end
    sits at s + max(H′, W′) whatever was kept (the full grid's extent: dropping a token is masking it)."""
    extent = max(grid_hw)
    starts = (ids == config.vision_start_token_id).nonzero()[:, 0].tolist()
    ends = (ids == config.vision_end_token_id).nonzero()[:, 0].tolist()
    out = torch.zeros(len(ids), 4, dtype=torch.long)
    position, previous, video = 0, 0, 0
    for start, end in zip(starts, ends, strict=True):
        text = start + 1 - previous  # the temporal patch's timestamp tokens and its vision start
        out[previous : start + 1, :3] = (position + torch.arange(text))[:, None]
        first = position + text
        count = end - start - 1
        out[start + 1 : end, :3] = first + cells[video : video + count]
        out[end, :3] = first + extent
        position, previous, video = first + extent + 1, end + 1, video + count
    out[:, 3] = position
    return out


@MULTIMODAL_REGISTRY.register_processor(
    TrimmedQwen3VLMultiModalProcessor,
    info=functools.partial(trimmed_qwen_info, architecture=ARCHITECTURE, info=Qwen3VLProcessingInfo),
    dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class VitrimQwen3VLForConditionalGeneration(QwenImageTrimming, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL whose images and videos hand the LLM the tokens (and their DeepStack rows) a vitrim.vlm
    method selects, at their own positions."""

    title = "Qwen3-VL"
    # the processor normalizes the pixels, as transformers' does (see VitrimQwen2_5_VLForConditionalGeneration)
    supports_mm_device_do_normalize = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model") -> None:
        options = qwen_trim_options(vllm_config.model_config.hf_config, ARCHITECTURE)
        refuse_vllm_video_pruning(vllm_config.model_config.multimodal_config.get_video_pruning_spec(), options)
        declare_image_pruning(vllm_config.model_config.multimodal_config)  # before vLLM's class reads it
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.install_vitrim(options, vllm_config.model_config.mrope_num_dims)

    def embed_multimodal(self, **kwargs: object) -> Any:
        out = []
        for modality, found in self.vitrim_media(kwargs):
            video = modality == "video"
            grid = found["video_grid_thw" if video else "image_grid_thw"]
            pixels = found["pixel_values_videos" if video else "pixel_values"]
            rows = self.visual(pixels, grid_thw=grid)  # (ΣN, E·(1 + L)): the merger's output, then L DeepStack rows
            width = self.visual_dim
            own, deepstack = rows.split([width, rows.shape[1] - width], dim=1)
            counts = tokens_per_image(grid, self.visual.spatial_merge_size)
            stacks = deepstack.split(counts)
            # each temporal patch is numbered as a one-frame grid: a temporal step of 0 gives every video token its
            # (0, row, column) within its temporal patch, whose start video_span lays out
            steps = [0.0] * len(grid) if video else None
            prompts = None if video else image_prompts(kwargs, self.vitrim_options.method, len(grid))
            keeps, methods = asked_keeps(kwargs, modality), self.vitrim_item_methods(kwargs, modality)
            cuts = self.cut_media(grid, pixels, own.split(counts), None, steps, keeps, prompts, methods)
            for cut in cuts:  # full attention: raster order
                kept = self.kept_rows(cut, stacks[cut.image])
                if video:
                    out.append(self.video_rows(cut, kept, grid[cut.image].tolist(), found["timestamps"][cut.image]))
                else:
                    out.append(torch.cat([kept, cut.positions[cut.selection.kept].to(kept.dtype)], dim=1))
        return tuple(out)

    def kept_rows(self, cut: ImageCut, deepstack: Tensor) -> Tensor:
        """(k, E·(1 + L)) the kept tokens of one item, each its merger output (or merged token) and its DeepStack rows
        (a merged slot's: its group's mean); deepstack: (N, E·L) the item's DeepStack rows."""
        main = cut.own if cut.written is None else cut.written  # (N, E)
        levels = merge_deepstack(list(deepstack.split(self.visual_dim, dim=1)), [cut.selection], [len(main)])
        return torch.cat([main, *levels], dim=1)[cut.selection.kept]

    def video_rows(self, cut: ImageCut, kept: Tensor, grid_thw: list[int], timestamps: Any) -> Tensor:
        """(S, E·(1 + L) + 4) one row per token of the video's text as transformers lays out the pruned prompt
        (:func:`video_span`): the kept tokens (``kept``, (k, E·(1 + L))) in their temporal patches, the LLM's own
        embeddings of the timestamp and vision start / end tokens (zero DeepStack rows), and every row's position."""
        merge = self.visual.spatial_merge_size
        frames, height, width = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
        chosen = cut.selection.kept
        per_frame = torch.bincount(chosen.cpu() // (height * width), minlength=frames).tolist()
        ids = torch.tensor(video_text(per_frame, timestamps, self._tokenizer, self.config))
        span = video_span(ids, cut.positions[chosen].cpu()[:, :3], (height, width), self.config)
        ids = ids.to(kept.device)
        is_video = ids == self.config.video_token_id
        rows = kept.new_zeros(len(ids), kept.shape[1])
        rows[is_video] = kept
        rows[~is_video, : self.visual_dim] = self.get_language_model().embed_input_ids(ids[~is_video]).to(kept.dtype)
        return torch.cat([rows, span.to(rows)], dim=1)
