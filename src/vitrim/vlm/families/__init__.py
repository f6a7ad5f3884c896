"""Model families vitrim.vlm handles, and what every family adapter offers the stages (owned here).

A family adapter wraps ONE model instance the user holds (``adapter.model``); it knows that family's seams (where
the image tokens are made, where they enter the LLM) and never changes a class or a transformers source file. A new
family is one file ``family_<name>.py`` with an adapter class (it must not import this module, which imports it)
and one line in :data:`FAMILIES`. Families are told
apart by the model's class name (in its MRO), so ``import vitrim.vlm`` never imports transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol

from torch import nn

from vitrim.vlm.families.gemma3 import Gemma3Adapter
from vitrim.vlm.families.llava import LlavaAdapter
from vitrim.vlm.families.llava_next import LlavaNextAdapter
from vitrim.vlm.families.paligemma import PaliGemmaAdapter
from vitrim.vlm.families.qwen2vl import Qwen2VLAdapter
from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.base import Installation, Method
from vitrim.vlm.stages.spans import ImageSpans


class FamilyAdapter(Protocol):
    """The seams of one VLM instance.

    model: the user's model (``…ForConditionalGeneration``)
    language_model: the decoder stack the LLM runs (has ``.layers``; in-LLM methods hook its layers)
    """

    model: nn.Module
    language_model: nn.Module

    def tokens_per_image(self) -> int | None:
        """Image tokens per image entering the LLM unpruned, when the config fixes it (LLaVA-1.5: 576); else None."""
        ...

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        """Call ``on_prefill(spans)`` at every prefill before the LLM runs (the spans of the UNMODIFIED input);
        returns the function that removes the watch."""
        ...

    def install_pre_llm(self, method: Method, keep: KeepSpec) -> Installation:
        """Install a pre-LLM method: ``keep`` image tokens per image enter the LLM (see vitrim.vlm.stages.sequence)."""
        ...


# class name (anywhere in the model's MRO) -> adapter factory
FAMILIES: dict[str, Callable[[nn.Module], FamilyAdapter]] = {
    "LlavaForConditionalGeneration": LlavaAdapter,
    "LlavaNextForConditionalGeneration": LlavaNextAdapter,
    "Qwen2VLForConditionalGeneration": Qwen2VLAdapter,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLAdapter,
    "Qwen3VLForConditionalGeneration": Qwen2VLAdapter,
    "Gemma3ForConditionalGeneration": Gemma3Adapter,
    "PaliGemmaForConditionalGeneration": PaliGemmaAdapter,
}


def find_family(model: object) -> FamilyAdapter:
    """The adapter for ``model``; ``TypeError`` naming the class and the families handled otherwise."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a transformers vision-language model (an nn.Module); got {type(model).__name__}"
        )
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__](model)
    handled = ", ".join(sorted(FAMILIES))
    text_only = " (a text-only model has no image tokens to reduce)" if _is_text_only(model) else ""
    raise TypeError(f"vitrim.vlm does not handle {type(model).__name__}{text_only}; it handles: {handled}")


def _is_text_only(model: nn.Module) -> bool:
    """A model that reads token ids and takes no images (a causal LM)."""
    parameters = inspect.signature(model.forward).parameters
    return "input_ids" in parameters and "pixel_values" not in parameters
