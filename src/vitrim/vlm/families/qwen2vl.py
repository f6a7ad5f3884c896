"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (transformers' ``Qwen2VL…``, ``Qwen2_5_VL…``, ``Qwen3VL…`` classes).

The model (transformers ≥ 5): ``model.model.visual`` (patches → blocks → ``PatchMerger``, one token per 2×2
patches; Qwen2.5 runs most blocks in windows) → scattered into the ``input_ids == image_token_id`` positions of the
embeddings → ``model.model.language_model`` with M-RoPE: positions (3, B, L) - temporal, height, width - from
``get_rope_index`` over the whole sequence; an image's tokens take their grid coordinates and the text after it
continues from the image's largest coordinate + 1, so positions run ahead of or behind the token count by
``rope_deltas`` (B, 1), which the model stores and adds at decode (position = tokens seen + rope_deltas).
Images have different sizes, so the token count per image is known only at the forward pass.

What vitrim does (conventions of ``vitrim.vlm.families.qwen2vl_vision`` for the evidence and the index space):
- **positions**: computed from the FULL sequence as the unmodified model would (its own ``get_rope_index``, or the
  ``position_ids`` ``generate`` passes), then sliced to the kept tokens, so dropping a token is masking its key;
- **rope_deltas**: the LLM's cache holds ``n_dropped`` fewer tokens per sample, so after a pruned prefill the model's
  ``rope_deltas`` is set to the unmodified value + ``n_dropped`` (per sample): the model's own decode positions
  (kept tokens seen + rope_deltas) then equal the unmodified model's;
- **decode**: the caller's attention mask (the unpruned layout, as ``generate`` grows it) is mapped onto the cache's
  layout; ``generate``'s own position ids need nothing (it counts on from the full prefill's positions). A caller
  who passes a mask and no positions gets the positions the model means (mask count + rope_deltas, this step's
  columns): transformers 5.24's unmodified Qwen fails on that path (it builds positions for the whole mask).

