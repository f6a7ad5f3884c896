"""Reducers at matched FLOPs: the value of a reducer's strength option whose FLOPs come closest to a target.

Every registered reducer that declares a :class:`~vitrim.reduce.base.StrengthOption` (ToMe's ``r``, EViT's
``keep_rate``, …) can be tuned this way, with no code here that knows the reducer. FLOPs are counted by
:mod:`vitrim.bench.flops` (matrix products, 2 per multiply-add, the reducer's own products included) on one image:
a reducer keeps a fixed number of tokens, so the count does not depend on the pixels and needs no timing.

The search runs over the option's values ``weakest, weakest ± step, …`` (their indices 0, 1, 2, …): FLOPs do not
grow with the index, so bisection finds the boundary between the last value above the target and the first at or
below it, and the closer of the two wins (a tie goes to the weaker value, which removes less); of the values with
the winner's FLOPs, the weakest is reported. An unbounded option (``strongest`` None) is doubled first until it
reaches the target or its FLOPs stay flat over three doublings. A target below what the strongest value reaches is
reported as not reachable, with the weakest value that removes as much as the strongest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from vitrim import reduce
from vitrim.bench.flops import model_flops_per_image
from vitrim.reduce.base import StrengthOption

MAX_DOUBLINGS = 24  # an unbounded option is tried up to weakest + 2^24 steps
FLAT_DOUBLINGS = 3  # … and no further once its FLOPs stayed the same over three doublings (a factor 8)


@dataclass(frozen=True)
class Match:
    """The value found for one target. FLOPs are per image (2 per multiply-add)."""

    value: float  # the option's value (an int for int options)
    flops: float  # FLOPs per image at that value
    target: float  # the FLOPs asked for
    reachable: bool  # False: even the strongest value tried stays above the target (value is that one)


def match_flops(count: Callable[[float], float], option: StrengthOption, target: float) -> Match:
    """The value of ``option`` whose ``count(value)`` (FLOPs, non-increasing towards strongest) is closest to target."""
    if not target > 0:
        raise ValueError(f"target FLOPs must be positive, got {target!r}")
    memo: dict[int, float] = {}

    def f(index: int) -> float:
        if index not in memo:
            memo[index] = float(count(option.value(index)))
        return memo[index]

    def found(index: int, reachable: bool = True) -> Match:
        # the weakest value with the same FLOPs: the same compute, and no more removed than needed; the search
        # starts from the strongest value already counted above them
        b = index
        above = [i for i, v in memo.items() if i < b and v > f(b)]
        if not above:
            return Match(option.value(0), f(0), target, reachable)
        a = max(above)
        while b - a > 1:  # f(a) > f(b)
            mid = (a + b) // 2
            if f(mid) > f(b):
                a = mid
            else:
                b = mid
        return Match(option.value(b), f(b), target, reachable)

    lo = 0  # invariant below: f(lo) > target
    if f(lo) <= target:
        return found(lo)
    hi = option.last_index
    if hi is None:  # double until the target is reached or FLOPs stop falling
        hi, flat = 1, 0
        for _ in range(MAX_DOUBLINGS):
            if f(hi) <= target:
                break
            flat = flat + 1 if f(2 * hi) >= f(hi) else 0
            lo, hi = hi, 2 * hi
            if flat >= FLAT_DOUBLINGS:  # flat over a factor 2^FLAT_DOUBLINGS: stronger values remove no more
                break
    if f(hi) > target:
        return found(hi, reachable=False)
    while hi - lo > 1:  # f(lo) > target >= f(hi)
        mid = (lo + hi) // 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return found(lo if f(lo) - target <= target - f(hi) else hi)


def reducer_flops(model: nn.Module, name: str, options: dict[str, Any], img_size: tuple[int, int]) -> float:
    """FLOPs per image of ``model`` with reducer ``name`` applied with ``options`` (at its default blocks).

    The reducer is put on in place and taken off again, so the model is left as it came (dense).
    """
    config = getattr(model, "config", None)
    in_chans = int(getattr(config, "in_chans", 3))
    reduce.apply(model, name, **options)
    try:
        return model_flops_per_image(model, img_size, in_chans)
    finally:
        reduce.remove(model)


def match_reducer(
    model: nn.Module,
    name: str,
    targets: Sequence[float],
    img_size: tuple[int, int],
    counted: dict[float, float] | None = None,
) -> list[Match]:
    """For each target, the strength of reducer ``name`` on ``model`` whose FLOPs per image come closest to it.

    Each value is counted once for all targets (``counted``: value -> FLOPs, kept across calls if given). Raises
    ValueError if the reducer declares no strength option, or if it refuses the model (e.g. a [CLS]-ranking reducer
    on a model without [CLS]).
    """
    option = reduce.get_reducer(name).strength_option
    if option is None:
        raise ValueError(f"reducer {name!r} declares no strength_option to tune")
    counted = {} if counted is None else counted

    def count(value: float) -> float:
        if value not in counted:
            counted[value] = reducer_flops(model, name, {option.name: value}, img_size)
        return counted[value]

    return [match_flops(count, option, target) for target in targets]
