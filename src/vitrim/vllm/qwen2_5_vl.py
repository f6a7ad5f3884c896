"""Qwen2.5-VL in vLLM with a vitrim.vlm pre-LLM method: ``VitrimQwen2_5_VLForConditionalGeneration``.

A subclass of vLLM's ``Qwen2_5_VLForConditionalGeneration``, for images and videos:

- **Placeholders** (the processor's ``_get_prompt_updates``): an image of N tokens gets ``keep`` (the engine's, or
  the request's own: :mod:`vitrim.vllm.request_keep`; an int: at most N, else the request fails naming both; a
  fraction: of N), a video of t temporal patches of P tokens t·``keep``
  of P (an image method) or its video method's count (:meth:`~vitrim.vllm.options.TrimOptions.video_tokens`), all
  decided from the grid before the tower runs;
- **Features** (``embed_multimodal``): the tower runs as vLLM's does, and vitrim.vlm's one encoder seam
  (:mod:`vitrim.vlm.stages.capture`, :meth:`~vitrim.vlm.stages.capture.HandOn.run_media`, the same call as
  transformers' family) selects per image or video from the evidence of :mod:`vitrim.vlm.evidence.merged_tokens`
  (the scoring block read by :func:`read_tower_attention` with vLLM's fused ``qkv`` and rotary op; the token grid
  included): a video method over a whole video (images kept whole), an image method on each temporal patch as on an
  image. Merged tokens go through the merger as on transformers, and each item hands the LLM its kept tokens in
  raster order;
- **Positions**: each kept token keeps its ORIGINAL M-RoPE position (t, h, w of the full grid, a video's temporal
  patch at ``int(τ · tokens_per_second · second_per_grid_ts)``) and the text after an image or video continues where
  it would after the full one, as the unmodified transformers model and vitrim.vlm number them. vLLM does this
  through the machinery of its video pruning (EVS): the embeddings carry their positions, the runner re-numbers the
  prompt (vitrim.vllm.compat says what that needs and where vLLM's own EVS numbers otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from vllm.config import VllmConfig
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
    renumber_media,
    sequential_mrope_positions,
    tap_input,
    video_positions,
)
from vitrim.vllm.options import TrimOptions, refuse_vllm_video_pruning, request_options, trim_options
from vitrim.vllm.pipeline_positions import PositionsAcrossStages, carry_positions
from vitrim.vllm.prompt_instruction import ImagePrompt, PromptInstruction, image_prompts, select_with_prompts
from vitrim.vllm.request_keep import (
    BuiltMethods,
    RequestKeep,
    asked_keeps,
    item_methods,
    keep_field,
    options_bytes,
    options_field,
)
from vitrim.vllm.selection_record import SelectionRecord, recording
from vitrim.vllm.tensor_parallel import all_heads
from vitrim.vlm.evidence.attention import received_by_segment
from vitrim.vlm.evidence.merged_tokens import TowerAttention, image_evidence, tokens_per_image
from vitrim.vlm.evidence.seeds import image_seeds
from vitrim.vlm.method.base import ImageSelection, Method
from vitrim.vlm.stages.capture import HandOn, Taps, select_keeping

ARCHITECTURE = "VitrimQwen2_5_VLForConditionalGeneration"


def qwen_trim_options(hf_config: Any, architecture: str = ARCHITECTURE) -> TrimOptions:
    """The validated ``vitrim`` options of a Qwen-VL config for ``architecture`` (Qwen2.5-VL's, or Qwen3-VL's)."""
    check_vllm_version()
    options = trim_options(hf_config, architecture)
    count = options.spec().count
    if count is not None:
        options.method.check_keep(count)
    return options


def trimmed_qwen_info(ctx: Any, architecture: str = ARCHITECTURE, info: Callable[[Any], Any] | None = None) -> Any:
    """The processing info (images and videos; ``info``: vLLM's class of it, default Qwen2.5-VL's), its options for
    ``architecture`` checked first: on the untyped config, so another family's checkpoint gets vitrim's line (naming
    its model_type) before vLLM's typed getter refuses it with a ``TypeError``; and vLLM's own video pruning refused
    beside them."""
    options = qwen_trim_options(ctx.get_hf_config(), architecture)
    refuse_vllm_video_pruning(ctx.get_mm_config().get_video_pruning_spec(), options)
    return (info or Qwen2_5_VLProcessingInfo)(ctx)


def kept_per_qwen_item(processed: Mapping[str, Any], options: TrimOptions, merge: int) -> dict[str, Any]:
    """What a Qwen processor hands the model beside each item (:mod:`vitrim.vllm.request_keep`): each image's kept
    tokens, and each video's per temporal patch under an image method; under a video method (which decides its own
    count) each video's request's options."""
    kept: dict[str, Any] = {}
    grids = processed.get("image_grid_thw")
    if grids is not None:
        kept[keep_field("image")] = torch.tensor([options.tokens(int(g.prod()) // merge**2) for g in grids])
    grids = processed.get("video_grid_thw")
    if grids is not None and not options.method.reads_time:
        kept[keep_field("video")] = torch.tensor([options.tokens(int(g[1] * g[2]) // merge**2) for g in grids])
    elif grids is not None:  # a video method takes no keep; its request's options decide each video's count
        kept[options_field("video")] = [options_bytes(options) for _ in grids]
    return kept


class QwenPromptInstruction(PromptInstruction):
    """Each image's text for a method that reads the prompt (:mod:`vitrim.vllm.prompt_instruction`), both Qwen
    processors: an image is its one ``<|image_pad|>`` in the prompt; image and video tokens are not text (vision
    start / end are, as on transformers)."""

    def instruction_tokens(self) -> tuple[int, frozenset[int]]:
        config = self.info.get_hf_config()
        return int(config.image_token_id), frozenset({int(config.image_token_id), int(config.video_token_id)})


class TrimmedQwen2_5_VLMultiModalProcessor(QwenPromptInstruction, RequestKeep, Qwen2_5_VLMultiModalProcessor):
    """vLLM's Qwen2.5-VL processor whose replacements hold the kept count of placeholders: ``keep`` of an image,
    a video's :meth:`~vitrim.vllm.options.TrimOptions.video_tokens`, at the request's own ``keep`` where it gives one
    (:mod:`vitrim.vllm.request_keep`), and each image's text for a method that reads the prompt."""

    def request_trim(self, hf_kwargs: Mapping[str, object]) -> TrimOptions:
        return request_options(qwen_trim_options(self.info.get_hf_config()), hf_kwargs)

    def kept_per_item(self, processed: Mapping[str, Any], options: TrimOptions) -> dict[str, Any]:
        return kept_per_qwen_item(processed, options, int(self.info.get_hf_config().vision_config.spatial_merge_size))

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Sequence[Any]:
        options = self.request_trim(hf_processor_mm_kwargs)
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        merge = int(self.info.get_hf_config().vision_config.spatial_merge_size)

        def video_grid(item: int) -> tuple[int, int]:  # (t, P) of the request's video ``item``
            t, h, w = (int(v) for v in out_mm_kwargs["video"][item]["video_grid_thw"].data)
            return t, (h // merge) * (w // merge)

        return shortened_images(updates, options, video_grid)


def read_tower_attention(attention: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TowerAttention:
    """A vLLM ``Qwen2_5_VisionAttention``'s evidence: the attention each patch receives within its segment (H, P)
    and its keys before rotary (P, H, hd), from its fused ``qkv`` and vLLM's own rotary op, as vLLM's block computes
    them. args/kwargs: the block's call, its normed input (P, 1, C) in tower (window) order, ``cu_seqlens`` and
    ``rotary_pos_emb_cos`` / ``rotary_pos_emb_sin``. Under tensor parallelism each rank computes its own heads and
    gathers the others' (:func:`~vitrim.vllm.tensor_parallel.all_heads`)."""
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
    return TowerAttention(received=all_heads(received, dim=0), keys=all_heads(key.to(work), dim=1))


def shortened_images(
    updates: Sequence[Any], options: TrimOptions, video_grid: Callable[[int], tuple[int, int]] | None = None
) -> list[Any]:
    """A Qwen processor's prompt updates with each image's replacement :func:`shortened`, and each video's where
    ``video_grid`` (a video's index -> its temporal patches t and tokens per temporal patch P) is given (None: videos
    untouched, an architecture that takes none)."""
    out = []
    for update in updates:
        if update.modality == "image":
            replacement = shortened(update.replacement, lambda item, count: options.tokens(count))
        elif update.modality == "video" and video_grid is not None:
            replacement = shortened(update.replacement, lambda item, count: options.video_tokens(*video_grid(item)))
        else:
            out.append(update)
            continue
        out.append(PromptReplacement(modality=update.modality, target=update.target, replacement=replacement))
    return out


def shortened(replacement: Any, kept: Callable[[int, int], int]) -> Any:
    """The replacement of item ``item`` of N placeholders with its first ``kept(item, N)`` (all alike: Qwen2.5-VL
    writes one placeholder token per merged token)."""

    def replace(item: int) -> list[int]:
        full = replacement(item)
        return full[: kept(item, len(full))]

    return replace


@dataclass(frozen=True)
class ImageCut:
    """One image's or video's cut: its index in the request's images (videos), its own tokens (N, E) as the tower
    made them, their M-RoPE cells (N, 4) (:func:`~vitrim.vllm.compat.video_positions`), the selection and, where
    the method merges, the tokens it wrote (N, E; None where it only drops)."""

    image: int
    own: Tensor
    positions: Tensor
    selection: ImageSelection
    written: Tensor | None


class QwenImageTrimming(PositionsAcrossStages):
    """What a trimmed Qwen-VL class of vLLM adds to vLLM's: the options, the taps on the tower, the per-image cut
    through vitrim.vlm's encoder seam, the prompt's first positions, and its positions on a later pipeline stage.
    Mixed in before vLLM's class (Qwen2.5-VL's,
    Qwen3-VL's), whose ``visual`` it reads; the class's ``embed_multimodal`` runs the tower and builds its rows."""

    title: str  # the family's name in errors
    visual: Any  # vLLM's vision tower
    use_data_parallel: bool

    def install_vitrim(self, options: TrimOptions, position_rows: int) -> None:
        """After vLLM's ``__init__``: refuse what the seam cannot serve, then tap the scoring block and the merger;
        a later pipeline stage receives the first stage's ``position_rows`` × n positions (:meth:`forward`)."""
        if self.use_data_parallel:
            raise ValueError(f"vitrim: trimmed {self.title} runs its tower whole; drop --mm-encoder-tp-mode data")
        carry_positions(self, position_rows)
        self.vitrim_options = options
        self.vitrim_record = SelectionRecord()
        self.vitrim_methods: BuiltMethods = {}  # the requests' own option sets' methods (request_keep)
        method = options.method
        if method.reads_time:  # a video method decides its count (a video's; images stay whole: run_media)
            self.vitrim_hand_on = HandOn(method, method.select)
        else:  # an image method keeps ``keep`` of an image, of each temporal patch of a video
            self.vitrim_hand_on = HandOn(
                method, lambda evidence, count: select_keeping(method, evidence, options.tokens(count))
            )
        last: Any = self.visual.blocks[-1]
        self.vitrim_taps = Taps(method, scoring=(last.attn, read_tower_attention))
        self.vitrim_merger_input: Tensor | None = None
        tap_input(self.visual.merger, self.keep_merger_input)  # the merger takes no hooks (vitrim.vllm.compat)

    def hand_on_keeping(self, keep: int, method: Method) -> HandOn:
        """The seam at a request's own ``keep`` (tokens of an image, of each temporal patch of a video) and method
        (the engine's, with the request's own options: :func:`~vitrim.vllm.request_keep.item_methods`)."""
        return HandOn(method, lambda evidence, count: select_keeping(method, evidence, keep))

    def hand_on_prompt(self, keep: int, prompt: ImagePrompt, method: Method) -> HandOn:
        """The seam for one image at ``keep`` whose selection by ``method`` reads ``prompt`` (its text, embedded by
        the LLM)."""
        embed = self.get_language_model().embed_input_ids  # type: ignore[attr-defined]
        return HandOn(method, lambda evidence, count: select_with_prompts([method], evidence, [keep], [prompt], embed))

    def vitrim_item_methods(self, kwargs: Mapping[str, object], modality: str) -> list[Method] | None:
        """Each ``modality`` item's method as its request asked (None: the engine's for every item)."""
        return item_methods(kwargs, modality, self.vitrim_options.method, self.vitrim_methods) or None

    def keep_merger_input(self, states: Tensor) -> None:
        self.vitrim_merger_input = states.reshape(states.shape[0], -1)  # (P, 1, C) -> (P, C)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[Tensor, int]:
        return sequential_mrope_positions(len(input_tokens))  # re-numbered from the images on (compat)

    def recompute_mrope_positions(
        self,
        input_ids: list[int] | Tensor,
        multimodal_embeddings: Sequence[Tensor],
        mrope_positions: Tensor,
        num_computed_tokens: int,
    ) -> tuple[Sequence[Tensor], Tensor, int]:
        """vLLM's runner hook, each medium's rows (E + 4 columns) of this prefill chunk -> the rows without their
        4 position columns, the prompt's positions and delta (:func:`~vitrim.vllm.compat.renumber_media`)."""
        ids = input_ids.tolist() if isinstance(input_ids, Tensor) else list(input_ids)
        cells = [rows[:, -4:].T.long() for rows in multimodal_embeddings]
        positions, delta = renumber_media(ids, cells, mrope_positions, num_computed_tokens, self.config)  # type: ignore[attr-defined]
        return [rows[:, :-4] for rows in multimodal_embeddings], positions, delta

    def vitrim_media(self, kwargs: dict[str, object]) -> list[tuple[str, Any]]:
        """(modality, vLLM's parsed input) for each modality the request holds, in vLLM's order; embeddings refused
        in one line."""
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)  # type: ignore[attr-defined]
        media = []
        for modality, found in inputs.items():
            if found is None:
                continue
            if found["type"] not in ("pixel_values", "pixel_values_videos"):
                raise ValueError(
                    f"vitrim: trimmed {self.title} selects from the tower's evidence; send pixels, not embeds"
                )
            media.append((modality, found))
        return media

    def cut_media(
        self,
        grid: Tensor,
        pixels: Tensor,
        own: Sequence[Tensor],
        window_index: Tensor | None,
        time_intervals: Sequence[Tensor | float] | None = None,
        keeps: Sequence[int] | None = None,
        prompts: Sequence[ImagePrompt] | None = None,
        methods: Sequence[Method] | None = None,
    ) -> Iterator[ImageCut]:
        """After the tower ran on ``pixels``: each image's (or, with ``time_intervals``, each video's) selection from
        the evidence the taps caught, through vitrim.vlm's seam as on transformers (:meth:`HandOn.run_media`);
        ``own`` its tokens (N_i, E) in raster order, ``window_index`` the tower's window order (None: full attention,
        raster order), ``time_intervals`` per video its temporal step (Qwen2.5-VL: ``tokens_per_second ·
        second_per_grid_ts``; Qwen3-VL: 0, each temporal patch numbered as its own grid), ``keeps`` each item's kept
        tokens as its request asked (per temporal patch of a video; None: the engine's), ``prompts`` each image's
        prompt for a method that reads it (:func:`~vitrim.vllm.prompt_instruction.image_prompts`; images only),
        ``methods`` each item's method as its request asked (None: the engine's); each selection recorded under the
        item's content seed."""
        states, self.vitrim_merger_input = self.vitrim_merger_input, None
        if states is None:
            raise RuntimeError(f"vitrim: the {self.title} tower ran without its merger")
        merge = self.visual.spatial_merge_size
        evidence = image_evidence(self.vitrim_taps.take_attention(), states, grid, merge, window_index)
        items = pixels.split(grid.prod(-1).tolist())
        seeds = image_seeds(items) if recording() else None  # (I,) the record's keys (selection_record)
        unit = merge * merge
        video = time_intervals is not None

        def project(merged: Tensor) -> Tensor:  # (k, m²C) merged patch states -> (k, E) through the merger
            return self.visual.merger(merged.reshape(-1, merged.shape[-1] // unit).to(states.dtype)[:, None])

        for index, (item, tokens) in enumerate(zip(evidence, own, strict=True)):
            method = self.vitrim_options.method if methods is None else methods[index]
            hand_on = self.vitrim_hand_on
            if keeps is not None:  # an image method at the request's keep
                hand_on = self.hand_on_keeping(keeps[index], method)
            elif method is not self.vitrim_options.method:  # a video method at the request's options
                hand_on = HandOn(method, method.select)
            if prompts is not None:
                keep = self.vitrim_options.tokens(len(tokens)) if keeps is None else keeps[index]
                hand_on = self.hand_on_prompt(keep, prompts[index], method)
            chosen, written = hand_on.run_media(item, tokens, items[index], project, video=video)
            self.vitrim_record.add_all(None if seeds is None else seeds[index : index + 1], [chosen.kept])
            cells = grid[index].tolist()
            if time_intervals is None:
                positions = image_positions(cells, merge)  # (N, 4)
            else:
                positions = video_positions(cells, merge, time_intervals[index])
                per_frame = len(tokens) // cells[0]
                placeholders = (
                    replace(self.vitrim_options, method=method).video_tokens(cells[0], per_frame)
                    if keeps is None
                    else cells[0] * keeps[index]
                )
                if len(chosen.kept) != placeholders:
                    raise RuntimeError(
                        f"vitrim: method {self.vitrim_options.method.name!r} kept {len(chosen.kept)} tokens of a "
                        f"video whose prompt holds {placeholders} placeholders"
                    )
            yield ImageCut(index, tokens, positions.to(tokens.device), chosen, written)


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
        refuse_vllm_video_pruning(vllm_config.model_config.multimodal_config.get_video_pruning_spec(), options)
        declare_image_pruning(vllm_config.model_config.multimodal_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.install_vitrim(options, vllm_config.model_config.mrope_num_dims)

    def embed_multimodal(self, **kwargs: object) -> Any:
        out = []
        for modality, found in self.vitrim_media(kwargs):
            video = modality == "video"
            grid = found["video_grid_thw" if video else "image_grid_thw"]
            pixels = found["pixel_values_videos" if video else "pixel_values"]
            embeds = self.visual(pixels, grid_thw=grid.tolist())  # (ΣN, E) raster order
            window_index = self.visual.prepare_encoder_metadata(grid.tolist())["window_index"].to(embeds.device)
            own = embeds.split(tokens_per_image(grid, self.visual.spatial_merge_size))
            intervals = self.time_intervals(found) if video else None
            keeps, methods = asked_keeps(kwargs, modality), self.vitrim_item_methods(kwargs, modality)
            prompts = None if video else image_prompts(kwargs, self.vitrim_options.method, len(grid))
            for cut in self.cut_media(grid, pixels, own, window_index, intervals, keeps, prompts, methods):
                kept = (cut.own if cut.written is None else cut.written)[cut.selection.kept]  # (k, E)
                out.append(torch.cat([kept, cut.positions[cut.selection.kept].to(kept.dtype)], dim=1))
        return tuple(out)

    def time_intervals(self, video_input: Any) -> list[Tensor]:
        """Per video, transformers' temporal step ``tokens_per_second · second_per_grid_ts`` (a 0-d tensor in the
        processor's dtype, as ``get_rope_index`` multiplies it)."""
        seconds = video_input.get("second_per_grid_ts")
        if seconds is None:
            raise ValueError(f"vitrim: a video reached trimmed {self.title} without second_per_grid_ts")
        tokens_per_second = self.config.vision_config.tokens_per_second
        return [tokens_per_second * second for second in seconds.reshape(-1)]