Seams (hooks on this instance's submodules only): a forward pre-hook with kwargs on ``model.model`` (prefill: its
input ids, mask and token types; decode: the mask); a forward pre-hook on the scoring block's attention (the
received attention, ``family_qwen2vl_vision``; only for methods that read it); a forward hook with kwargs on
``model.model.visual`` (the method selects per image; merged tokens are put through the merger and written into
their slots); a forward pre-hook with kwargs on ``model.model.language_model`` (the LLM input is shortened,
``vitrim.vlm.stages.sequence``, at the full sequence's positions; rope_deltas corrected).
Videos and images after a cached prefix are refused with a ``ValueError`` (nothing is left silently unpruned).

Qwen3-VL adds DeepStack: the tower's intermediate blocks give one more row per image token for each of the LLM's
first layers (``deepstack_visual_embeds``, added at ``visual_pos_masks``); those rows go with their tokens, and a
merged slot's rows are the mean of its group's. ``generate()`` encodes the images before its first forward
(``mm_encoder_outputs``) and expands beams after; both are handled (the method selects in the tower's own hook).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.families.qwen2vl_vision import ScoringCapture, capture_scoring_block, image_evidence
from vitrim.vlm.families.seams import inner_model, input_ids_of, keep_all
from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.base import ImageSelection, Installation, Method, VisionEvidence, content_seed
from vitrim.vlm.stages.sequence import (
    DecodeState,
    columns_to_keep,
    decode_attention_mask,
    gather_columns,
    plan_short_sequence,
)
from vitrim.vlm.stages.spans import ImageSpans, spans_from_mask

SCORING_BLOCK = -1  # the block whose output the merger reads: Qwen's counterpart of LLaVA's feature layer


class Qwen2VLAdapter:
    """The seams of one Qwen2-VL / Qwen2.5-VL / Qwen3-VL instance (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        inner = inner_model(model, ("visual", "language_model", "get_rope_index"), "Qwen2-VL")
        self.model = model
        self.inner: Any = inner  # transformers' Qwen2VLModel / Qwen2_5_VLModel
        self.visual: Any = inner.visual
        self.language_model: nn.Module = inner.language_model
        self.config: Any = model.config
        self.merge_size = int(inner.visual.spatial_merge_size)

    def tokens_per_image(self) -> None:
        return None  # images keep their own size: (h / 28)·(w / 28) tokens at Qwen's 14-px patches

    def tokens_of(self, grid_thw: Tensor) -> list[int]:
        """Merged tokens per image (I,) of ``image_grid_thw`` (I, 3)."""
        return (grid_thw.prod(-1) // (self.merge_size * self.merge_size)).tolist()

    def spans(self, input_ids: Tensor, grid_thw: Tensor) -> ImageSpans:
        """The image positions of ``input_ids`` (B, L), image i giving ``tokens_of(grid_thw)[i]`` tokens."""
        return spans_from_mask(input_ids == self.config.image_token_id, self.tokens_of(grid_thw))

    def prefill_token_counts(self, kwargs: dict[str, Any]) -> list[int] | None:
        """Merged tokens per image of a forward's images, None when it has none (a decode step, text only).

        The images come as ``pixel_values`` + ``image_grid_thw`` (a direct call) or, under ``generate``, already
        encoded as ``mm_encoder_outputs["image"]`` (whose ``pooler_output`` holds one tensor per image).
        """
        if kwargs.get("pixel_values") is not None:
            return self.tokens_of(kwargs["image_grid_thw"])
        encoded = (kwargs.get("mm_encoder_outputs") or {}).get("image")
        if encoded is not None:
            return [int(image.shape[0]) for image in encoded.pooler_output]
        return None

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            counts = self.prefill_token_counts(kwargs)
            if counts is None:
                return  # a decode step or a text-only call
            is_image = input_ids_of(args, kwargs) == self.config.image_token_id
            on_prefill(spans_from_mask(is_image, counts))

        handle = self.inner.register_forward_pre_hook(hook, with_kwargs=True)
        return handle.remove

    def install_pre_llm(self, method: Method, keep: KeepSpec) -> Installation:
        return QwenPreLLM(self, method, keep)


@dataclass
class TowerRun:
    """One run of the tower on images, with the method's choice per image (reading order)."""

    grid: Tensor  # (I, 3) image_grid_thw
    selections: list[ImageSelection]


@dataclass
class Prefill:
    """The model-level inputs of the prefill in flight (the LLM hook needs them, transformers hands it none)."""

    input_ids: Tensor  # (B, L)
    attention_mask: Tensor | None  # (B, L)
    token_types: Tensor  # (B, L) mm_token_type_ids


class QwenPreLLM:
    """A pre-LLM method installed on a Qwen2-VL / Qwen2.5-VL / Qwen3-VL instance (an :class:`Installation`).

    The tower may run inside the model's forward (``model(pixel_values=...)``) or before it (``generate`` encodes
    the images first and passes ``mm_encoder_outputs``), so the method selects in the tower's own hook, for the
    images of that run, and the LLM hook takes the last run's choice.
    """

    def __init__(self, adapter: Qwen2VLAdapter, method: Method, keep: KeepSpec) -> None:
        self.adapter = adapter
        self.method = method
        self.keep = keep
        self.capture: ScoringCapture | None = None
        self.tower: TowerRun | None = None
        self.prefill: Prefill | None = None
        self.layout: DecodeState | None = None
        self.selections: list[ImageSelection] | None = None
        self.rope_deltas_before = adapter.inner.rope_deltas
        inner, visual = adapter.inner, adapter.visual
        self.handles = [
            inner.register_forward_pre_hook(self.before_model, with_kwargs=True),
            visual.register_forward_hook(self.after_tower, with_kwargs=True),
            adapter.language_model.register_forward_pre_hook(self.before_llm, with_kwargs=True),
        ]
        if method.needs_cls_attention:  # the received attention costs one more attention map: only when asked
            scoring = visual.blocks[SCORING_BLOCK].attn
            self.handles.append(scoring.register_forward_pre_hook(self.before_scoring, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.adapter.inner.rope_deltas = self.rope_deltas_before

    def selection(self) -> list[ImageSelection] | None:
        return self.selections

    # the tower: score, select, write merged tokens

    def before_scoring(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        with torch.no_grad():
            self.capture = capture_scoring_block(module, hidden, kwargs["cu_seqlens"], kwargs["position_embeddings"])

    def after_tower(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        capture, self.capture = self.capture, None
        if capture is None and self.method.needs_cls_attention:
            raise RuntimeError("vitrim.vlm: the Qwen tower ran without its scoring block")
        grid: Tensor = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
        pixels: Tensor = args[0] if args else kwargs["hidden_states"]
        tokens = self.adapter.tokens_of(grid)
        keep = [self.keep.tokens(n) for n in tokens]  # ValueError naming keep when an int exceeds an image
        if keep == tokens:
            self.tower = TowerRun(grid, [keep_all(n, grid.device) for n in tokens])
            return None  # every token stays: the tower's output is untouched
        with torch.no_grad():
            evidence = image_evidence(
                capture, output.last_hidden_state, grid, self.adapter.merge_size, self.window_index(grid)
            )
        seeds = torch.tensor([content_seed(image) for image in pixels.split(grid.prod(-1).tolist())])  # (I,)
        selections, rows, merged_tokens = [], [], []
        start = 0
        for image, (item, k) in enumerate(zip(evidence, keep, strict=True)):
            found = VisionEvidence(
                features=item.features[None],
                cls_attention=None if item.received is None else item.received[None],
                keys=None if item.keys is None else item.keys[None],
                seeds=seeds[image : image + 1],
                projected=output.pooler_output[start : start + tokens[image]][None],  # the merger's (raster) output
            )
            chosen = self.method.select(found, k)[0]
            selections.append(chosen)
            if chosen.merged is not None:
                unit = self.adapter.merge_size**2
                merged = chosen.merged.reshape(k * unit, -1).to(output.last_hidden_state.dtype)
                rows.append(chosen.kept + start)
                merged_tokens.append(self.adapter.visual.merger(merged))  # (k, D): the projector on merged states
            start += tokens[image]
        self.tower = TowerRun(grid, selections)
        if rows:
            pooled = output.pooler_output.clone()
            pooled[torch.cat(rows)] = torch.cat(merged_tokens).to(pooled.dtype)
            output.pooler_output = pooled
            if getattr(output, "deepstack_features", None):
                output.deepstack_features = _merge_deepstack(output.deepstack_features, selections, tokens)
        return output

    def window_index(self, grid: Tensor) -> Tensor | None:
        """Qwen2.5's window order of the tower's row groups (None for Qwen2-VL, which keeps raster order)."""
        visual = self.adapter.visual
        if not hasattr(visual, "fullatt_block_indexes"):
            return None
        from transformers.vision_utils import get_vision_window_index

        window_index, _ = get_vision_window_index(
            grid, visual.spatial_merge_size, visual.window_size, visual.patch_size
        )
        return window_index

    # the model: what a prefill holds, the decode steps after a pruned one

    def before_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
        cache = kwargs.get("cache")
        seen = cache.get_seq_length() if cache is not None else 0
        encoded = kwargs.get("mm_encoder_outputs") or {}
        has_images = kwargs.get("pixel_values") is not None or encoded.get("image") is not None
        self.prefill = None
        if kwargs.get("pixel_values_videos") is not None or encoded.get("video") is not None:
            raise ValueError("vitrim.vlm reduces images only; this Qwen input holds videos")
        if not has_images:
            if seen == 0:
                self.layout = None  # a text-only forward: nothing of ours in its cache
                return None
            return None if self.layout is None else self.decode_inputs(args, kwargs, seen)
        if seen:
            raise ValueError("vitrim.vlm cannot reduce images that follow a cached prefix; run them in the prefill")
        if encoded.get("image") is not None and self.tower is None:
            raise ValueError("vitrim.vlm needs the image features made by this model after apply (mm_encoder_outputs)")
        if kwargs.get("pixel_values") is not None:
            self.tower = None  # the tower runs inside this forward
        input_ids = input_ids_of(args, kwargs)
        token_types = kwargs.get("mm_token_type_ids")
        if token_types is None:
            token_types = (input_ids == self.adapter.config.image_token_id).int()
        self.layout = None
        self.prefill = Prefill(input_ids, kwargs.get("attention_mask"), token_types)
        return None

    def decode_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], seen: int) -> tuple | None:
        """A decode step after a pruned prefill: the caller's mask mapped onto the cache, positions where needed."""
        assert self.layout is not None
        given = kwargs.get("attention_mask")
        if given is None and bool(self.layout.prefill_mask.all()):
            return None  # the model's own positions: tokens in the cache + the corrected rope_deltas
        query = _query_length(args, kwargs)
        mask = decode_attention_mask(self.layout, given, seen, query)  # (B, seen + query)
        kwargs["attention_mask"] = mask
        if kwargs.get("position_ids") is None:
            # what the model computes from a mask (tokens seen + rope_deltas), for this step's columns only
            deltas = self.adapter.inner.rope_deltas  # (B, 1), corrected at the prefill
            steps = mask.long().cumsum(-1)[:, -query:] - 1 + deltas  # (B, q)
            kwargs["position_ids"] = steps[None].expand(3, -1, -1)
        return args, kwargs

    # the LLM: the shortened prefill

    def before_llm(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
        prefill, self.prefill = self.prefill, None
        tower, self.tower = self.tower, None
        if prefill is None:
            return None
        if tower is None:
            raise RuntimeError("vitrim.vlm: a Qwen prefill with images reached the LLM without a tower run")
        self.selections = tower.selections
        tokens = self.adapter.tokens_of(tower.grid)
        if [len(s.kept) for s in tower.selections] == tokens:
            return None  # every token stays: the model runs untouched
        tower = _expanded(tower, prefill.input_ids == self.adapter.config.image_token_id, tokens)
        tokens = self.adapter.tokens_of(tower.grid)
        spans = self.adapter.spans(prefill.input_ids, tower.grid)
        kept = columns_to_keep(spans, tower.selections, max(tokens))  # (B, L) bool
        short = plan_short_sequence(kept, kwargs.get("attention_mask"))
        positions = kwargs.get("position_ids")  # the full sequence's (3 or 4, B, L), from the model or generate
        if positions is None:
            raise ValueError("vitrim.vlm needs Qwen's M-RoPE positions at the prefill (pass mm_token_type_ids)")
        kwargs["inputs_embeds"] = gather_columns(short, kwargs["inputs_embeds"])
        kwargs["position_ids"] = gather_columns(short, positions, batch_dim=positions.dim() - 2)
        kwargs["attention_mask"] = short.attention_mask
        if kwargs.get("visual_pos_masks") is not None:  # Qwen3-VL's DeepStack: its rows go with their tokens
            stays = kept[kwargs["visual_pos_masks"]]  # (V,) per visual position, reading order
            kwargs["visual_pos_masks"] = gather_columns(short, kwargs["visual_pos_masks"])
            kwargs["deepstack_visual_embeds"] = [rows[stays] for rows in kwargs["deepstack_visual_embeds"]]
        self.layout = DecodeState(prefill_mask=short.attention_mask, full_length=short.full_length)
        _, deltas = self.adapter.inner.get_rope_index(
            prefill.input_ids, prefill.token_types, image_grid_thw=tower.grid, attention_mask=prefill.attention_mask
        )
        dropped = (spans.is_image & ~kept).sum(1)  # (B,)
        self.adapter.inner.rope_deltas = deltas + dropped[:, None].to(deltas.device)
        return args, kwargs


def _query_length(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs["inputs_embeds"]
    return int(tokens.shape[1])


def _expanded(tower: TowerRun, is_image: Tensor, tokens: list[int]) -> TowerRun:
    """The tower's run for a batch ``generate`` expanded (beams, ``num_return_sequences``): each prompt's row
    repeated n times in a row, the images encoded once per prompt; unchanged when the batch was not expanded."""
    copies, rest = divmod(int(is_image.sum()), sum(tokens))
    if copies <= 1 or rest or is_image.shape[0] % copies:
        return tower  # not an expansion: ImageSpans reports any mismatch
    if not torch.equal(is_image, is_image[::copies].repeat_interleave(copies, dim=0)):
        return tower
    per_prompt = is_image[::copies].sum(1).tolist()  # image tokens of each prompt
    order, image = [], 0
    for count in per_prompt:
        mine = []
        while count > 0:
            mine.append(image)
            count -= tokens[image]
            image += 1
        order += mine * copies
    index = torch.tensor(order, dtype=torch.long, device=tower.grid.device)
    return TowerRun(grid=tower.grid[index], selections=[tower.selections[i] for i in order])


def _merge_deepstack(features: list[Tensor], selections: list[ImageSelection], tokens: list[int]) -> list[Tensor]:
    """Qwen3-VL's DeepStack rows (T, D) per tapped layer, a merged slot's row the mean of its group's rows (the
    taps see intermediate states the method's merge formula does not cover; the mean is what vitrim uses)."""
    merged = [rows.clone() for rows in features]
    start = 0
    for selection, count in zip(selections, tokens, strict=True):
        for slot, group in zip(selection.kept.tolist(), selection.groups, strict=True):
            if len(group) > 1:
                for rows, out in zip(features, merged, strict=True):
                    out[start + slot] = rows[start + group.to(rows.device)].mean(0)
        start += count
    return merged
