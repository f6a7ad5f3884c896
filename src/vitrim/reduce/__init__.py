"""Token reducers that plug into a Block: the interface, the methods (one file each), and ``apply`` / ``remove``.

vitrim.reduce.apply(model, "tome", r=13)
vitrim.reduce.apply(model, "evit", keep_rate=0.7, layers=(3, 6, 9))
vitrim.reduce.apply(model, "topk", keep_rate=0.7, layers=(3, 6, 9))
vitrim.reduce.remove(model)
vitrim.reduce.list_reducers()

Every module of this package is imported here, so a method registers itself by being a file in it (see
:mod:`vitrim.reduce.base`).
"""

import importlib
import pkgutil

from vitrim.reduce.api import (
    applied_reducers,
    apply,
    check_layers,
    parse_spec,
    reducer_options,
    remove,
    training_objective,
)
from vitrim.reduce.base import Reducer, StrengthOption, quarter_layers
from vitrim.reduce.registry import get_reducer, list_reducers, register
from vitrim.reduce.state import TokenState

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from vitrim.reduce.evit import EViT  # noqa: E402  (after discovery: the classes are public names too)
from vitrim.reduce.tome import ToMe  # noqa: E402
from vitrim.reduce.topk import TopK  # noqa: E402

__all__ = [
    "EViT",
    "Reducer",
    "StrengthOption",
    "ToMe",
    "TokenState",
    "TopK",
    "apply",
    "applied_reducers",
    "check_layers",
    "get_reducer",
    "list_reducers",
    "parse_spec",
    "quarter_layers",
    "reducer_options",
    "register",
    "remove",
    "training_objective",
]
