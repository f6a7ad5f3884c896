"""The tower stage's methods: one per vitrim reducer (``vitrim.vlm.methods()``), and the reducers they put on a tower.

Every reducer of :mod:`vitrim.reduce` but the two that cannot run in a transformers tower (:data:`UNSUPPORTED`) is a
vlm method of stage "tower" under its own name (the random baseline as ``tower_random``: ``random`` is the pre-LLM
one), taking the reducer's options, ``keep=`` (count-based reducers) and ``to_grid``. :func:`build_reducers`
validates them as ``vitrim.reduce.apply`` does and builds the reducers; on a tower without [CLS] the [CLS]-ranking
ones rank by received attention (:mod:`vitrim.vlm.method.tower_ranking`). :mod:`vitrim.vlm.stages.tower` installs them.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from vitrim.reduce import Reducer, get_reducer, list_reducers, reducer_options
from vitrim.reduce.api import check_layers, missing_options
from vitrim.reduce.schedule import Schedule
from vitrim.vlm.method.base import Method, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, VisionTower
from vitrim.vlm.method.tower_ranking import for_tower_without_cls

# vitrim reducers that cannot run here: DynamicViT learns its scorer with the model; MCTF needs the attention
# weights before the block's attention runs (it merges ahead and reuses them).
UNSUPPORTED = {"dynamicvit": "it is trained with its model", "mctf": "it needs a block's attention before it runs"}
RENAMED = {"random": "tower_random"}  # "random" is the pre-LLM baseline; the reducer keeps its name with a prefix
_UNSET = inspect.Parameter.empty  # an option the user did not give (the reducer's own default then applies)


def build_reducers(
    name: str, depth: int, *, has_cls: bool, patches: int, num_prefix: int, width: int, options: dict[str, Any],
    keep: int | None = None,
) -> dict[int, Reducer]:  # fmt: skip
    """Reducers of vitrim reducer ``name`` for the first ``depth`` blocks of a tower, validated as vitrim.reduce.apply
    validates them; ``keep``: patches left after block ``depth - 1``, spread evenly over the reducer's default blocks
    (a count-based reducer; its own strength options are then not given)."""
    cls = get_reducer(name)
    if name in UNSUPPORTED:
        raise ValueError(f"reducer {name!r} cannot run in a transformers vision tower: {UNSUPPORTED[name]}")
    allowed = set(reducer_options(name)) - {"schedule"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"unknown option {unknown[0]!r} for tower reducer {name!r}; expected some of {sorted(allowed)}"
        )
    layers = options.pop("layers", None)
    if keep is not None:
        if not cls.takes_schedule():
            raise ValueError(f"keep= needs a count-based reducer; {name!r} takes its own options ({sorted(allowed)})")
        if layers is not None:
            raise ValueError("pass keep= or layers=, not both: keep= spreads the reduction over the reducer's blocks")
        stages = cls.default_layers(depth)
        after = patches_after_stages(name, patches, keep, len(stages))
        counts, left = [], patches
        for block in range(depth):
            if block in stages:
                left = after[stages.index(block)]
            counts.append(left + num_prefix)
        schedule = Schedule(f"keep={keep}", "a vlm tower", 0.0, tuple(counts), tuple(counts), patches + num_prefix,
                            num_prefix, width)  # fmt: skip
        layers, scheduled = cls.options_for_schedule(schedule)
        clash = sorted(set(scheduled) & set(options))
        if clash:
            raise ValueError(f"keep= sets {clash[0]!r} itself; pass one or the other")
        options = {**options, **scheduled}
    missing = missing_options(name, options)
    if missing:
        count = " (or keep=, the patches left)" if cls.takes_schedule() else ""
        raise ValueError(f"tower method {name!r} needs option(s) {missing}{count}, e.g. {cls.example_options}")
    chosen = cls.default_layers(depth) if layers is None else check_layers(layers, depth)
    reducers = {i: r for i, r in cls.for_layers(tuple(chosen), **options).items() if r is not None}
    if cls.needs_cls_token and not has_cls:  # SigLIP: rank by the attention each token receives
        return for_tower_without_cls(name, reducers)
    return reducers


def patches_after_stages(name: str, patches: int, keep: int, stages: int) -> list[int]:
    """Patches left after each of ``stages`` reducing blocks of reducer ``name`` so that ``keep`` are left after the
    last: an even spread, except for a reducer that merges away at most half of a block's tokens (ToMe's bipartite
    matching: an even spread it cannot follow would leave more than ``keep``, silently), where each stage leaves at
    most twice what the next leaves, the surplus removed earlier."""
    after = [patches - (patches - keep) * done // stages for done in range(1, stages + 1)]
    reducer = get_reducer(name)
    if not reducer.merges_at_most_half:
        return after
    for stage in range(stages - 2, -1, -1):
        after[stage] = min(after[stage], 2 * after[stage + 1])
    if patches > 2 * after[0]:
        fewest = -(-patches // 2**stages)
        raise ValueError(
            f"keep={keep}: {reducer.__name__} merges at most half of the tokens in each of the tower's {stages} blocks "
            f"before its feature layer, so it leaves at least {fewest} of the {patches} patches"
        )
    return after


class TowerMethod(Method):
    """A vitrim reducer as a VLM method of stage "tower" (one subclass per reducer, registered below)."""

    reducer: ClassVar[str] = ""

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The reducer's options; None where the user may leave one out and the reducer's own default applies."""
        return {name: None if value is _UNSET else value for name, value in cls.defaults.items()}

    def reducer_options(self) -> dict[str, Any]:
        """The options the user gave (the reducer's own defaults apply to the others)."""
        return {k: v for k, v in self.options.items() if v is not _UNSET and k != "to_grid"}

    def tower_reducers(self, plan: TowerLayout, keep: int | None) -> dict[int, Reducer]:
        """The reducers this method puts on a tower of layout ``plan``, by block index (blocks 0 … depth − 1 up to
        the feature layer); ``keep``: patches left at the feature layer (None: not given). A vitrim reducer's by
        default; a tower method of its own (HiPrune, FlowCut) overrides this."""
        return build_reducers(
            self.reducer, plan.depth, has_cls=bool(plan.num_prefix), patches=plan.patches,
            num_prefix=plan.num_prefix, width=plan.width, options=self.reducer_options(), keep=keep,
        )  # fmt: skip


