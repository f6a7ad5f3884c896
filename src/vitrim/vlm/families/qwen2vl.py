"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (transformers' ``Qwen2VL…``, ``Qwen2_5_VL…``, ``Qwen3VL…`` classes).

The model (transformers ≥ 5): ``model.model.visual`` (patches → blocks → ``PatchMerger``, one token per 2×2
patches; Qwen2.5 runs most blocks in windows) → scattered into the ``input_ids == image_token_id`` positions of the
embeddings → ``model.model.language_model`` with M-RoPE: positions (3, B, L) - temporal, height, width - from
``get_rope_index`` over the whole sequence; an image's tokens take their grid coordinates and the text after it
continues from the image's largest coordinate + 1, so positions run ahead of or behind the token count by
``rope_deltas`` (B, 1), which the model stores and adds at decode (position = tokens seen + rope_deltas).
Images have different sizes, so the token count per image is known only at the forward pass.

What vitrim does (conventions of :mod:`vitrim.vlm.evidence.merged_tokens` for the evidence and the index space):
- **positions**: computed from the FULL sequence as the unmodified model would (its own ``get_rope_index``, or the
  ``position_ids`` ``generate`` passes), then sliced to the kept tokens, so dropping a token is masking its key;
- **rope_deltas**: the LLM's cache holds ``n_dropped`` fewer tokens per sample, so after a pruned prefill the model's
  ``rope_deltas`` is set to the unmodified value + ``n_dropped`` (per sample): the model's own decode positions
  (kept tokens seen + rope_deltas) then equal the unmodified model's. ``remove()`` puts back the unmodified value
  where vitrim's still stands (what a model never touched holds after the same calls: a later decode on a cache,
  or a call with ``inputs_embeds`` alone, reads it);
- **decode**: the caller's attention mask (the unpruned layout, as ``generate`` grows it) is mapped onto the cache's
  layout; ``generate``'s own position ids need nothing (it counts on from the full prefill's positions). A caller
  who passes a mask and no positions gets the positions the model means (mask count + rope_deltas, this step's
  columns): transformers 5.24's unmodified Qwen fails on that path (it builds positions for the whole mask).

