"""Put token reducers on any ViT, and take them off: ``apply(model, "tome", r=13)``, ``remove(model)``.

A reducer is a plain object set on ``block.reducer`` (see :mod:`vitrim.reduce.base`): nothing is swapped, wrapped or
registered with torch, the state dict is unchanged, and ``remove`` restores the dense model exactly. Works on any
module whose ``blocks`` hold a ``reducer`` slot (every vitrim ViT, with weights from timm, DeiT or Hugging Face).

``apply(model, name, layers=None, **options)``: ``layers`` (block indices) says which blocks get an instance, by
default the reducer's own choice (every block for ToMe; a quarter, half and three quarters deep for EViT and
top-k); the other options go to the reducer (``vitrim.reduce.reducer_options(name)`` lists them). A count-based
reducer also takes ``schedule="diffrate_deit_s_2.9"`` (:mod:`vitrim.reduce.schedule`): the preset sets the blocks
and the per-block counts.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from vitrim.literals import split_top_level
from vitrim.reduce.base import Reducer
from vitrim.reduce.registry import get_reducer, list_reducers
from vitrim.reduce.schedule import get_schedule


def reducer_options(name: str) -> tuple[str, ...]:
    """The options of reducer ``name`` (e.g. ``("layers", "r")`` for ToMe); raises ValueError for an unknown name."""
    cls = get_reducer(name)
    alias = cls.layers_alias
    return ("layers", *((alias,) if alias else ()), *(("schedule",) if cls.takes_schedule() else ()), *_options(name))


def missing_options(name: str, options: Mapping[str, Any]) -> list[str]:
    """The options reducer ``name`` needs (no default) that ``options`` lacks, sorted (e.g. ToMe's ``r``)."""
    return sorted(k for k, p in _options(name).items() if p.default is p.empty and k not in options)


def _options(name: str) -> dict[str, inspect.Parameter]:
    """The reducer's options by name: the keyword parameters of the most specific of ``for_model``, ``for_layers``
    and the constructor that lists them explicitly (the base class's ``**options`` pass them on)."""
    cls = get_reducer(name)
    for method, skip in ((cls.for_model, 2), (cls.for_layers, 1), (cls.__init__, 1)):  # skip model/layers/self
        params = list(inspect.signature(method).parameters.values())[skip:]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {}


def check_layers(layers: object, depth: int) -> tuple[int, ...]:
    """Validate block indices for a model of ``depth`` blocks (an int is one block)."""
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    if not isinstance(layers, Sequence) or isinstance(layers, str):
        raise TypeError(f"layers must be a sequence of block indices, got {layers!r}")
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < depth:
            raise ValueError(f"layers must be block indices in [0, {depth}), got {tuple(layers)}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers must not repeat a block, got {tuple(layers)}")
    return tuple(layers)


def apply(model: nn.Module, name: str, *, layers: Sequence[int] | int | None = None, **options: Any) -> nn.Module:
    """Attach reducer ``name`` to the model's blocks (in place) and return the model.

    Raises ValueError for an unknown name or option, a bad value, a block that already has a reducer (call
    :func:`remove` first), or a [CLS]-ranking reducer on a model without a [CLS] token. Nothing is attached when
    anything is wrong.
    """
    blocks = _blocks(model)
    cls = get_reducer(name)
    if cls.layers_alias is not None and cls.layers_alias in options:
        if layers is not None:
            raise ValueError(f"pass layers or {cls.layers_alias}, not both")
        layers = options.pop(cls.layers_alias)
    allowed = reducer_options(name)
    if "schedule" in options:
        schedule = options.pop("schedule")
        if layers is not None:
            raise ValueError(f"pass schedule or layers, not both: schedule {schedule!r} sets the blocks itself")
        layers, scheduled = schedule_options(cls, model, schedule)
        clash = sorted(set(scheduled) & set(options))
        if clash:
            raise ValueError(f"schedule {schedule!r} sets {clash} itself; pass one or the other")
        options = {**options, **scheduled}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for reducer {name!r}; expected some of {list(allowed)}")
    missing = missing_options(name, options)
    if missing:
        raise ValueError(f"reducer {name!r} needs option(s) {missing}, e.g. {cls.example_options}")
    if cls.needs_cls_token and not _has_class_token(model):
        raise ValueError(
            f"reducer {name!r} ranks tokens by [CLS] attention, but the model has no [CLS] token "
            "(a GAP or attention-pool model: use 'tome' or 'dynamicvit')"
        )
    chosen = cls.default_layers(len(blocks)) if layers is None else check_layers(layers, len(blocks))
    reducers = {i: r for i, r in cls.for_model(model, chosen, **options).items() if r is not None}
    taken = [i for i in reducers if blocks[i].reducer is not None]
    if taken:
        _delete_modules(model, cls.adds_modules)  # nothing half-applied
        raise ValueError(
            f"block {taken[0]} already has a reducer {blocks[taken[0]].reducer!r}; call vitrim.reduce.remove first"
        )
    for index, reducer in reducers.items():
        reducer.applied = True
        blocks[index].reducer = reducer
    spec = {"name": name, "layers": list(chosen), "options": options}
    model.applied_reducers = [*getattr(model, "applied_reducers", []), spec]  # type: ignore[assignment]
    return model


def remove(model: nn.Module) -> nn.Module:
    """Take off every reducer that :func:`apply` attached, and the modules it added (others, such as a DynamicViT
    model's own, stay)."""
    for block in _blocks(model):
        if getattr(block.reducer, "applied", False):
            _delete_modules(model, block.reducer.adds_modules)
            block.reducer = None
    model.applied_reducers = []  # type: ignore[assignment]
    return model


def training_objective(
    model: nn.Module, *, label_smoothing: float, options: dict[str, Any], teacher: nn.Module | None = None
) -> Any | None:
    """The training objective the model's reducers ask for (:meth:`Reducer.training_objective`), or None.

    ValueError when reducers of two kinds each want their own: one loss cannot serve both recipes.
    """
    reducers = [getattr(block, "reducer", None) for block in getattr(model, "blocks", ())]  # none on a CNN
    wanted = {}
    for kind in {type(r) for r in reducers if isinstance(r, Reducer)}:
        objective = kind.training_objective(model, label_smoothing=label_smoothing, options=options, teacher=teacher)
        if objective is not None:
            wanted[kind] = objective
    if len(wanted) > 1:
        names = sorted(cls.name for cls in wanted)
        raise ValueError(f"reducers {names} each bring their own training objective; train with one of them")
    return next(iter(wanted.values()), None)


def applied_reducers(model: nn.Module) -> list[dict[str, Any]]:
    """What :func:`apply` put on ``model``, in order: ``{"name", "layers", "options"}`` (kept in checkpoints)."""
    return list(getattr(model, "applied_reducers", []))


def _delete_modules(model: nn.Module, names: Sequence[str]) -> None:
    for name in names:
        if name in model._modules:
            delattr(model, name)
            prefixes = getattr(model, "checkpoint_optional_prefixes", ())
            model.checkpoint_optional_prefixes = tuple(p for p in prefixes if p != f"{name}.")  # type: ignore[assignment]


def schedule_options(cls: Any, model: nn.Module, name: object) -> tuple[tuple[int, ...], dict[str, Any]]:
    """The blocks and options with which reducer class ``cls`` follows schedule ``name`` on ``model``.

    (Here rather than in :mod:`vitrim.reduce.schedule`, which must not import the registry: the registry's reducers
    import the schedule.)"""
    schedule = get_schedule(name)
    if not cls.takes_schedule():
        takers = [r for r in list_reducers() if get_reducer(r).takes_schedule()]
        raise ValueError(f"reducer {cls.name!r} takes no schedule (no per-block token counts); these do: {takers}")
    schedule.check(model)
    return cls.options_for_schedule(schedule)


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"tome:r=13"`` -> ``("tome", {"r": 13})``; ``"evit:keep_rate=0.7,layers=(3,6,9)"`` -> options with a tuple.

    Values are Python literals (numbers, tuples, lists), read with :func:`ast.literal_eval`, which runs no code.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reducer spec must be a string like 'tome:r=13', got {spec!r}")
    name, _, rest = spec.partition(":")
    name = name.strip()
    get_reducer(name)
    options: dict[str, Any] = {}
    for item in split_top_level(rest):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ValueError(f"reducer option {item!r} in {spec!r} must look like name=value")
        try:
            options[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"reducer option {key}={value!r} in {spec!r} is not a number or tuple") from None
    return name, options


def _has_class_token(model: nn.Module) -> bool:
    """Whether token 0 is a [CLS] token (registers are prefix tokens too, but no [CLS])."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "class_token"):
        return bool(config.class_token)
    return int(getattr(model, "num_prefix", 1)) >= 1


def _blocks(model: nn.Module) -> list[Any]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module with vitrim Blocks, got {type(model).__name__}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not blocks or not all(hasattr(b, "reducer") for b in blocks):
        raise TypeError(f"model must have .blocks, a ModuleList of vitrim Blocks; {type(model).__name__} has none")
    return list(blocks)
