"""The family contract, where the stages read it: :class:`FamilyTraits` (what a family can do), :class:`FamilyAdapter`
(its seams, with the defaults most families share) and what a prefill hands the seams (:class:`Prefill`,
:class:`Shortened`).

A new family is one file ``families/<name>.py``: a :class:`FamilyAdapter` subclass with its ``traits`` and the
seams it needs, and one line in :data:`vitrim.vlm.families.ADAPTERS`. The stages read nothing else: no class-name
tables, no attribute probing. Every stage types a family as :class:`FamilyAdapter`, this one class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from vitrim.vlm.method.base import ImageSelection
from vitrim.vlm.stages.capture import EncoderSeam
from vitrim.vlm.stages.inputs import inner_model, prefill_input_ids
from vitrim.vlm.stages.sequence import DecodeState, ShortSequence, decode_position_ids
from vitrim.vlm.stages.spans import ImageSpans, spans_from_mask

if TYPE_CHECKING:
    from vitrim.vlm.boxes import TokenBoxes


@dataclass(frozen=True)
class ServedArchitecture:
    """A vLLM architecture vitrim's plugin registers for a family: ``name`` (what ``--hf-overrides``
    ``architectures`` names), ``module`` (where its class lives, imported by vLLM only when such a model loads),
    ``vllm_class`` (the vLLM class it subclasses) and ``model_type`` (the checkpoints' ``model_type`` it runs)."""

    name: str
    module: str
    vllm_class: str
    model_type: str


@dataclass
class Prefill:
    """What one prefill holds, as the family's model received it.

    input_ids: (B, L)               the prompt ids with the image placeholders
    attention_mask: (B, L) | None   the caller's 2-D padding mask (None: no padding)
    runs_tower: the images come as pixels (the tower runs in this forward), not as features ``generate()`` made
    extras: the family's own (Qwen: ``image_grid_thw`` and the token types; LLaVA-NeXT: ``image_sizes``)
    media: where a family also takes videos, the positions of all its media tokens, images and videos (each video is
    one "image" of the pre-LLM stage: its tokens, raster ``(t, row, column)``, wherever they lie in the prompt)
    """

    input_ids: Tensor
    attention_mask: Tensor | None
    runs_tower: bool
    extras: dict[str, Any] = field(default_factory=dict)
    media: Tensor | None = None  # (B, L) bool: the positions of every image's and video's tokens; None: image tokens


@dataclass(frozen=True)
class Shortened:
    """What :meth:`FamilyAdapter.shorten_extras` may read about a shortened prefill.

    short: the plan (:class:`~vitrim.vlm.stages.sequence.ShortSequence`); kept: (B, L) bool, the kept columns;
    spans: the images' spans in the (possibly expanded) batch; order: per image of ``spans``, the index of the
    encoded image it repeats (``generate()``'s beams repeat a prompt's images).
    """

    short: ShortSequence
    kept: Tensor
    spans: ImageSpans
    order: list[int]


@dataclass(frozen=True)
class FamilyTraits:
    """What one family declares.

    classes: transformers class names it handles (found anywhere in the model's MRO)
    title: how errors name it, e.g. "LLaVA-1.5 (LlavaForConditionalGeneration)"
    stages: the stages vitrim.vlm runs on it ("pre_llm", "in_llm", "tower"); ``apply`` refuses the others
    tower_grid_only: where the tower stage must put its tokens back on the patch grid, why (None: it need not)
    tower_refused: why the tower stage is not offered, for ``apply``'s refusal (None: no reason beyond ``stages``)
    served: the vLLM architectures vitrim's plugin serves this family with (none: not served)
    video: whether vitrim.vlm reduces this family's videos (a video method, ``reads_time``, is refused elsewhere)
    options: the family's own options of the pre-LLM stage, name -> the values it takes, the default first
    (LLaVA-NeXT's ``tiles``); ``apply`` and vLLM's ``vitrim`` entry take them beside ``keep``
    """

    classes: tuple[str, ...]
    title: str
    stages: tuple[str, ...]
    tower_grid_only: str | None = None
    tower_refused: str | None = None
    served: tuple[ServedArchitecture, ...] = ()
    video: bool = False  # its pre-LLM stage reduces videos (each temporal patch's tokens, or a video method's pick)
    options: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class FamilyAdapter:
    """The seams of one VLM instance the user holds (``self.model``); it never changes a class or a source file.

    model: the user's ``…ForConditionalGeneration``; inner: its ``model.model``; language_model: the decoder stack
    (has ``.layers``; in-LLM methods hook them). The pre-LLM seams are those of
    :class:`~vitrim.vlm.stages.pre_llm.PreLLMSeams`; defaults here are the plain causal LLM's (positions 0 … L−1,
    one 2-D mask).
    """

    traits: ClassVar[FamilyTraits]
    parts: ClassVar[tuple[str, ...]] = ("vision_tower", "multi_modal_projector", "language_model")  # of model.model
    cls_to_llm: ClassVar[bool] = False  # a method may hand the LLM the tower's [CLS] through this family's projector
    # positions="authors" hands the LLM the authors' shorter sequence numbered contiguously (their LLaVA code's
    # convention, for every family with 1-D positions); a family whose positions are not a count (Qwen's M-RoPE)
    # keeps the original ones there and says why
    authors_positions: bool = True
    model: nn.Module
    inner: Any
    language_model: nn.Module

    def __init__(self, model: nn.Module) -> None:
        inner = inner_model(model, self.parts, self.traits.classes[0])  # TypeError naming what the layout lacks
        self.model = model
        self.inner = inner
        self.language_model = inner.language_model
        self.config: Any = model.config

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

    # the pre-LLM stage's seams

    def select_hooks(self, stage: EncoderSeam) -> list[Callable[[], None]]:
        """Install the taps where this family makes its image tokens and call ``stage.hand_on`` there
        (:mod:`vitrim.vlm.stages.capture`), reporting every encoded image's selection with ``stage.selected``;
        returns the functions that remove them."""
        raise TypeError(self._not_here("before the LLM"))

    def prefill_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Prefill | None:
        """The prefill a forward of ``model.model`` holds, None for a forward without images:
        ``model.model(input_ids, pixel_values, attention_mask, ...)`` (LLaVA-1.5's and Gemma 3's layout)."""
        input_ids = prefill_input_ids(args, kwargs)
        if input_ids is None:
            return None
        pixels = kwargs.get("pixel_values", args[1] if len(args) > 1 else None)
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        return Prefill(input_ids, mask, runs_tower=pixels is not None)

    def image_tokens(
        self, prefill: Prefill, selections: list[ImageSelection]
    ) -> tuple[list[ImageSelection], list[int]]:
        """The encoded images' selections in the index space of each image's LLM tokens, and each image's count of
        LLM tokens (LLaVA-NeXT maps its tiles onto the packed tokens here)."""
        count = self.tokens_per_image()
        assert count is not None, "a family whose images differ in size maps them itself"
        return selections, [count] * len(selections)

    def prefill_positions(self, kwargs: dict[str, Any], embeds: Tensor) -> Tensor:
        """The full sequence's position ids the unmodified LLM uses: (B or 1, L), or M-RoPE's (3, B, L)."""
        positions = kwargs.get("position_ids")
        if positions is None:  # what the unmodified LLM would use: 0 … L−1 for every sample
            positions = torch.arange(embeds.shape[1], device=embeds.device)[None]
        return positions

    def shorten_extras(self, kwargs: dict[str, Any], prefill: Prefill, shortened: Shortened) -> None:
        """Nothing more to shorten: the embeddings, positions and the 2-D mask are all a causal LLM reads."""

    def decode_extras(self, kwargs: dict[str, Any], state: DecodeState, mask: Tensor, past: int, new: int) -> None:
        """A decode step: ``mask`` (B, past + new) is the 2-D mask on the cache's layout; set ``kwargs``' mask and,
        when the caller gave none, its positions as the unmodified model would have them."""
        kwargs["attention_mask"] = mask
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = decode_position_ids(state, past, new, mask.device)

    def remove_extras(self) -> None:
        """Undo what the family changed on the instance besides hooks (Qwen: its ``rope_deltas``); here nothing."""

    def _not_here(self, where: str) -> str:
        stages = ", ".join(map(repr, self.traits.stages))
        return f"vitrim.vlm does not cut {where} on {type(self.model).__name__}; it runs the stage(s) {stages} there"

    # where its image tokens lie in the user's picture (vitrim.viz.vlm_token_boxes reads nothing else)

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        """Per picture, its LLM image tokens' pixel boxes in the ORIGINAL picture (:mod:`vitrim.vlm.boxes`).

        image_processor: the processor's image processor (its resize, crop, pinpoints); inputs: what the processor
        made of the pictures (``pixel_values``, ``image_grid_thw``, ``image_sizes`` ...); sizes: each picture's
        (H, W); stage: the stage whose selection the boxes are for (a tower stage may select patches, not the LLM's
        tokens). Returns one :class:`~vitrim.vlm.boxes.TokenBoxes` per picture, its T boxes in the order of
        the picture's tokens in ``last_selection``'s index space. A family that maps its tokens overrides this.
        """
        raise TypeError(f"vitrim does not map the image tokens of {type(self.model).__name__} to pixels")
