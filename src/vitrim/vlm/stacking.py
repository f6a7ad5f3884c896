"""Methods of several stages on one model: which stack, in which order, what each ``keep=`` counts, what is refused.

A model sheds image tokens in three places, and a stack runs them in the model's own order, whatever the order of
the ``apply`` calls: **tower → pre-LLM → in-LLM**, at most one method per stage. Each stage works on what the stage
before it handed on:

- a **tower** method reduces the vision tower's patches (``keep=`` counts the tower's patches per image);
- a **pre-LLM** method after it selects among the image tokens the reduced tower makes. Where the tower puts its
  tokens back on the patch grid (``to_grid=True``; Gemma 3 always) every image token is still there, filled from
  the tower's tokens, and ``keep=`` counts image tokens as without the tower. Where it does not (LLaVA's default,
  ``to_grid=False``) the pre-LLM method picks among the tower's own tokens (the slots they fill), ``keep=``
  counts those, and its merged tokens stand for every patch of the tower tokens they merge;
- an **in-LLM** method after either drops, from its layer on, among the image tokens that entered the LLM:
  ``keep=`` counts those (a fraction is of them), and it ranks them on the shortened sequence.

Refused, because they do not compose (:func:`refusal`): a pre-LLM method that scores by the tower's attention
(FasterVLM, VisPruner, VisionZip, SCOPE) after a tower method, since the tower method has already changed the
tokens of the layer it reads; after a tower whose tokens stay off the grid, a method that reads the token grid
(downsample) or the instruction at the LLM's input (CDPruner), since the tower's tokens are no longer a grid and the
LLM's input still holds the slots the tower emptied; an in-LLM method after a shortened LLM input on a family whose
LLM takes masks built per layer type (Gemma 3), since the in-LLM stage then reads no 2-D padding mask at decode.
After a tower whose tokens stay off the grid the pre-LLM method keeps each token at its own position (the tower
stage's convention); ``positions="authors"`` asked by name is refused there. A [CLS] that VisionZip hands the LLM
stands for no image token: a stacked in-LLM method treats it as text (never ranked, never dropped).
A ``keep=`` that cannot be met after the earlier stage is refused at ``apply`` where the count is known.

``last_selection(model, stage=...)`` reads one stage of the stack (:meth:`Stack.selection`).

Composition lives here and only here: a stage installs itself, never another. Where a tower's tokens leave the grid,
this module installs the pre-LLM stage after the tower with :class:`AfterTower` as its selector (the tower's tokens,
then the stacked pre-LLM method among them), and hands an in-LLM method the pre-LLM stage's spans to follow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from vitrim.vlm.keep import KeepSpec, parse_keep
from vitrim.vlm.method.base import ImageSelection, Installation, Method, StageOptions, VisionEvidence
from vitrim.vlm.stages import in_llm, pre_llm, tower
from vitrim.vlm.stages.contract import FamilyAdapter
from vitrim.vlm.stages.inputs import InputCheck

STAGE_ORDER = ("tower", "pre_llm", "in_llm")
STAGE_WORDS = {"pre_llm": "pre-LLM", "in_llm": "in-LLM", "tower": "tower"}


@dataclass(frozen=True)
class Plan:
    """One stage's method as the caller asked for it: the method, ``keep=`` / ``layer=`` as given, and the family's
    own options of that stage (checked: LLaVA-NeXT's ``tiles``)."""

    method: Method
    keep: object
    layer: int | None
    family_options: Mapping[str, str] = field(default_factory=dict)


def tower_to_grid(family: FamilyAdapter, method: Method) -> bool:
    """Whether the tower method puts its tokens back on the patch grid (its ``to_grid``, else the family's
    default: back on the grid where the family needs it)."""
    return tower.to_grid_of(family, method)


def refusal(family: FamilyAdapter, plans: dict[str, Plan]) -> str | None:
    """Why the stack of ``plans`` (stage -> plan) does not compose on ``family``, None when it does."""
    tower_plan, pre, inside = plans.get("tower"), plans.get("pre_llm"), plans.get("in_llm")
    on_grid = tower_plan is not None and tower_to_grid(family, tower_plan.method)
    if tower_plan is not None and pre is not None:
        pair = f"pre-LLM method {pre.method.name!r} after tower method {tower_plan.method.name!r}"
        if pre.method.needs_cls_attention:
            return (
                f"{pair}: it scores by the attention at the tower's scoring layer, whose tokens the tower method has "
                "already reduced; stack one that reads the tokens only (random, divprune; downsample and cdpruner "
                "with the tower's to_grid=True)"
            )
        if not on_grid and pre.method.reads_grid:
            return f"{pair}: it reads the token grid, and the tower's tokens (to_grid=False) are no longer one"
        if not on_grid and pre.method.reads_instruction():
            return (
                f"{pair}: it selects at the LLM's input, which still holds the slots the tower (to_grid=False) "
                "emptied; pass to_grid=True to the tower method"
            )
    shortened = pre is not None or (tower_plan is not None and not on_grid)
    if inside is not None and shortened and family.in_llm_padding_module() is not None:
        before = pre.method.name if pre is not None else tower_plan.method.name  # type: ignore[union-attr]
        return (
            f"in-LLM method {inside.method.name!r} after {before!r} on {type(family.model).__name__}: its LLM takes "
            "masks built per layer type, which the shortened input's decode steps hand it instead of the 2-D padding "
            "mask the in-LLM stage reads"
        )
    return None


def stage_options(family: FamilyAdapter, plans: dict[str, Plan]) -> dict[str, StageOptions]:
    """Each stage's validated options, in stage order: ``keep=`` parsed against the tokens that reach that stage
    where the count is known at ``apply`` (``ValueError`` naming the earlier stage when it cannot be met)."""
    options: dict[str, StageOptions] = {}
    reaching = family.tokens_per_image()  # image tokens per image entering the stage now being planned
    earlier = ""
    for stage in STAGE_ORDER:
        plan = plans.get(stage)
        if plan is None:
            continue
        method = plan.method
        if plan.layer is not None and stage != "in_llm":
            raise ValueError(f"layer={plan.layer!r} is for in-LLM methods; {method.name!r} cuts at stage {stage!r}")
        count = tower.keep_counts_per_image(family, method) if stage == "tower" else reaching
        if method.reads_time and plan.keep is not None:
            raise ValueError(
                f"keep={plan.keep!r}: vlm method {method.name!r} reduces videos and decides its own count from "
                f"its options ({', '.join(sorted(method.defaults))}); drop keep="
            )
        keep = _keep(method, plan.keep, count, earlier)
        if stage == "pre_llm" and keep is None and not method.reads_time:
            raise ValueError(
                f"vlm method {method.name!r} needs keep= (image tokens per image, or a fraction in (0, 1])"
            )
        options[stage] = StageOptions(keep=keep, layer=plan.layer)
        if stage == "tower" and tower_to_grid(family, method):
            continue  # every image token still enters the projector
        reaching = None if keep is None or count is None else keep.tokens(count)
        earlier = f" (after {STAGE_WORDS[stage]} method {method.name!r}, {reaching} per image reach this stage)"
    return options


def _keep(method: Method, keep: object, count: int | None, earlier: str) -> KeepSpec | None:
    if keep is None:
        keep = method.default_keep()
        if keep is None:
            return None
    try:
        spec = parse_keep(keep, count)
        if count is not None:
            method.check_keep(spec.tokens(count))
    except ValueError as err:
        raise ValueError(f"{err}{earlier}") from None
    return spec


class Stack:
    """The installed stages of one model, in stage order (an :class:`~vitrim.vlm.method.base.Installation`).

    ``parts``: stage -> what that stage installed; ``handoff``: the pre-LLM stage the LLM input passes, when there
    is one (installed for a stacked pre-LLM method, or after a tower whose tokens leave the grid, to drop the slots
    it emptied).
    """

    def __init__(self, family: FamilyAdapter, plans: dict[str, Plan], options: dict[str, StageOptions]) -> None:
        self.parts: dict[str, Any] = {}
        self.handoff: pre_llm.PreLLMStage | None = None
        self._owned: list[Installation] = []
        self._input_check: InputCheck | None = InputCheck(family.model)  # first: it runs before every stage's hooks
        try:
            self._install(family, plans, options)
        except BaseException:
            self.remove()
            raise

    def _own(self, installed: Any) -> Any:
        self._owned.append(installed)
        return installed

    def _install(self, family: FamilyAdapter, plans: dict[str, Plan], options: dict[str, StageOptions]) -> None:
        pre = plans.get("pre_llm")
        keep = None if pre is None else options["pre_llm"].keep or KeepSpec(fraction=1.0)
        if pre is not None and pre.method.reads_time:
            keep = None  # a video method decides its own count
        if "tower" in plans:
            reduction = self.parts["tower"] = self._own(tower.install(family, plans["tower"].method, options["tower"]))
            if not reduction.to_grid:  # the slots no tower token fills are dropped before the LLM
                after = AfterTower(reduction, None if pre is None else pre.method, keep)
                self.handoff = self._own(pre_llm.install(family, after, None))
            elif pre is not None:  # a stacked pre-LLM method on the refilled grid
                self.handoff = self._own(pre_llm.install(family, pre.method, keep, pre.family_options))
        elif pre is not None:
            self.handoff = self._own(pre_llm.install(family, pre.method, keep, pre.family_options))
        if pre is not None:
            self.parts["pre_llm"] = self.handoff
        if "in_llm" in plans:
            watch = None if self.handoff is None else self.handoff.follow
            self.parts["in_llm"] = self._own(
                in_llm.install(family, plans["in_llm"].method, options["in_llm"], watch=watch)
            )

    def last_stage(self) -> str:
        return [stage for stage in STAGE_ORDER if stage in self.parts][-1]

    def selection(self, stage: str | None = None) -> list[ImageSelection] | None:
        """Per image of the last prefill, what is left after ``stage`` (default: the stack's last stage):

        - "tower": the patches of the tower's grid whose tokens reach its feature layer, groups the patches each
          stands for (on LLaVA-1.5 and PaliGemma a patch is an image token; on Gemma 3 a patch of the 64×64 grid);
        - "pre_llm": the image tokens entering the LLM (after a tower whose tokens leave the grid: among the
          tower's, each group the patches it stands for);
        - "in_llm": the image tokens through the LLM's last layer, each group what its token stood for when it
          entered the LLM (a token merged before the LLM stands for its group).

        Indices are raster indices of the unmodified model's image tokens (tower: its patches). None before any
        prefill, [] after one without images.
        """
        if stage is None:
            stage = self.last_stage()
        if stage not in self.parts:
            applied = ", ".join(repr(s) for s in STAGE_ORDER if s in self.parts)
            raise ValueError(f"stage={stage!r}: no method of that stage is applied (applied: {applied})")
        selection = self.parts[stage].selection()
        if stage != "in_llm" or selection is None or self.handoff is None:
            return selection
        entered = self.handoff.selection()
        if not entered or not selection:
            return selection
        # per image that entered the LLM (generate()'s beams repeat a prompt's images; their copies keep the same)
        through: dict[int, ImageSelection] = {}
        for image, shown in zip(selection, self.handoff.order, strict=True):
            through.setdefault(shown, _through(entered[shown], image.kept))
        return [through[shown] for shown in range(len(entered))]

    def remove(self) -> None:
        for installed in reversed(self._owned):
            installed.remove()
        if self._input_check is not None:
            self._input_check.remove()
        self._owned, self.parts, self.handoff, self._input_check = [], {}, None, None


class AfterTower:
    """The pre-LLM stage's selector after a tower whose tokens stay off the grid (a
    :class:`~vitrim.vlm.method.base.Selector`): the slots the tower's tokens fill, and, with a pre-LLM method
    stacked (``then``, keeping ``then_keep``), that method's pick among those tokens.

    ``then`` selects from the evidence restricted to the filled slots (features, projected), and its selection is
    composed with the tower's (kept: the slots it keeps; groups: the patches of the tower tokens it stands for). The
    taps capture what ``then`` reads; no attention of the tower's (the tower method changed its tokens: such a
    method is refused, :func:`refusal`).
    """

    name = "tower"
    needs_cls_attention = False
    needs_query_attention = False
    uses_cls_token = False
    reads_time = False  # a tower stage runs on families without video

    def __init__(self, reduction: tower.TowerReduction, then: Method | None, then_keep: KeepSpec | None) -> None:
        # the tower stage's convention: each kept slot at its own position (the tower's tokens are not the image's
        # raster, so no author numbered them); a stacked method asked for its authors' sequence by name is refused
        if then is not None and "positions" in then.given and then.options["positions"] != "original":
            raise ValueError(
                f"positions={then.options['positions']!r} for vlm method {then.name!r} stacked after a tower method "
                "whose tokens stay off the patch grid: the stack keeps each token at its own position "
                "(positions='original'); drop the option, or use to_grid=True in the tower"
            )
        self.reduction, self.then, self.then_keep = reduction, then, then_keep
        self.needs_seeds = then is not None and then.needs_seeds
        self.scores_projected = then is not None and then.scores_projected

    def reads_instruction(self) -> bool:
        return False

    def authors_layout(self) -> bool:
        return False  # positions="original": each token in its own slot

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        selection = self.reduction.selection()
        if selection is None:
            raise RuntimeError("the projector ran before the tower's feature layer in this forward pass")
        if self.then is None:
            return selection
        assert self.then_keep is not None
        rows = torch.stack([image.kept for image in selection]).to(evidence.features.device)  # (I, n) the filled slots
        restricted = VisionEvidence(
            features=_rows(evidence.features, rows),
            seeds=evidence.seeds,
            projected=None if evidence.projected is None else _rows(evidence.projected, rows),
        )
        chosen = self.then.select(restricted, self.then_keep.tokens(rows.shape[1]))
        return [_compose(reduced, picked) for reduced, picked in zip(selection, chosen, strict=True)]


def _rows(values: Tensor, rows: Tensor) -> Tensor:
    """(I, P, D) at the (I, n) slots ``rows`` -> (I, n, D)."""
    return values.gather(1, rows[..., None].expand(-1, -1, values.shape[-1]))


def _compose(reduced: ImageSelection, picked: ImageSelection) -> ImageSelection:
    """A selection among the tower's tokens (``picked``: indices into ``reduced.kept``) as one over the image's
    slots: each picked token's slot, standing for the patches of every tower token in its group."""
    index = picked.kept.to(reduced.kept.device)
    groups = tuple(
        torch.cat([reduced.groups[int(j)] for j in group]).sort().values for group in picked.groups
    )  # a merged token of the pre-LLM method stands for every patch of the tower tokens it merged
    return ImageSelection(kept=reduced.kept[index], groups=groups, merged=picked.merged, projected=picked.projected)


def _through(entered: ImageSelection, kept: Tensor) -> ImageSelection:
    """The in-LLM stage's ``kept`` (sorted raster indices, among ``entered.kept``), each with the group it stood for
    when it entered the LLM; a [CLS] that entered (VisionZip) goes through as text does, its empty group first."""
    group_of = {int(k): g for k, g in zip(entered.kept.tolist(), entered.groups, strict=True)}
    groups = tuple(group_of[int(k)] for k in kept.tolist())
    return ImageSelection(kept=kept, groups=groups, cls=entered.cls)
