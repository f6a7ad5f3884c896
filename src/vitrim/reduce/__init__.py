"""Token reducers that plug into a Block: the interface (``base``), the methods, and ``apply`` / ``remove``.

vitrim.reduce.apply(model, "tome", r=13)
vitrim.reduce.apply(model, "evit", keep_rate=0.7, layers=(3, 6, 9))
vitrim.reduce.apply(model, "topk", keep_rate=0.7, layers=(3, 6, 9))
vitrim.reduce.remove(model)
"""

from vitrim.reduce.api import apply, list_reducers, parse_spec, reducer_options, remove
from vitrim.reduce.base import AttentionInfo, Reducer, TokenState
from vitrim.reduce.evit import EViT
from vitrim.reduce.tome import ToMe
from vitrim.reduce.topk import TopK

__all__ = [
    "AttentionInfo",
    "EViT",
    "Reducer",
    "ToMe",
    "TokenState",
    "TopK",
    "apply",
    "list_reducers",
    "parse_spec",
    "reducer_options",
    "remove",
]
