"""The rows of ``vitrim bench models``: which model, with which overrides and which way of trimming tokens.

``MODEL`` is a comma-separated list of registered names (timm's ``name.tag`` with ``[pretrained=True]`` for its
weights) or hub repos (``hf-hub:ORG/NAME``), each optionally with its own settings in brackets:
``NAME[keep_ratio=R]`` (DynamicViT), ``NAME[reducer=tome:r=13]``, ``NAME[reducer='evit:keep_rate=0.7,layers=(3,6,9)']``
(quotes keep a reducer's own commas), or any ``create_model`` override (``NAME[depth=6]``). ``--keep-ratio`` and
``--reducer`` (repeatable) apply to the items without a setting of their own, one row per value; ``--set`` applies
to every item. Values are Python literals read with :func:`ast.literal_eval` (never run), else strings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vitrim import reduce
from vitrim.literals import parse_assignments, split_top_level
from vitrim.models.config_limits import FROM_THE_COMMAND_LINE, check_file_config
from vitrim.models.registry import check_registered
from vitrim.weights.hub import is_hub_name
from vitrim.weights.tags import split_tag


@dataclass(frozen=True)
class Case:
    """One row: a registered model, its constructor overrides, and at most one way of trimming tokens."""

    model: str
    overrides: dict[str, Any] = field(default_factory=dict)
    keep_ratio: float | None = None
    reducer: str | None = None  # the spec as typed, e.g. "tome:r=13"
    timm_reference: bool = False  # run timm's eager forward, written out, on this model's weights
    own_overrides: dict[str, Any] = field(default_factory=dict)  # given in MODEL[...], shown in the label

    @property
    def label(self) -> str:
        parts = [self.model]
        if self.own_overrides:
            parts.append(",".join(f"{k}={v}" for k, v in self.own_overrides.items()))
        if self.keep_ratio is not None:
            parts.append(f"keep_ratio={self.keep_ratio:g}")
        if self.reducer is not None:
            parts.append(self.reducer)
        if self.timm_reference:
            parts.append("[timm eager ops]")
        return " ".join(parts)


# -- parsing ----------------------------------------------------------------------------------------------------


def parse_reducer(spec: str) -> tuple[str, dict[str, Any]] | None:
    """``"tome:r=13"`` -> ``("tome", {"r": 13})`` (read by ``vitrim.reduce.parse_spec``); ``"none"`` -> None (dense)."""
    if spec.strip() == "none":
        return None
    try:
        name, options = reduce.parse_spec(spec)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--reducer {spec!r}: {err}") from err
    return name, options


def build_cases(
    models: str,
    *,
    overrides: Mapping[str, Any] | None = None,
    keep_ratios: Sequence[float] = (),
    reducers: Sequence[str] = (),
    img_size: int | None = None,
    timm_reference: bool = False,
) -> list[Case]:
    """Check every setting and expand models × keep ratios × reducers into rows, before any compute.

    ``models``: the MODEL list (module doc); ``overrides``: create_model keywords for every item (``--set``);
    ``keep_ratios`` / ``reducers``: one row per value for the items without a setting of their own;
    ``timm_reference``: add timm's eager ops after each dense row.
    """
    if img_size is not None and img_size <= 0:
        raise ValueError(f"--img-size must be a positive int, got {img_size}")
    items = [parse_model_item(item) for item in split_top_level(models)]
    if not items:
        raise ValueError(f"MODEL must name at least one model, got {models!r}")
    shared = dict(overrides or {})
    if img_size is not None and any("img_size" in o for o in [shared, *(i[1] for i in items)]):
        raise ValueError("give the image size once: --img-size or --set img_size=..., not both")
    ratios: list[float | None] = list(keep_ratios) if keep_ratios else [None]
    for ratio in ratios:
        if ratio is not None and not 0.0 < ratio <= 1.0:
            raise ValueError(f"--keep-ratio must be in (0, 1], got {ratio}")
    specs: list[str | None] = list(reducers) if reducers else [None]
    specs = [None if spec is None or parse_reducer(spec) is None else spec for spec in specs]
    cases = []
    for name, own in items:
        own = dict(own)
        has_own_setting = "keep_ratio" in own or "reducer" in own
        own_ratio, own_reducer = own.pop("keep_ratio", None), own.pop("reducer", None)
        if own_ratio is not None and not (isinstance(own_ratio, (int, float)) and 0.0 < own_ratio <= 1.0):
            raise ValueError(f"keep_ratio must be in (0, 1], got {own_ratio!r} in {name}[...]")
        if own_reducer is not None and parse_reducer(str(own_reducer)) is None:
            own_reducer = None
        row_overrides = {**shared, **own}
        check_file_config(row_overrides, f"{name}[...] with --set", origin=FROM_THE_COMMAND_LINE)  # sizes typed
        if has_own_setting:  # the item's own setting replaces the flags
            settings = [(own_ratio, None if own_reducer is None else str(own_reducer))]
        else:
            settings = [(r, spec) for r in ratios for spec in specs]
        for ratio, spec in settings:
            case = Case(name, row_overrides, ratio, spec, own_overrides=own)
            cases.append(case)
            if timm_reference and case.keep_ratio is None and case.reducer is None:
                cases.append(Case(case.model, row_overrides, timm_reference=True, own_overrides=own))
    return cases


def parse_model_item(item: str) -> tuple[str, dict[str, Any]]:
    """``"vit_small_patch16_224[reducer=tome:r=13]"`` -> (name, its own settings); the name must be registered."""
    name, bracket, rest = item.partition("[")
    name = name.strip()
    own: dict[str, Any] = {}
    if bracket:
        if not rest.endswith("]"):
            raise ValueError(f"MODEL item {item!r} must look like name or name[key=value,...]")
        own = parse_assignments(rest[:-1], f"MODEL item {name}[...]") if rest[:-1].strip() else {}
    if not is_hub_name(name):  # a hub repo is read when its row is built
        check_registered(split_tag(name)[0])  # "arch.tag" names timm's pretrained weights (with pretrained=True)
    return name, own
