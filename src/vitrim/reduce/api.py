"""Put token reducers on any ViT, and take them off: ``apply(model, "tome", r=13)``, ``remove(model)``.

A reducer is a plain object set on ``block.reducer`` (see :mod:`vitrim.reduce.base`): nothing is swapped, wrapped or
registered, the state dict is unchanged, and ``remove`` restores the dense model exactly. Works on every
:class:`~vitrim.models.vit.VisionTransformer` (weights from timm, DeiT, Hugging Face; DeiT's distillation token is
protected like [CLS]), and on any module whose ``blocks`` are vitrim Blocks.

Methods and options:

* ``"tome"``: ``r`` tokens merged per block, an int for every block or one int per block (a schedule); 0 = off.
* ``"evit"``: ``keep_rate`` in (0, 1] (one number, or one per reducing block) at the blocks ``layers`` (default:
  depth/4, depth/2, 3·depth/4, i.e. 3, 6, 9 for 12 blocks, as EViT does for DeiT).
* ``"topk"``: the same options as EViT, without fusion.
"""

from __future__ import annotations

import ast
import difflib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from vitrim.literals import split_top_level
from vitrim.reduce.base import Reducer
from vitrim.reduce.evit import EViT
from vitrim.reduce.tome import ToMe
from vitrim.reduce.topk import TopK, check_keep_rate

ATTACHED_TYPES = (ToMe, EViT, TopK)  # what ``remove`` takes off; other reducers (DynamicViT's) stay


def _tome(depth: int, *, r: int | Sequence[int]) -> list[Reducer | None]:
    if isinstance(r, Sequence) and not isinstance(r, str):
        if len(r) != depth:
            raise ValueError(f"r must be one int or one int per block ({depth}), got {len(r)} values: {list(r)}")
        schedule = list(r)
    else:
        schedule = [r] * depth
    for value in schedule:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"r must be an int >= 0 (tokens merged per block) or a list of them, got {r!r}")
    return [ToMe(value) if value > 0 else None for value in schedule]


def default_layers(depth: int) -> tuple[int, ...]:
    """EViT's reducing blocks: depth/4, depth/2, 3·depth/4 (3, 6, 9 for 12 blocks), duplicates removed."""
    return tuple(sorted({depth // 4, depth // 2, 3 * depth // 4}))


def _check_layers(layers: Sequence[int] | None, depth: int) -> tuple[int, ...]:
    if layers is None:
        return default_layers(depth)
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


def _by_cls_attention(cls: type[EViT] | type[TopK]) -> Callable[..., list[Reducer | None]]:
    def build(
        depth: int, *, keep_rate: float | Sequence[float] = 0.7, layers: Sequence[int] | None = None
    ) -> list[Reducer | None]:
        chosen = _check_layers(layers, depth)
        if isinstance(keep_rate, Sequence) and not isinstance(keep_rate, str):
            if len(keep_rate) != len(chosen):
                raise ValueError(
                    f"keep_rate must be one number or one per reducing block ({len(chosen)}: layers {chosen}), "
                    f"got {len(keep_rate)} values: {list(keep_rate)}"
                )
            rates = dict(zip(chosen, keep_rate))
        else:
            rates = dict.fromkeys(chosen, keep_rate)
        for rate in rates.values():
            check_keep_rate(rate)
        return [cls(rates[i]) if i in rates else None for i in range(depth)]

    return build


REDUCERS: dict[str, Callable[..., list[Reducer | None]]] = {
    "tome": _tome,
    "evit": _by_cls_attention(EViT),
    "topk": _by_cls_attention(TopK),
}
NEEDS_CLS_TOKEN = ("evit", "topk")


def list_reducers() -> list[str]:
    """Names accepted by :func:`apply`."""
    return sorted(REDUCERS)


def reducer_options(name: str) -> tuple[str, ...]:
    """The keyword options of reducer ``name`` (e.g. ``("r",)`` for ToMe); raises ValueError for an unknown name."""
    _check_name(name)
    params = inspect.signature(REDUCERS[name]).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def apply(model: nn.Module, name: str, **options: Any) -> nn.Module:
    """Attach reducer ``name`` to the model's blocks (in place) and return the model.

    Raises ValueError for an unknown name or option, a bad value, a block that already has a reducer (call
    :func:`remove` first), or EViT / top-k on a model without a [CLS] token.
    """
    blocks = _blocks(model)
    allowed = reducer_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for reducer {name!r}; expected some of {list(allowed)}")
    if name in NEEDS_CLS_TOKEN and getattr(model, "num_prefix", 1) < 1:
        raise ValueError(f"reducer {name!r} ranks tokens by [CLS] attention, but the model has no [CLS] token")
    reducers = REDUCERS[name](len(blocks), **options)
    for index, (block, reducer) in enumerate(zip(blocks, reducers)):
        if reducer is not None and block.reducer is not None:
            raise ValueError(f"block {index} already has a reducer {block.reducer!r}; call vitrim.reduce.remove first")
    for block, reducer in zip(blocks, reducers):
        if reducer is not None:
            block.reducer = reducer
    return model


def remove(model: nn.Module) -> nn.Module:
    """Take off every reducer that :func:`apply` attached (other reducers stay) and return the model."""
    for block in _blocks(model):
        if isinstance(block.reducer, ATTACHED_TYPES):
            block.reducer = None
    return model


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"tome:r=13"`` -> ``("tome", {"r": 13})``; ``"evit:keep_rate=0.7,layers=(3,6,9)"`` -> options with a tuple.

    Values are Python literals (numbers, tuples, lists), read with :func:`ast.literal_eval`, which runs no code.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reducer spec must be a string like 'tome:r=13', got {spec!r}")
    name, _, rest = spec.partition(":")
    name = name.strip()
    _check_name(name)
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


def _check_name(name: object) -> None:
    if not isinstance(name, str) or name not in REDUCERS:
        close = difflib.get_close_matches(str(name), list(REDUCERS), n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(f"unknown reducer {name!r}; expected one of {list_reducers()}{hint}")


def _blocks(model: nn.Module) -> list[Any]:
    from vitrim.models.block import Block  # here, not at the top: vitrim.models imports vitrim.reduce.base

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module with vitrim Blocks, got {type(model).__name__}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not blocks or not all(isinstance(b, Block) for b in blocks):
        raise TypeError(f"model must have .blocks, a ModuleList of vitrim Blocks; {type(model).__name__} has none")
    return list(blocks)
