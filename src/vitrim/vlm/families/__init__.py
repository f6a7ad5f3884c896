"""Model families vitrim.vlm handles: one file each, an adapter declaring its traits and offering its seams
(:mod:`vitrim.vlm.stages.contract`).

A family adapter wraps ONE model instance the user holds (``adapter.model``); it knows that family's seams (where
the image tokens are made, where they enter the LLM) and never changes a class or a transformers source file.
Families are told apart by the model's class name (in its MRO, :attr:`FamilyTraits.classes`), so
``import vitrim.vlm`` never imports transformers. A new family: its file, and one entry in :data:`ADAPTERS`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from torch import nn

from vitrim.vlm.families.gemma3 import Gemma3Adapter
from vitrim.vlm.families.llava import LlavaAdapter
from vitrim.vlm.families.llava_next import LlavaNextAdapter
from vitrim.vlm.families.llava_onevision import LlavaOnevisionAdapter
from vitrim.vlm.families.paligemma import PaliGemmaAdapter
from vitrim.vlm.families.qwen2vl import Qwen2VLAdapter
from vitrim.vlm.stages.contract import FamilyAdapter, FamilyTraits, ServedArchitecture

ADAPTERS: tuple[type[FamilyAdapter], ...] = (
    LlavaAdapter,
    LlavaNextAdapter,
    LlavaOnevisionAdapter,
    Qwen2VLAdapter,
    Gemma3Adapter,
    PaliGemmaAdapter,
)
# class name (anywhere in the model's MRO) -> its adapter
FAMILIES: dict[str, type[FamilyAdapter]] = {name: adapter for adapter in ADAPTERS for name in adapter.traits.classes}


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


def served_architectures() -> dict[str, ServedArchitecture]:
    """Every vLLM architecture vitrim serves, by name: the one table, read from the families' traits."""
    return {served.name: served for adapter in ADAPTERS for served in adapter.traits.served}


def family_option_names() -> frozenset[str]:
    """The names of every family's own options (:attr:`FamilyTraits.options`): what ``apply`` takes beside ``keep``."""
    return frozenset(name for adapter in ADAPTERS for name in adapter.traits.options)


def checked_family_options(traits: FamilyTraits, given: Mapping[str, object]) -> dict[str, str]:
    """``given`` (family option name -> value) checked against the family of ``traits``; ``ValueError`` (one line)
    naming the option where that family does not take it or its value is not one of the option's."""
    for name, value in given.items():
        values = traits.options.get(name)
        if values is None:
            takers = ", ".join(adapter.traits.title for adapter in ADAPTERS if name in adapter.traits.options)
            raise ValueError(f"{name}={value!r:.80} is an option of {takers}; {traits.title} takes no {name!r}")
        if not isinstance(value, str) or value not in values:
            raise ValueError(f"{name}={value!r:.80}: expected one of {', '.join(map(repr, values))}")
    return {name: str(value) for name, value in given.items()}


def served_traits(architecture: str) -> FamilyTraits:
    """The traits of the family vLLM serves with ``architecture`` (one of :func:`served_architectures`)."""
    return next(adapter.traits for adapter in ADAPTERS for s in adapter.traits.served if s.name == architecture)


def families_taking(stage: str) -> list[FamilyTraits]:
    """The traits of every family that takes ``stage`` (for error texts)."""
    return [adapter.traits for adapter in ADAPTERS if stage in adapter.traits.stages]


def families_with_video() -> list[FamilyTraits]:
    """The traits of every family whose videos vitrim.vlm reduces (for error texts)."""
    return [adapter.traits for adapter in ADAPTERS if adapter.traits.video]


def _is_text_only(model: nn.Module) -> bool:
    """A model that reads token ids and takes no images (a causal LM)."""
    parameters = inspect.signature(model.forward).parameters
    return "input_ids" in parameters and "pixel_values" not in parameters


__all__ = [
    "ADAPTERS",
    "FAMILIES",
    "FamilyAdapter",
    "FamilyTraits",
    "checked_family_options",
    "families_taking",
    "families_with_video",
    "family_option_names",
    "find_family",
    "served_architectures",
    "served_traits",
]
