"""What an in-LLM method may read at the layer where it drops image tokens (prefill only): :class:`LayerEvidence`.

A method that ranks tokens by attention needs ONE row of it: the softmax row of the last real token of each
sample. It is computed here from the decoder layer's own weights (``input_layernorm``, ``q_proj``/``k_proj``, the
q/k norms where the model has them, the rotary embedding the layer received, ``scaling``, GQA groups), on that
layer's input hidden states, so every layer keeps running on SDPA and nothing asks for ``output_attentions``.

Slots: the positions a layer runs on after earlier drops, (B, S). ``slot_columns`` maps each slot to its column in
the prefill sequence (the UNMODIFIED model's positions); a slot is ``real`` when it is not padding (the user's 2-D
attention mask) and not a filler that vitrim added to re-pad a batch whose samples kept different counts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LayerInput:
    """A decoder layer's input as the layer received it (after vitrim's fix-ups): hidden (B, S, D), the rotary
    (cos, sin), each (B, S, hd), and its attention mask (B|1, 1, S, S), bool or additive float, or None (SDPA's own
    causal mask: then the layer's sliding window, if it has one, is applied here)."""

    hidden: Tensor
    cos: Tensor
    sin: Tensor
    mask: Tensor | None = None


@dataclass(frozen=True)
class ImageTokens:
    """The current slots of one image (images numbered over the batch in reading order).

    sample: the batch row; slots: (n,) slot indices in raster order; tokens: (n,) their raster indices in the image
    """

    sample: int
    slots: Tensor
    tokens: Tensor


def rotary_function(attention: nn.Module) -> Any:
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` of the module that defines ``attention``'s class, or None."""
    return getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)


def check_attention_readable(layer: nn.Module, index: int) -> None:
    """``ValueError`` when vitrim cannot recompute ``layer``'s q·kᵀ from its weights (a layer it does not know)."""
    attention = getattr(layer, "self_attn", None)
    needed = ("q_proj", "k_proj", "head_dim", "scaling")
    missing = [name for name in needed if attention is None or not hasattr(attention, name)]
    if not hasattr(layer, "input_layernorm"):
        missing.append("input_layernorm")
    if attention is not None and rotary_function(attention) is None:
        missing.append("apply_rotary_pos_emb")
    if missing:
        raise ValueError(
            f"decoder layer {index} ({type(layer).__name__}) has no {', '.join(missing)}; in-LLM methods that read "
            "attention or keys need a Llama-style layer (self_attn.q_proj/k_proj, input_layernorm, rotary)"
        )


def project(layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, which: str) -> Tensor:
    """The layer's post-rotary queries (``which="q"``: (B, H, S, hd)) or keys (``"k"``: (B, Hkv, S, hd)) of
    ``hidden`` (B, S, D).

    Same order of operations as the transformers layers: input norm, projection, per-head q/k norm (when the model
    has one), rotary with the (cos, sin) the layer received. Only the asked-for projection runs.
    """
    attention: Any = layer.self_attn
    x = layer.get_submodule("input_layernorm")(hidden)  # (B, S, D)
    batch, length = x.shape[:2]
    heads = getattr(attention, f"{which}_proj")(x).view(batch, length, -1, attention.head_dim).transpose(1, 2)
    norm = getattr(attention, f"{which}_norm", None)
    if norm is not None:
        heads = norm(heads)
    rotated, _ = rotary_function(attention)(heads, heads[:, :1], cos, sin)  # the model's own rotary on one tensor
    return rotated


@dataclass(frozen=True)
class LayerEvidence:
    """Everything an in-LLM method may read when it drops tokens before decoder layer ``layer`` (prefill).

    own: the input of layer ``layer``; previous: the input of layer ``layer - 1`` on the same slots (None unless
    the method asked for it). slot_columns, real, image_of, token_of: (B, S); last_slot: (B,) the slot of each
    sample's last real token (the query of FastV's and PyramidDrop's attention row); image_sample: (I,) the sample
    each image of the batch belongs to.
    """

    layer: int
    layers: nn.ModuleList
    final_norm: nn.Module
    own: LayerInput
    previous: LayerInput | None
    slot_columns: Tensor
    real: Tensor
    image_of: Tensor
    token_of: Tensor
    last_slot: Tensor
    image_sample: Tensor
    previous_keys: Tensor | None = None  # (B, Hkv, S, hd) layer K−1's keys as its KV cache holds them, when it has one

    def _keys(self, index: int, given: LayerInput) -> Tensor:
        """(B, Hkv, S, hd) post-rotary keys of layer ``index`` on ``given``: read from layer K−1's KV cache when the
        prefill keeps one (the same computation that layer just ran), recomputed otherwise."""
        if index == self.layer - 1 and self.previous_keys is not None:
            return self.previous_keys
        return project(self.layers[index], given.hidden, given.cos, given.sin, "k")

    def _input(self, previous: bool) -> tuple[int, LayerInput]:
        if not previous:
            return self.layer, self.own
        if self.previous is None:
            raise RuntimeError("this method did not ask for the previous layer's input (needs_previous_layer)")
        return self.layer - 1, self.previous

    def last_token_attention(self, previous: bool) -> Tensor:
        """(B, H, S): per head, the softmax attention row of each sample's last real token over the keys the layer
        lets it see (its own mask's row: causal, and within the window on a sliding-window layer), computed from
        layer ``layer - 1`` (``previous=True``, FastV) or ``layer`` (PyramidDrop)."""
        index, given = self._input(previous)
        layer = self.layers[index]
        attention: Any = layer.self_attn
        rows = self.last_slot.view(-1, 1)  # (B, 1)
        take = rows.unsqueeze(-1)
        hidden_last = given.hidden.gather(1, take.expand(-1, -1, given.hidden.shape[-1]))  # (B, 1, D)
        cos_last = given.cos.gather(1, take.expand(-1, -1, given.cos.shape[-1]))  # (B, 1, hd)
        sin_last = given.sin.gather(1, take.expand(-1, -1, given.sin.shape[-1]))
        q = project(layer, hidden_last, cos_last, sin_last, "q")  # (B, H, 1, hd)
        k = self._keys(index, given)  # (B, Hkv, S, hd)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, S, hd) GQA: head h reads kv head h // g
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype  # softmax as the model does
        logits = (q.to(work) @ k.to(work).transpose(-1, -2)).squeeze(2) * attention.scaling  # (B, H, S)
        softcap = getattr(attention, "attn_logit_softcapping", None)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        allowed = self.real & self._seen_by_last(given, attention)  # (B, S)
        logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
        return torch.softmax(logits, dim=-1)

    def _seen_by_last(self, given: LayerInput, attention: Any) -> Tensor:
        """(B, S) bool: the keys the last real token may attend to at that layer, read from the layer's mask."""
        slots = self.slot_columns.shape[1]
        mask = given.mask
        if mask is not None and mask.ndim == 4 and tuple(mask.shape[-2:]) == (slots, slots):
            mask = mask.expand(self.slot_columns.shape[0], *mask.shape[1:])
            row = mask[:, 0].gather(1, self.last_slot.view(-1, 1, 1).expand(-1, 1, slots)).squeeze(1)  # (B, S)
            return row if row.dtype == torch.bool else row == 0
        distance = self.slot_columns.gather(1, self.last_slot.view(-1, 1)) - self.slot_columns  # (B, S)
        window = getattr(attention, "sliding_window", None)
        return (distance >= 0) & (distance < window) if isinstance(window, int) else distance >= 0

    def rank_by_last_token(
        self, counts: list[int], previous: bool, rank: Callable[[Tensor, int], Tensor]
    ) -> list[Tensor]:
        """Per image of :meth:`images`: the tokens (ascending) that ``rank(rows, counts[i])`` keeps, ``rows`` (H, n)
        being :meth:`last_token_attention` on that image's slots (FastV: ``previous=True``; PyramidDrop: False)."""
        attention = self.last_token_attention(previous)  # (B, H, S)
        return [
            image.tokens[rank(attention[image.sample][:, image.slots], count)]
            for image, count in zip(self.images(), counts, strict=True)
        ]

    def keys(self, previous: bool) -> Tensor:
        """(B, S, Hkv·hd): the post-rotary keys of layer ``layer - 1`` (``previous=True``) or ``layer``, heads
        concatenated (the vectors the KV cache of that layer holds)."""
        index, given = self._input(previous)
        k = self._keys(index, given)  # (B, Hkv, S, hd)
        return k.transpose(1, 2).flatten(2)

    def normed_hidden(self) -> Tensor:
        """(B, S, D): the model's final norm applied to layer ``layer``'s input (DART's duplication space)."""
        return self.final_norm(self.own.hidden)

    def images(self) -> list[ImageTokens]:
        """The current slots of every image (all I, in batch reading order), slots in raster order."""
        found = []
        for image, sample in enumerate(self.image_sample.tolist()):
            slots = (self.image_of[sample] == image).nonzero().flatten()  # (n,)
            tokens = self.token_of[sample, slots]
            order = torch.argsort(tokens)
            found.append(ImageTokens(sample, slots[order], tokens[order]))
        return found