Where it taps (the capture → select → write sequence is :mod:`vitrim.vlm.stages.capture`'s; the prefill, the
shortened LLM input and decoding are the pre-LLM stage's, :mod:`vitrim.vlm.stages.pre_llm`): the scoring block's
attention (the received attention, :func:`tower_attention`; only for methods that read it); the output of
``model.model.visual`` (the method selects per image; merged tokens are put through the merger and written into
their slots); at the shortened prefill, the DeepStack rows and rope_deltas; at decode, M-RoPE positions.
Images after a cached prefix are refused with a ``ValueError`` (nothing is left silently unpruned).

Videos (``pixel_values_videos`` + ``video_grid_thw``, or ``generate()``'s ``mm_encoder_outputs["video"]``) run through
the same tower, one tower call for the prompt's images and one for its videos; which call is which is known from the
model's own ``get_image_features`` / ``get_video_features`` (an instance attribute wraps each while installed). Each
video is one item of the pre-LLM stage, its N = t·(h/m)·(w/m) tokens in raster order ``(t, row, column)`` wherever
they lie in the prompt (Qwen3-VL writes a timestamp text before each temporal patch; those text tokens always stay),
and :meth:`Qwen2VLAdapter.image_tokens` puts images and videos in the prompt's reading order. A video method
(``reads_time``: ``evs``, ``vidcom2``, ``temporal_downsample``) selects over the whole video and leaves images
whole; an image method selects on each temporal patch as on an image (``keep=`` per temporal patch), the baselines'
practice. DeepStack rows follow their tokens, video or image, with the same indices.

Qwen3-VL adds DeepStack: the tower's intermediate blocks give one more row per image token for each of the LLM's
first layers (``deepstack_visual_embeds``, added at ``visual_pos_masks``); those rows go with their tokens, and a
merged slot's rows are the mean of its group's. ``generate()`` encodes the images before its first forward
(``mm_encoder_outputs``) and expands beams after; both are handled (the method selects in the tower's own hook).
Inside the LLM (the in-LLM stage) the rows are added after layers 0, 1, 2 of the real checkpoints, at or after
FastV's and DART's default drop layer 2: :meth:`Qwen2VLAdapter.follow_in_llm_slots` reads the rows and their mask
at the kept slots once a drop has shortened the hidden states.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.boxes import Affine, TokenBoxes, grid_boxes
from vitrim.vlm.evidence.attention import received_by_segment, rotate_half
from vitrim.vlm.evidence.merged_tokens import TowerAttention, image_evidence, tokens_per_image
from vitrim.vlm.method.base import ImageSelection
from vitrim.vlm.stages.capture import EncoderSeam, Reader, Taps
from vitrim.vlm.stages.contract import FamilyAdapter, FamilyTraits, Prefill, ServedArchitecture, Shortened
from vitrim.vlm.stages.inputs import input_ids_of, refuse_meta_inputs
from vitrim.vlm.stages.sequence import DecodeState, read_short
from vitrim.vlm.stages.spans import ImageSpans, media_in_reading_order, media_spans

# per modality, the forward's pixels and grid arguments
MEDIA_INPUTS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
SCORING_BLOCK = -1  # the block whose output the merger reads: Qwen's counterpart of LLaVA's feature layer


class Qwen2VLAdapter(FamilyAdapter):
    """The seams of one Qwen2-VL / Qwen2.5-VL / Qwen3-VL instance (see the module docstring)."""

    traits = FamilyTraits(
        classes=(
            "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
        ),
        title="Qwen2-VL, Qwen2.5-VL and Qwen3-VL (Qwen2VL…, Qwen2_5_VL…, Qwen3VLForConditionalGeneration)",
        stages=("pre_llm", "in_llm"),
        tower_refused=(
            "its tower packs every image into one sequence and its merger (and Qwen3-VL's DeepStack mergers at "
            "intermediate blocks) reads each 2×2 patch group whole, so a tower method would have to cut whole groups "
            "in every block up to each tap; vitrim's tower methods cut patches (use a pre-LLM or in-LLM method: "
            "DeepStack rows follow the kept tokens there)"
        ),
        video=True,
        served=(
            ServedArchitecture(
                "VitrimQwen2_5_VLForConditionalGeneration",
                "vitrim.vllm.qwen2_5_vl",
                "Qwen2_5_VLForConditionalGeneration",
                "qwen2_5_vl",
            ),
            ServedArchitecture(
                "VitrimQwen3VLForConditionalGeneration",
                "vitrim.vllm.qwen3_vl",
                "Qwen3VLForConditionalGeneration",
                "qwen3_vl",
            ),
        ),
    )
    # M-RoPE gives an image token its (t, h, w) cell, not a count: a subset of the grid has no renumbering of its
    # own, and no author of these methods released Qwen code that builds one (CDPruner's was asked for, never
    # published). positions="authors" here is the common practice of pruning papers on Qwen2.5-VL: the positions
    # the model computes for the full prompt, gathered at the kept tokens (= positions="original"), raster order
    authors_positions = False
    parts = ("visual", "language_model", "get_rope_index")

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.visual: Any = self.inner.visual  # transformers' Qwen2VLModel / Qwen2_5_VLModel's tower
        self.merge_size = int(self.visual.spatial_merge_size)
        # the last shortened prefill's rope_deltas: the value vitrim set, and the unmodified model's (for remove)
        self.rope_deltas_set: Tensor | None = None
        self.rope_deltas_unmodified: Tensor | None = None
        self.encoding: str | None = None  # "image" / "video" while the model's get_…_features runs, else None
        # per modality, the last tower run's grid (I, 3) and one selection per item (encode order)
        self.grids: dict[str, Tensor] = {}
        self.chosen: dict[str, list[ImageSelection]] = {}
        self.full_positions: Tensor | None = None  # the last prefill's M-RoPE positions before shortening

    def tokens_of(self, grid_thw: Tensor) -> list[int]:
        """Merged tokens per image (I,) of ``image_grid_thw`` (I, 3)."""
        return tokens_per_image(grid_thw, self.merge_size)

    def prefill_token_counts(self, kwargs: dict[str, Any], modality: str = "image") -> list[int] | None:
        """Merged tokens per image (or per video) of a forward's images (videos), None when it has none (a decode
        step, text only).

        They come as ``pixel_values`` + ``image_grid_thw`` (``pixel_values_videos`` + ``video_grid_thw``; a direct
        call) or, under ``generate``, already encoded as ``mm_encoder_outputs[modality]`` (whose ``pooler_output``
        holds one tensor per image or video).
        """
        pixels, grid = MEDIA_INPUTS[modality]
        if kwargs.get(pixels) is not None:
            return self.tokens_of(kwargs[grid])
        encoded = (kwargs.get("mm_encoder_outputs") or {}).get(modality)
        if encoded is not None:
            return [int(item.shape[0]) for item in encoded.pooler_output]
        return None

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        """The in-LLM stage's spans: every image's and every video's merged tokens, in reading order (a video's are
        visual tokens as an image's are: FastV, PyramidDrop and DART rank all visual tokens; Qwen3-VL's timestamp
        text between temporal patches stays text)."""

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            refuse_meta_inputs(args, kwargs)
            images, videos = self.prefill_token_counts(kwargs), self.prefill_token_counts(kwargs, "video")
            if images is None and videos is None:
                return  # a decode step or a text-only call
            counts = {int(self.config.image_token_id): images or [], int(self.config.video_token_id): videos or []}
            on_prefill(media_spans(input_ids_of(args, kwargs), counts))

        handle = self.inner.register_forward_pre_hook(hook, with_kwargs=True)
        return handle.remove

    def follow_in_llm_slots(self, slots_now: Callable[[], tuple[Tensor, Tensor] | None]) -> Callable[[], None]:
        """Qwen3-VL: make the DeepStack rows follow the tokens the in-LLM stage keeps; returns the undo.

        transformers' text model adds ``deepstack_visual_embeds[i]`` (V, D) at ``visual_pos_masks`` (B, L) after
        its layer i (``_deepstack_process``, the first layers: 0-2 on Qwen3-VL-8B). After an in-LLM drop before
        such a layer the hidden states are on the kept slots (``slots_now()``: columns, valid, (B, S)), so the
        mask and the rows are read at those slots: each kept image token gets its own row, as in the full model.
        The instance gets an attribute ``_deepstack_process`` calling the model's own (its class is untouched);
        nothing for Qwen2-VL and Qwen2.5-VL."""
        language_model: Any = self.language_model
        original = getattr(language_model, "_deepstack_process", None)
        if original is None:
            if "deepstack_visual_embeds" in inspect.signature(language_model.forward).parameters:
                raise TypeError(
                    f"{type(language_model).__name__} takes DeepStack rows but has no _deepstack_process; vitrim.vlm's "
                    "in-LLM stage needs transformers >= 5's Qwen3-VL layout"
                )
            return lambda: None  # Qwen2-VL, Qwen2.5-VL: nothing is added between layers

        def process(hidden: Tensor, visual_pos_masks: Tensor, visual_embeds: Tensor) -> Tensor:
            slots = slots_now()
            if slots is not None:
                visual_pos_masks, visual_embeds = deepstack_on_slots(visual_pos_masks, visual_embeds, *slots)
            return original(hidden, visual_pos_masks, visual_embeds)

        language_model._deepstack_process = process

        def undo() -> None:
            del language_model._deepstack_process  # the class's method again

        return undo

    # the pre-LLM stage's seams: the method selects in the tower's own hook, for the images of that run

    def prefill_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Prefill | None:
        encoded = kwargs.get("mm_encoder_outputs") or {}
        modalities = tuple(
            name
            for name, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos"))
            if kwargs.get(pixels) is not None or encoded.get(name) is not None
        )
        if not modalities:
            return None
        input_ids = input_ids_of(args, kwargs)
        media = (input_ids == self.config.image_token_id) | (input_ids == self.config.video_token_id)
        runs_tower = kwargs.get("pixel_values") is not None or kwargs.get("pixel_values_videos") is not None
        return Prefill(input_ids, kwargs.get("attention_mask"), runs_tower, {"modalities": modalities}, media)

    def select_hooks(self, stage: EncoderSeam) -> list[Callable[[], None]]:
        return [*TowerSelection(self, stage).hooks(), self.watch_encoding()]

    def watch_encoding(self) -> Callable[[], None]:
        """Wrap the model's ``get_image_features`` / ``get_video_features`` (instance attributes, its class untouched)
        so the tower's hook knows whether it encodes images or videos (Qwen3-VL's video call runs its image one
        inside: the outer call names the run); returns the undo."""
        inner = self.inner
        names = {"get_image_features": "image", "get_video_features": "video"}
        for name, modality in names.items():
            original = getattr(inner, name)

            @functools.wraps(original)  # its signature: generate() reads which inputs it takes
            def encode(*args: Any, _original: Any = original, _modality: str = modality, **kwargs: Any) -> Any:
                outer = self.encoding is None
                if outer:
                    self.encoding = _modality
                try:
                    return _original(*args, **kwargs)
                finally:
                    if outer:
                        self.encoding = None

            setattr(inner, name, encode)

        def undo() -> None:
            for name in names:
                if name in vars(inner):
                    delattr(inner, name)  # the class's method again

        return undo

    def image_tokens(
        self, prefill: Prefill, selections: list[ImageSelection]
    ) -> tuple[list[ImageSelection], list[int]]:
        """The selections and LLM token counts of the prompt's images and videos in reading order (the tower encodes
        all images, then all videos); rows ``generate()`` repeated for beams are walked once per prompt."""
        records: dict[int, tuple[str, list[ImageSelection], list[int]]] = {}
        for modality, token in (("image", self.config.image_token_id), ("video", self.config.video_token_id)):
            encoded = modality in prefill.extras["modalities"]
            if encoded and modality not in self.grids:
                raise ValueError(f"vitrim.vlm saw no {modality} of this prompt encoded after vitrim.vlm.apply")
            chosen, counts = (self.chosen[modality], self.tokens_of(self.grids[modality])) if encoded else ([], [])
            records[int(token)] = (modality, chosen, counts)
        assert prefill.media is not None
        return media_in_reading_order(prefill.input_ids, prefill.media, records)

    def prefill_positions(self, kwargs: dict[str, Any], embeds: Tensor) -> Tensor:
        positions = kwargs.get("position_ids")  # the full sequence's (3 or 4, B, L), from the model or generate
        if positions is None:
            raise ValueError("vitrim.vlm needs Qwen's M-RoPE positions at the prefill (pass mm_token_type_ids)")
        self.full_positions = positions
        return positions

    def shorten_extras(self, kwargs: dict[str, Any], prefill: Prefill, shortened: Shortened) -> None:
        short, kept = shortened.short, shortened.kept
        if kwargs.get("visual_pos_masks") is not None:  # Qwen3-VL's DeepStack: its rows go with their tokens
            stays = kept[kwargs["visual_pos_masks"]]  # (V,) per visual position, reading order
            kwargs["visual_pos_masks"] = read_short(short, kwargs["visual_pos_masks"])
            kwargs["deepstack_visual_embeds"] = [rows[stays] for rows in kwargs["deepstack_visual_embeds"]]
        assert self.full_positions is not None
        deltas = rope_deltas(self.full_positions, prefill.attention_mask)  # (B, 1) the unmodified model's
        dropped = (shortened.spans.is_image & ~kept).sum(1)  # (B,)
        self.rope_deltas_unmodified = deltas
        self.rope_deltas_set = self.inner.rope_deltas = deltas + dropped[:, None].to(deltas.device)

    def decode_extras(self, kwargs: dict[str, Any], state: DecodeState, mask: Tensor, past: int, new: int) -> None:
        if kwargs.get("attention_mask") is None and bool(state.prefill_mask.all()):
            return  # the model's own positions: tokens in the cache + the corrected rope_deltas
        kwargs["attention_mask"] = mask
        if kwargs.get("position_ids") is None:
            # what the model computes from a mask (tokens seen + rope_deltas), for this step's columns only
            deltas = self.inner.rope_deltas  # (B, 1), corrected at the prefill
            steps = mask.long().cumsum(-1)[:, -new:] - 1 + deltas  # (B, q)
            kwargs["position_ids"] = steps[None].expand(3, -1, -1)

    def remove_extras(self) -> None:
        """The model's ``rope_deltas`` as the unmodified model would hold them after the same calls: the last
        shortened prefill's unmodified value while vitrim's corrected one still stands (the model replaces it at
        every prefill of its own, which is then already the unmodified value; so was it before the first)."""
        if self.rope_deltas_set is not None and self.inner.rope_deltas is self.rope_deltas_set:
            self.inner.rope_deltas = self.rope_deltas_unmodified
        self.rope_deltas_set = self.rope_deltas_unmodified = None

    # where its image tokens lie in the user's picture

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        """Per picture of ``sizes`` (H, W): its merged tokens' boxes (:func:`qwen_boxes`), the resize read from
        ``inputs["image_grid_thw"]``."""
        grids = torch.as_tensor(inputs["image_grid_thw"])
        return [qwen_boxes(self.config, g, s) for g, s in zip(grids, sizes, strict=True)]


def rope_deltas(positions: Tensor, attention_mask: Tensor | None) -> Tensor:
    """(B, 1) long: what ``get_rope_index`` stores as ``rope_deltas`` for the prefill whose M-RoPE ``positions``
    (3 or 4, B, L; the last three rows are t, h, w) these are - the largest position of a sample's real tokens + 1
    minus their count. Read from the positions, so images, videos and Qwen3-VL's timestamps need no grid here."""
    mrope = positions[-3:]
    if attention_mask is None:
        real = torch.ones(mrope.shape[1:], dtype=torch.bool, device=mrope.device)
    else:
        real = attention_mask.bool().to(mrope.device)
    largest = torch.where(real, mrope, torch.zeros_like(mrope)).amax(dim=(0, 2))  # (B,)
    return (largest + 1 - real.sum(1))[:, None]


def tower_attention(
    attention: Any,
    hidden: Tensor,
    cu_seqlens: Tensor,
    rotary: tuple[Tensor, Tensor],
    merge_unit: int | None = None,
    qkv: Tensor | None = None,
) -> TowerAttention:
    """A transformers Qwen vision attention's evidence: its ``qkv`` and rotary on its input, then the attention each
    patch receives within its segment (:func:`~vitrim.vlm.evidence.attention.received_by_segment`), or, given
    ``merge_unit`` (m², for a method with ``needs_query_attention``), in its place the rotated queries (scaled) and
    keys averaged over each row group of m² patches (``TowerAttention.group_queries`` / ``group_keys``).

    hidden: (P, C) the block's normed input in tower order; rotary: (cos, sin), each (P, hd), as the block gets them;
    qkv: (P, 3·C) the block's own ``qkv`` output on ``hidden`` where the tap kept it (:class:`ScoringTap` with the
    projection), else computed here: the same values, and at the benchmark's shapes 70 % of this function's time.
    """
    num_patches = hidden.shape[0]
    num_heads = int(attention.num_heads)
    work = torch.promote_types(hidden.dtype, torch.float32)  # a half-precision tower's map is scored in float32
    if qkv is None:
        qkv = attention.qkv(hidden)
    qk = qkv.reshape(num_patches, 3, num_heads, -1)[:, :2].to(work)  # (P, 2, H, hd): the values are not read
    query, key = qk[:, 0], qk[:, 1]  # (P, H, hd) each
    cos, sin = (r.to(work).unsqueeze(-2) for r in rotary)  # (P, 1, hd)
    query_rot = query * cos + rotate_half(query) * sin
    key_rot = key * cos + rotate_half(key) * sin
    if merge_unit is None:
        received = received_by_segment(query_rot, key_rot, cu_seqlens, float(attention.scaling))  # (H, P)
        return TowerAttention(received=received, keys=key)

    def by_group(rows: Tensor) -> Tensor:  # (P, H, hd) -> (G, H, hd): the mean over each merged token's patches
        return rows.reshape(num_patches // merge_unit, merge_unit, num_heads, -1).mean(1)

    return TowerAttention(  # no received map: a method reading the mean-query attention reads nothing else of it
        received=None,
        keys=key,
        group_queries=by_group(query_rot) * float(attention.scaling),
        group_keys=by_group(key_rot),
    )


def read_tower_attention(
    attention: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    qkv: Tensor | None = None,
    merge_unit: int | None = None,
) -> TowerAttention:
    """:func:`tower_attention` of a block's attention from its forward's arguments and its ``qkv`` output (the taps'
    reader, tapped with the block's ``qkv``; bind ``merge_unit`` for a method that reads the mean-query
    attention)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    return tower_attention(
        attention, hidden, kwargs["cu_seqlens"], kwargs["position_embeddings"], merge_unit=merge_unit, qkv=qkv
    )


class TowerSelection:
    """Where Qwen hands on its tokens: the tower's output (its forward hook), per image (their sizes differ);
    merged tokens are put through the merger and written into their slots, DeepStack rows averaged over their
    groups."""

    def __init__(self, adapter: Qwen2VLAdapter, stage: EncoderSeam) -> None:
        self.adapter, self.stage = adapter, stage
        blocks = adapter.visual.blocks
        object_block = getattr(stage.method, "object_block", None)  # a method reading a second block (HiPrune)
        if object_block is not None and not 0 <= object_block < len(blocks):
            raise ValueError(
                f"object_layer={object_block + 1} is past this tower's {len(blocks)} blocks; expected 1 … {len(blocks)}"
            )
        # each tap reads its block's own qkv output (ScoringTap's projection): q and k are not computed twice
        probe = None if object_block is None else (blocks[object_block].attn, read_tower_attention,
                                                   blocks[object_block].attn.qkv)  # fmt: skip
        scoring: Reader = read_tower_attention
        if stage.method.needs_query_attention:  # FastVID: the q/k means in place of the received map
            scoring = functools.partial(read_tower_attention, merge_unit=adapter.merge_size**2)
        last = blocks[SCORING_BLOCK].attn
        self.taps = Taps(stage.method, scoring=(last, scoring, last.qkv), probe=probe)
        stage.taps.append(self.taps)

    def hooks(self) -> list[Callable[[], None]]:
        handle = self.adapter.visual.register_forward_hook(self.after_tower, with_kwargs=True)
        return [handle.remove, self.taps.remove]

    def after_tower(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        attention, probed = self.taps.take_attention(), self.taps.take_probe()
        grid: Tensor = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
        pixels: Tensor = args[0] if args else kwargs["hidden_states"]
        adapter = self.adapter
        modality = adapter.encoding or "image"  # a direct call of the tower: images
        tokens = adapter.tokens_of(grid)
        with torch.no_grad():
            window = self.window_index(grid)
            evidence = image_evidence(attention, output.last_hidden_state, grid, adapter.merge_size, window)
            objects = (
                None
                if probed is None
                else image_evidence(probed, output.last_hidden_state, grid, adapter.merge_size, window)
            )
        unit = adapter.merge_size**2
        states_dtype = output.last_hidden_state.dtype

        def project(merged: Tensor) -> Tensor:  # (k, m²C) merged patch states -> (k, E) through the merger
            return adapter.visual.merger(merged.reshape(-1, merged.shape[-1] // unit).to(states_dtype))

        selections, pieces, wrote = [], [], False
        start = 0
        for index, (item, item_pixels) in enumerate(zip(evidence, pixels.split(grid.prod(-1).tolist()), strict=True)):
            probed_item = None if objects is None else objects[index]  # a second block's (HiPrune's object layer)
            count = item.features.shape[0]
            own = output.pooler_output[start : start + count]  # (N, E) the merger's (raster) output
            chosen, written = self.stage.hand_on.run_media(
                item, own, item_pixels, project, video=modality == "video", probed=probed_item
            )
            selections.append(chosen)
            wrote |= written is not None
            pieces.append(own if written is None else written)
            start += count
        adapter.grids[modality], adapter.chosen[modality] = grid, selections
        self.stage.selected(selections)
        if not wrote:
            return None  # nothing merged: the tower's output is untouched
        output.pooler_output = torch.cat(pieces)
        if getattr(output, "deepstack_features", None):
            output.deepstack_features = merge_deepstack(output.deepstack_features, selections, tokens)
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


def deepstack_on_slots(visual_pos_masks: Tensor, rows: Tensor, columns: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Qwen3-VL's DeepStack input on slots: ``visual_pos_masks`` (B, L) bool and ``rows`` (V, D), one per True
    position in reading order, read at the slots ``columns`` / ``valid`` (B, S) -> the mask (B, S) and the rows of
    the image positions it marks, in reading order again (slots keep their columns' order within a sample)."""
    rank = visual_pos_masks.flatten().long().cumsum(0).view_as(visual_pos_masks) - 1  # (B, L) row of each position
    on_slots = valid & visual_pos_masks.gather(1, columns)  # (B, S)
    return on_slots, rows[rank.gather(1, columns)[on_slots].to(rows.device)]


def merge_deepstack(features: list[Tensor], selections: list[ImageSelection], tokens: list[int]) -> list[Tensor]:
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


def qwen_boxes(config: Any, grid_thw: Tensor, size: tuple[int, int]) -> TokenBoxes:
    """Qwen's merged tokens on a picture of ``size`` (H, W); ``grid_thw``: (3,) the image's ``image_grid_thw`` row.

    The processor resizes the picture to ``grid · patch`` (smart_resize); one token per ``merge × merge`` patches in
    raster order. Returns (grid_h / merge)·(grid_w / merge) boxes, all of view 0 ("image").
    """
    height, width = size
    patch = int(config.vision_config.patch_size)
    merge = int(config.vision_config.spatial_merge_size)
    frames, grid_h, grid_w = (int(v) for v in grid_thw.tolist())
    if frames != 1:
        raise ValueError(f"image_grid_thw {grid_thw.tolist()} has {frames} frames; a picture has one")
    resized_h, resized_w = grid_h * patch, grid_w * patch  # the smart_resize size
    x, y = Affine(width / resized_w, 0.0), Affine(height / resized_h, 0.0)
    rows, cols = grid_h // merge, grid_w // merge
    boxes = grid_boxes(rows, cols, patch * merge, x, y, size)
    return TokenBoxes(boxes, torch.zeros(len(boxes), dtype=torch.long), ("image",), ((rows, cols),), size)
