"""Dropping image tokens inside the LLM from layer K on: per-layer hooks, per-layer KV-cache lengths, decode masks.

How it runs (forward pre-hooks with kwargs on the instance's own decoder layers; no class or source is changed):

- Prefill (the first layer's cache is empty): at each drop layer K (a method may have several, PyramidDrop), the
  method reads :class:`~vitrim.vlm.evidence.llm_layer.LayerEvidence` and names the image tokens each image keeps;
  layers ≥ K then run on the kept slots only: hidden states gathered per sample, rotary (cos, sin) and
  ``position_ids`` gathered so every token keeps its ORIGINAL position, the 4-D attention mask rebuilt on the kept
  keys (each layer's OWN mask: the per-layer-type masks of Gemma 3, sliding window and image block included).
  Dropping therefore equals the full model with those keys masked out from layer K on (to rounding: exactly on
  SDPA; eager attention takes its softmax in float32, ~1e-6 apart). Samples that keep different counts (different
  numbers of images) are re-padded on the LEFT with filler slots that attend to themselves only and that nothing
  else attends to (a row seeing no key is NaN under eager attention), so each sample's last slots are its latest
  tokens (what a sliding-window cache keeps). Under eager attention a left-padding row, which sees no key, sees its
  own key at every layer of a prefill the drop acts on: in float64 it is NaN otherwise, the next layer carries the
  NaN into every real row, and a later drop stage would rank NaN (no real row sees a padding key: nothing real
  changes).
- The KV cache of layers ≥ K holds only the kept tokens, so each layer's cache has its own length. At every decode
  step the new tokens join every stage, and each layer ≥ K gets a mask built on the keys ITS cache returns (all its
  slots; a sliding-window layer's last ``window − 1`` of them and the new ones): causal on the original columns,
  the user's padding kept, and on a sliding layer a key is seen only within ``window`` ORIGINAL columns of the
  query (the unmodified model's window; the kept slots a window cache holds always cover it). Layer 0 is never
  pruned, so transformers' own bookkeeping (positions, the cache length ``generate()`` reads) still counts the full
  sequence.
- ``logits`` after a pruned prefill keep the full (B, L) layout: at a kept position they are the pruned model's
  (equal to the masked full model's), at a dropped image position they are the final norm and head applied to the
  hidden state the token had when it was dropped (an early exit; nothing attends to it afterwards). ``generate()``
  reads the last position, which is always kept: where a prompt ends on image tokens, its last one stays whatever
  the method chose (that image then keeps one token more than ``keep``). ``output_hidden_states`` of layers ≥ K
  hold the kept slots only.
- A drop that keeps every token changes nothing: the hooks then leave every argument as it was (bit for bit).

Handled: decoder stacks whose layers take ``(hidden_states, attention_mask=, position_ids=,
position_embeddings=(cos, sin), cache=)`` and return the hidden states (transformers ≥ 5; tested: Llama, Qwen2,
the text stack of Qwen2.5-VL with its (3, B, L) M-RoPE positions, Gemma 3's interleaved sliding-window and full
layers with their own masks and rotary tables), SDPA or eager attention, ``generate()`` greedy, sampled or with
beams (the beams of one prompt keep the same tokens, so reordering them keeps every layer's cache consistent).
Each layer's mask and rotary table are read from that layer's own arguments. Where the LLM receives masks already
built per layer type (Gemma 3), the user's 2-D padding mask is read where the caller gives it (``padding_from``).
Refused: flash/flex attention (at install); a static or compiled cache, or masks prepared for one (at the prefill,
one message on every family: ``in_llm_slots.DYNAMIC_CACHE_ONLY``); a cache cut outside vitrim (at decode: assisted
decoding crops it); meta-device inputs (naming the input). Between layers, what a family adds at the image positions
(Qwen3-VL's DeepStack rows, after the LLM's first layers) follows the kept slots (``follow_in_llm_slots``).
``last_selection`` after a prefill without images: [] (no image).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from vitrim.vlm.evidence.columns import expand_batch, gather_columns
from vitrim.vlm.evidence.llm_layer import LayerEvidence, LayerInput, check_attention_readable
from vitrim.vlm.method.base import DropPolicy, ImageSelection, Method, StageOptions
from vitrim.vlm.stages.filler_masks import additive_with_own_key_where_blank
from vitrim.vlm.stages.in_llm_slots import (
    DYNAMIC_CACHE_ONLY,
    Slots,
    as_implementation,
    decode_mask,
    prefill_mask,
    sliding_window,
)
from vitrim.vlm.stages.spans import ImageSpans

if TYPE_CHECKING:  # the families' table imports the stages' plumbing
    from vitrim.vlm.stages.contract import FamilyAdapter


@dataclass
class PassState:
    """What one forward of the LLM carries from its first layer to its last.

    prefill: the cache was empty (a prefill; else a decode step); active: vitrim acts on this pass; dtype: the
    hidden states'; cache: the pass's KV cache (or None). A prefill that drops: spans of its images, real (B, L)
    the columns that are not padding, length L, columns (B, L) 0 … L−1, drop_layers the layers it drops before,
    selections per drop stage so far. A decode step on a dropped prefill: query_columns (q,) its new columns.
    """

    prefill: bool
    dtype: torch.dtype
    cache: Any
    active: bool = False
    spans: ImageSpans | None = None
    real: Tensor | None = None
    length: int = 0
    columns: Tensor | None = None
    drop_layers: frozenset[int] = frozenset()
    selections: list[list[Tensor]] = field(default_factory=list)
    query_columns: Tensor | None = None
    own_key_masks: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # eager prefill: _padding_rows_…


class InLLMDrop:
    """Hooks that make the decoder stack ``language_model`` (it has ``.layers`` and ``.norm``) drop image tokens as
    ``policy`` decides. Call :meth:`on_prefill` with the prefill's :class:`ImageSpans` before the LLM runs (a family
    adapter does); :meth:`remove` takes every hook off.

    ``padding_from``: the module whose ``attention_mask`` argument is the user's 2-D padding mask, when the language
    model itself receives masks already built per layer type (Gemma 3: its ``model.model``); default the language
    model."""

    def __init__(self, language_model: nn.Module, policy: DropPolicy, padding_from: nn.Module | None = None) -> None:
        self.layers: nn.ModuleList = language_model.get_submodule("layers")  # type: ignore[assignment]
        self.final_norm: nn.Module = language_model.get_submodule("norm")
        self.policy = policy
        num_layers = len(self.layers)
        self.stages = policy.drop_stages(num_layers)
        previous = 0
        for stage in self.stages:
            if isinstance(stage.layer, bool) or not isinstance(stage.layer, int):
                raise ValueError(f"layer={stage.layer!r} must be an int (a decoder layer index)")
            if not 1 <= stage.layer < num_layers or stage.layer <= previous:
                raise ValueError(
                    f"drop layer {stage.layer} (layer= / layers=) is outside the LLM or out of order; expected "
                    f"increasing layers in 1 … {num_layers - 1} (the LLM has {num_layers} decoder layers)"
                )
            previous = stage.layer
        config = getattr(language_model, "config", None)
        implementation = getattr(config, "_attn_implementation", "sdpa")
        if implementation not in ("sdpa", "eager"):
            raise ValueError(f"in-LLM dropping runs on 'sdpa' or 'eager' attention; the LLM uses {implementation!r}")
        for index, layer in enumerate(self.layers):
            if policy.reads_attention and index in self._read_layers():
                check_attention_readable(layer, index)
        self._windows: list[int | None] = [sliding_window(layer) for layer in self.layers]
        self._typed_masks = padding_from is not None
        self._eager = implementation == "eager"
        self._stage_of_layer = [-1] * num_layers
        for number, stage in enumerate(self.stages):
            for index in range(stage.layer, num_layers):
                self._stage_of_layer[index] = number
        self._spans: ImageSpans | None = None
        self._padding: Tensor | None = None
        self._prepared_masks = False  # the padding module was handed masks already built (static/compiled cache)
        self._slots: list[Slots] = []
        self._cache: object = None
        self._pass: PassState | None = None
        self._captured: LayerInput | None = None
        self._early_exit: Tensor | None = None
        self._selections: list[list[Tensor]] | None = None
        self._running = -1  # the decoder layer that ran last (its pre-hook was the last one called)
        owner = language_model if padding_from is None else padding_from
        self._handles = [owner.register_forward_pre_hook(self._capture_padding, with_kwargs=True)]
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._hook_for(index), with_kwargs=True))
        self._handles.append(self.layers[-1].register_forward_hook(self._after_last_layer))

    def _read_layers(self) -> set[int]:
        read = {stage.layer for stage in self.stages}
        return read | {layer - 1 for layer in read} if self.policy.needs_previous_layer else read

    # ---- public -------------------------------------------------------------------------------------------------
    def on_prefill(self, spans: ImageSpans | None) -> None:
        """The image positions of the next prefill (None: no images, nothing is dropped)."""
        self._spans = spans

    def selection(self) -> list[Tensor] | None:
        """For the last prefill, per image: the sorted raster indices kept through the last layer ([] after a
        prefill without images; None before any prefill)."""
        return None if self._selections is None else self._selections[-1]

    def stage_selections(self) -> list[list[Tensor]] | None:
        """For the last prefill, per drop stage, per image: the sorted raster indices kept from that stage on."""
        return self._selections

    def slots_now(self) -> tuple[Tensor, Tensor] | None:
        """During a prefill that dropped tokens, between layers: the slots the hidden states are on after the layer
        that ran last, ``(columns, valid)`` each (B, S) (module conventions of ``in_llm_slots``); None while they are
        the full sequence (before the first drop, after the last layer) and at decode steps. What a family that
        adds rows to image positions between layers reads (Qwen3-VL's DeepStack)."""
        if self._pass is None or not self._pass.active or not self._pass.prefill:
            return None
        if not 0 <= self._running < len(self.layers):
            return None  # a decode step, or the last layer's output already back on the full layout
        stage = self._stage_of_layer[self._running]
        if stage < 0 or stage >= len(self._slots) or not self._slots[stage].differs:
            return None
        return self._slots[stage].columns, self._slots[stage].valid

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._slots, self._pass, self._spans, self._captured, self._early_exit = [], None, None, None, None

    # ---- hooks --------------------------------------------------------------------------------------------------
    def _capture_padding(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        self._padding = mask.bool() if isinstance(mask, Tensor) and mask.ndim == 2 else None
        self._prepared_masks = self._typed_masks and mask is not None and self._padding is None

    def _hook_for(self, index: int) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict] | None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            return self._before_layer(index, args, kwargs)

        return hook

    def _before_layer(self, index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self._running = index
        if index == 0:
            self._start_pass(hidden, kwargs)
        state = self._pass
        if state is None or not state.active:
            return None
        stage = self._stage_of_layer[index]
        changed = False
        if state.prefill and self._eager:
            mask = kwargs.get("attention_mask")
            seen = self._padding_rows_see_themselves(mask)
            if seen is not mask:
                kwargs, changed = {**kwargs, "attention_mask": seen}, True
        if state.prefill and stage >= 0 and self.stages[stage].layer == index:
            hidden = self._drop(stage, index, hidden, kwargs)
            changed = True
        if stage >= 0 and self._slots[stage].differs:
            if not state.prefill:
                self._check_cache(index, stage, hidden.shape[1])
            kwargs = {**kwargs, **self._stage_kwargs(stage, index, kwargs)}
            changed = True
        if state.prefill and self.policy.needs_previous_layer and index + 1 in state.drop_layers:
            self._captured = _layer_input(hidden, kwargs)
        if not changed:
            return None
        args = (hidden, *args[1:]) if args else args
        if not args:
            kwargs = {**kwargs, "hidden_states": hidden}
        return args, kwargs

    def _padding_rows_see_themselves(self, mask: Any) -> Any:
        """An eager layer's additive 4-D prefill mask with each row that sees no key (left padding) seeing its own
        key (``filler_masks.with_own_key_where_blank``): in float64 such a row is NaN, the next layer carries it into
        every real row as 0 × NaN, and a later drop stage would rank NaN (PyramidDrop's second stage, DART's
        duplicates). One fixed mask per mask the model built, for the whole pass (layers of a kind share it)."""
        if not isinstance(mask, Tensor) or mask.ndim != 4 or not mask.is_floating_point():
            return mask
        fixed = self._state().own_key_masks
        if id(mask) not in fixed:
            fixed[id(mask)] = (mask, additive_with_own_key_where_blank(mask))  # the original held: its id stays
        return fixed[id(mask)][1]

    def _start_pass(self, hidden: Tensor, kwargs: dict) -> None:
        if hidden.is_meta:
            raise ValueError(
                "the LLM's input (inputs_embeds) is on the meta device, without values; vitrim.vlm's in-LLM drop "
                "reads the hidden states it ranks: run the model on real tensors"
            )
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = int(cache.get_seq_length(0)) if cache is not None else 0
        batch, length = hidden.shape[:2]
        self._pass = state = PassState(prefill=past == 0, dtype=hidden.dtype, cache=cache)
        if past == 0:
            self._selections, self._slots, self._early_exit, self._cache = None, [], None, cache
            spans, self._spans = self._spans, None  # one prefill per on_prefill
            if spans is None or not self.stages or not bool(spans.is_image.any()):
                self._selections = [[] for _ in self.stages]  # this prefill had no image: nothing was selected
                return
            if tuple(spans.is_image.shape) != (batch, length):
                raise ValueError(
                    f"the image spans cover {tuple(spans.is_image.shape)} positions but the LLM's input is "
                    f"{(batch, length)}; build them from the same prefill"
                )
            self._refuse_prepared_masks()
            if getattr(cache, "is_compileable", False):  # StaticCache: one length for every layer, fixed
                raise ValueError(DYNAMIC_CACHE_ONLY)
            real = (
                self._real_columns(kwargs.get("attention_mask"), spans.is_image) if spans.real is None else spans.real
            )
            columns = torch.arange(length, device=hidden.device).expand(batch, length)
            state.active, state.spans, state.real, state.length, state.columns = True, spans, real, length, columns
            state.drop_layers = frozenset(stage.layer for stage in self.stages)
            return
        if not self._slots or cache is not self._cache or batch != self._slots[0].columns.shape[0]:
            return  # a decode step of a pass that dropped nothing (or of a cache vitrim did not prune)
        if any(slots.differs for slots in self._slots):
            self._refuse_prepared_masks()
        new = past + torch.arange(hidden.shape[1], device=hidden.device)  # (q,) columns of the new tokens
        for slots in self._slots:
            slots.columns = torch.cat([slots.columns, new.expand(batch, -1)], dim=1)
            added = torch.ones(batch, new.numel(), dtype=torch.bool, device=new.device)
            slots.valid = torch.cat([slots.valid, added], dim=1)
            slots.kwargs = {}
        state.active, state.query_columns = True, new

    def _refuse_prepared_masks(self) -> None:
        if self._prepared_masks:
            raise ValueError(DYNAMIC_CACHE_ONLY)

    def _real_columns(self, layer_mask: Any, is_image: Tensor) -> Tensor:
        """(B, L) bool, the columns that are not padding: the user's 2-D mask; failing that (the LLM was handed a
        prepared 4-D mask) the last query row of the mask layer 0 got, which sees every real column before it (not
        with masks per layer type: layer 0 may be a sliding one, whose last row sees its window only; not after a
        stage that shortened the input: its spans say which columns are real, since under right padding a row's
        last column is padding or a filler, which sees no real column)."""
        length = is_image.shape[1]
        if self._padding is not None:
            return self._padding[:, -length:]
        if not self._typed_masks and isinstance(layer_mask, Tensor) and layer_mask.ndim == 4:
            last_row = layer_mask[:, 0, -1, -length:]
            last_row = last_row if last_row.dtype == torch.bool else last_row == 0
            return last_row.expand(is_image.shape[0], -1)
        return torch.ones_like(is_image)

    def _check_cache(self, index: int, stage: int, new_tokens: int) -> None:
        held = int(self._state().cache.get_seq_length(index))
        expected = self._slots[stage].columns.shape[1] - new_tokens
        if held != expected:
            raise RuntimeError(
                f"the KV cache of decoder layer {index} holds {held} tokens where vitrim's in-LLM drop left "
                f"{expected}; the cache was cut outside vitrim (assisted decoding crops it; that is not supported)"
            )

    # ---- prefill: dropping --------------------------------------------------------------------------------------
    def _current(self, stage: int) -> tuple[Tensor, Tensor]:
        if stage == 0:
            columns = self._state().columns
            assert columns is not None
            return columns, torch.ones_like(columns, dtype=torch.bool)
        previous = self._slots[stage - 1]
        return previous.columns, previous.valid

    def _drop(self, stage: int, index: int, hidden: Tensor, given: dict[str, Any]) -> Tensor:
        """Choose the kept tokens before layer ``index`` (stage ``stage``) from its input ``hidden`` and its own
        arguments ``given``; returns the hidden states of the new slots."""
        state = self._state()
        spans, all_real = state.spans, state.real
        assert spans is not None and all_real is not None
        columns, valid = self._current(stage)
        image_of = torch.where(valid, spans.image_of.gather(1, columns), -1)
        token_of = torch.where(valid, spans.token_of.gather(1, columns), -1)
        real = valid & all_real.gather(1, columns)
        last_slot = torch.where(real, columns, -1).argmax(dim=1)  # (B,) the last real token (the largest column)
        differs = stage > 0 and self._slots[stage - 1].differs
        own = _layer_input(hidden, {**given, **self._stage_kwargs(stage - 1, index, given)} if differs else given)
        image_sample = self._image_samples(spans)
        evidence = LayerEvidence(
            layer=self.stages[stage].layer, layers=self.layers, final_norm=self.final_norm, own=own,
            previous=self._captured, slot_columns=columns, real=real, image_of=image_of, token_of=token_of,
            last_slot=last_slot, image_sample=image_sample, previous_keys=self._cached_keys(stage, hidden),
        )  # fmt: skip
        sizes = [int((spans.image_of == image).sum()) for image in range(len(image_sample))]
        current = [int((image_of == image).sum()) for image in range(len(image_sample))]
        counts = [min(self.stages[stage].tokens(size), now) for size, now in zip(sizes, current, strict=True)]
        chosen = _with_last_position(self.policy.choose(evidence, counts), image_of, token_of, last_slot, image_sample)
        self._captured = None
        state.selections.append([kept.sort().values for kept in chosen])
        self._selections = state.selections
        keep = valid & (image_of < 0)  # (B, S) every valid non-image slot stays
        for image, kept in enumerate(chosen):
            sample = int(image_sample[image])
            keep[sample] |= (image_of[sample] == image) & torch.isin(token_of[sample], kept)
        drops = bool((keep != valid).any())
        differs = drops or differs
        counts_per_sample = keep.sum(dim=1)  # (B,)
        width = int(counts_per_sample.max())
        # fillers first, then the kept slots in order: a sample's last slots are its latest tokens, which is what a
        # sliding-window cache keeps (fillers at the end would push real keys out of the window)
        order = torch.argsort(keep.to(torch.int8), dim=1, stable=True)[:, -width:]
        new_valid = torch.arange(width, device=keep.device) >= (width - counts_per_sample)[:, None]  # (B, width)
        new_columns = torch.where(new_valid, columns.gather(1, order), 0)
        self._slots.append(Slots(new_columns, new_valid, differs))
        if not drops:
            return hidden
        if self._early_exit is None:
            self._early_exit = torch.cat([hidden, hidden[:, :1]], dim=1).clone()  # (B, L+1, D): column L is a bin
        self._scatter(self._early_exit, columns, valid, hidden)
        return hidden.gather(1, order.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))

    def _cached_keys(self, stage: int, hidden: Tensor) -> Tensor | None:
        """Layer K−1's keys from the prefill's KV cache when it holds exactly this stage's current slots."""
        layers = getattr(self._state().cache, "layers", None)
        index = self.stages[stage].layer - 1
        if not self.policy.needs_previous_layer or layers is None or index >= len(layers):
            return None
        keys = getattr(layers[index], "keys", None)
        expected = (hidden.shape[0], hidden.shape[1])
        if not isinstance(keys, Tensor) or keys.ndim != 4 or (keys.shape[0], keys.shape[2]) != expected:
            return None
        return keys

    @staticmethod
    def _image_samples(spans: ImageSpans) -> Tensor:
        images = int(spans.image_of.max()) + 1
        samples = torch.zeros(images, dtype=torch.long, device=spans.image_of.device)
        where = (spans.image_of >= 0).nonzero()  # (n, 2)
        samples[spans.image_of[where[:, 0], where[:, 1]]] = where[:, 0]
        return samples

    def _scatter(self, target: Tensor, columns: Tensor, valid: Tensor, hidden: Tensor) -> None:
        bin_column = target.shape[1] - 1
        index = torch.where(valid, columns, bin_column)
        target.scatter_(1, index.unsqueeze(-1).expand(-1, -1, target.shape[-1]), hidden)

    def _after_last_layer(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._pass is None or not self._pass.active or not self._pass.prefill or self._early_exit is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        self._running = len(self.layers)  # the output goes back to the full sequence's layout
        last = self._slots[-1]
        full = self._early_exit
        self._scatter(full, last.columns, last.valid, hidden)
        self._early_exit = None
        full = full[:, :-1]
        return (full, *output[1:]) if isinstance(output, tuple) else full

    # ---- the arguments of a layer ≥ K ---------------------------------------------------------------------------
    def _stage_kwargs(self, stage: int, index: int, given: dict[str, Any]) -> dict[str, Any]:
        """The arguments of layer ``index`` (in stage ``stage``) on that stage's slots, from the arguments ``given``
        it received for the full sequence: its own mask and rotary table (layers of one kind share them)."""
        slots = self._slots[stage]
        full_mask = given.get("attention_mask")
        cos, sin = given["position_embeddings"]
        window = self._windows[index]
        key = (id(full_mask), id(cos), window)
        if key in slots.kwargs:
            return slots.kwargs[key]
        fixed: dict[str, Any]
        state = self._state()
        if state.prefill:
            allowed = prefill_mask(slots, full_mask, window, state.length)
            fixed = {"attention_mask": self._as_implementation(allowed, full_mask)}
            fixed["position_embeddings"] = (
                gather_columns(cos, slots.columns, -2, -3),
                gather_columns(sin, slots.columns, -2, -3),
            )
            position_ids = given.get("position_ids")
            if isinstance(position_ids, Tensor):
                fixed["position_ids"] = gather_columns(position_ids, slots.columns, -1, -2)
        else:
            query_columns = state.query_columns  # (q,)
            assert query_columns is not None
            kv_length, _ = state.cache.get_mask_sizes(query_columns.numel(), index)
            real = self._decode_real(full_mask, int(query_columns[-1]) + 1)
            allowed = decode_mask(slots, query_columns, int(kv_length), real, window)
            fixed = {"attention_mask": self._as_implementation(allowed, full_mask)}
        slots.kwargs[key] = fixed
        return fixed

    def _decode_real(self, full: Tensor | None, total: int) -> Tensor:
        """(B or 1, total) bool, the columns that are not padding at a decode step: the user's 2-D mask; failing
        that, the last query row of a full-width 4-D mask the layer got (not with masks per layer type: a sliding
        one's last row sees its window only); else every column."""
        if self._padding is not None and self._padding.shape[1] == total:
            return self._padding
        if not self._typed_masks and isinstance(full, Tensor) and full.ndim == 4 and full.shape[-1] == total:
            last_row = full[:, 0, -1]
            return last_row if last_row.dtype == torch.bool else last_row == 0
        query_columns = self._state().query_columns  # a decode step's: set before any layer runs
        assert query_columns is not None
        return torch.ones(1, total, dtype=torch.bool, device=query_columns.device)

    def _as_implementation(self, allowed: Tensor, full: Tensor | None) -> Tensor:
        return as_implementation(allowed, full, self._eager, self._state().dtype)

    def _state(self) -> PassState:
        assert self._pass is not None, "a layer hook ran outside a forward pass of the LLM"
        return self._pass


def _with_last_position(
    chosen: list[Tensor], image_of: Tensor, token_of: Tensor, last_slot: Tensor, image_sample: Tensor
) -> list[Tensor]:
    """``chosen`` (per image, the raster indices the method keeps) with each sample's last real token added where it
    is an image token the method left out: ``generate()`` reads that position, so it is never dropped (a prompt
    that ends on image tokens). ``image_of``, ``token_of``: (B, S); ``last_slot``: (B,); ``image_sample``: (I,)."""
    rows = torch.arange(last_slot.shape[0], device=last_slot.device)
    last_image = image_of[rows, last_slot].tolist()  # (B,) the image the last real token shows, -1 for text
    last_token = token_of[rows, last_slot]  # (B,)
    kept = list(chosen)
    for image, sample in enumerate(image_sample.tolist()):
        if last_image[sample] == image and not bool((kept[image] == last_token[sample]).any()):
            kept[image] = torch.cat([kept[image], last_token[sample : sample + 1].to(kept[image].device)])
    return kept


def _layer_input(hidden: Tensor, kwargs: dict[str, Any]) -> LayerInput:
    """What a layer receives: its input ``hidden`` (B, S, D), its rotary table and its mask (after vitrim's fix-ups)."""
    cos, sin = kwargs["position_embeddings"]
    batch = hidden.shape[0]
    mask = kwargs.get("attention_mask")
    return LayerInput(
        hidden, expand_batch(cos, batch, -3), expand_batch(sin, batch, -3), mask if isinstance(mask, Tensor) else None
    )


class InLLMInstallation:
    """What :func:`install` leaves on a model: the drop hooks and the family's prefill watch."""

    def __init__(self, drop: InLLMDrop, undo: list[Callable[[], None]]) -> None:
        self.drop = drop
        self._undo = undo

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []
        self.drop.remove()

    def selection(self) -> list[ImageSelection] | None:
        """Per image: the tokens kept through the last layer (each stands for itself: in-LLM methods never merge)."""
        kept = self.drop.selection()
        if kept is None:
            return None
        return [ImageSelection.unmerged(tokens) for tokens in kept]


def install(
    family: FamilyAdapter,
    method: Method,
    options: StageOptions,
    watch: Callable[[Callable[[ImageSpans], None]], Callable[[], None]] | None = None,
) -> InLLMInstallation:
    """Install the in-LLM ``method`` on ``family``'s language model; every check runs before the first hook.

    ``watch``: where the drop learns each prefill's image positions (default: the family's own watch of the
    unmodified input, :meth:`FamilyAdapter.watch_spans`); after a stage that shortened the LLM input, that stage's
    :meth:`~vitrim.vlm.stages.pre_llm.PreLLMStage.follow` (the positions of the tokens that reached the LLM).
    Install it after that stage: its hooks must see the shortened input."""
    make_policy = getattr(method, "drop_policy", None)
    if make_policy is None:
        raise ValueError(f"vlm method {method.name!r} has no in-LLM drop policy")
    padding = family.in_llm_padding_module()  # families whose LLM gets masks built per layer type
    drop = InLLMDrop(family.language_model, make_policy(options), padding_from=padding)
    # the watch of the prefills, and what follows the kept tokens where the LLM adds rows at image positions between
    # layers (Qwen3-VL's DeepStack)
    watch = family.watch_spans if watch is None else watch
    undo = [watch(drop.on_prefill), family.follow_in_llm_slots(drop.slots_now)]
    return InLLMInstallation(drop, undo)
