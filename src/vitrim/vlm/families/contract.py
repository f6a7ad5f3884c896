"""What a family declares and offers the stages, in one place: :class:`FamilyTraits` (what it can do) and
:class:`FamilyAdapter` (its seams, with the defaults most families share).

A new family is one file ``families/<name>.py``: a :class:`FamilyAdapter` subclass with its ``traits`` and the
seams it needs, and one line in :data:`vitrim.vlm.families.ADAPTERS`. The stages read nothing else: no class-name
tables, no attribute probing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from vitrim.vlm.families.seams import prefill_input_ids
from vitrim.vlm.method.base import ImageSelection
from vitrim.vlm.stages.pre_llm import Prefill
from vitrim.vlm.stages.sequence import DecodeState, decode_position_ids
from vitrim.vlm.stages.spans import spans_from_mask

if TYPE_CHECKING:
    from vitrim.vlm.families.boxes import TokenBoxes
    from vitrim.vlm.stages.pre_llm import PreLLMStage, Shortened
    from vitrim.vlm.stages.spans import ImageSpans


@dataclass(frozen=True)
class FamilyTraits:
    """What one family declares.

    classes: transformers class names it handles (found anywhere in the model's MRO)
    title: how errors name it, e.g. "LLaVA-1.5 (LlavaForConditionalGeneration)"
    stages: the stages vitrim.vlm runs on it ("pre_llm", "in_llm", "tower"); ``apply`` refuses the others
    tower_grid_only: where the tower stage must put its tokens back on the patch grid, why (None: it need not)
    tower_refused: why the tower stage is not offered, for ``apply``'s refusal (None: no reason beyond ``stages``)
    """

    classes: tuple[str, ...]
    title: str
    stages: tuple[str, ...]
    tower_grid_only: str | None = None
    tower_refused: str | None = None


class FamilyAdapter:
    """The seams of one VLM instance the user holds (``self.model``); it never changes a class or a source file.

    model: the user's ``…ForConditionalGeneration``; inner: its ``model.model``; language_model: the decoder stack
    (has ``.layers``; in-LLM methods hook them). The pre-LLM seams are those of
    :class:`~vitrim.vlm.stages.pre_llm.PreLLMSeams`; defaults here are the plain causal LLM's (positions 0 … L−1,
    one 2-D mask).
    """

    traits: ClassVar[FamilyTraits]
    # positions="authors" hands the LLM the authors' shorter sequence numbered contiguously (their LLaVA code's
    # convention, for every family with 1-D positions); a family whose positions are not a count (Qwen's M-RoPE)
    # keeps the original ones there and says why
    authors_positions: bool = True
    model: nn.Module
    inner: Any
    language_model: nn.Module

    def __init__(self, model: nn.Module) -> None:
        raise NotImplementedError  # each family checks its model's layout

    def image_token_id(self) -> int:
        config: Any = self.model.config
        return int(config.image_token_id)

    def tokens_per_image(self) -> int | None:
        """Image tokens per image entering the LLM unpruned, when the config fixes it (LLaVA-1.5: 576); else None."""
        return None

    def same_size_spans(self, input_ids: Tensor) -> ImageSpans:
        """The image positions of ``input_ids`` (B, L) where every image gives :meth:`tokens_per_image` tokens."""
        per_image = self.tokens_per_image()
        assert per_image is not None, "a family whose images differ in size finds its spans itself"
        is_image: Tensor = input_ids == self.image_token_id()  # (B, L)
        return spans_from_mask(is_image, [per_image] * (int(is_image.sum()) // per_image))

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        """Call ``on_prefill(spans)`` at every prefill before the LLM runs (the spans of the UNMODIFIED input, read
        at ``model.model``); returns the function that removes the watch (the in-LLM stage)."""
        if "in_llm" not in self.traits.stages:
            raise TypeError(self._not_here("inside the LLM"))

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            input_ids = prefill_input_ids(args, kwargs)
            if input_ids is not None:
                on_prefill(self.same_size_spans(input_ids))

        return self.inner.register_forward_pre_hook(hook, with_kwargs=True).remove

    def in_llm_padding_module(self) -> nn.Module | None:
        """Where an in-LLM drop reads the caller's 2-D padding mask when the LLM receives masks built per layer
        type (Gemma 3: ``model.model``); None: the language model's own ``attention_mask``."""
        return None

    def follow_in_llm_slots(self, slots_now: Callable[[], tuple[Tensor, Tensor] | None]) -> Callable[[], None]:
        """Where the LLM adds rows at the image positions between its layers (Qwen3-VL's DeepStack), make them
        follow the tokens an in-LLM drop keeps: ``slots_now()`` gives, between layers of a prefill that dropped
        tokens, the slots the hidden states are on (``vitrim.vlm.stages.in_llm.InLLMDrop.slots_now``). Returns the
        undo; nothing to do for an LLM that adds nothing between layers."""
        return lambda: None

    # the pre-LLM stage's seams (vitrim.vlm.stages.pre_llm.PreLLMSeams)

    def select_hooks(self, stage: PreLLMStage) -> list[Callable[[], None]]:
        raise TypeError(self._not_here("before the LLM"))

    def prefill_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Prefill | None:
        """``model.model(input_ids, pixel_values, attention_mask, ...)`` (LLaVA-1.5's and Gemma 3's layout)."""
        input_ids = prefill_input_ids(args, kwargs)
        if input_ids is None:
            return None
        pixels = kwargs.get("pixel_values", args[1] if len(args) > 1 else None)
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        return Prefill(input_ids, mask, runs_tower=pixels is not None)

    def image_tokens(
        self, prefill: Prefill, selections: list[ImageSelection]
    ) -> tuple[list[ImageSelection], list[int]]:
        count = self.tokens_per_image()
        assert count is not None, "a family whose images differ in size maps them itself"
        return selections, [count] * len(selections)

    def prefill_positions(self, kwargs: dict[str, Any], embeds: Tensor) -> Tensor:
        positions = kwargs.get("position_ids")
        if positions is None:  # what the unmodified LLM would use: 0 … L−1 for every sample
            positions = torch.arange(embeds.shape[1], device=embeds.device)[None]
        return positions

    def shorten_extras(self, kwargs: dict[str, Any], prefill: Prefill, shortened: Shortened) -> None:
        """Nothing more to shorten: the embeddings, positions and the 2-D mask are all a causal LLM reads."""

    def decode_extras(self, kwargs: dict[str, Any], state: DecodeState, mask: Tensor, past: int, new: int) -> None:
        kwargs["attention_mask"] = mask
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = decode_position_ids(state, past, new, mask.device)

    def remove_extras(self) -> None:
        """Nothing but hooks was changed."""

    def _not_here(self, where: str) -> str:
        stages = ", ".join(map(repr, self.traits.stages))
        return f"vitrim.vlm does not cut {where} on {type(self.model).__name__}; it runs the stage(s) {stages} there"

    # where its image tokens lie in the user's picture (vitrim.viz.vlm_token_boxes reads nothing else)

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        """Per picture, its LLM image tokens' pixel boxes in the ORIGINAL picture (:mod:`vitrim.vlm.families.boxes`).

        image_processor: the processor's image processor (its resize, crop, pinpoints); inputs: what the processor
        made of the pictures (``pixel_values``, ``image_grid_thw``, ``image_sizes`` ...); sizes: each picture's
        (H, W); stage: the stage whose selection the boxes are for (a tower stage may select patches, not the LLM's
        tokens). Returns one :class:`~vitrim.vlm.families.boxes.TokenBoxes` per picture, its T boxes in the order of
        the picture's tokens in ``last_selection``'s index space. A family that maps its tokens overrides this.
        """
        from vitrim.vlm.families import ADAPTERS  # the family table imports this module: read it when asked

        mapped = [a.traits.title for a in ADAPTERS if a.token_boxes is not FamilyAdapter.token_boxes]
        raise TypeError(
            f"vitrim maps image tokens to pixels for {', '.join(mapped)}; not for {type(self.model).__name__}"
        )
