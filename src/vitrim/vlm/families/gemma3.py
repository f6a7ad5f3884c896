"""Gemma 3 (transformers' ``Gemma3ForConditionalGeneration``): where its image tokens are made and enter the LLM.

The model (transformers ≥ 5): ``model.model.vision_tower`` (SigLIP, no [CLS]; its last layer's states after the
post-LayerNorm) → ``model.model.multi_modal_projector`` (an average pool of the P = p×p patch grid to the
``mm_tokens_per_image`` = t×t grid, kernel k = p / t, then RMSNorm and a matmul: Gemma-3-4B pools 64×64 patches
to 16×16 = 256 tokens) → scattered into the ``input_ids == image_token_id`` positions → ``model.model.language_model``,
whose masks are built per layer type (full and sliding-window layers) with the image block bidirectional through
``token_type_ids`` (``vitrim.vlm.families.gemma3_masks``).

Index space: the image tokens entering the LLM are the projector's pooled tokens, so indices are raster indices of
the pooled t×t grid (row-major, 0 … t²−1); pooled token (r, c) stands for the k×k patches of rows r·k … r·k+k−1 and
columns c·k … c·k+k−1 of the tower's grid. Under the processor's pan-and-scan each crop is a picture of its own
(its own ``pixel_values`` row and run of image tokens), so it is one "image" of ``last_selection`` and keeps ``keep``.

Evidence (:class:`~vitrim.vlm.method.base.VisionEvidence`) in that space:
- ``features``: the pooled tower states (what the projector's norm and matmul read), so a merged token is the mean
  of its group's pooled states put through the projector's norm and matmul;
- **no [CLS]**: the [CLS]-based methods (FasterVLM, VisPruner, VisionZip) rank by the attention each token RECEIVES
  at the scoring layer (the tower's last layer, whose output the projector reads), as for Qwen
  (``vitrim.vlm.families.qwen2vl_vision``): per head, the softmax map of that layer from its own q/k projections on
  its input, summed over the queries and divided by the patch count, then summed over the k×k patches of each
  pooled token (per image and head the scores sum to 1). ``keys``: that layer's keys averaged over the k×k patches.

What reaches the LLM after a method selects: the kept tokens only, at their ORIGINAL positions, with the masks the
unmodified model built gathered to the kept rows and columns (so the image block and the sliding window are the
unmodified model's and dropping is exactly masking keys); decode steps get masks built over each layer's cache.
Seams: forward pre-hooks on the model (``input_ids``, the mask), on the tower (each image's seed), on the scoring
layer's attention (its input), a forward hook on the projector (select, write merged tokens) and a pre-hook with
kwargs on ``model.model`` (decode steps) and on the language model (the prefill is shortened).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.families.gemma3_masks import decode_masks, gather_masks
from vitrim.vlm.families.qwen2vl_vision import received_attention
from vitrim.vlm.families.seams import inner_model, keep_all, prefill_input_ids
from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.base import ImageSelection, Installation, Method, VisionEvidence, content_seed
from vitrim.vlm.stages.sequence import (
    DecodeState,
    columns_to_keep,
    decode_attention_mask,
    decode_position_ids,
    gather_columns,
    plan_short_sequence,
)
from vitrim.vlm.stages.spans import ImageSpans, spans_from_mask


class Gemma3Adapter:
    """The seams of one ``Gemma3ForConditionalGeneration`` instance (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        parts = ("vision_tower", "multi_modal_projector", "language_model")
        inner = inner_model(model, parts, "Gemma3ForConditionalGeneration")
        self.model = model
        self.inner: Any = inner
        self.language_model: nn.Module = inner.language_model
        config: Any = model.config
        self.config: Any = config
        self.text_config: Any = config.get_text_config()

    def tokens_per_image(self) -> int:
        return int(self.config.mm_tokens_per_image)

    def spans(self, input_ids: Tensor) -> ImageSpans:
        """The image positions of ``input_ids`` (B, L): every image gives :meth:`tokens_per_image` tokens."""
        is_image: Tensor = input_ids == self.config.image_token_id  # (B, L)
        per_image = self.tokens_per_image()
        return spans_from_mask(is_image, [per_image] * (int(is_image.sum()) // per_image))

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            input_ids = prefill_input_ids(args, kwargs)
            if input_ids is not None:
                on_prefill(self.spans(input_ids))

        handle = self.model.register_forward_pre_hook(hook, with_kwargs=True)
        return handle.remove

    def scoring_attention(self) -> Any:
        """The attention of the tower's last layer (the projector reads that layer's output)."""
        return self.inner.vision_tower.encoder.layers[-1].self_attn

    def install_pre_llm(self, method: Method, keep: KeepSpec) -> Installation:
        return Gemma3PreLLM(self, method, keep)

    def in_llm_padding_module(self) -> nn.Module:
        """Where an in-LLM drop reads the user's 2-D padding mask: ``model.model``, whose ``attention_mask`` is the
        caller's (its language model receives the masks already built per layer type)."""
        return self.inner


def pool_to_tokens(values: Tensor, kernel: int, reduce: str) -> Tensor:
    """(I, P, ...) per patch of a p×p grid -> (I, t², ...) per pooled token (t = p / kernel), raster order.

    ``reduce``: "mean" (the projector's average pool) or "sum" (attention mass of the k×k patches).
    """
    images, patches = values.shape[:2]
    side = math.isqrt(patches)
    tokens_side = side // kernel
    rest = values.shape[2:]
    grid = values.reshape(images, tokens_side, kernel, tokens_side, kernel, *rest)
    grouped = grid.transpose(2, 3).reshape(images, tokens_side * tokens_side, kernel * kernel, *rest)
    return grouped.mean(2) if reduce == "mean" else grouped.sum(2)


class Gemma3PreLLM:
    """A pre-LLM method installed on one Gemma 3 instance (an :class:`Installation`).

    The projector's forward hook selects for the images of that tower run (inside the model's forward, or before
    it when ``generate`` encodes the images and passes ``mm_encoder_outputs``); the language model's pre-hook
    shortens the prefill; the model's pre-hook fixes the masks and positions of decode steps on that prefill's cache.
    """

    def __init__(self, adapter: Gemma3Adapter, method: Method, keep: KeepSpec) -> None:
        self.adapter, self.method, self.keep = adapter, method, keep
        self.last: list[ImageSelection] | None = None
        self.spans: ImageSpans | None = None
        self.user_mask: Tensor | None = None
        self.seeds: Tensor | None = None
        self.scoring_input: Tensor | None = None
        self.decode: DecodeState | None = None
        self.positions: Tensor | None = None  # (B, S) original positions of the cache's layout
        self.decode_cache: weakref.ref[Any] | None = None
        self.shortened_now = False
        inner = adapter.inner
        projector = inner.multi_modal_projector
        handles = [
            adapter.model.register_forward_pre_hook(self.on_model, with_kwargs=True),
            inner.register_forward_pre_hook(self.on_inner, with_kwargs=True),
            inner.vision_tower.register_forward_pre_hook(self.on_tower, with_kwargs=True),
            projector.register_forward_hook(self.after_projector),
            adapter.language_model.register_forward_pre_hook(self.on_language_model, with_kwargs=True),
            adapter.language_model.register_forward_hook(self.after_language_model, with_kwargs=True),
        ]
        if method.needs_cls_attention:  # the received attention costs one more attention map: only when asked
            attention = adapter.scoring_attention()
            handles.append(attention.register_forward_pre_hook(self.on_scoring_attention, with_kwargs=True))
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def selection(self) -> list[ImageSelection] | None:
        return self.last

    # the tower and the projector: evidence, selection, merged tokens

    def on_tower(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pixel_values: Any = kwargs.get("pixel_values", args[0] if args else None)
        self.seeds = torch.tensor([content_seed(image) for image in pixel_values], dtype=torch.long)

    def on_scoring_attention(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.scoring_input = kwargs.get("hidden_states", args[0] if args else None)

    def received_and_keys(self, kernel: int) -> tuple[Tensor, Tensor]:
        """Per pooled token: the attention received at the scoring layer (I, H, N) and its mean keys (I, H, N, hd)."""
        if self.scoring_input is None:
            raise ValueError("vitrim.vlm saw no input of the tower's scoring layer in this forward pass")
        hidden, self.scoring_input = self.scoring_input, None
        attention = self.adapter.scoring_attention()
        images, patches, _ = hidden.shape
        heads, head_dim = attention.num_heads, attention.head_dim
        work = torch.promote_types(hidden.dtype, torch.float32)  # a half-precision tower is scored in float32
        query = attention.q_proj(hidden).reshape(images * patches, heads, head_dim).to(work)  # (I·P, H, hd)
        key = attention.k_proj(hidden).reshape(images * patches, heads, head_dim).to(work)
        bounds = torch.arange(images + 1) * patches  # each image attends within itself
        received = received_attention(query, key, bounds, float(attention.scale)) / patches  # (H, I·P)
        received = received.reshape(heads, images, patches).permute(1, 2, 0)  # (I, P, H)
        keys = key.reshape(images, patches, heads, head_dim)
        pooled_received = pool_to_tokens(received, kernel, "sum").transpose(1, 2)  # (I, H, N)
        pooled_keys = pool_to_tokens(keys, kernel, "mean").transpose(1, 2)  # (I, H, N, hd)
        return pooled_received, pooled_keys

    def after_projector(self, module: Any, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
        tower_states = args[0]  # (I, P, C) the tower's last states
        num_tokens = output.shape[1]
        keep = self.keep.tokens(num_tokens)
        if keep == num_tokens:
            self.last = [keep_all(num_tokens, output.device) for _ in range(output.shape[0])]
            self.scoring_input = None
            return None  # every token stays: the projector's output is untouched
        kernel = int(module.kernel_size)
        with torch.no_grad():
            pooled = _projector_pool(module, tower_states)  # (I, N, C), what the projector's norm reads
            received = keys = None
            if self.method.needs_cls_attention:
                received, keys = self.received_and_keys(kernel)
        evidence = VisionEvidence(
            features=pooled, cls_attention=received, keys=keys, seeds=self.seeds, projected=output
        )
        selections = self.method.select(evidence, keep)
        self.last = selections
        merged = [(image, s) for image, s in enumerate(selections) if s.merged is not None]
        if not merged:
            return None
        output = output.clone()
        for image, selection in merged:
            states = selection.merged.to(tower_states.dtype)  # type: ignore[union-attr]  # (k, C) pooled states
            projected = module.mm_soft_emb_norm(states) @ module.mm_input_projection_weight
            output[image, selection.kept] = projected.to(output.dtype)
        return output

    # the model: what a prefill holds, the decode steps after a pruned one

    def on_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input_ids = prefill_input_ids(args, kwargs)
        self.spans = None if input_ids is None else self.adapter.spans(input_ids)
        self.user_mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)

    def on_inner(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cache = kwargs.get("cache")
        if cache is None:
            return None
        owner = None if self.decode_cache is None else self.decode_cache()
        if self.spans is not None or self.decode is None or owner is not cache:
            return None  # a prefill, or not a step on the pruned prefill's cache
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = input_ids if input_ids is not None else kwargs["inputs_embeds"]
        new = int(tokens.shape[1])
        past = int(kwargs["cache"].get_seq_length())  # (not `cache`: mypy narrows it to the weakref's type)
        if isinstance(kwargs.get("attention_mask"), dict):
            raise ValueError(_PREPARED_MASKS)
        mask_2d = decode_attention_mask(self.decode, kwargs.get("attention_mask"), past, new)  # (B, past + new)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = decode_position_ids(self.decode, past, new, mask_2d.device)
            kwargs["position_ids"] = positions
        assert self.positions is not None
        self.positions = torch.cat([self.positions, positions.expand(mask_2d.shape[0], new)], 1)
        config = self.adapter.text_config
        kwargs["attention_mask"] = decode_masks(
            cache,
            list(config.layer_types),
            mask_2d,
            self.positions,
            new,
            config.sliding_window,
            config._attn_implementation,
            _dtype(self.adapter.language_model),
        )
        return args, kwargs

    # the LLM: the shortened prefill

    def on_language_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spans, self.spans = self.spans, None
        if spans is None:
            return None
        selections = self.last
        if selections is None or len(selections) != spans.num_images:
            raise ValueError(
                f"the input holds {spans.num_images} images but vitrim.vlm selected tokens for "
                f"{0 if selections is None else len(selections)} (beam search and other input expansions are not "
                "supported with a pre-LLM method)"
            )
        num_tokens = self.adapter.tokens_per_image()
        if all(len(s.kept) == num_tokens for s in selections):
            self.decode = None  # every token stays: the model runs unmodified
            return None
        cache = kwargs.get("cache")
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError("vitrim.vlm prunes a prefill that starts a cache; got a cache already holding tokens")
        embeds = kwargs["inputs_embeds"]  # (B, L, D)
        masks: Any = kwargs.get("attention_mask")  # a dict per layer type, checked below
        lengths = {mask.shape[-1] for mask in masks.values() if mask is not None} if isinstance(masks, dict) else {0}
        if isinstance(self.user_mask, dict) or not lengths <= {embeds.shape[1]}:
            raise ValueError(_PREPARED_MASKS)
        short = plan_short_sequence(columns_to_keep(spans, selections, num_tokens), self.user_mask)
        positions = kwargs.get("position_ids")
        if positions is None:  # what the unmodified LLM would use: 0 … L−1 for every sample
            positions = torch.arange(embeds.shape[1], device=embeds.device)[None]
        config = self.adapter.text_config
        kwargs["attention_mask"] = gather_masks(
            masks, short, config.sliding_window, config._attn_implementation, embeds.dtype
        )
        kwargs["inputs_embeds"] = gather_columns(short, embeds)
        kwargs["position_ids"] = gather_columns(short, positions)
        self.positions = kwargs["position_ids"]
        self.decode = DecodeState(prefill_mask=short.attention_mask, full_length=short.full_length)
        self.shortened_now = True
        return (), kwargs

    def after_language_model(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self.shortened_now:
            cache = getattr(output, "cache", None)
            self.decode_cache = weakref.ref(cache) if cache is not None else None
        self.shortened_now = False


_PREPARED_MASKS = (
    "vitrim.vlm builds Gemma 3's masks for a pruned prefill from the unmodified model's (one per layer type, one "
    "column per token) and needs the 2-D attention_mask at decode; got masks prepared for a static or compiled "
    "cache (use generate's default dynamic cache)"
)


def _projector_pool(projector: Any, tower_states: Tensor) -> Tensor:
    """(I, P, C) -> (I, N, C): the projector's own average pool (so a token kept as it is stays bit for bit)."""
    images, _, channels = tower_states.shape
    side = int(projector.patches_per_image)
    grid = tower_states.transpose(1, 2).reshape(images, channels, side, side).contiguous()
    return projector.avg_pool(grid).flatten(2).transpose(1, 2)


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
