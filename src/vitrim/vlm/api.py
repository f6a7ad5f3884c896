"""``apply`` / ``remove`` / ``last_selection``: validate everything, find the family, install the stages, undo them.

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
from vitrim.vlm.families import (
    checked_family_options,
    families_taking,
    families_with_video,
    family_option_names,
    find_family,
)
from vitrim.vlm.method.base import Installation, Method, method_class
from vitrim.vlm.stacking import STAGE_ORDER, STAGE_WORDS, Plan, Stack, refusal, stage_options

STATE_ATTRIBUTE = "_vitrim_vlm"
ModelT = TypeVar("ModelT", bound=nn.Module)


@dataclass
class Applied:
    """What :func:`apply` left on a model: per stage the method as asked for (``plans``, stage order) and the
    installed stack. ``method`` / ``installation``: the method applied alone and what its stage installed (the last
    stage's, for a stack)."""

    plans: dict[str, Plan]
    stack: Stack

    @property
    def method(self) -> Method:
        return self.plans[self.stack.last_stage()].method

    @property
    def installation(self) -> Installation:
        return self.stack.parts[self.stack.last_stage()]


def apply(model: ModelT, method: str, **options: Any) -> ModelT:
    """Reduce the image tokens of ``model`` (a transformers VLM the caller holds) with ``method``; returns ``model``.

    ``options``: ``keep=`` (int: image tokens per image; float in (0, 1]: a fraction of each image's tokens),
    ``layer=`` (in-LLM methods), and the method's own options under its authors' names (``vitrim.vlm.methods()``
    lists the methods; each method's docstring its options and defaults). A family's own option of the pre-LLM
    stage comes beside them: LLaVA-NeXT's ``tiles=`` ("whole", the default: ``keep`` tokens selected per anyres tile
    before the unpadding, the authors' convention; "unpadded": each tile selected among the tokens the unpadding
    leaves, :mod:`vitrim.vlm.families.llava_next`). After ``apply`` the caller's
    ``model(**inputs)`` and ``model.generate(**inputs, ...)`` run unchanged; ``remove(model)`` restores the model.

    Methods of different stages stack: a second ``apply`` of another stage's method adds it, and the stack runs in
    the model's order, tower → pre-LLM → in-LLM, whatever the order of the calls; each stage's ``keep=`` counts the
    tokens the stage before it handed on (:mod:`vitrim.vlm.stacking`: what composes, what is refused and why). A
    second method of the same stage is refused. Every check runs before anything changes: an error leaves the
    model (and what was applied to it) as it was.
    """
    require("transformers", feature="vitrim.vlm")
    cls = method_class(method)
    generic = {name: options.pop(name) for name in ("keep", "layer") if name in options}
    family = find_family(model)
    own = checked_family_options(
        family.traits, {name: options.pop(name) for name in sorted(family_option_names()) if name in options}
    )
    stages = family.traits.stages
    if cls.stage not in stages and cls.pre_llm_form is not None and "pre_llm" in stages:
        cls = cls.pre_llm_form  # the method's own form for this family (its authors' code there)
    instance = cls(**options)
    if cls.stage not in stages:
        titles = ", ".join(traits.title for traits in families_taking(cls.stage))
        raise TypeError(
            f"vlm method {method!r} cuts at stage {cls.stage!r}; on {type(model).__name__} vitrim.vlm handles the "
            f"stage(s) {', '.join(map(repr, stages))} only ({STAGE_WORDS[cls.stage]} method {method!r} runs on "
            f"{titles}; {type(model).__name__} is not handled there"
            + (f": {family.traits.tower_refused})" if cls.stage == "tower" and family.traits.tower_refused else ")")
        )
    if cls.reads_time and not family.traits.video:
        titles = ", ".join(traits.title for traits in families_with_video())
        raise TypeError(
            f"vlm method {method!r} reduces videos; vitrim.vlm takes no video on {type(model).__name__} (video runs "
            f"on {titles})"
        )
    if instance.options.get("cls") is True and cls.uses_cls_token and not family.cls_to_llm:
        raise ValueError(
            f"{method} cls=True: {type(model).__name__} hands vitrim no [CLS] token to give the LLM (its tower has "
            "none, or the family packs tiles); use cls=None (one more dominant patch where there is no [CLS]) or False"
        )
    applied = getattr(model, STATE_ATTRIBUTE, None)
    plans = dict(applied.plans) if isinstance(applied, Applied) else {}
    if cls.stage in plans:
        raise ValueError(
            f"model already has {STAGE_WORDS[cls.stage]} method {plans[cls.stage].method.name!r} applied; one "
            "method per stage (tower → pre-LLM → in-LLM stack): call vitrim.vlm.remove(model) first"
        )
    if own and cls.stage != "pre_llm":
        name = next(iter(own))
        raise ValueError(
            f"{name}={own[name]!r} is how the pre-LLM stage selects {family.traits.title}'s images; {method!r} cuts at "
            f"stage {cls.stage!r}"
        )
    layer = generic.get("layer")
    if layer is not None and cls.stage != "in_llm":
        raise ValueError(f"layer={layer!r} is for in-LLM methods; {method!r} cuts at stage {cls.stage!r}")
    plans[cls.stage] = Plan(instance, generic.get("keep"), layer, own)
    plans = {stage: plans[stage] for stage in STAGE_ORDER if stage in plans}
    why = refusal(family, plans)
    if why is not None:
        raise ValueError(f"these methods do not stack: {why}")
    checked = stage_options(family, plans)
    if isinstance(applied, Applied):  # the stack is installed anew in the model's order
        applied.stack.remove()
        try:
            stack = Stack(family, plans, checked)
        except BaseException:
            applied.stack = Stack(family, applied.plans, stage_options(family, applied.plans))
            raise
    else:
        stack = Stack(family, plans, checked)
    setattr(model, STATE_ATTRIBUTE, Applied(plans, stack))
    return model


def remove(model: nn.Module) -> None:
    """Undo :func:`apply` (every method of a stack): every hook and attribute it set is removed; ``ValueError`` when
    none was applied."""
    applied = _applied(model)
    applied.stack.remove()
    delattr(model, STATE_ATTRIBUTE)


@overload
def last_selection(model: nn.Module, groups: Literal[False] = False, *, stage: str | None = None) -> list[Tensor]: ...


@overload
def last_selection(model: nn.Module, groups: Literal[True], *, stage: str | None = None) -> list[list[Tensor]]: ...


def last_selection(
    model: nn.Module, groups: bool = False, *, stage: str | None = None
) -> list[Tensor] | list[list[Tensor]]:
    """For the last prefill, per image (reading order of the batch): the sorted LongTensor of kept image-token
    indices, raster order of the image tokens the unmodified model would have produced.

    ``groups=True``: per image, a list with one LongTensor per token entering the LLM, the image-token indices it
    stands for (one for a kept token, several for a merged one), in raster order of the kept indices; an EMPTY
    LongTensor, always first, is the tower's [CLS] token, which stands for no patch (VisionZip hands it to the LLM
    as its authors do, ``ImageSelection.cls``). After a forward without images: ``[]`` (that prefill had no image to
    select from); ``ValueError`` before any forward.

    ``stage``: with methods of several stages stacked, what is left after that stage ("tower", "pre_llm",
    "in_llm"); default the last applied stage's, i.e. the tokens that go furthest. Per stage: tower, the tower's
    patches that reach its feature layer; pre-LLM, the image tokens entering the LLM; in-LLM, those through the
    LLM's last layer, each grouped with what it stood for on entering the LLM (:meth:`Stack.selection`).
    """
    applied = _applied(model)
    if stage is not None and (not isinstance(stage, str) or stage not in STAGE_ORDER):
        raise ValueError(f"stage={stage!r:.80} must be None or one of {', '.join(map(repr, STAGE_ORDER))}")
    selection = applied.stack.selection(stage)
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