@dataclass(frozen=True)
class TowerLayout:
    """What a tower method needs to know of the tower: ``depth`` blocks up to and including the feature layer's,
    ``num_prefix`` (1 with [CLS], else 0), ``patches`` P per image (a ``side`` × ``side`` grid), token ``width``."""

    depth: int
    num_prefix: int
    patches: int
    width: int

    @property
    def side(self) -> int:
        """Columns of the (square) patch grid: the raster stride of a vertical neighbour."""
        return math.isqrt(self.patches)


def tome_tower_schedule(tower: VisionTower, keep: int) -> list[int]:
    """Tokens entering each block ([CLS] included) for ToMe with ``keep=``, as the tower runs it: the patches left
    after each of the L blocks up to the feature layer are :func:`patches_after_stages` (an even spread, merged
    earlier where one block would have to merge more than half).

    ToMe merges after each block's attention, so block i runs its attention on the tokens left by block i - 1 and
    its MLP on fewer; counted here (upper bound) with the tokens entering the block.
    """
    after = patches_after_stages("tome", tower.patches, keep, tower.reducing_layers)
    entering = [tower.patches, *after]
    cls = int(tower.cls_token)
    return [entering[min(block, len(after))] + cls for block in range(tower.layers)]


def tome_cost(self: TowerMethod, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
    """``tome``'s :meth:`~vitrim.vlm.method.base.Method.cost`: ``keep`` patches at the feature layer, spread over
    the blocks as :func:`tome_tower_schedule`, and ``keep`` enter the LLM; its own: in each block up to the feature
    layer, the bipartite similarity, (n/2) × (n/2) cosines of the keys summed over heads (head width)."""
    tower = model.tower
    schedule = tome_tower_schedule(tower, keep)
    head = tower.width // tower.heads
    own = sum((n // 2) * (n - n // 2) * head for n in schedule[: tower.reducing_layers])
    return MethodCost(own=own, llm_cuts=((0, keep),), tower_blocks=tuple((n, n) for n in schedule))


# the tower reducers whose cost is counted (``vitrim vlm flops``); the others' schedules are their own options
COSTS = {"tome": tome_cost}


def _register_tower_methods() -> None:
    for reducer in list_reducers():
        if reducer in UNSUPPORTED:
            continue
        name = RENAMED.get(reducer, reducer)
        defaults: dict[str, Any] = {option: _UNSET for option in reducer_options(reducer) if option != "schedule"}
        defaults["to_grid"] = None
        cls = type(f"Tower_{reducer}", (TowerMethod,), {"defaults": defaults, "reducer": reducer, "__doc__": (
            f"vitrim reducer {reducer!r} in the vision tower (vitrim.vlm.stages.tower); options: the reducer's, and "
            "to_grid (put the tokens back on the patch grid before the projector)"),
            **({"cost": COSTS[reducer]} if reducer in COSTS else {})})  # fmt: skip
        register_method(name, stage="tower")(cls)


_register_tower_methods()


__all__ = [
    "COSTS", "RENAMED", "UNSUPPORTED", "TowerLayout", "TowerMethod", "build_reducers", "patches_after_stages",
    "tome_cost", "tome_tower_schedule",
]  # fmt: skip
