"""``apply`` / ``remove`` / ``last_selection``: validate everything, find the family, install one stage, undo it.

Everything that can be known without running the model is checked before anything is installed (the method and
its options, ``keep`` against the image's token count where the config fixes it, ``layer`` by the in-LLM stage),
so an error leaves the model as it was. What ``apply`` installs lives on the instance only (hooks on its own
submodules and one attribute, :data:`STATE_ATTRIBUTE`); ``remove`` takes all of it away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

from torch import Tensor, nn

from vitrim.extras import require
from vitrim.vlm.families import FamilyAdapter, families_taking, find_family
from vitrim.vlm.keep import KeepSpec, parse_keep
from vitrim.vlm.method.base import Installation, Method, StageOptions, method_class
from vitrim.vlm.stages import in_llm, pre_llm, tower

STATE_ATTRIBUTE = "_vitrim_vlm"
STAGE_WORDS = {"pre_llm": "pre-LLM", "in_llm": "in-LLM", "tower": "tower"}
ModelT = TypeVar("ModelT", bound=nn.Module)


@dataclass
class Applied:
    """What :func:`apply` left on a model: the method and its installation."""

    method: Method
    installation: Installation


def apply(model: ModelT, method: str, **options: Any) -> ModelT:
    """Reduce the image tokens of ``model`` (a transformers VLM the caller holds) with ``method``; returns ``model``.

    ``options``: ``keep=`` (int: image tokens per image; float in (0, 1]: a fraction of each image's tokens),
    ``layer=`` (in-LLM methods), and the method's own options under its authors' names (``vitrim.vlm.methods()``
    lists the methods; each method's docstring its options and defaults). After ``apply`` the caller's
    ``model(**inputs)`` and ``model.generate(**inputs, ...)`` run unchanged; ``remove(model)`` restores the model.
    """
    require("transformers", feature="vitrim.vlm")
    cls = method_class(method)
    generic = {name: options.pop(name) for name in ("keep", "layer") if name in options}
    instance = cls(**options)
    family = find_family(model)
    stages = family.traits.stages
    if cls.stage not in stages:
        titles = ", ".join(traits.title for traits in families_taking(cls.stage))
        raise TypeError(
            f"vlm method {method!r} cuts at stage {cls.stage!r}; on {type(model).__name__} vitrim.vlm handles the "
            f"stage(s) {', '.join(map(repr, stages))} only ({STAGE_WORDS[cls.stage]} method {method!r} runs on "
            f"{titles}; {type(model).__name__} is not handled there)"
        )
    if hasattr(model, STATE_ATTRIBUTE):
        applied = getattr(model, STATE_ATTRIBUTE)
        raise ValueError(
            f"model already has vlm method {applied.method.name!r} applied; call vitrim.vlm.remove(model) first"
        )
    keep = _keep(instance, generic.get("keep"), family)
    layer = generic.get("layer")
    if layer is not None and cls.stage != "in_llm":
        raise ValueError(f"layer={layer!r} is for in-LLM methods; {method!r} cuts at stage {cls.stage!r}")
    if cls.stage == "pre_llm":
        if keep is None:
            raise ValueError(f"vlm method {method!r} needs keep= (image tokens per image, or a fraction in (0, 1])")
        installation: Installation = pre_llm.install(family, instance, keep)
    elif cls.stage == "in_llm":
        installation = in_llm.install(family, instance, StageOptions(keep=keep, layer=layer))
    else:
        installation = tower.install(family, instance, StageOptions(keep=keep, layer=layer))
    setattr(model, STATE_ATTRIBUTE, Applied(instance, installation))
    return model


def remove(model: nn.Module) -> None:
    """Undo :func:`apply`: every hook and attribute it set is removed; ``ValueError`` when none was applied."""
    applied = _applied(model)
    applied.installation.remove()
    delattr(model, STATE_ATTRIBUTE)


@overload
def last_selection(model: nn.Module, groups: Literal[False] = False) -> list[Tensor]: ...


@overload
def last_selection(model: nn.Module, groups: Literal[True]) -> list[list[Tensor]]: ...


def last_selection(model: nn.Module, groups: bool = False) -> list[Tensor] | list[list[Tensor]]:
    """For the last prefill, per image (reading order of the batch): the sorted LongTensor of kept image-token
    indices, raster order of the image tokens the unmodified model would have produced.

    ``groups=True``: per image, a list with one LongTensor per token entering the LLM, the image-token indices it
    stands for (one for a kept token, several for a merged one), in raster order of the kept indices; an EMPTY
    LongTensor, always first, is the tower's [CLS] token, which stands for no patch (VisionZip hands it to the LLM
    as its authors do, ``ImageSelection.cls``). After a forward without images: ``[]`` (that prefill had no image to
    select from); ``ValueError`` before any forward.
    """
    applied = _applied(model)
    selection = applied.installation.selection()
    if selection is None:
        raise ValueError(f"vlm method {applied.method.name!r} has seen no prefill yet: run the model first")
    if groups:
        return [[image.kept.new_zeros(0)] * image.cls + list(image.groups) for image in selection]
    return [image.kept for image in selection]


def _applied(model: nn.Module) -> Applied:
    applied = getattr(model, STATE_ATTRIBUTE, None)
    if not isinstance(applied, Applied):
        raise ValueError(f"no vlm method is applied to this {type(model).__name__}; call vitrim.vlm.apply first")
    return applied


def _keep(method: Method, keep: object, family: FamilyAdapter) -> KeepSpec | None:
    if keep is None:
        default = method.default_keep()
        if default is None:
            return None
        keep = default
    num_tokens = _tokens_per_image(method, family)
    spec = parse_keep(keep, num_tokens)
    if num_tokens is not None:
        method.check_keep(spec.tokens(num_tokens))
    return spec


def _tokens_per_image(method: Method, family: FamilyAdapter) -> int | None:
    """What ``keep=`` counts: the family's image tokens, except in the tower (its patches per image, on Gemma 3 more
    than the image tokens its projector pools them to)."""
    if method.stage == "tower":
        return tower.keep_counts_per_image(family, method)
    return family.tokens_per_image()
