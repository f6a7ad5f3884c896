"""LLaVA-1.5 (transformers' ``LlavaForConditionalGeneration``): where its image tokens are made and enter the LLM.

The model (transformers ≥ 5): ``model.model.vision_tower`` (CLIP) → ``hidden_states[vision_feature_layer]``
([CLS] dropped under the "default" strategy) → ``model.model.multi_modal_projector`` → scattered into the
``input_ids == image_token_id`` positions of the embeddings → ``model.model.language_model``. Each image gives
(image_size / patch_size)² tokens (576 for LLaVA-1.5 at 336 px), +1 under the "full" strategy.

Seams used (hooks on this instance's submodules only):
- a forward pre-hook with kwargs on ``model.model`` (so calling it directly prunes too): the ``input_ids`` and
  ``pixel_values`` (or, under generate(), ``mm_encoder_outputs``) of a prefill;
- a forward pre-hook on the scoring layer's attention (tower layer ``vision_feature_layer``): its input hidden
  states, from which the [CLS] attention row and the keys are computed with the layer's own q/k projections;
- a forward pre-hook on the projector: the features of the images, where the method selects (and merged tokens
  are written into their slots);
- a forward pre-hook with kwargs on the language model: the LLM input is shortened (``vitrim.vlm.stages.sequence``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.families.seams import inner_model, prefill_input_ids
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


class LlavaAdapter:
    """The seams of one ``LlavaForConditionalGeneration`` instance (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        parts = ("vision_tower", "multi_modal_projector", "language_model")
        inner = inner_model(model, parts, "LlavaForConditionalGeneration")
        self.model = model
        self.inner: Any = inner
        self.language_model: nn.Module = inner.language_model
        self.config: Any = model.config

    def tile_tokens(self) -> int:
        """Tokens of one tower image entering the projector: the grid, +1 ([CLS]) under the "full" strategy."""
        vision = self.config.vision_config
        grid = (vision.image_size // vision.patch_size) ** 2
        return grid + (1 if self.config.vision_feature_select_strategy == "full" else 0)

    def tokens_per_image(self) -> int | None:
        return self.tile_tokens()

    def spans(self, input_ids: Tensor) -> ImageSpans:
        """The image positions of ``input_ids`` (B, L): every image gives :meth:`tokens_per_image` tokens."""
        is_image: Tensor = input_ids == self.config.image_token_id  # (B, L)
        per_image = self.tile_tokens()
        num_images = int(is_image.sum()) // per_image
        return spans_from_mask(is_image, [per_image] * num_images)

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            input_ids = prefill_input_ids(args, kwargs)
            if input_ids is not None:
                on_prefill(self.spans(input_ids))

        handle = self.inner.register_forward_pre_hook(hook, with_kwargs=True)
        return handle.remove

    def scoring_layer(self) -> Any:
        """The tower layer that produces the feature layer (``vision_feature_layer`` −2: the tower's layer −2, whose
        attention the authors of FasterVLM, VisPruner and VisionZip read); None for the embeddings (layer 0)."""
        layer = self.config.vision_feature_layer
        layers = self.inner.vision_tower.encoder.layers
        if not isinstance(layer, int) or layer == 0:
            return None
        return layers[layer] if layer < 0 else layers[layer - 1]

    def install_pre_llm(self, method: Method, keep: KeepSpec) -> Installation:
        layer_ok = self.config.vision_feature_select_strategy == "default" and self.scoring_layer() is not None
        if method.needs_cls_attention and not layer_ok:
            raise ValueError(
                f"vlm method {method.name!r} scores by [CLS] attention at one tower layer; this model has "
                f"vision_feature_layer={self.config.vision_feature_layer!r} and vision_feature_select_strategy="
                f"{self.config.vision_feature_select_strategy!r} (expected an int layer and 'default')"
            )
        return self.make_pre_llm(method, keep)

    def make_pre_llm(self, method: Method, keep: KeepSpec) -> Installation:
        return LlavaPreLLM(self, method, keep)


def cls_attention_and_keys(attention: Any, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """The [CLS] attention row and the keys of a CLIP attention layer, from its own q/k projections.

    hidden_states: (I, 1 + N, D) the layer's input after its first LayerNorm ([CLS] first).
    Returns ((I, H, N) softmax row of [CLS] over [CLS] and the N tokens, [CLS]'s own weight left out;
    (I, H, N, hd) the keys of the N tokens).
    """
    images, length, _ = hidden_states.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    query = attention.q_proj(hidden_states[:, :1]).view(images, 1, heads, head_dim).transpose(1, 2)  # (I, H, 1, hd)
    keys = attention.k_proj(hidden_states).view(images, length, heads, head_dim).transpose(1, 2)  # (I, H, 1+N, hd)
    row = torch.softmax((query @ keys.transpose(-1, -2)) * attention.scale, dim=-1)  # (I, H, 1, 1+N)
    return row[:, :, 0, 1:], keys[:, :, 1:]


class LlavaPreLLM:
    """A pre-LLM method installed on one LLaVA instance: selects at the projector, shortens the LLM input.

    Per forward pass with images: the tower's pre-hook keeps each image's seed (for the seeded method); the
    scoring layer's pre-hook its input; the projector's pre-hook selects (``method.select``) and writes merged
    features into their slots; the language model's pre-hook shortens its input (vitrim.vlm.stages.sequence) and
    remembers what decoding needs; the language model's forward hook remembers the cache it returned, so a later
    call on that cache is a decode step.
    """

    def __init__(self, adapter: LlavaAdapter, method: Method, keep: KeepSpec) -> None:
        self.adapter, self.method, self.keep = adapter, method, keep
        self.last: list[ImageSelection] | None = None
        self.spans: ImageSpans | None = None
        self.seeds: Tensor | None = None
        self.scoring_input: Tensor | None = None
        self.features: Tensor | None = None
        self.decode: DecodeState | None = None
        self.decode_cache: weakref.ref[Any] | None = None
        self.shortened_now = False
        inner = adapter.inner
        handles = [
            inner.register_forward_pre_hook(self.on_model, with_kwargs=True),
            inner.multi_modal_projector.register_forward_pre_hook(self.on_projector),
            inner.multi_modal_projector.register_forward_hook(self.after_projector),
            adapter.language_model.register_forward_pre_hook(self.on_language_model, with_kwargs=True),
            adapter.language_model.register_forward_hook(self.after_language_model, with_kwargs=True),
        ]
        if not keep.keeps_all(adapter.tile_tokens()):
            handles.append(adapter.model.register_forward_pre_hook(self.refuse_labels, with_kwargs=True))
        if method.needs_seeds:
            handles.append(inner.vision_tower.register_forward_pre_hook(self.on_tower, with_kwargs=True))
        scoring = adapter.scoring_layer()
        if method.needs_cls_attention and scoring is not None:
            handles.append(scoring.self_attn.register_forward_pre_hook(self.on_scoring_attention, with_kwargs=True))
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def selection(self) -> list[ImageSelection] | None:
        return self.last

    def on_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # the selection (made at the projector) may come before this hook: generate() encodes the images first
        input_ids = prefill_input_ids(args, kwargs)
        self.spans = None if input_ids is None else self.adapter.spans(input_ids)

    def image_selections(self) -> tuple[list[ImageSelection], int]:
        """The selection per image of the prompts (before any expansion by generate()) in the index space of
        the image's LLM tokens, and the most tokens an image has. LLaVA-1.5: one tower image per image."""
        assert self.last is not None
        return self.last, self.adapter.tile_tokens()

    def keeps_everything(self) -> bool:
        """Every tower image keeps all its tokens (and nothing merged): the LLM input stays as it is."""
        assert self.last is not None
        return all(len(s.kept) == self.adapter.tile_tokens() for s in self.last)

    def refuse_labels(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs.get("labels") is not None:
            raise ValueError(
                "labels= (a loss over every position) cannot be computed while vitrim.vlm shortens the LLM input; "
                "call vitrim.vlm.remove(model) to train or score with labels"
            )

    def on_tower(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pixel_values: Any = kwargs.get("pixel_values", args[0] if args else None)
        self.seeds = torch.tensor([content_seed(image) for image in pixel_values], dtype=torch.long)

    def on_scoring_attention(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.scoring_input = kwargs.get("hidden_states", args[0] if args else None)

    def evidence(self, features: Tensor, projected: Tensor | None = None) -> VisionEvidence:
        cls_attention = keys = None
        if self.method.needs_cls_attention:
            if self.scoring_input is None:
                raise ValueError("vitrim.vlm saw no input of the tower's scoring layer in this forward pass")
            attention = self.adapter.scoring_layer().self_attn
            cls_attention, keys = cls_attention_and_keys(attention, self.scoring_input)
        self.scoring_input = None
        return VisionEvidence(
            features=features, cls_attention=cls_attention, keys=keys, seeds=self.seeds, projected=projected
        )

    def on_projector(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        features = args[0]  # (I, N, D) the tower features of every image of this forward pass
        self.features = features
        if self.method.scores_projected:
            return None  # selected on the projector's output (after_projector)
        selections = self.method.select(self.evidence(features), self.keep.tokens(features.shape[1]))
        self.last = selections
        merged = [(image, s) for image, s in enumerate(selections) if s.merged is not None]
        if not merged:
            return None
        features = features.clone()
        for image, selection in merged:
            features[image, selection.kept] = selection.merged.to(features.dtype)  # type: ignore[union-attr]
        return (features, *args[1:])

    def after_projector(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        if self.method.scores_projected and self.features is not None:
            evidence = self.evidence(self.features, projected=output)
            self.last = self.method.select(evidence, self.keep.tokens(output.shape[1]))
        self.features = None

    def on_language_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cache = kwargs.get("cache")
        if self.spans is not None:
            return self.shorten_prefill(kwargs)
        decoding = self.decode is not None and self.decode_cache is not None and cache is not None
        if decoding and self.decode_cache() is cache:  # type: ignore[misc]  # a step on the prefill's cache
            return self.fix_decode(kwargs, cache)
        return None

    def shorten_prefill(self, kwargs: dict[str, Any]) -> Any:
        spans = self.spans
        assert spans is not None
        if self.last is None:
            raise ValueError("vitrim.vlm saw images enter the LLM but no selection was made for them")
        images, num_tokens = self.image_selections()
        selections = expand_selections(images, spans)
        if self.keeps_everything():
            self.decode = None  # every token stays: the model runs unmodified
            return None
        cache = kwargs.get("cache")
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError("vitrim.vlm prunes a prefill that starts a cache; got a cache already holding tokens")
        embeds = kwargs["inputs_embeds"]  # (B, L, D)
        short = plan_short_sequence(columns_to_keep(spans, selections, num_tokens), kwargs.get("attention_mask"))
        positions = kwargs.get("position_ids")
        if positions is None:  # what the unmodified LLM would use: 0 … L−1 for every sample
            positions = torch.arange(embeds.shape[1], device=embeds.device)[None]
        kwargs["inputs_embeds"] = gather_columns(short, embeds)
        kwargs["position_ids"] = gather_columns(short, positions)
        kwargs["attention_mask"] = short.attention_mask
        self.decode = DecodeState(prefill_mask=short.attention_mask, full_length=short.full_length)
        self.shortened_now = True
        return (), kwargs

    def after_language_model(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self.shortened_now:
            cache = getattr(output, "cache", None)
            self.decode_cache = weakref.ref(cache) if cache is not None else None
        self.shortened_now = False
        self.spans = None  # this prefill's; a later direct call of the language model is not one

    def fix_decode(self, kwargs: dict[str, Any], cache: Any) -> Any:
        assert self.decode is not None
        embeds = kwargs["inputs_embeds"]  # (B, q, D)
        past, new = cache.get_seq_length(), embeds.shape[1]
        kwargs["attention_mask"] = decode_attention_mask(self.decode, kwargs.get("attention_mask"), past, new)
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = decode_position_ids(self.decode, past, new, embeds.device)
        return (), kwargs


def expand_selections(selections: list[ImageSelection] | None, spans: ImageSpans) -> list[ImageSelection]:
    """The selection per image of ``spans``: the images as selected, or, when generate() expanded the batch (beam
    search, several sequences per prompt: each row repeated e times with its own images), each row's images'
    selections repeated alike. ``ValueError`` when the two cannot be matched."""
    count = 0 if selections is None else len(selections)
    if selections is not None and spans.num_images == count:
        return selections
    per_row = [int(row.unique().numel()) - int(bool((row < 0).any())) for row in spans.image_of]  # images per row
    expand = spans.num_images // count if count and spans.num_images % count == 0 else 0
    consistent = (
        selections is not None
        and expand > 0
        and len(per_row) % expand == 0
        and spans.num_images == expand * count
        and all(per_row[row] == per_row[row - row % expand] for row in range(len(per_row)))
    )
    if not consistent:
        raise ValueError(f"the input holds {spans.num_images} images but vitrim.vlm selected tokens for {count}")
    assert selections is not None
    starts = [sum(per_row[:row:expand]) for row in range(0, len(per_row), expand)]  # first image of each prompt
    expanded: list[ImageSelection] = []
    for row, images in enumerate(per_row):
        start = starts[row // expand]
        expanded += selections[start : start + images]
    return expanded
